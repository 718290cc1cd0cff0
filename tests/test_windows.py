"""The attention windows: one schedule (attention_windows) and one per-layer pick (layer_windows) in one section of
train_gpt.py, which every consumer calls; their values at the schedule's boundary steps for every preset."""
import ast
import dataclasses

import pytest
import torch

import train_gpt as T
from conftest import REPO

# Where the window changes, (first step, (long, short)), as the schedule gave it before it moved into its section.
LINEAR_1770 = [(0, (1, 1)), (132, (2, 1)), (263, (3, 1)), (394, (4, 2)), (525, (5, 2)), (656, (6, 3)), (787, (7, 3)),
               (918, (8, 4)), (1049, (9, 4)), (1181, (10, 5)), (1312, (11, 5)), (1443, (12, 6)), (1574, (13, 6)),
               (1705, (14, 7))]
# M get_ws: int(12 * step / 4700) over the 4700 scheduled steps, (23, 11) through the extension, and the last
# validation's long window 27 (ws_validate_post_yarn_ext, short min(11, 27 // 2)).
MEDIUM_STAGES = [(0, (3, 1)), (392, (7, 3)), (784, (11, 5)), (1175, (13, 6)), (1567, (15, 7)), (1959, (17, 8)),
                 (2350, (19, 9)), (2742, (21, 10)), (3134, (23, 11)), (4740, (27, 11))]
BOUNDARIES = {
    ("speedrun", "reference"): LINEAR_1770,
    ("speedrun", "v2"): LINEAR_1770,
    ("cpu", "reference"): [(0, (1, 1)), (8, (2, 1)), (16, (3, 1)), (23, (4, 2)), (31, (5, 2)), (38, (6, 3)),
                           (46, (7, 3)), (53, (8, 4))],
    ("cpu", "v2"): [(0, (1, 1)), (16, (2, 1)), (31, (3, 1)), (46, (4, 2))],
    ("medium", "reference"): MEDIUM_STAGES,
    ("medium", "v2"): MEDIUM_STAGES,
}


@pytest.mark.parametrize("preset, recipe", sorted(BOUNDARIES))
def test_the_schedule_changes_where_it_did(preset, recipe):
    args = T.parse_args([f"--preset={preset}", f"--recipe={recipe}"], True)
    runs, previous = [], None
    for step in range(args.num_iterations + 1):
        pair = T.attention_windows(step, args)
        if pair != previous:
            runs.append((step, pair))
            previous = pair
    assert runs == BOUNDARIES[preset, recipe]


def test_each_layer_gets_its_half_of_the_pair():
    speedrun = T.parse_args(["--preset=speedrun", "--recipe=reference"], True)
    roles = T.LayerRoles.for_depth(12)
    assert T.layer_windows(T.attention_windows(1770, speedrun), roles) == [14, 7, 7, 7, 14, 7,
                                                                                         7, 14, 7, 7, 7, 14]
    assert T.layer_windows((0, 1), roles) == [0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0]
    medium = T.parse_args(["--preset=medium"], True)
    assert T.layer_windows(T.attention_windows(4739, medium), T.LayerRoles.for_depth(16)) == [
        23, 11, 11, 11, 23, 11, 11, 11, 11, 11, 11, 23, 11, 11, 11, 23]
    full = T.parse_args(["--preset=speedrun", "--recipe=reference", "--sliding_window=false"], True)
    assert {T.attention_windows(s, full) for s in (0, 885, 1770)} == {(2048, 1024)}
    # a tool's or HellaSwag's windows are the schedule's pair, cap included, never re-derived from the long one
    without_stages = T.parse_args(["--preset=medium", "--window_stages=", "--sliding_window=false"], True)
    model = T.GPT(T.ModelConfig.of(T.parse_args(["--preset=cpu", "--n_layer=2", "--model_dim=64", "--n_head=2",
                                                 "--head_dim=32"], False)))
    pair = T.attention_windows(without_stages.num_iterations, without_stages)
    assert model.window(pair).tolist() == list(pair)


# What window arithmetic reads: the window flags, the layout's long-window layers, the pair's rule.
WINDOW_NAMES = {"window_final_tokens", "window_stages", "short_window_cap", "sliding_window", "long_window",
                "final_window_blocks"}
