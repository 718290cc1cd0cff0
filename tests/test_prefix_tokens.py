"""Record #89's prefix-token table: its writer (data/prefix_tokens.py) and the trainer's reader (load_prefix_table):
the committed file against a fresh build from GPT-2's vocabulary in shared/, its counts and examples, and one-line
errors for a missing or damaged file."""

import numpy as np
import pytest

import train_gpt as T
from conftest import REPO
from data import prefix_tokens as P

VOCAB = REPO.parent / "shared" / "data" / "gpt2" / "gpt2.tiktoken"
needs_vocab = pytest.mark.skipif(not VOCAB.is_file(), reason=f"GPT-2's vocabulary not found at {VOCAB}")
needs_table = pytest.mark.skipif(not T.PREFIX_TABLE.is_file(), reason=f"the committed table {T.PREFIX_TABLE} is absent")


@pytest.fixture(scope="module")
def ranks():
    return P.read_vocab(VOCAB)


def longest_proper_prefix(token: bytes, ranks: dict[bytes, int]) -> int:
    """The definition, probed length by length (slow, direct)."""
    return next((ranks[token[:n]] for n in range(len(token) - 1, 0, -1) if token[:n] in ranks), -1)


@needs_vocab
@needs_table
def test_the_committed_table_is_a_fresh_build_from_the_vocabulary(ranks):
    assert np.array_equal(T.load_prefix_table(), P.build_prefix_table(ranks))


@needs_vocab
def test_the_table_holds_each_tokens_longest_proper_prefix_token(ranks):
    table = P.build_prefix_table(ranks)
    assert len(ranks) == P.MERGEABLE_TOKENS and table.shape == (50304,)
    assert (table == -1).sum() == 304 and (table >= 0).sum() == 50000
    assert (table[:256] == -1).all() and (table[50256:] == -1).all()  # single bytes, EOT, the head's padding
    for token, rank in list(ranks.items())[::97]:
        assert table[rank] == longest_proper_prefix(token, ranks), token
    for word, prefix in [(b"The", b"Th"), (b" the", b" th"), (b" gazed", b" gaze")]:
        assert table[ranks[word]] == ranks[prefix]


@needs_vocab
def test_the_generator_writes_what_the_loader_reads(tmp_path, ranks, capsys):
    out = tmp_path / "t.npy"
    assert P.main(["--vocab", str(VOCAB), "--output", str(out)]) == 0
    assert np.array_equal(T.load_prefix_table(out), P.build_prefix_table(ranks))
    assert P.main(["--vocab", str(tmp_path / "none"), "--output", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("content, message", [
    (None, "which is missing; rebuild it with python -m data.prefix_tokens"),
    (b"not a numpy file", "is not a .npy file"),
    (np.zeros(10, dtype=np.int32), "holds int32 (10,), not int32 (50304,)"),
    (np.arange(50304, dtype=np.int32), "or a token as its own prefix"),
])
def test_a_missing_or_damaged_table_is_one_line_naming_the_fix(tmp_path, content, message):
    path = tmp_path / "table.npy"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        np.save(path, content)
    with pytest.raises(T.UsageError) as e:
        T.load_prefix_table(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_run_without_the_table_ends_in_one_line(monkeypatch, tmp_path):
    from conftest import TINY, run_main
    monkeypatch.setattr(T, "PREFIX_TABLE", tmp_path / "none.npy")
    monkeypatch.setattr(T.load_prefix_table, "__defaults__", (tmp_path / "none.npy",))
    result = run_main(TINY + ["--prefix_loss_weight=0.25", "--loss_weights_by_stage=true"], tmp_path)
    assert result.returncode == T.EXIT_USAGE
    assert result.stderr.count("\n") == 1 and result.stderr.strip().endswith(
        "none.npy, which is missing; rebuild it with python -m data.prefix_tokens")


@needs_table
def test_the_trainers_table_covers_its_vocabulary_and_drops_ids_past_it():
    full = T.prefix_token_table(50257)
    assert full.shape == (50257,) and full.tolist() == T.load_prefix_table()[:50257].tolist()
    small = T.prefix_token_table(1000)
    assert small.max() < 1000 and (small[small >= 0] == full[:1000][small >= 0]).all()
    assert (small[full[:1000] >= 1000] == -1).all()
    assert T.prefix_token_table(50400)[50304:].eq(-1).all()


@pytest.mark.parametrize("preset", ["speedrun", "cpu"])
def test_the_record_recipe_sets_the_records_loss(preset):
    """--recipe=record: T:1980-1988 (MTP 3 and the prefix weight by stage), T:2360 (summed), K:1003-1005 (bf16),
    23 sigmoid((z + 5) / 7.5) (K:1210), MTP targets across documents (K:1073-1079)."""
    args = T.parse_args([f"--preset={preset}", "--recipe=record"], preset == "speedrun")
    assert (args.mtp_tokens, args.prefix_loss_weight, args.loss_weights_by_stage, args.loss_sum) == (3, 0.25, True, True)
    assert (args.bf16_train_logits, args.logit_softcap, args.logit_offset, args.cross_document_shifts) == \
        (True, 23.0, 5.0, True)


@needs_table
def test_a_run_trains_with_the_prefix_token_loss(tmp_path):
    from conftest import TINY, run_main
    result = run_main(TINY + ["--prefix_loss_weight=0.25", "--loss_weights_by_stage=true", "--mtp_tokens=3",
                              "--loss_sum=true", "--batch_schedule=1/3,2/3,1", "--batch_tokens=1536",
                              "--num_iterations=6"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "step:6/6 val_loss:" in result.stdout
