"""evaluation.py, and the model's decode path it samples through: KV-cache decoding against the full forward
(the v2 techniques that read the previous token rerun the history, as their declarations say), greedy and seeded
sampling, HellaSwag's reading, packing and scoring against a fixture of known accuracy, its pinned file downloaded
once and verified; and the trainer's --sample_at_end and --hellaswag_every, which call it."""
import json
import subprocess
import urllib.error
import urllib.request

import pytest
import torch
import torch.nn.functional as F

import evaluation
import train_gpt as T
from conftest import REPO, TIKTOKEN_CACHE, TINY, TOKENIZER_ENV, run_main, run_trainer, tool_in_process
from conftest import needs_gpt2_vocab as needs_tokenizer
from tools import sample

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
    assert evaluation.generate(model, tokens[:140].tolist(), 8, (2, 1), temperature=0) == \
        evaluation.generate(model, tokens[:140].tolist(), 8, (2, 1), temperature=0, kv_cache=False)


def test_record_layout_decodes_from_its_history_with_the_full_forward_logits():
    """Record #89's whole stream (paired blocks, DC, gates, h7, MUDD) decodes by rerunning its history, and gives
    logits()'s numbers one token at a time across a document start."""
    args = model_args("--dtype=fp32", "--n_layer=11", "--long_window_blocks=3,10", "--attention_free_blocks=6",
                      "--paired_head_blocks=0,2,5,9", "--value_embed_blocks=1,2,8,9,10", "--key_offset=true",
                      "--skip_connections=3>6", "--skip_sigmoid=true", "--sublayer_lambdas=true",
                      "--attention_cache_block=7", "--mudd=true", "--mudd_gate_block=4", "--output_gate_blocks=3,10",
                      "--xsa_blocks=1,3,4,7", "--dc_blocks=10", "--ve_gates=true", "--ve_gate_reads_value=true",
                      "--attn_output_lambda=true", "--bigram_vocab_size=1000", "--bigram_dim=0")
    model = randomised_model(args)
    assert model.decodes_from_history
    tokens = torch.tensor(prompt_with_documents(200, [0, 150]))
    with torch.no_grad():
        full = model.logits(F.pad(tokens, (0, 56), value=T.EOT_TOKEN), T.window_tensor(2))[0]
    cache = T.KVCache(model, T.window_tensor(2))
    got = [model.decode(tokens[:140], cache)] + [model.decode(tokens[i:i + 1], cache) for i in range(140, 160)]
    torch.testing.assert_close(torch.stack(got), full[139:160], atol=1e-4, rtol=1e-5)


MODEL_TECHNIQUES = [t for t in T.TECHNIQUES if t.part == "model"]
# Record #89's techniques on the 4-layer model: their values, and the techniques they need on beside them.
RECORD_CASES = {
    "block_lists": ({"long_window_blocks": "1,3", "attention_free_blocks": "2", "paired_head_blocks": "0",
                     "value_embed_blocks": "1,3"}, []),
    "ve_gate_reads_value": ({"ve_gate_reads_value": True, "ve_gates": True}, ["ve_skip_gates"]),
    "record_89_init": ({"value_embed_init_std": 0.01, "attn_proj_uniform_init": True}, []),
    "sublayer_lambdas": ({"sublayer_lambdas": True}, []),
    "attention_cache": ({"attention_cache_block": 1}, []),
    "mudd_gates": ({"mudd_gate_block": 2, "output_gate_blocks": "1,2", "xsa_blocks": "0", "dc_blocks": "2"}, []),
    "mudd": ({"mudd": True, "attention_cache_block": 1, "skip_connections": "0>2", "attention_free_layer": False},
             ["attention_cache", "attention_free_layer", "skip_layout"]),
}


@pytest.mark.parametrize("technique", MODEL_TECHNIQUES, ids=[t.name for t in MODEL_TECHNIQUES])
def test_a_technique_marked_as_reading_the_previous_token_is_one_the_kv_cache_cannot_extend(technique, monkeypatch):
    """Each model technique alone on a reference model, every weight random: decoding through the KV cache gives
    the full forward's logits exactly when its declaration says the cache can extend it (reads_previous_token
    false); for the ones marked true it does not, so decode() must (and does) rerun the history."""
    # its short-track v2 values, or, for track 2's own techniques, the medium preset's
    on = next((technique.v2[preset] for preset in ("cpu", "speedrun") if preset in technique.v2), None) or \
        RECORD_CASES.get(technique.name, ({},))[0] or \
        {name: T.PRESETS["medium"].get(name, T.RECORD_VALUES["speedrun"].get(name)) for name in technique.flags}
    needs = {"fp8_head_scales": {"loss_sum": True}}.get(technique.name, {})  # another technique it is refused without
    values = {**on, **needs, **({"bigram_vocab_size": 1000, "bigram_dim": 32} if technique.name == "bigram" else {}),
              **({"short_window_cap": 1} if technique.name == "short_window_cap" else {}),  # a cap below window 2
              **({"value_embed_tables": 1} if technique.name == "value_embed_tables" else {}),  # 4 layers hold 2
              **({"skip_connections": "1>2,0>3"} if technique.name == "skip_layout" else {})}  # M's needs 12 layers
    args = model_args("--dtype=fp32", *[f"--{k}={T.flag_text(v)}" for k, v in values.items()])
    companions = RECORD_CASES.get(technique.name, ({}, []))[1]
    on_now = [t.name for t in T.TECHNIQUES if t.is_on(args) and t.switch not in needs]
    assert sorted(on_now) == sorted([technique.name, *companions])
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
        # record #89's stream sums random MUDD coefficients times several streams: fp32 noise reaches 5e-5 there
        matches = torch.allclose(got, full[89:256], atol=1e-4 if technique.name in RECORD_CASES else 2e-5, rtol=1e-5)
    except (RuntimeError, ValueError):  # paired heads' doubled positions do not fit the cache's layout, nor DC's
        # 128-token chunks a single new token
        matches = False
    assert matches != technique.reads_previous_token


