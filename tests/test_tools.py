"""tools/: KV-cache decoding against the full forward, HellaSwag scoring and its pinned file, export round
trip, refusals of bad input, and the trainer's --sample_at_end / --hellaswag_every."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
import torch.nn.functional as F

import checkpoints  # noqa: E402
import evaluation  # noqa: E402
import train_gpt as T
from conftest import REPO, TIKTOKEN_CACHE, TINY, TOKENIZER_ENV, run_trainer
from conftest import needs_gpt2_vocab as needs_tokenizer
from tools import hellaswag as H
from tools import loading, sample
from tools.loading import run_tool
from tools.export import export
from tools.loading import load_exported

EOT = T.EOT_TOKEN
FIXTURE = REPO / "tests" / "fixtures" / "hellaswag" / "hellaswag_fixture.jsonl"


def model_args(*extra):
    return T.parse_args(["--preset=cpu", "--n_layer=4", "--model_dim=64", "--n_head=2", "--head_dim=32",
                         "--seq_len=512", "--val_seq_len=512", "--val_tokens=512", *extra], False)


def random_model(dtype="fp32", seed=0):
    """Random weights everywhere (no zero-initialised projections): every path through the model matters."""
    args = model_args("--zero_init=false", f"--dtype={dtype}")
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                   dtype=torch.float32 if dtype == "fp32" else torch.bfloat16, attention="banded", fp8_head=False,
                   compile="off")
    torch.manual_seed(seed)
    model = T.build_model(args, rt).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambdas" in name or name == "skip_weights":
                p.add_(torch.randn_like(p) * 0.3)  # no mixing weight at a special value (0 or 1)
    return model


def randomised_model(args, seed=0):
    """The model of args in eval mode, every weight random (gates and lambdas included): each path carries signal."""
    model = T.GPT(T.ModelConfig.of(args)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.ndim < 2 else 0.1))
    return model


def prompt_with_documents(n, eot_at, seed=1):
    tokens = torch.randint(0, EOT, (n,), generator=torch.Generator().manual_seed(seed))
    tokens[list(eot_at)] = EOT
    return tokens.tolist()


def tool(name, *args, env=None):
    return subprocess.run([sys.executable, str(REPO / "tools" / f"{name}.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def one_error_line(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture
def checkpoint(tiny_run):
    """A real tiny run's final checkpoint (4 steps on the bundled sample; another at step 2 beside it)."""
    return tiny_run / "tiny" / "step_000004"


def test_a_mid_run_checkpoint_runs_with_its_step_s_window(checkpoint):
    middle = loading.load_model(checkpoint.parent / "step_000002", "cpu")
    assert (middle.step, middle.window_blocks) == (2, 4)  # 1024 final tokens * 2/4 steps = 4 blocks
    assert loading.load_model(checkpoint.parent / "step_000002", "cpu", window="final").window_blocks == 8
    final = loading.load_model(checkpoint, "cpu")
    assert (final.step, final.window_blocks) == (4, 8)
    a, b = middle.model.state_dict(), final.model.state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)  # two different points of the run


# ----------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("window", [1, 2, 3])
def test_cached_decoding_gives_the_full_forward_logits(window):
    """Prefill plus one token at a time, across documents and beyond both windows, against logits()."""
    model = random_model()
    tokens = torch.tensor(prompt_with_documents(512, [0, 150, 151, 300]))
    with torch.no_grad():
        full = model.logits(tokens, T.window_tensor(window))[0]
    cache = T.KVCache(model, T.window_tensor(window))
    got = [model.decode(tokens[:100], cache)]
    got += [model.decode(tokens[i:i + 1], cache) for i in range(100, 512)]
    expected = torch.cat([full[99:100], full[100:512]])
    torch.testing.assert_close(torch.stack(got), expected, atol=2e-5, rtol=1e-5)


