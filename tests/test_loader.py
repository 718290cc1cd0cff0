"""Data section of train_gpt.py: shard validation, the token stream and the per-rank batch split."""
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as T
from data import shardio

VOCAB = 50257
REPO_SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample" / "sotu_train_000001.bin"


def write_shard(path, tokens, magic=None, version=None, count=None):
    """A shard written by data/shardio.py (the format's one definition), then damaged as asked."""
    shardio.write_shard(path, np.asarray(tokens))
    header = np.frombuffer(path.read_bytes()[:shardio.HEADER_BYTES], dtype="<i4").copy()
    for i, value in enumerate((magic, version, count)):
        if value is not None:
            header[i] = value
    path.write_bytes(header.tobytes() + path.read_bytes()[shardio.HEADER_BYTES:])
    return path


def doc_tokens(n, seed=0, mean_doc=40):
    """n tokens of documents that each start with EOT, other ids random below the EOT id."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, T.EOT_TOKEN, n)
    tokens[0] = T.EOT_TOKEN
    tokens[rng.random(n) < 1 / mean_doc] = T.EOT_TOKEN
    return tokens


def test_shard_token_count_reads_a_valid_header(tmp_path):
    assert T.shard_token_count(write_shard(tmp_path / "a.bin", range(1000))) == 1000


def test_the_trainer_reads_exactly_what_the_data_writer_writes(tmp_path):
    """train_gpt.py keeps its own reader (it runs as one file): byte for byte the format shardio defines."""
    assert (T.SHARD_MAGIC, T.SHARD_VERSION, T.HEADER_BYTES) == (shardio.MAGIC, shardio.VERSION, shardio.HEADER_BYTES)
    tokens = doc_tokens(5000, seed=4)
    path = tmp_path / "w.bin"
    shardio.write_shard(path, tokens)
    assert path.read_bytes() == shardio.make_header(5000) + tokens.astype("<u2").tobytes()
    assert T.shard_token_count(path) == shardio.check_shard(path) == 5000
    assert np.array_equal(T.load_shard(path, VOCAB), shardio.read_tokens(path))
    for damage in (dict(magic=1), dict(version=2), dict(count=4999), dict(count=5001)):
        bad = write_shard(tmp_path / "bad.bin", tokens, **damage)
        assert shardio.shard_problem(bad) is not None, damage
        with pytest.raises(T.UsageError):
            T.shard_token_count(bad)


@pytest.mark.parametrize("case, message", [
    ("magic", "magic"), ("version", "version"), ("truncated", "truncated"), ("short_header", "truncated"),
    ("token", "token id 50300"),
])
def test_bad_shards_give_a_clear_error_naming_the_file(tmp_path, case, message):
    path = tmp_path / f"{case}.bin"
    if case == "magic":
        write_shard(path, range(10), magic=12345)
    elif case == "version":
        write_shard(path, range(10), version=7)
    elif case == "truncated":
        write_shard(path, range(10), count=20)
    elif case == "short_header":
        path.write_bytes(b"\0" * 100)
    else:
        write_shard(path, [1, 2, 50300, 4])
    with pytest.raises(T.UsageError) as err:
        T.load_shard(path, VOCAB)
    assert str(path) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_empty_glob_names_the_pattern_and_the_download_command(tmp_path):
    with pytest.raises(T.UsageError) as err:
        T.find_shards(str(tmp_path / "fineweb_train_*.bin"), "training")
    assert "fineweb_train_*.bin" in str(err.value) and "python -m data.cached_fineweb10B 9" in str(err.value)


def test_relative_globs_also_resolve_against_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = T.find_shards("data/sample/sotu_val_*.bin", "validation")
    assert [p.name for p in found] == ["sotu_val_000000.bin"]


def global_layout(files, seq_len, n_seqs, bos_align=False):
    stream = T.TokenStream(files, VOCAB, cycle=False)
    return [np.array(stream.take(seq_len, bos_align)) for _ in range(n_seqs)]


@pytest.mark.parametrize("world_size, accum", [(1, 4), (2, 2), (4, 1)])
def test_rank_slices_are_disjoint_and_cover_the_global_batch(tmp_path, world_size, accum):
    tokens = np.arange(5000) % 50000  # every position distinguishable
    files = [write_shard(tmp_path / "s1.bin", tokens[:2600]), write_shard(tmp_path / "s2.bin", tokens[2600:])]
    seq_len, steps = 128, 3
    expected = global_layout(files, seq_len, world_size * accum * steps)
    per_rank = []
    for rank in range(world_size):
        loader = T.DistributedTokenLoader(T.TokenStream(files, VOCAB, False), rank, world_size,
                                          False, 0, torch.device("cpu"))
        per_rank.append([loader.next_batch(accum, seq_len) for _ in range(steps)])
    seen = []
    for step in range(steps):
        chunk_of = {}
        for rank in range(world_size):
            batch = per_rank[rank][step]
            assert len(batch) == accum
            for micro, (x, y) in enumerate(batch):
                assert torch.equal(x[1:], y[:-1])  # targets are the inputs shifted by one
                chunk_of[micro * world_size + rank] = torch.cat([x, y[-1:]]).numpy()
        assert sorted(chunk_of) == list(range(world_size * accum))
        for i in range(world_size * accum):
            np.testing.assert_array_equal(chunk_of[i], expected[step * world_size * accum + i])
            seen.append(tuple(chunk_of[i][:-1]))
    assert len(set(seen)) == len(seen)  # no sequence repeats: rank slices are disjoint
    flat = np.concatenate([np.array(s) for s in seen])
    assert len(np.unique(flat)) == len(flat)  # and no token is used twice as an input


def test_bos_alignment_starts_every_sequence_at_a_document(tmp_path):
    files = [write_shard(tmp_path / "s.bin", doc_tokens(20000, seed=3))]
    loader = T.DistributedTokenLoader(T.TokenStream(files, VOCAB, False), 1, 2, True, 0, torch.device("cpu"))
    for _ in range(5):
        for x, _ in loader.next_batch(2, 256):
            assert x[0].item() == T.EOT_TOKEN


def test_running_out_of_data_is_an_error_unless_cycling_is_asked_for(tmp_path):
    files = [write_shard(tmp_path / "s.bin", np.arange(1000))]
    stream = T.TokenStream(files, VOCAB, cycle=False)
    for _ in range(3):
        stream.take(256)
    with pytest.raises(T.UsageError, match="--train_cycle=true"):
        stream.take(256)
    cycling = T.TokenStream(files, VOCAB, cycle=True)
    first = [np.array(cycling.take(256)) for _ in range(3)]
    again = np.array(cycling.take(256))
    assert cycling.epoch == 1
    np.testing.assert_array_equal(again, first[0])


def test_stream_state_round_trip_resumes_at_the_same_tokens(tmp_path):
    files = [write_shard(tmp_path / "a.bin", np.arange(700)), write_shard(tmp_path / "b.bin", np.arange(700, 1500))]
    stream = T.TokenStream(files, VOCAB, cycle=False)
    for _ in range(3):
        stream.take(200)
    state = stream.state()
    expected = [np.array(stream.take(200)) for _ in range(2)]
    restored = T.TokenStream(files, VOCAB, cycle=False)
    restored.load_state(state)
    for e in expected:
        np.testing.assert_array_equal(np.array(restored.take(200)), e)


@pytest.mark.parametrize("bos_align", [False, True])
def test_the_next_shard_is_read_and_checked_in_the_background(tmp_path, monkeypatch, bos_align):
    """The training stream reads shard i + 1 (the vocabulary check, the document starts) in another thread
    while shard i is used, and hands out exactly the tokens of a stream that reads each shard when it gets
    there, across shard switches and a new epoch."""
    files = [write_shard(tmp_path / f"s{i}.bin", doc_tokens(1500, seed=i)) for i in range(3)]
    readers = []
    load_shard = T.load_shard
    monkeypatch.setattr(T, "load_shard", lambda path, vocab: readers.append(
        (path.name, threading.current_thread() is threading.main_thread())) or load_shard(path, vocab))
    plain = T.TokenStream(files, VOCAB, cycle=True)
    expected = [np.array(plain.take(256, bos_align)) for _ in range(20)]
    readers.clear()
    ahead = T.TokenStream(files, VOCAB, cycle=True, read_ahead=True)
    try:
        got = [np.array(ahead.take(256, bos_align)) for _ in range(20)]
    finally:
        ahead.close()
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(g, e)
    assert ahead.epoch >= 1 and readers[0] == ("s0.bin", True)  # the first shard: read where it is needed
    assert readers[1:4] == [("s1.bin", False), ("s2.bin", False), ("s0.bin", False)]  # then always ahead


def test_a_bad_shard_read_ahead_is_refused_when_the_stream_reaches_it(tmp_path):
    bad = np.arange(1000)
    bad[500] = VOCAB  # one id outside the vocabulary
    files = [write_shard(tmp_path / "a.bin", np.arange(1000)), write_shard(tmp_path / "b.bin", bad)]
    stream = T.TokenStream(files, VOCAB, cycle=False, read_ahead=True)
    try:
        for _ in range(3):
            stream.take(256)  # the whole first shard, while b.bin is read (and refused) in the background
        with pytest.raises(T.UsageError, match=f"b.bin holds token id {VOCAB} >= vocab size {VOCAB}"):
            stream.take(256)
    finally:
        stream.close()


def test_validation_split_over_ranks_covers_the_budget_once(tmp_path):
    files = [write_shard(tmp_path / "v.bin", np.arange(3000))]
    args = T.Hyperparameters(val_tokens=2048, val_seq_len=256)
    whole = T.validation_sequences(files, args, 0, 1)
    assert len(whole) == 8
    split = [T.validation_sequences(files, args, r, 3) for r in range(3)]
    assert sorted(tuple(s) for part in split for s in part) == sorted(tuple(s) for s in whole)
    too_much = T.Hyperparameters(val_tokens=4096, val_seq_len=256)
    with pytest.raises(T.UsageError, match=r"hold 11: pass --val_tokens=2816 or fewer$"):
        T.validation_sequences(files, too_much, 0, 1)


def capped_packing_reference(tokens, n_seqs, seq_len, cap):
    """2025-09-03_FA3's packing, from the documents: each sequence (seq_len + 1 tokens with its last target)
    is whole documents from a document start, each cut to `cap` tokens; the document that overflows the
    sequence is cut there and the rest of it dropped."""
    starts = np.flatnonzero(tokens == T.EOT_TOKEN)
    docs = [tokens[a:b][:cap] for a, b in zip(starts, list(starts[1:]) + [len(tokens)])]
    out, i = [], 0
    for _ in range(n_seqs):
        buf = []
        while len(buf) < seq_len + 1:
            buf += list(docs[i])
            i += 1
        out.append(np.array(buf[:seq_len + 1]))
    return out


@pytest.mark.parametrize("cap", [16, 37, 10_000])
def test_document_length_cap_packs_capped_documents_from_their_starts(tmp_path, cap):
    tokens = doc_tokens(30000, seed=5, mean_doc=60)
    tokens[:7] = 11  # text before the first document start is never trained on
    files = [write_shard(tmp_path / "s.bin", tokens)]
    stream = T.TokenStream(files, VOCAB, cycle=False)
    got = [np.array(stream.take(256, bos_align=True, doc_cap=cap)) for _ in range(20)]
    expected = capped_packing_reference(tokens[7:], 20, 256, cap)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
        assert g[0] == T.EOT_TOKEN
        run = max_run_without_eot(g)
        assert run <= cap - 1  # no document piece is longer than the cap (its EOT plus cap - 1 tokens)


def max_run_without_eot(seq):
    longest = current = 0
    for t in seq:
        current = 0 if t == T.EOT_TOKEN else current + 1
        longest = max(longest, current)
    return longest


def test_capped_packing_resumes_at_the_same_tokens_and_never_spans_shards(tmp_path):
    files = [write_shard(tmp_path / "a.bin", doc_tokens(3000, seed=1)),
             write_shard(tmp_path / "b.bin", doc_tokens(4000, seed=2))]
    stream = T.TokenStream(files, VOCAB, cycle=False)
    for _ in range(5):
        stream.take(256, bos_align=True, doc_cap=48)
    state = stream.state()
    expected = [np.array(stream.take(256, bos_align=True, doc_cap=48)) for _ in range(8)]
    assert stream.shard == 1  # the expected sequences crossed into the second shard
    restored = T.TokenStream(files, VOCAB, cycle=False)
    restored.load_state(state)
    for e in expected:
        np.testing.assert_array_equal(np.array(restored.take(256, bos_align=True, doc_cap=48)), e)
    second = doc_tokens(4000, seed=2)
    first_of_second = capped_packing_reference(second, 1, 256, 48)[0]
    assert any(np.array_equal(e, first_of_second) for e in expected)  # shard b starts afresh at its first document


# ----------------------------------------------------------------------------- the track-2 record's packed buffers

class RecordBOSFinder:
    """M L1245-1303 (BOSFinder), transcribed without its background index thread (quickload only delays the full
    index; the first 4M tokens' starts are the same): the next world_size buffers of num_tokens_local + 1 tokens,
    each from a document start, documents whole but cut at max_seq_len, the last one cut to fill."""

    def __init__(self, tokens):
        self.tokens, self.size = tokens, len(tokens)
        self.bos_idx = np.flatnonzero(np.asarray(tokens) == T.EOT_TOKEN)
        self.i = 0

    def next_batch(self, num_tokens_local, max_seq_len, world_size):
        n = len(self.bos_idx)
        starts = [[] for _ in range(world_size)]
        ends = [[] for _ in range(world_size)]
        idx = self.i
        for r in range(world_size):
            cur_len = 0
            while cur_len <= num_tokens_local:
                if idx >= n:
                    raise StopIteration("Insufficient BOS ahead; hit tail of shard.")
                cur = self.bos_idx[idx]
                starts[r].append(cur)
                end = min(self.bos_idx[idx + 1] if idx + 1 < n else self.size,
                          cur + max_seq_len,
                          cur + num_tokens_local - cur_len + 1)
                ends[r].append(end)
                cur_len += end - cur
                idx += 1
            assert cur_len == num_tokens_local + 1
        self.i = idx
        return starts, ends


def record_steps(files, batch_sizes, world_size, max_seq_len):
    """M's distributed_data_generator (L1330-1403) as its training loop calls it: grad_accum = 8 // world_size
    calls per step, each giving rank r its buffer r; a shard that cannot give a call's buffers is left for the
    next one (StopIteration). Each step's buffers in the order [call k, rank r] -> k * world_size + r."""
    grad_accum = 8 // world_size
    shards = iter(files)
    tokens = T.load_shard(next(shards), VOCAB)
    finder = RecordBOSFinder(tokens)
    caps = max_seq_len if isinstance(max_seq_len, list) else [max_seq_len] * len(batch_sizes)  # record #89: per stage
    for batch, max_seq_len in zip(batch_sizes, caps):
        num_tokens_local = batch // grad_accum // world_size
        buffers = []
        for _ in range(grad_accum):
            while True:
                try:
                    starts, ends = finder.next_batch(num_tokens_local, max_seq_len, world_size)
                    break
                except StopIteration:
                    tokens = T.load_shard(next(shards), VOCAB)
                    finder = RecordBOSFinder(tokens)
            for r in range(world_size):
                buffers.append(np.concatenate([tokens[i:j] for i, j in zip(starts[r], ends[r])]))
        yield buffers


def packed_steps(files, batch_sizes, world_size, doc_cap, rank):
    """This trainer's --batch_sequences=8 steps on one rank: [micro-step k] -> inputs and the last target."""
    loader = T.DistributedTokenLoader(T.TokenStream(files, VOCAB, False), rank, world_size, True, doc_cap,
                                      torch.device("cpu"), step_in_one_shard=True)
    for batch in batch_sizes:
        yield [torch.cat([x, y[-1:]]).numpy() for x, y in loader.next_batch(8 // world_size, batch // 8)]


def check_packed_against_record(files, batch_sizes, world_size, doc_cap, same_shard_steps):
    """Every rank's buffers at every step are the 8-GPU record's (sequence j = k * W + r is its buffer j), and
    the record at this world size gives the same ones wherever a step lies in one shard (the first
    same_shard_steps): the layout does not depend on the world size."""
    on8 = list(record_steps(files, batch_sizes, 8, doc_cap))
    here = list(record_steps(files, batch_sizes, world_size, doc_cap))
    ranks = [list(packed_steps(files, batch_sizes, world_size, doc_cap, r)) for r in range(world_size)]
    for step, batch in enumerate(batch_sizes):
        assert [len(b) for b in on8[step]] == [batch // 8 + 1] * 8
        for r in range(world_size):
            for k, buffer in enumerate(ranks[r][step]):
                np.testing.assert_array_equal(buffer, on8[step][k * world_size + r], err_msg=f"step {step} rank {r}")
                if step < same_shard_steps:
                    np.testing.assert_array_equal(buffer, here[step][k * world_size + r])
    moved = any(not np.array_equal(a, b) for s, t in zip(on8, here) for a, b in zip(s, t))
    assert moved == (world_size != 8)  # the record's own layout moves with the world size at a shard's end


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_packed_steps_are_the_records_buffers_on_short_documents(tmp_path, world_size):
    """Short synthetic documents (mean 40 tokens, cut at 64): many whole documents per buffer, cut ones, and
    shard ends crossed; the stages' 128 to 512-token buffers as the medium preset's 16K to 64K."""
    files = [write_shard(tmp_path / f"s{i}.bin", doc_tokens(9000, seed=10 + i)) for i in range(8)]
    batch_sizes = [8 * 128 * n for n in (1, 2, 3, 4, 4, 4, 4, 4)]
    check_packed_against_record(files, batch_sizes, world_size, doc_cap=64, same_shard_steps=3)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_packed_steps_are_the_records_buffers_on_the_sample_shard_at_the_medium_shapes(world_size):
    """The bundled real-format shard (185 documents of ~7.8K tokens), read three times over as three shards, at
    the medium preset's own stages (131,072 to 524,288 tokens) and document cap (4,096)."""
    files = [REPO_SAMPLE] * 3
    batch_sizes = [131072, 262144, 393216, 524288]
    check_packed_against_record(files, batch_sizes, world_size, doc_cap=4096, same_shard_steps=2)


def test_record_89s_document_cap_changes_with_the_stage(tmp_path):
    """Record #89 (T:1737-1760, T:1980-1987): the stage's train_max_seq_len cuts documents, 896 tokens in stage 0
    and 2048 after; --stage_doc_len_caps gives the loader each step's cap (here 48 then 64, on 2 ranks)."""
    files = [write_shard(tmp_path / f"s{i}.bin", doc_tokens(9000, seed=30 + i, mean_doc=60)) for i in range(4)]
    args = T.parse_args(["--preset=cpu", "--recipe=record", "--bos_align=true", "--batch_tokens=3072",
                         "--batch_sequences=8", "--seq_len=384", "--stage_doc_len_caps=48,64,64", "--num_iterations=7",
                         "--extension_steps=1", "--muon_momentum_warmup_steps=3", "--tied_embed_steps=5",
                         "--muon_momentum_cooldown_steps=1"], False)
    batches = T.batch_schedule(args, 2)
    assert [batches.doc_cap(step) for step in range(8)] == [48, 48, 64, 64, 64, 64, 64, 64]
    steps = range(6)
    want = list(record_steps(files, [batches.tokens(s) for s in steps], 8, [batches.doc_cap(s) for s in steps]))
    for rank in range(2):
        loader = T.DistributedTokenLoader(T.TokenStream(files, VOCAB, False), rank, 2, True, 0,
                                          torch.device("cpu"), step_in_one_shard=True)
        for step in steps:
            got = loader.next_batch(batches.accum(step), batches.seq_len(step), batches.doc_cap(step))
            for k, (x, y) in enumerate(got):
                np.testing.assert_array_equal(torch.cat([x, y[-1:]]).numpy(), want[step][k * 2 + rank])
    assert T.batch_schedule(T.parse_args(["--preset=cpu"], False), 1).doc_cap(0) is None  # off: the loader's cap