def test_greedy_with_the_cache_matches_the_naive_forward():
    """A prompt longer than the long window, with a document boundary (EOT) inside it."""
    model = random_model()
    prompt = prompt_with_documents(330, [0, 200])
    with_cache = evaluation.generate(model, prompt, 60, windows=(2, 1), temperature=0)
    naive = evaluation.generate(model, prompt, 60, windows=(2, 1), temperature=0, kv_cache=False)
    assert len(with_cache) == 60 and with_cache == naive


def test_greedy_in_bf16_matches_the_naive_forward():
    model = random_model("bf16")
    prompt = prompt_with_documents(140, [0, 70])
    assert evaluation.generate(model, prompt, 20, (1, 1), temperature=0) == \
        evaluation.generate(model, prompt, 20, (1, 1), temperature=0, kv_cache=False)


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


# ----------------------------------------------------------------------------- sampling

def test_sampling_is_seeded_and_respects_top_k():
    model = random_model()
    prompt = prompt_with_documents(10, [0])
    draw = lambda seed, top_k=0: evaluation.generate(model, prompt, 30, (4, 2), 1.0, top_k,  # noqa: E731
                                                     torch.Generator().manual_seed(seed))
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
    assert evaluation.generate(model, [EOT, 5, 6], 10, (4, 2), temperature=0) == []


def test_the_smallest_temperature_allowed_still_draws_a_token():
    """Its scaled logits stay finite (1e-40 made NaN probabilities): it draws the likeliest token, as greedy does."""
    logits = torch.randn(T.next_multiple(EOT + 1, 128), generator=torch.Generator().manual_seed(0))
    model = random_model()
    token = evaluation.next_token(model, logits, sample.MIN_TEMPERATURE, 0, torch.Generator())
    assert token == int(T.apply_softcap(logits[:EOT + 1], T.Softcap(30.0)).argmax())


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
        result = evaluation.hellaswag_score(unigram_model(enc), items, windows=(1, 1), pack_tokens=pack_tokens)
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


@pytest.mark.parametrize("endings", ['"abcd"', '["a", "b", "c"]', '["a", "b", "c", 4]'])
def test_a_hellaswag_line_without_four_string_endings_is_refused(tmp_path, endings):
    data = tmp_path / "h.jsonl"
    data.write_text(f'{{"ctx": "x", "endings": {endings}, "label": 0}}\n')
    with pytest.raises(T.UsageError, match="line 1 of .* is not a HellaSwag example"):
        evaluation.read_hellaswag(data)


# ----------------------------------------------------------------------------- in the trainer

@needs_tokenizer
def test_sample_at_end_writes_samples_into_the_log_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    result = run_main(TINY + ["--run_id=s", "--sample_at_end=2", "--val_every=0"], tmp_path)
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
    assert not (tmp_path / "n.txt").exists()  # refused before the run folder: the same --run_id can run again


SLOW_HELLASWAG = '''
import time
import evaluation
import train_gpt as T
from rank_driver import exit_checked
score = evaluation.hellaswag_score
evaluation.hellaswag_score = lambda *a, **k: (time.sleep(2), score(*a, **k))[1]  # a slow eval must not count as training
stop = T.StopSignal()
exit_checked(T.main(stop=stop), stop)
'''


@needs_tokenizer
def test_hellaswag_every_over_two_ranks_matches_the_tool_and_is_untimed(tmp_path):
    driver = tmp_path / "slow.py"
    driver.write_text(SLOW_HELLASWAG)
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
    assert summary["train_time_ms"] < 3 * 2000  # three 2-second evaluations happened outside the clock
    scored = tool_in_process("hellaswag", tmp_path / "logs" / "h" / "step_000004", "--data", FIXTURE,
                             env=TOKENIZER_ENV)
    assert scored.returncode == 0, scored.stderr
    assert f"acc:{curve[-1][1]:.4f} acc_norm:{curve[-1][2]:.4f} examples:10" in scored.stdout