def test_v2_model_decodes_from_its_history_with_the_full_forward_logits():
    """Smear, bigrams, key offset and paired heads read the token before or interleave positions, which the KV
    cache cannot extend: decode() runs the model over the cached history, and gives logits()'s numbers."""
    args = model_args("--recipe=v2", "--n_layer=4", "--batch_tokens=2048", "--batch_schedule=", "--dtype=fp32",
                      "--bigram_vocab_size=1000", "--bigram_dim=32")
    model = randomised_model(args)
    assert model.decodes_from_history
    tokens = torch.tensor(prompt_with_documents(300, [0, 150, 151]))
    with torch.no_grad():
        full = model.logits(F.pad(tokens, (0, 84), value=T.EOT_TOKEN), T.window_tensor(2))[0]
    cache = T.KVCache(model, T.window_tensor(2))
    # one token at a time across the document starts at 150 and 151 and past the 256-token window; a chunk between
    singles = [*range(140, 160), *range(250, 300)]
    got = [model.decode(tokens[:140], cache)] + [model.decode(tokens[i:i + 1], cache) for i in range(140, 160)]
    got += [model.decode(tokens[160:250], cache)] + [model.decode(tokens[i:i + 1], cache) for i in range(250, 300)]
    torch.testing.assert_close(torch.stack(got), full[[139, *singles[:20], 249, *singles[20:]]], atol=2e-5, rtol=1e-5)
    assert evaluation.generate(model, tokens[:140].tolist(), 8, 2, temperature=0) == \
        evaluation.generate(model, tokens[:140].tolist(), 8, 2, temperature=0, kv_cache=False)


MODEL_TECHNIQUES = [t for t in T.TECHNIQUES if t.part == "model"]


@pytest.mark.parametrize("technique", MODEL_TECHNIQUES, ids=[t.name for t in MODEL_TECHNIQUES])
def test_a_technique_marked_as_reading_the_previous_token_is_one_the_kv_cache_cannot_extend(technique, monkeypatch):
    """Each model technique alone on a reference model, every weight random: decoding through the KV cache gives
    the full forward's logits exactly when its declaration says the cache can extend it (reads_previous_token
    false); for the ones marked true it does not, so decode() must (and does) rerun the history."""
    values = {**technique.v2.get("cpu", technique.v2.get("speedrun")),
              **({"bigram_vocab_size": 1000, "bigram_dim": 32} if technique.name == "bigram" else {})}  # small table
    args = model_args("--dtype=fp32", *[f"--{k}={T.flag_text(v)}" for k, v in values.items()])
    assert [t.name for t in T.TECHNIQUES if t.is_on(args)] == [technique.name]
    model = randomised_model(args)
    assert model.decodes_from_history == technique.reads_previous_token
    monkeypatch.setattr(T.GPT, "decodes_from_history", property(lambda self: False))  # the cache path, always
    tokens = torch.tensor(prompt_with_documents(256, [0, 100]))
    with torch.no_grad():
        full = model.logits(tokens, T.window_tensor(2))[0]
    cache = T.KVCache(model, T.window_tensor(2))
    try:
        got = torch.stack([model.decode(tokens[:90], cache)] + [model.decode(tokens[i:i + 1], cache)
                                                                for i in range(90, 256)])
        matches = torch.allclose(got, full[89:256], atol=2e-5, rtol=1e-5)
    except RuntimeError:  # paired heads' doubled positions do not even fit the cache's layout
        matches = False
    assert matches != technique.reads_previous_token


def test_greedy_with_the_cache_matches_the_naive_forward():
    """A prompt longer than the long window, with a document boundary (EOT) inside it."""
    model = random_model()
    prompt = prompt_with_documents(330, [0, 200])
    with_cache = evaluation.generate(model, prompt, 60, window_blocks=2, temperature=0)
    naive = evaluation.generate(model, prompt, 60, window_blocks=2, temperature=0, kv_cache=False)
    assert len(with_cache) == 60 and with_cache == naive


def test_greedy_in_bf16_matches_the_naive_forward():
    model = random_model("bf16")
    prompt = prompt_with_documents(140, [0, 70])
    assert evaluation.generate(model, prompt, 20, 1, temperature=0) == \
        evaluation.generate(model, prompt, 20, 1, temperature=0, kv_cache=False)


def test_a_new_token_attends_only_to_its_window(monkeypatch):
    """O(window) per token: at position t the cache hands attention at most the window's blocks."""
    model = random_model()
    seen = []
    attend = T.dense_attention
    monkeypatch.setattr(T, "dense_attention",
                        lambda q, k, v, mask, scale: seen.append(k.shape[1]) or attend(q, k, v, mask, scale))
    cache = T.KVCache(model, T.window_tensor(2))
    tokens = torch.tensor(prompt_with_documents(500, [0]))
    model.decode(tokens[:1], cache)
    seen.clear()
    for i in range(1, 500):
        model.decode(tokens[i:i + 1], cache)
    assert max(seen) <= 2 * T.BLOCK_SIZE and min(seen) >= 1


