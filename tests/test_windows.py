"""The attention windows: one schedule (attention_windows) and one per-layer pick (layer_windows) in one section of
train_gpt.py, which every consumer calls; their values at the schedule's boundary steps for every preset."""
import ast

import pytest
import torch

import train_gpt as T
from conftest import REPO

# Where the window changes, (first step, (long, short)), as the schedule gave it before it moved into its section.
LINEAR_1770 = [(0, (1, 1)), (132, (2, 1)), (263, (3, 1)), (394, (4, 2)), (525, (5, 2)), (656, (6, 3)), (787, (7, 3)),
               (918, (8, 4)), (1049, (9, 4)), (1181, (10, 5)), (1312, (11, 5)), (1443, (12, 6)), (1574, (13, 6)),
               (1705, (14, 7))]
MEDIUM_STAGES = [(0, (3, 1)), (395, (7, 3)), (790, (11, 5)), (1185, (13, 6)), (1580, (15, 7)), (1975, (17, 8)),
                 (2370, (19, 9)), (2765, (21, 10)), (3160, (23, 11))]
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
    speedrun = T.parse_args(["--preset=speedrun"], True)
    roles = T.LayerRoles.for_depth(12)
    assert T.layer_windows(T.attention_windows(1770, speedrun), roles) == [14, 7, 7, 7, 14, 7,
                                                                                         7, 14, 7, 7, 7, 14]
    assert T.layer_windows((0, 1), roles) == [0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0]
    medium = T.parse_args(["--preset=medium"], True)
    assert T.layer_windows(T.attention_windows(4740, medium), T.LayerRoles.for_depth(16)) == [
        23, 11, 11, 11, 23, 11, 11, 11, 11, 11, 11, 23, 11, 11, 11, 23]
    full = T.parse_args(["--preset=speedrun", "--sliding_window=false"], True)
    assert {T.attention_windows(s, full) for s in (0, 885, 1770)} == {(2048, 1024)}
    # a tool's or HellaSwag's windows are the schedule's pair, cap included, never re-derived from the long one
    without_stages = T.parse_args(["--preset=medium", "--window_stages=", "--sliding_window=false"], True)
    model = T.GPT(T.ModelConfig.of(T.parse_args(["--preset=cpu", "--n_layer=2", "--model_dim=64", "--n_head=2",
                                                 "--head_dim=32"], False)))
    pair = T.attention_windows(without_stages.num_iterations, without_stages)
    assert model.window(pair).tolist() == list(pair)


# What window arithmetic reads: the window flags, the layout's long-window layers, the pair's rule.
WINDOW_NAMES = {"window_final_tokens", "window_stages", "short_window_cap", "sliding_window", "long_window"}
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
