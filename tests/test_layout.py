"""How train_gpt.py reads (docs/layout.md): a file in which the speedrun's math (the model, optimizers,
schedules, loss, data as tensors and the training step, as bench/code_share.py counts them) keeps its share,
siblings of at most ~700 lines, the loop and its step on one screen, and no module-level object that a run
reassigns or changes (choices travel through Runtime instead)."""
import ast
import copy
import importlib.util
import io
import sys
import tokenize

import pytest
import torch

import train_gpt as T
from conftest import REPO, TINY, run_main

SIBLINGS = ("flags.py", "runlog.py", "checkpoints.py", "evaluation.py", "lifecycle.py")


def code_share():
    spec = importlib.util.spec_from_file_location("code_share", REPO / "bench" / "code_share.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_speedruns_math_keeps_its_share_of_the_trainer():
    source = (REPO / "train_gpt.py").read_text()
    share = code_share()
    counted = share.counted_definitions(source)
    assert share.math_share(source) >= 0.40, counted  # 41% when the sections were last rearranged
    assert {title for title, _, _ in counted} >= {"Configuration", "Data", "Attention windows", "Model", "Optimizers",
                                                  "The gradient's path", "Schedules", "Training loop"}
    math = {name for title, name, _ in counted if share.is_math(title, name)}
    assert {"GPT", "attention_windows", "Muon", "ShardedAdam", "lr_multiplier", "to_device", "train_step"} <= math
    assert not math & {"Hyperparameters", "TokenStream", "GradientSync", "Bucket", "train_loop", "finish", "KVCache"}
    for name in SIBLINGS:
        assert len((REPO / name).read_text().splitlines()) <= 700, name


def test_a_reader_meets_the_model_in_the_first_quarter_of_the_file():
    """The speedrun first: configuration, then the windows and the model, before the machinery around them."""
    lines = (REPO / "train_gpt.py").read_text().splitlines()
    model = lines.index("# Model")
    assert model < len(lines) / 4, (model, len(lines))
    banners = [lines[i + 1].split(":")[0] for i, line in enumerate(lines[:-1]) if line.startswith("# -----")]
    assert banners[:3] == ["# Configuration", "# Attention windows", "# Model"], banners


@pytest.mark.parametrize("name", ["train_gpt.py", *SIBLINGS])
def test_the_code_reads_without_continuations_long_lines_or_long_functions(name):
    """No backslash continuation, no line over 120 characters, and (in train_gpt.py) no function over 60 lines."""
    source = (REPO / name).read_text()
    long = [i + 1 for i, line in enumerate(source.splitlines()) if len(line) > 120]
    assert long == [], long
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    continued = sorted({t.start[0] for t, after in zip(tokens, tokens[1:]) if after.start[0] > t.end[0]
                        and t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.STRING)
                        and source.splitlines()[t.end[0] - 1].rstrip().endswith("\\")})
    assert continued == [], continued
    if name == "train_gpt.py":
        functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)]
        too_long = [(f.name, f.end_lineno - f.lineno + 1) for f in functions if f.end_lineno - f.lineno + 1 > 60]
        assert too_long == [], too_long


def test_the_loop_and_its_step_read_in_one_place_on_one_screen():
    tree = ast.parse((REPO / "train_gpt.py").read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    names = [f.name for f in functions]
    step, loop = (functions[names.index(name)] for name in ("train_step", "train_loop"))
    assert names.index("train_loop") == names.index("train_step") + 1  # adjacent: read together
    assert loop.end_lineno - step.lineno + 1 <= 80
    calls = {node.func.id for node in ast.walk(loop) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert {"train_step", "validate", "checkpoint_or_stop", "log_train_step", "finish"} <= calls


def module_state(module) -> dict:
    """Every module-level object that is not a function, class or module: what a run could reassign or change."""
    skip = (type(sys), type, type(len), type(module_state))
    return {name: value for name, value in vars(module).items()
            if not name.startswith("__") and name != "annotations" and not isinstance(value, skip) and not callable(value)}


def snapshot(state: dict) -> dict:
    out = {}
    for name, value in state.items():
        try:
            out[name] = (id(value), copy.deepcopy(value))
        except Exception:  # an object deepcopy cannot copy (a torch function table): its identity then
            out[name] = (id(value), repr(value))
    return out


@pytest.mark.parametrize("extra", [[], ["--recipe=v2", "--n_layer=4", "--bigram_vocab_size=4096",
                                            "--bigram_dim=32", "--batch_schedule=1/2,1"]])
def test_a_run_reassigns_and_changes_no_module_level_object(tmp_path, extra):
    """A whole run in this process (start-up, set-up, warm-up, training, checkpoint, resume, finish): every
    module-level object of train_gpt.py is the same object afterwards, with the same contents."""
    before = snapshot(module_state(T))
    assert "PRESETS" in before and "TECHNIQUES" in before and "TORCH_API" in before and "FLAG_RULES" in before
    args = TINY + ["--num_iterations=3", "--warmup_steps=1", "--checkpoint_every=2", "--run_id=state", *extra]
    assert run_main(args + ["--stop_after=2"], tmp_path).returncode == 0
    assert run_main(args + ["--resume=latest"], tmp_path).returncode == 0
    after = snapshot(module_state(T))
    assert set(after) == set(before)
    for name, (identity, contents) in before.items():
        assert after[name][0] == identity, f"{name} was reassigned"
        same = contents == after[name][1] if not isinstance(contents, torch.Tensor) else torch.equal(contents,
                                                                                                   after[name][1])
        assert same, f"{name} was changed"