WINDOW_CALLS = {"window_pair", "window_stage_blocks"}


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def does_window_arithmetic(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in WINDOW_NAMES and isinstance(sub.ctx, ast.Load):
            return True
        if isinstance(sub, ast.Call) and getattr(sub.func, "id", getattr(sub.func, "attr", None)) in WINDOW_CALLS:
            return True
    return False


def calls(node: ast.AST) -> set[str]:
    return {getattr(sub.func, "id", getattr(sub.func, "attr", None)) for sub in ast.walk(node)
            if isinstance(sub, ast.Call)}


def test_only_the_window_section_computes_windows_and_every_consumer_calls_it():
    source = (REPO / "train_gpt.py").read_text()
    lines = source.splitlines()
    banners = [i + 2 for i in range(len(lines) - 1)
               if lines[i].startswith("# ----") and lines[i + 1].startswith("# ")]
    first = next(line for line in banners if lines[line - 1].startswith("# Attention windows"))
    last = next(line for line in banners if line > first)
    found = dict(functions(ast.parse(source)))
    in_section = {name for name, node in found.items() if first < node.lineno < last}
    assert {"attention_windows", "window_pair", "window_pairs", "window_stage_blocks", "layer_windows",
            "attention_allowed", "banded_window_mask", "sliding_window_block_mask"} <= in_section
    outside = {name for name, node in found.items() if name not in in_section and does_window_arithmetic(node)}
    assert outside == set(), f"window arithmetic outside the attention windows section: {sorted(outside)}"
    assert "attention_windows" in calls(found["window_pairs"])  # start-up's tensors: every pair it reaches
    assert "window_pairs" in calls(found["StepTensors.__init__"])
    for name in ("StepTensors.windows", "train_loop", "log_train_step", "finish"):
        assert "attention_windows" in calls(found[name]), name
    for name in ("GPT.layer_attention", "GPT.flops_per_token", "KVCache.__init__"):
        assert "layer_windows" in calls(found[name]), name
    for path in ["evaluation.py", "tools/loading.py", "tools/sample.py", "tools/hellaswag.py", "tools/export.py",
                 "bench/memory_estimate.py", "bench/step_cost.py"]:
        tree = ast.parse((REPO / path).read_text())
        assert not [name for name, node in functions(tree) if does_window_arithmetic(node)], path
    assert "attention_windows" in calls(ast.parse((REPO / "tools/loading.py").read_text()))
    assert torch.equal(T.window_tensor(4, short_cap=1), torch.tensor([4, 1]))  # the tests' helper: window_pair's


# ----------------------------------------------------------------------------- track 2: token-exact windows

def exact_reference_mask(tokens, window):
    """The record's FA3 rule written out pair by pair: key j is seen by query q iff q - 128 * w <= j <= q, both in
    one document (M L982-984: window_size=(128 * w, 0) over cu_seqlens)."""
    n = tokens.numel()
    docs = (tokens == T.EOT_TOKEN).cumsum(0).tolist()
    return torch.tensor([[j <= q and q - 128 * window <= j and docs[j] == docs[q] for j in range(n)]
                         for q in range(n)])


def test_token_exact_windows_see_128_w_keys_and_the_query_itself():
    tokens = torch.ones(1024, dtype=torch.int64)
    mask = T.sliding_window_mask(tokens, torch.tensor(3), exact=True)
    assert mask[1000].sum() == 3 * 128 + 1 and mask[1000, 1000 - 384] and not mask[1000, 1000 - 385]
    blocks = T.sliding_window_mask(tokens, torch.tensor(3))  # whole blocks: (w-1)*128+1 .. w*128 keys
    assert blocks[1000].sum() == 2 * 128 + 1000 % 128 + 1
    assert T.first_key_in_window(1000, 3, exact=True) == 616 and T.first_key_in_window(1000, 3) == 640
    assert T.first_key_in_window(100, 3, exact=True) == 0


@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_token_exact_masks_of_every_backend_are_the_records_rule(window):
    """Dense, banded (its band one block wider, its chunks covering the extra key) and Flex (its block mask and
    mask_mod) against the rule written out, at 6 blocks with documents starting mid-block."""
    from test_model import tokens_with_docs
    tokens = tokens_with_docs(768, [0, 200, 201, 450])
    want = exact_reference_mask(tokens, window)
    w = torch.tensor(window)
    assert torch.equal(T.sliding_window_mask(tokens, w, exact=True), want)
    banded = T.banded_window_mask(tokens, w, chunk_keys=2 * 128 * (window + 1), exact=True)
    assert banded.band_blocks == min(window + 1, 6) and len(banded.chunks) > 1
    got = torch.zeros_like(want)
    for lo, hi, allowed in banded.chunks:
        for i in range(lo, hi):
            first = (i - banded.band_blocks + 1) * 128
            for k_off in range(banded.band_blocks * 128):
                if first + k_off >= 0:
                    got[i * 128:(i + 1) * 128, first + k_off] = allowed[i - lo, 0, :, k_off]
    assert torch.equal(got, want)
    block_mask = T.sliding_window_block_mask(tokens, w, exact=True)
    dense = block_mask.to_dense()[0, 0].bool()  # the blocks flex visits (full or partial)
    q, kv = torch.arange(768)[:, None], torch.arange(768)[None, :]
    visited = dense[q // 128, kv // 128]
    assert not (want & ~visited).any()  # every allowed pair lies in a visited block
    assert torch.equal(block_mask.mask_mod(0, 0, q, kv) & visited, want)
    full_counts, full_idx = block_mask.full_kv_num_blocks[0, 0], block_mask.full_kv_indices[0, 0]
    for qb in range(6):
        for kb in full_idx[qb, :full_counts[qb]].tolist():  # a full block is allowed throughout
            assert want[qb * 128:(qb + 1) * 128, kb * 128:(kb + 1) * 128].all()


@pytest.mark.parametrize("window", [1, 2, 5])
def test_token_exact_attention_forward_and_gradient_match_the_rule(window):
    """Banded attention under the token-exact mask against float64 softmax attention under the written-out rule:
    outputs and the gradients of q, k and v; Flex's forward too (its backward does not run on CPU)."""
    import warnings

    from test_model import attention_inputs, reference_attention, tokens_with_docs
    tokens = tokens_with_docs(768, [0, 300, 301, 640])
    want_mask = exact_reference_mask(tokens, window)
    q, k, v = (t.requires_grad_() for t in attention_inputs(768, seed=window))
    got = T.BandedAttention.attend(q, k, v, T.banded_window_mask(tokens, torch.tensor(window), exact=True), 0.1)
    ref = reference_attention(q, k, v, want_mask, 0.1)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    weights = torch.randn(got.shape, dtype=torch.float64)
    grads = torch.autograd.grad((got.double() * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r.double(), atol=1e-5, rtol=1e-5)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        mask = T.sliding_window_block_mask(tokens, torch.tensor(window), exact=True)
        flex = T.FlexAttention().attend(q.detach(), k.detach(), v.detach(), mask, 0.1)
    torch.testing.assert_close(flex.double(), ref.detach(), atol=1e-5, rtol=1e-5)


def test_the_model_and_its_kv_cache_apply_the_token_exact_rule():
    """A tiny medium model: every layer's mask is the exact rule (the spy sees exact=True), and decoding through
    the KV cache gives the full forward's logits (first_key_in_window reaches the extra key)."""
    from test_model import tokens_with_docs
    args = T.parse_args(["--preset=medium", "--compile=off", "--n_layer=2", "--model_dim=64", "--n_head=2",
                         "--head_dim=32", "--value_embed_tables=1", "--smear=false", "--key_offset=false",
                         "--dtype=fp32", "--skip_connections=0>1", "--batch_sequences=0", "--seq_len=256"], False)
    assert args.token_exact_windows
    model = T.GPT(T.ModelConfig.of(args)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    tokens = tokens_with_docs(512, [0, 200], vocab=1000)
    window = T.window_tensor(1)
    with torch.no_grad():
        full = model.logits(tokens, window)[0]
    cache = T.KVCache(model, window)
    got = torch.stack([model.decode(tokens[:130], cache)] + [model.decode(tokens[i:i + 1], cache)
                                                             for i in range(130, 400)])
    torch.testing.assert_close(got, full[129:400], atol=2e-5, rtol=1e-5)
    blocks = T.GPT(T.ModelConfig.of(dataclasses.replace(args, token_exact_windows=False))).eval()
    blocks.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(blocks.logits(tokens, window)[0], full)  # the extra keys matter