def test_sampling_is_seeded_and_respects_top_k():
    model = random_model()
    prompt = prompt_with_documents(10, [0])
    draw = lambda seed, top_k=0: evaluation.generate(model, prompt, 30, 4, 1.0, top_k, torch.Generator().manual_seed(seed))
    assert draw(3) == draw(3) and draw(3) != draw(4)
    logits = torch.randn(T.next_multiple(EOT + 1, 128))
    top = set(torch.topk(T.apply_softcap(logits[:EOT + 1], T.Softcap(30.0)), 5).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    assert model.vocab_size == EOT + 1 and model.softcap == T.Softcap(30.0)
    assert {evaluation.next_token(model, logits, 1.0, 5, gen) for _ in range(200)} <= top
    logits[EOT + 1] = 1e4  # a padding row of the head is never drawn
    assert evaluation.next_token(model, logits, 0, 0, None) != EOT + 1


def test_generation_stops_at_the_end_of_the_document():
    model = random_model()
    with torch.no_grad():
        model.lm_head.weight[EOT] = 50.0 * model.lm_head.weight[EOT].sign()  # make EOT the likeliest next token
    assert evaluation.generate(model, [EOT, 5, 6], 10, 4, temperature=0) == []


def test_a_long_prompt_is_cut_from_the_left_keeping_the_document_start():
    prompt = [EOT] + list(range(1, 300))
    cut, was_cut = sample.fit_prompt(prompt, 56, 256)
    assert was_cut and len(cut) == 200 and cut[0] == EOT and cut[1:] == prompt[-199:]
    assert sample.fit_prompt(prompt[:50], 56, 256) == (prompt[:50], False)
    with pytest.raises(T.UsageError, match="max_new_tokens=256 leaves no room"):
        sample.fit_prompt(prompt, 256, 256)


# ----------------------------------------------------------------------------- sample.py CLI


@needs_tokenizer
def test_sample_cli_prints_text_and_warns_on_a_long_prompt(checkpoint):
    result = tool("sample", checkpoint, "--prompt", "The President", "--max_new_tokens", 20, "--num_samples", 2,
                  env=TOKENIZER_ENV)
    assert result.returncode == 0, result.stderr
    texts = [line for line in result.stdout.splitlines() if not line.startswith("--- sample")]
    assert result.stdout.count("--- sample") == 2 and all(t.startswith("The President") for t in texts)
    assert len(texts[0]) > len("The President") and "tokens/s (kv_cache true)" in result.stderr
    long = tool("sample", checkpoint, "--prompt", "the nation " * 200, "--max_new_tokens", 16,
                "--temperature", 0, env=TOKENIZER_ENV)
    assert long.returncode == 0, long.stderr
    assert "warning: the prompt is longer than the model's 256-token context" in long.stderr
    assert "kept its last 239 tokens" in long.stderr


def test_sample_cli_refuses_a_nan_temperature_in_one_line(checkpoint):
    """The probe as written (it was a traceback from torch.multinomial)."""
    assert one_error_line(tool("sample", checkpoint, "--temperature=nan", env=TOKENIZER_ENV)) == (
        "error: argument --temperature: bad value 'nan'; valid: a finite number in [1e-06, inf), or 0 "
        "(see sample.py --help)")


@pytest.mark.parametrize("program, option, valid", [
    (sample, "--temperature=inf", "a finite number in [1e-06, inf), or 0"),  # was a silent uniform draw
    (sample, "--temperature=1e-40", "a finite number in [1e-06, inf), or 0"),  # overflows the logits: NaN
    (sample, "--top_k=-1", "an integer at least 0"),
    (sample, "--max_new_tokens=0", "an integer at least 1"),
    (sample, "--num_samples=0", "an integer at least 1"),
    (sample, f"--seed={2**64}", f"an integer in [0, {2**64 - 1}]"),  # was a traceback from manual_seed
    (H, "--limit=-1", "an integer at least 0"),
])
def test_a_tool_number_out_of_range_is_one_error_line_naming_the_range(program, option, valid, checkpoint, capsys):
    assert run_tool(lambda: program.main([str(checkpoint), option])) == 2
    name, value = option.split("=")
    err = capsys.readouterr().err
    assert err.startswith(f"error: argument {name}: bad value '{value}'; valid: {valid} (see ") and \
        err.count("\n") == 1, err


def test_the_smallest_temperature_allowed_still_draws_a_token():
    """Its scaled logits stay finite (1e-40 made NaN probabilities): it draws the likeliest token, as greedy does."""
    logits = torch.randn(T.next_multiple(EOT + 1, 128), generator=torch.Generator().manual_seed(0))
    model = random_model()
    token = evaluation.next_token(model, logits, sample.MIN_TEMPERATURE, 0, torch.Generator())
    assert token == int(T.apply_softcap(logits[:EOT + 1], T.Softcap(30.0)).argmax())


def test_cli_number_types_refuse_what_is_out_of_range_naming_the_range():
    """tools/cli.py's type= helpers, which every program's number arguments use."""
    from tools.cli import integer, number
    def refused(convert, text):
        with pytest.raises(argparse.ArgumentTypeError) as caught:
            convert(text)
        return str(caught.value)
    between = number(0, 1, lo_open=True, hi_open=True)
    assert between("0.5") == 0.5
    for text in ("0", "1", "nan", "inf", "-inf", "half"):
        assert refused(between, text) == f"bad value {text!r}; valid: a finite number in (0, 1)"
    greedy_or_warm = number(1e-6, also=(0.0,))
    assert greedy_or_warm("0") == 0.0 and greedy_or_warm("1e-6") == 1e-6 and greedy_or_warm("1e9") == 1e9
    assert refused(greedy_or_warm, "1e-7") == "bad value '1e-7'; valid: a finite number in [1e-06, inf), or 0"
    one_to_three = integer(1, 3)
    assert (one_to_three("1"), one_to_three("3")) == (1, 3)
    for text in ("0", "4", "1.5", "two"):
        assert refused(one_to_three, text) == f"bad value {text!r}; valid: an integer in [1, 3]"
    assert refused(integer(0), "-1") == "bad value '-1'; valid: an integer at least 0"


def test_tokenizer_unavailable_is_one_line(checkpoint, tmp_path):
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path), "HTTPS_PROXY": "http://127.0.0.1:9",
               "HTTP_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    line = one_error_line(tool("sample", checkpoint, "--prompt", "x", env=offline))
    assert "cannot load the GPT-2 tokenizer" in line and "TIKTOKEN_CACHE_DIR" in line


@needs_tokenizer
def test_checkpoint_of_another_shape_or_recipe_is_refused(checkpoint, tmp_path):
    def edited(name, change):
        folder = tmp_path / name
        shutil.copytree(checkpoint, folder)
        meta = json.loads((folder / "checkpoint.json").read_text())
        change(meta["hyperparameters"])
        (folder / "checkpoint.json").write_text(json.dumps(meta))
        return folder
    wide = edited("wide", lambda h: h.update(model_dim=128))
    line = one_error_line(tool("sample", wide, "--prompt", "x", env=TOKENIZER_ENV))
    assert "the weights have model_dim=64 but the recorded hyperparameters say model_dim=128" in line
    deep = edited("deep", lambda h: h.update(n_layer=4))
    assert "n_layer=2 but the recorded hyperparameters say n_layer=4" in \
        one_error_line(tool("hellaswag", deep, "--data", FIXTURE))
    other = edited("other", lambda h: h.update(attn_sink="sparse"))
    assert "records hyperparameter 'attn_sink'='sparse', which this train_gpt.py does not have" in \
        one_error_line(tool("export", other, tmp_path / "out"))
    not_bool = edited("not_bool", lambda h: h.update(attn_gate="sparse"))  # a switch recorded as text
    assert "refuses (bad value 'sparse' for --attn_gate; valid: true or false)" in \
        one_error_line(tool("export", not_bool, tmp_path / "out3"))
    newer = edited("newer", lambda h: h.update(recipe="v9"))
    assert "refuses (bad value 'v9' for --recipe; valid: one of reference, v2)" in \
        one_error_line(tool("export", newer, tmp_path / "out2"))
    assert "does not exist" in one_error_line(tool("sample", tmp_path / "missing", env=TOKENIZER_ENV))


# ----------------------------------------------------------------------------- HellaSwag

# The fixture's model: every position predicts the same distribution, where " cat", " dog", " sun" and
# " tree" cost about 1.39 nats and every other token about 16.39. Each example was built so that the
# choices below follow from those two numbers alone: 4 examples both rules get right, 2 only acc_norm
# (long all-good endings), 3 only acc (a one-token label against a longer ending of better mean), 1
# neither. Example 3 also flips if the context's tokens were scored, or targets shifted by one.
FIXTURE_CHOICES = [(1, 1), (0, 0), (3, 3), (2, 2), (0, 2), (1, 0), (2, 0), (0, 3), (3, 2), (1, 1)]
FIXTURE_ACC, FIXTURE_ACC_NORM = 0.7, 0.6


def unigram_model(enc):
    """Attention and MLPs output zero (zero-init projections), every token embeds to the same vector, so
    the head sees one hidden state everywhere; its rows for the good words stand out."""
    args = T.parse_args(TINY, False)
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16,
                   attention="banded", fp8_head=False, compile="off")
    model = T.build_model(args, rt).eval()
    with torch.no_grad():
        model.embed.weight.fill_(1.0)
        for word in (" cat", " dog", " sun", " tree"):
            (token,) = enc.encode_ordinary(word)
            model.lm_head.weight[token] = 200.0 / args.model_dim  # logit 200: softcapped to ~30, others 15
    return model


@needs_tokenizer
def test_fixture_gives_its_known_accuracy(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    enc = evaluation.gpt2_tokenizer()
    items = evaluation.tokenized_hellaswag(evaluation.read_hellaswag(FIXTURE), enc, 256)
    for pack_tokens in (128, 256):  # one candidate per sequence, and several packed together
        result = evaluation.hellaswag_score(unigram_model(enc), items, window_blocks=1, pack_tokens=pack_tokens)
        assert result.predictions == FIXTURE_CHOICES
        assert (result.examples, result.acc, result.acc_norm) == (10, FIXTURE_ACC, FIXTURE_ACC_NORM)


@needs_tokenizer
def test_packed_ending_losses_match_one_forward_per_candidate(monkeypatch):
    """Against the training loss itself: each candidate alone, the context's targets ignored (-100)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    model = random_model()
    rows = [row for rows, _ in evaluation.tokenized_hellaswag(evaluation.read_hellaswag(FIXTURE), evaluation.gpt2_tokenizer(), 512)
            for row in rows]
    window = T.window_tensor(2)
    packed = evaluation.ending_losses(model, rows, window, pack_tokens=512)
    for row, losses in zip(rows, packed):
        tokens = evaluation.padded_to_blocks(model, row.tokens)
        targets = torch.full_like(tokens, -100)
        targets[row.ending_start - 1:len(row.tokens) - 1] = tokens[row.ending_start:len(row.tokens)]
        n = len(row.tokens) - row.ending_start
        with torch.no_grad():
            mean = model(tokens, targets, window)
        assert losses.numel() == n
        assert losses.sum().item() == pytest.approx(mean.item() * n, rel=1e-5)


def test_blob_id_is_gits_and_the_pins_are_the_issue_s():
    assert evaluation.git_blob_id(FIXTURE.read_bytes()) == subprocess.run(
        ["git", "hash-object", str(FIXTURE)], capture_output=True, text=True, check=True).stdout.strip()
    assert evaluation.git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # git's empty blob
    assert evaluation.HELLASWAG_BLOB_SHA1 == "0f5ee25d72216f12317d5d8a7b92deafa423d81e"
    assert evaluation.HELLASWAG_URL == ("https://raw.githubusercontent.com/rowanz/hellaswag/"
                     "a29ff8e9a04bba4bd6588223785ce105328adc57/data/hellaswag_val.jsonl")


class FakeServer:
    """urlopen stand-in serving fixed bytes (or failing), counting requests."""

    def __init__(self, data=None):
        self.data, self.requests = data, 0

    def __call__(self, url, timeout):
        self.requests += 1
        assert url == evaluation.HELLASWAG_URL
        if self.data is None:
            raise urllib.error.URLError("no route to host")
        import io
        return io.BytesIO(self.data)


def test_download_once_then_verified_cache(monkeypatch, tmp_path):
    good = FIXTURE.read_bytes()
    server = FakeServer(good)
    monkeypatch.setattr(urllib.request, "urlopen", server)
    expected = evaluation.git_blob_id(good)
    path = evaluation.cached_hellaswag_file(tmp_path, expected=expected)
    assert path.read_bytes() == good and server.requests == 1
    assert evaluation.cached_hellaswag_file(tmp_path, expected=expected) == path and server.requests == 1
    path.write_bytes(good[:-5])  # a corrupt cache is fetched again
    assert evaluation.cached_hellaswag_file(tmp_path, expected=expected).read_bytes() == good and server.requests == 2


def test_corrupt_download_is_refused_with_the_url(monkeypatch, tmp_path):
    good = FIXTURE.read_bytes()
    monkeypatch.setattr(urllib.request, "urlopen", FakeServer(good.replace(b"cat", b"cow", 1)))
    with pytest.raises(T.UsageError) as e:
        evaluation.cached_hellaswag_file(tmp_path, expected=evaluation.git_blob_id(good))
    assert "corrupt or changed" in str(e.value) and evaluation.HELLASWAG_URL in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing half-written is left to be trusted later


def test_unreachable_file_is_one_line_with_the_url(monkeypatch, tmp_path, capsys, checkpoint):
    monkeypatch.setattr(urllib.request, "urlopen", FakeServer(None))
    assert run_tool(lambda: H.main([str(checkpoint), "--cache_dir", str(tmp_path)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot download the HellaSwag validation file" in err[0] and evaluation.HELLASWAG_URL in err[0]


def test_missing_or_malformed_local_file_is_one_line_with_the_url(tmp_path, checkpoint):
    assert evaluation.HELLASWAG_URL in one_error_line(tool("hellaswag", checkpoint, "--data", tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(FIXTURE.read_text().splitlines()[0] + "\n" + '{"ctx": "x", "endings": ["a"], "label": 0}\n')
    line = one_error_line(tool("hellaswag", checkpoint, "--data", bad))
    assert "line 2 of" in line and "is not a HellaSwag example" in line and evaluation.HELLASWAG_URL in line


# ----------------------------------------------------------------------------- export


def test_export_round_trip_is_bit_identical(checkpoint, tmp_path):
    result = tool("export", checkpoint, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    original = loading.load_model(checkpoint, "cpu")
    from safetensors.torch import load_file
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    trained = checkpoints.read_checkpoint_tensors(checkpoint)
    assert stored.keys() == trained.keys() and all(stored[k].dtype == trained[k].dtype for k in trained)
    assert {t.dtype for t in stored.values()} == {torch.float32, torch.bfloat16}  # embeddings trained in bf16
    shutil.copytree(tmp_path / "out", tmp_path / "alone")  # only the two files, away from the checkpoint
    rebuilt = load_exported(tmp_path / "alone", "cpu")
    a, b = original.model.state_dict(), rebuilt.model.state_dict()
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert rebuilt.args == original.args and rebuilt.window_blocks == original.window_blocks
    tokens = torch.tensor(prompt_with_documents(256, [0, 99]))
    window = T.window_tensor(original.window_blocks)
    with torch.no_grad():
        assert torch.equal(original.model.logits(tokens, window), rebuilt.model.logits(tokens, window))


def test_both_export_files_get_the_permissions_of_a_new_file(checkpoint, tmp_path):
    """safetensors writes its file 0600; the export's weights and config both get what the umask gives."""
    loaded = loading.load_model(checkpoint, "cpu")
    before = os.umask(0o002)  # a shared project's umask: group-writable files
    try:
        export(loaded, tmp_path / "out")
    finally:
        os.umask(before)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in (tmp_path / "out").iterdir()}
    assert modes == {"config.json": oct(0o664), "model.safetensors": oct(0o664)}


def test_export_of_a_shape_mismatch_is_refused(checkpoint, tmp_path):
    export(loading.load_model(checkpoint, "cpu"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hyperparameters"]["vocab_size"] = 50304
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(T.UsageError, match="the weights have vocab_size=50257 but the recorded hyperparameters "
                                           "say vocab_size=50304"):
        load_exported(tmp_path)


# ----------------------------------------------------------------------------- in the trainer


@needs_tokenizer
def test_sample_at_end_writes_samples_into_the_log_and_summary(tmp_path):
    result = run_trainer(TINY + ["--run_id=s", "--sample_at_end=2", "--val_every=0"], tmp_path, env=TOKENIZER_ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = (tmp_path / "s.txt").read_text().splitlines()
    final = next(i for i, line in enumerate(lines) if line.startswith("final: "))
    samples = [line for line in lines if line.startswith("sample ")]
    assert [s.split(":")[0] for s in samples] == ["sample 1/2", "sample 2/2"]
    assert lines[final + 1:final + 3] == samples
    texts = [json.loads(s.split(": ", 1)[1]) for s in samples]
    assert all(isinstance(t, str) and t for t in texts)
    assert json.loads((tmp_path / "s.json").read_text())["samples"] == texts


def test_sample_at_end_without_a_tokenizer_stops_at_start_up(tmp_path):
    result = run_trainer(TINY + ["--run_id=n", "--sample_at_end=1"], tmp_path,
                         env={"TIKTOKEN_CACHE_DIR": str(tmp_path), "HTTPS_PROXY": "http://127.0.0.1:9",
                              "https_proxy": "http://127.0.0.1:9"})
    assert result.returncode == 2 and "cannot load the GPT-2 tokenizer" in result.stderr
    assert "step:1/" not in (tmp_path / "n.txt").read_text()


SLOW_HELLASWAG = '''
import sys, time
sys.path[:0] = [{repo!r}, {repo!r} + "/tests"]
import evaluation
import train_gpt as T
from rank_driver import exit_checked
score = evaluation.hellaswag_score
evaluation.hellaswag_score = lambda *a, **k: (time.sleep(4), score(*a, **k))[1]  # a slow eval must not count as training
stop = T.StopSignal()
exit_checked(T.main(stop=stop), stop)
'''


@needs_tokenizer
def test_hellaswag_every_over_two_ranks_matches_the_tool_and_is_untimed(tmp_path):
    driver = tmp_path / "slow.py"
    driver.write_text(SLOW_HELLASWAG.format(repo=str(REPO)))
    result = run_trainer(TINY + ["--run_id=h", "--hellaswag_every=2", f"--hellaswag_data={FIXTURE}",
                                 "--checkpoint_final=true", "--val_every=0"], tmp_path / "logs", nproc=2,
                         driver=driver, env=TOKENIZER_ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "logs" / "h.txt").read_text()
    lines = [line for line in log.splitlines() if line.startswith("step:") and "hellaswag_acc:" in line]
    assert [line.split()[0] for line in lines] == ["step:0/4", "step:2/4", "step:4/4"]
    assert all(" hellaswag_examples:10 " in line for line in lines)
    summary = json.loads((tmp_path / "logs" / "h.json").read_text())
    curve = summary["hellaswag_curve"]
    assert [row[0] for row in curve] == [0, 2, 4] and all(row[3] == 10 for row in curve)
    assert summary["train_time_ms"] < 3 * 4000  # three 4-second evaluations happened outside the clock
    scored = tool("hellaswag", tmp_path / "logs" / "h" / "step_000004", "--data", FIXTURE, env=TOKENIZER_ENV)
    assert scored.returncode == 0, scored.stderr
    assert f"acc:{curve[-1][1]:.4f} acc_norm:{curve[-1][2]:.4f} examples:10" in scored.stdout


# ----------------------------------------------------------------------------- recipe v2 checkpoints

@pytest.fixture(scope="module")
def v2_checkpoint(tmp_path_factory):
    """A real tiny run of recipe v2 (every model technique) and its final checkpoint."""
    from test_training import V2_TINY
    logs = tmp_path_factory.mktemp("run_v2")
    result = run_trainer(TINY + V2_TINY + ["--run_id=v2", "--checkpoint_final=true"], logs)
    assert result.returncode == 0, result.stderr[-2000:]
    return logs / "v2" / "step_000004"


def test_v2_checkpoint_exports_like_the_trained_model(v2_checkpoint, tmp_path):
    """export round trip bit for bit (the bigram table and every gate; the sign table is rebuilt, not stored)."""
    loaded = loading.load_model(v2_checkpoint, "cpu")
    assert loaded.args.recipe == "v2" and loaded.model.bigram_embed is not None and loaded.model.decodes_from_history
    result = tool("export", v2_checkpoint, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "bigram_embed.weight" in stored and "smear_gate" in stored and "bigram_signs" not in stored
    rebuilt = load_exported(tmp_path / "out", "cpu")
    tokens = torch.tensor(prompt_with_documents(256, [0, 99]))
    window = T.window_tensor(loaded.window_blocks)
    with torch.no_grad():
        assert torch.equal(loaded.model.logits(tokens, window), rebuilt.model.logits(tokens, window))


@needs_tokenizer
def test_v2_checkpoint_samples_through_decode_s_history_path(v2_checkpoint):
    sampled = tool("sample", v2_checkpoint, "--prompt", "The President", "--max_new_tokens", 8,
                   "--temperature", 0, env=TOKENIZER_ENV)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.count("The President") == 1
