"""bench/: the ablation table's statistics on synthetic run summaries, the variants' overrides, and
gpu_check.py's no-GPU path and parsers. No training runs here (the failing run exits at argument parsing);
memory_estimate.py runs its small model on fake tensors."""
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import flags
import train_gpt as T
from bench import ablation as A
from bench import gpu_check as G
from conftest import REPO



def summary(variant, seed, losses, val_every=3, batch=2048, train_time_ms=10_000.0, hyperparameters=None):
    """A train_gpt.py-shaped JSON summary with validation at steps 0, val_every, 2*val_every, ..."""
    steps = val_every * (len(losses) - 1)
    curve = [[i * val_every, loss, train_time_ms * i / (len(losses) - 1)] for i, loss in enumerate(losses)]
    return {"run_id": f"{variant}_s{seed}", "steps": steps, "tokens": steps * batch, "final_val_loss": losses[-1],
            "train_time_ms": train_time_ms, "val_curve": curve, "status": "finished",
            "hyperparameters": hyperparameters or {"seed": seed}}


# ---------------------------------------------------------------- statistics

def test_tokens_to_reach_interpolates_between_the_bracketing_points():
    curve = [(0, 10.0), (100, 8.0), (200, 6.0), (300, 5.0)]
    assert A.tokens_to_reach(curve, 7.0) == pytest.approx(150.0)
    assert A.tokens_to_reach(curve, 5.5) == pytest.approx(250.0)
    assert A.tokens_to_reach(curve, 6.0) == pytest.approx(200.0)  # exactly on a point
    assert A.tokens_to_reach(curve, 5.0) == pytest.approx(300.0)
    assert A.tokens_to_reach(curve, 4.99) is None
    assert A.tokens_to_reach(curve, 11.0) == 0.0  # already there at the first point


def test_tokens_to_reach_takes_the_first_crossing_of_a_non_monotone_curve():
    curve = [(0, 10.0), (100, 6.0), (200, 7.0), (300, 5.0)]
    assert A.tokens_to_reach(curve, 6.5) == pytest.approx(87.5)



def test_variant_stats_averages_curves_over_seeds():
    runs = [summary("full", 0, [10.0, 8.0, 6.0], train_time_ms=6144.0),
            summary("full", 1, [10.0, 7.0, 5.0], train_time_ms=12288.0)]
    s = A.variant_stats("full", runs)
    assert s.seeds == [0, 1]
    assert s.final_mean == pytest.approx(5.5) and s.final_std == pytest.approx(math.sqrt(0.5))
    assert s.curve == [(0, 10.0), (3 * 2048, 7.5), (6 * 2048, 5.5)]
    assert s.budget_tokens == 6 * 2048
    assert s.tokens_per_s == pytest.approx((12288 / 6.144 + 12288 / 12.288) / 2)


def test_variant_stats_uses_only_validation_steps_every_run_has():
    a = summary("full", 0, [10.0, 8.0, 6.0])  # steps 0, 3, 6
    b = summary("full", 1, [10.0, 9.0, 7.0, 6.0], val_every=2)  # steps 0, 2, 4, 6
    assert [t for t, _ in A.variant_stats("full", [a, b]).curve] == [0, 6 * 2048]


def test_table_targets_the_full_recipe_and_reports_ratios_to_its_budget():
    stats = {
        "full": A.variant_stats("full", [summary("full", s, [10.0, 6.0, 4.0, 3.0 + 0.01 * s]) for s in range(2)]),
        "no_muon": A.variant_stats("no_muon", [summary("no_muon", s, [10.0, 8.0, 4.0, 2.5]) for s in range(2)]),
        "no_qk_norm": A.variant_stats("no_qk_norm", [summary("no_qk_norm", 0, [10.0, 9.0, 8.0, 7.0])]),
        "baseline": A.variant_stats("baseline", [summary("baseline", 0, [10.0, 8.0, 6.0, 5.0]),
                                                 summary("baseline", 1, [10.0, 8.0, 6.0, 5.0])]),
    }
    table = A.build_table(stats, [], "LABEL")
    assert table.target == pytest.approx(3.005)
    rows = {r["name"]: r for r in table.rows}
    step, budget = 3 * 2048, 9 * 2048
    # full: 4.0 at 2 step-blocks, 3.005 (its own mean) reached between 2 and 3 (mean curve 3.005 at 3)
    assert rows["full"]["reach_tokens"] == pytest.approx(3 * step) and rows["full"]["ratio"] == pytest.approx(1.0)
    # no_muon: 4.0 at 2, 2.5 at 3 -> 3.005 at 2 + 0.995/1.5
    assert rows["no_muon"]["reach_tokens"] == pytest.approx((2 + 0.995 / 1.5) * step)
    assert rows["no_muon"]["ratio"] == pytest.approx((2 + 0.995 / 1.5) * step / budget)
    assert rows["baseline"]["reach_tokens"] is None and rows["baseline"]["ratio"] is None
    assert rows["full"]["spread"] == pytest.approx(0.01) and rows["no_muon"]["spread"] == 0.0
    assert rows["no_muon"]["delta"] == pytest.approx(-0.505) and rows["no_muon"]["beyond_noise"] is True
    assert rows["no_qk_norm"]["beyond_noise"] is True  # the full recipe's spread is the noise for one seed
    md = table.markdown
    assert "LABEL" in md and "| no_qk_norm | 1 | 7.0000 | 0.0000 | +3.9950 | **yes** | not reached | n/a |" in md
    assert "| no_muon | 2 | 2.5000 | 0.0000 | -0.5050 | **yes** |" in md
    assert "full reaches baseline's final val loss 5.0000 after 9,216 tokens = 0.500 x" in table.headline
    assert "rotary" in md  # the baseline keeps rotary, and says so


def test_a_difference_counts_only_beyond_twice_the_larger_seed_spread():
    assert A.beyond_noise(0.021, 0.01, 0.005) and A.beyond_noise(-0.021, 0.005, 0.01)
    assert not A.beyond_noise(0.019, 0.01, 0.0) and not A.beyond_noise(-0.02, 0.0, 0.01)
    assert not A.beyond_noise(5.0, 0.0, 0.0)  # one seed each: no noise estimate, nothing counts
    full = [summary("full", s, [10.0, 5.0 + 0.02 * s]) for s in range(2)]
    close = [summary("no_x", s, [10.0, 5.03 + 0.01 * s]) for s in range(2)]
    table = A.build_table({"full": A.variant_stats("full", full), "no_x": A.variant_stats("no_x", close)}, [], "L")
    assert {r["name"]: r["beyond_noise"] for r in table.rows} == {"full": False, "no_x": False}


def test_table_says_so_when_full_does_not_reach_the_baseline():
    stats = {"full": A.variant_stats("full", [summary("full", 0, [10.0, 8.0, 6.0])]),
             "baseline": A.variant_stats("baseline", [summary("baseline", 0, [10.0, 7.0, 5.0])])}
    table = A.build_table(stats, [], "L")
    assert "did NOT reach" in table.headline and "6.0000" in table.headline


def test_table_without_a_full_run_has_no_differences():
    table = A.build_table({"baseline": A.variant_stats("baseline", [summary("baseline", 0, [10.0, 7.0])])}, [], "L")
    assert table.target is None and table.rows[0]["delta"] is None and "| n/a | n/a |" in table.markdown


def test_failed_run_is_reported_by_name_and_excluded():
    failure = A.FailedRun("full_s2", "full", 2, "exit status 2: error: something broke")
    stats = {"full": A.variant_stats("full", [summary("full", s, [10.0, 6.0]) for s in range(2)], [failure]),
             "baseline": A.variant_stats("baseline", [summary("baseline", 0, [10.0, 7.0])])}
    table = A.build_table(stats, [failure], "L")
    assert {r["name"]: r["n"] for r in table.rows}["full"] == 2
    assert "Runs left out (failed, or not run):\n- full_s2: exit status 2: error: something broke" in table.markdown


def test_run_one_turns_a_failing_trainer_into_a_failure_with_its_stderr(tmp_path):
    spec = A.RunSpec("full", 0, ["--preset=cpu", "--no_such_flag=1", "--run_id=full_s0", f"--log_dir={tmp_path}"])
    out = A.run_one(spec, tmp_path, threads=1)
    assert isinstance(out, A.FailedRun) and out.run_id == "full_s0"
    assert "exit status 2" in out.reason and "unknown argument '--no_such_flag=1'" in out.reason
    assert (tmp_path / "full_s0.out").is_file()


# ---------------------------------------------------------------- variants and runs

WHAT_EACH_VARIANT_SWITCHES = {  # every field the variant changes from the cpu preset, and to what
    "full": {},
    "no_muon": {"muon": False},
    "no_value_embeds": {"value_embeds": False},
    "no_unet_skips": {"unet_skips": False},
    "no_softcap": {"logit_softcap": 0.0},
    "no_sliding_window": {"sliding_window": False},
    "no_zero_init": {"zero_init": False},
    "no_qk_norm": {"qk_norm": False},
    "baseline": {"muon": False, "value_embeds": False, "unet_skips": False, "logit_softcap": 0.0,
                 "sliding_window": False, "zero_init": False, "mlp_act": "gelu", "weight_decay": 0.1},
}


def test_the_variants_are_the_ones_listed_here():
    assert set(A.VARIANTS) == set(WHAT_EACH_VARIANT_SWITCHES)


@pytest.mark.parametrize("name", list(WHAT_EACH_VARIANT_SWITCHES))
def test_each_variant_switches_what_its_name_says_and_nothing_else(name):
    """Parsed as train_gpt.py parses them: a misspelt, no-op or extra override changes another field or none."""
    args = T.parse_args(["--preset=cpu", *A.VARIANTS[name]], False)
    cpu = T.parse_args(["--preset=cpu"], False)
    changed = {k: getattr(args, k) for k in vars(cpu) if getattr(args, k) != getattr(cpu, k)}
    assert changed == WHAT_EACH_VARIANT_SWITCHES[name]


def test_run_specs_are_seed_major_with_unique_ids(tmp_path):
    specs = A.run_specs(["full", "baseline"], 3, 12, 3, 4096, tmp_path)
    assert [s.run_id for s in specs] == ["full_s0", "baseline_s0", "full_s1", "baseline_s1", "full_s2", "baseline_s2"]
    for spec in specs:
        args = T.parse_args(spec.args, False)
        assert (args.seed, args.num_iterations, args.val_every, args.val_tokens) == (spec.seed, 12, 3, 4096)
        assert args.batch_tokens == A.DEFAULT_BATCH_TOKENS
        assert args.run_id == spec.run_id and args.log_dir == str(tmp_path) and args.preset == "cpu"


def test_baseline_lr_override_reaches_only_the_baseline(tmp_path):
    lr = A.parse_cli(["--baseline-matrix-adam-lr=0.008"]).baseline_lr
    overrides = {**A.VARIANTS, "baseline": A.VARIANTS["baseline"] + [f"--matrix_adam_lr={lr}"]}
    specs = {s.variant: s for s in A.run_specs(["no_muon", "baseline"], 1, 12, 3, 4096, tmp_path, overrides)}
    assert T.parse_args(specs["baseline"].args, False).matrix_adam_lr == 0.008
    assert T.parse_args(specs["no_muon"].args, False).matrix_adam_lr == T.Hyperparameters().matrix_adam_lr


def test_default_budget_is_big_enough_to_judge_a_technique():
    a = A.parse_cli([])
    assert a.num_iterations * a.batch_tokens >= 393_216 and a.val_tokens >= 65_536 and a.seeds >= 2
    assert a.val_tokens <= T.shard_token_count(REPO / "data" / "sample" / "sotu_val_000000.bin") == A.SAMPLE_VAL_TOKENS


def test_cli_refuses_unknown_variants_and_bad_val_tokens():
    with pytest.raises(flags.UsageError):
        A.parse_cli(["--variants=full,no_such"])
    with pytest.raises(flags.UsageError):
        A.parse_cli(["--val_tokens=3000"])
    with pytest.raises(flags.UsageError):  # more than the held-out shard holds
        A.parse_cli([f"--val_tokens={A.SAMPLE_VAL_TOKENS + 2048}"])
    with pytest.raises(flags.UsageError):
        A.parse_cli(["--batch_tokens=1000"])
    assert A.parse_cli(["--variants=full, baseline"]).variants == ["full", "baseline"]


def write_finished_runs(log_dir, variants, seeds, curves):
    log_dir.mkdir(parents=True)
    for spec in A.run_specs(variants, seeds, 6, 3, 4096, log_dir):
        losses = [v - 0.01 * spec.seed for v in curves[spec.variant]]
        s = summary(spec.variant, spec.seed, losses, hyperparameters=A.expected_hyperparameters(spec))
        (log_dir / f"{spec.run_id}.json").write_text(json.dumps(s))


def test_resume_existing_reuses_matching_summaries_and_writes_table_and_plot(tmp_path):
    out = tmp_path / "out"
    write_finished_runs(out / "logs", ["full", "baseline"], 2, {"full": [10.8, 6.0, 5.0], "baseline": [10.8, 7.0, 6.0]})
    rc = A.main(["--resume-existing", "--variants=full,baseline", "--seeds=2", "--num_iterations=6",
                 "--val_every=3", "--val_tokens=4096", f"--out={out}"])
    assert rc == 0
    md = (out / "ablation.md").read_text()
    assert "6 steps × 4096 tokens" in md and "| baseline | 2 | 5.9950 | 0.0100 | +1.0000 | **yes** |" in md
    assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_existing_ignores_summaries_of_other_settings(tmp_path):
    log_dir = tmp_path / "logs"
    write_finished_runs(log_dir, ["full"], 1, {"full": [10.8, 6.0, 5.0]})
    spec = A.run_specs(["full"], 1, 6, 3, 4096, log_dir)[0]
    assert A.reusable_summary(spec, log_dir)["final_val_loss"] == 5.0
    other = A.run_specs(["full"], 1, 9, 3, 4096, log_dir)[0]  # a different step count: must train again
    assert A.reusable_summary(other, log_dir) is None


# ---------------------------------------------------------------- gpu_check.py

@pytest.mark.torch_range
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine gpu_check.py runs the real checks")
def test_gpu_check_without_a_gpu_reports_skips_and_exits_0(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", f"--out={out}"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "nothing GPU-specific can run" in proc.stdout and f"torch {torch.__version__}" in proc.stdout
    checks = ("pytest (GPU tests)", "fp8_matmul vs bf16", "fp8_matmul compiled vs eager", "FlexAttention vs SDPA",
              "2 ranks: stop, checkpoint, resume", "speedrun preset timing")
    for check in checks:
        assert check in proc.stdout
    assert proc.stdout.count("skipped: no CUDA GPU") == len(checks)
    assert [row["result"] for row in json.loads(out.read_text())["table"]] == ["skipped: no CUDA GPU"] * len(checks)


@pytest.mark.torch_range
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine gpu_check.py runs the real checks")
def test_gpu_check_in_which_nothing_ran_keeps_an_earlier_result_and_writes_beside_it(tmp_path):
    """--quick without a GPU replaced a real H100 result with a table of skips: a run in which nothing
    ran writes beside a file that holds a result and says where, in one line; one in which a check ran replaces it."""
    out = tmp_path / "gpu_check.json"
    real = json.dumps({"table": [{"check": G.SPEEDRUN_ROW, "result": "ok", "time": "201s of 260s",
                                  "numbers": "1043.2 ms/step"}], "budget_s": 405})
    out.write_text(real)
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--quick", f"--out={out}"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    beside = tmp_path / "gpu_check.nothing_ran.json"
    assert out.read_text() == real and beside.is_file()
    assert f"nothing ran: kept {out} (an earlier run's result); wrote this run's table to {beside}" in \
        proc.stdout.splitlines()
    assert G.results_path(out, [(G.FP8_ROW, "FAIL", "-", "")]) == out  # a check that ran replaces it
    assert G.results_path(tmp_path / "none.json", [(G.FP8_ROW, "skipped: no CUDA GPU", "-", "")]) == \
        tmp_path / "none.json"


@pytest.mark.torch_range
def test_gpu_check_plan_fits_one_loan_and_says_how_each_share_was_sized():
    """--plan without a GPU (and without torch): every part with its share and its basis, the total <= 420 s."""
    proc = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.modules['torch'] = None; sys.argv = "
                           "['gpu_check.py', '--plan']; runpy.run_module('bench.gpu_check', run_name='__main__')"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    shares = dict(re.findall(r"^  \([a-e]\) (\w+) +(\d+) s  (?:estimated|measured on CPU): ", proc.stdout, re.M))
    assert list(shares) == list(G.BUDGET_S) == list(G.PART_ROWS), proc.stdout
    total = int(re.search(r"^total (\d+) s of 420 s", proc.stdout, re.M)[1])
    assert total == sum(map(int, shares.values())) + G.OWN_S <= 420 == G.LOAN_S


@pytest.mark.torch_range
def test_gpu_check_needs_nothing_the_gpu_machines_torch_lacks(tmp_path, monkeypatch):
    """The GPU machine has its own torch and no network: gpu_check.py imports the standard library and flags.py
    at the top, torch, numpy and this repository inside its parts, and says so when pytest (an extra) is missing."""
    import ast
    import importlib.util
    tree = ast.parse((REPO / "bench" / "gpu_check.py").read_text())
    def roots(nodes):
        return {(a.name if isinstance(n, ast.Import) else n.module).split(".")[0]
                for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    # at the top: the standard library and flags.py (its one-line argument errors), itself standard library only
    assert roots(tree.body) <= set(sys.stdlib_module_names) | {"__future__", "flags"}
    assert roots(ast.parse((REPO / "flags.py").read_text()).body) <= set(sys.stdlib_module_names) | {"__future__"}
    assert roots(ast.walk(tree)) <= set(sys.stdlib_module_names) | {"__future__", "torch", "numpy", "train_gpt",
                                                                      "data", "records", "flags"}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else
                        real_find_spec(name, *a))
    ((check, result, numbers),) = G.check_tests(60, tmp_path)
    assert (check, result) == (G.TESTS_ROW, "skipped: no pytest") and "requirements-extras.txt" in numbers


def test_gpu_check_reruns_of_some_parts_get_their_share_and_a_file_of_their_own():
    assert G.default_out((), drill=False).name == "gpu_check.json"
    assert G.default_out(("speedrun",), drill=False).name == "gpu_check_only_speedrun.json"
    assert G.default_out((), drill=True).name == "gpu_check_resume_drill_cpu.json"
    assert G.default_budget(()) == sum(G.BUDGET_S.values()) == G.LOAN_S - G.OWN_S
    assert G.default_budget(("speedrun",)) == G.BUDGET_S["speedrun"] + G.BUDGET_S["resume"]  # as on one GPU
    assert G.default_budget(("fp8", "flex")) == G.BUDGET_S["fp8"] + G.BUDGET_S["flex"]
    with pytest.raises(Exception, match="unknown part"):
        G.only_parts("fp8,bogus")


def test_gpu_check_shards_are_valid_train_gpt_shards(tmp_path):
    path = tmp_path / "synth_train_000001.bin"
    G.write_shard(path, 50_000, seed=0)
    assert T.shard_token_count(path) == 50_000
    tokens = np.asarray(T.load_shard(path, 50257))
    assert tokens[0] == T.EOT_TOKEN and 10 < (tokens == T.EOT_TOKEN).sum() < 500


def test_gpu_check_reads_the_summary_of_a_real_run(tiny_run):
    """The keys check_speedrun reads from the trainer's JSON summary, from a real tiny CPU run (4 steps)."""
    summary = json.loads((tiny_run / "tiny.json").read_text())
    assert summary["step_avg_ms"] == pytest.approx(summary["train_time_ms"] / 4)
    assert summary["peak_memory_mib"] > 0 and summary["recompiles_after_warmup"] == 0
    assert summary["runtime"] == {"attention": "banded", "fp8_head": False, "compile": "off", "dtype": "bfloat16",
                                  "device": "cpu", "chunked_loss": True, "compile_attention": False, "world_size": 1,
                                  "compile_fp8": False, "fp8_mlp": False,
                                  "compile_newton_schulz": False, "grad_sync_from_hooks": True,
                                  "host_malloc": "glibc mmap_threshold=268435456,trim_threshold=1073741824,top_pad=268435456",
                                  "grad_accum_steps": 2,
                                  "batch_stages": [[0, 512, 2]]}  # one stage from step 0: 512 tokens, 2 micro-steps


def test_gpu_check_kernel_table_from_a_chrome_trace(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter", "dur": 3000},
              {"ph": "X", "cat": "kernel", "name": "triton_mm", "dur": 5000},
              {"ph": "X", "cat": "kernel", "name": "triton_mm", "dur": 1000},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99999}]  # host events are not kernels
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    table = G.kernel_table(trace, top=1)
    assert table["top_kernels"] == [{"name": "triton_mm", "ms": 6.0}]
    assert (table["kernel_ms"], table["communication_ms"], table["compute_ms"]) == (9.0, 3.0, 6.0)


def test_report_only_tabulates_finished_runs_and_names_the_missing_ones(tmp_path):
    out = tmp_path / "out"
    write_finished_runs(out / "logs", ["full", "baseline"], 1, {"full": [10.8, 6.0, 5.0], "baseline": [10.8, 7.0, 6.0]})
    rc = A.main(["--report-only", "--variants=full,baseline", "--seeds=2", "--num_iterations=6",
                 "--val_every=3", "--val_tokens=4096", f"--out={out}"])
    md = (out / "ablation.md").read_text()
    assert rc == 1 and "| full | 1 | 5.0000 |" in md and "| baseline | 1 | 6.0000 |" in md
    assert "- full_s1: not run (--report-only" in md and "- baseline_s1: not run" in md
    assert not list((out / "logs").glob("*_s1.json"))  # nothing was trained


# ---------------------------------------------------------------- the recipe-v2 suite

def test_v2_suite_gives_every_variant_the_same_token_budget(tmp_path):
    """The batch ramp's smaller early steps buy v2 more steps: 43 x 2048 + 43 x 3072 + 42 x 4096 = 392,192
    tokens in 128 steps, the closest to the reference's 96 x 4096 = 393,216."""
    suite = A.SUITES["v2_part1"]
    specs = A.run_specs(list(suite.variants), 1, 96, 24, 65536, tmp_path, suite.variants)
    steps = {s.variant: int(next(a for a in reversed(s.args) if a.startswith("--num_iterations="))
                            .split("=")[1]) for s in specs}
    assert steps["reference"] == steps["v2_part1_no_batch_schedule"] == 96
    assert all(steps[v] == 128 for v in suite.variants if v not in ("reference", "v2_part1_no_batch_schedule"))
    for spec in specs:
        args = T.parse_args([a for a in spec.args if not a.startswith(("--run_id", "--log_dir"))], False)
        trained = T.batch_schedule(args, 1).tokens_before(args.num_iterations)
        assert abs(trained - 393_216) <= 1024, (spec.variant, trained)
    v2 = T.parse_args(next(s for s in specs if s.variant == "v2_part1").args[:-2], False)
    assert v2.recipe == "v2" and T.batch_schedule(v2, 1).tokens_before(128) == 43 * 2048 + 43 * 3072 + 42 * 4096


def test_v2_suite_variants_put_back_exactly_their_techniques():
    """v2 is the cpu recipe v2 at its own batch; each v2_with_X differs from it in technique X's fields alone,
    at the records' (speedrun v2's) values (a misspelt or no-op flag would leave a variant identical to v2)."""
    def resolved(args, preset="cpu"):
        return T.parse_args([f"--preset={preset}", *args], False).__dict__
    v2, records = resolved(A.V2_VARIANTS[A.V2]), resolved(["--recipe=v2"], "speedrun")
    assert v2 == resolved(["--recipe=v2"])  # the suite's v2 row is the default cpu v2
    expected = {"v2_with_logit_rescale": {"logit_softcap", "logit_offset"}, "v2_with_mtp": {"mtp_tokens"}}
    assert set(A.V2_VARIANTS) == {"reference", A.V2, *expected}
    for variant, names in expected.items():
        got = resolved(A.V2_VARIANTS[variant])
        assert {k for k in v2 if got[k] != v2[k]} == names, variant
        assert all(got[k] == records[k] for k in names), variant


def test_v2_each_suite_takes_out_exactly_one_technique_per_variant():
    """Every technique the cpu v2 uses has its v2_without_X row; each row parses and differs from v2 in the fields
    that technique sets, each back at the reference recipe's value."""
    def resolved(args):
        return T.parse_args(["--preset=cpu", *args], False).__dict__
    v2, reference = resolved(A.V2_EACH_VARIANTS[A.V2]), resolved(["--batch_tokens=6144"])
    expected = {"batch_schedule", "polar_express", "normuon", "cautious_wd", "smoothed_scalars", "bigram", "smear",
                "attn_gate", "ve_skip_gates", "backout", "key_offset", "paired_heads"}
    assert set(A.V2_EACH_VARIANTS) == {"reference", A.V2, *(f"v2_without_{name}" for name in expected)}
    for name in expected:
        got = resolved(A.V2_EACH_VARIANTS[f"v2_without_{name}"])
        changed = {k for k in v2 if got[k] != v2[k]}
        assert changed == set(next(t for t in T.TECHNIQUES if t.name == name).v2["cpu"]), name
        assert all(got[k] == reference[k] for k in changed), name


def test_v2_table_targets_v2_and_compares_the_reference():
    suite = A.SUITES["v2_part1"]
    stats = {"reference": A.variant_stats("reference", [summary("reference", s, [10.0, 6.0, 5.0]) for s in range(2)]),
             "v2_part1": A.variant_stats("v2_part1", [summary("v2_part1", s, [10.0, 5.0, 4.0 + 0.01 * s])
                                                      for s in range(2)])}
    table = A.build_table(stats, [], "LABEL", suite)
    assert table.target == pytest.approx(4.005)
    assert table.headline.startswith("v2_part1 reaches reference's final val loss 5.0000 after 6,144 tokens")
    assert "| reference | 2 | 5.0000 | 0.0000 | +0.9950 | **yes** |" in table.markdown


# ---------------------------------------------------------------- step_cost.py

def test_step_cost_times_a_variant_as_the_trainer_builds_it(monkeypatch, capsys):
    """One real (small) step per variant through the trainer's own builders; a row per variant, ratios to the
    first; an unknown variant is refused naming the valid ones."""
    from bench import step_cost
    monkeypatch.setattr(step_cost, "STEP_TOKENS", 1024)
    small = ["--n_layer=4", "--model_dim=64", "--n_head=2", "--head_dim=32", "--bigram_vocab_size=1000",
             "--bigram_dim=32"]
    monkeypatch.setitem(A.SUITES, "tiny", A.Suite({"reference": small[:4], "v2": ["--recipe=v2", *small]}, "v2",
                                                  "reference", "", "bench/results/tiny"))
    with pytest.raises(flags.UsageError, match=r"unknown variant\(s\) nope"):
        step_cost.main(["--suite=v2", "--variants=reference,nope"])
    assert step_cost.ablation is A  # the suites step_cost reads are the ones patched above
    step_cost.main(["--suite=tiny", "--steps=1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| reference", "| v2"] and rows[0].endswith("| 1.00x |")


# ---------------------------------------------------------------- memory_estimate.py

def test_memory_tally_counts_each_storage_once_and_keeps_the_peak():
    from bench import memory_estimate as M
    tally = M.Tally()
    a = torch.empty(1024)  # 4 KiB
    tally.add(a, "x", "a")
    tally.add([a.view(32, 32), a[:10]], "x", "views of a")  # the same storage: not counted again
    assert tally.current() == 4096
    b = torch.empty(2048, dtype=torch.float16)
    tally.add(b, "y", "b")
    del a
    c = torch.empty(256)
    tally.add(c, "x", "c")
    assert tally.current() == 4096 + 1024 and tally.peak == 8192 and tally.peak_at == "b"
    assert tally.peak_by_label == {"x": 4096, "y": 4096}


def test_memory_estimate_runs_the_trainers_step_and_validation_on_fake_tensors(capsys):
    """A small model through the script: a row per phase and world size, the predicted peak at most the
    no-fusion bound; two ranks hold less optimizer state than one."""
    from bench import memory_estimate as M
    small = ["--n_layer=4", "--model_dim=128", "--n_head=2", "--head_dim=64", "--seq_len=1024", "--val_seq_len=2048",
             "--val_tokens=2048", "--batch_tokens=4096", "--batch_schedule=1/2,1", "--bigram_vocab_size=4096",
             "--bigram_dim=64"]
    assert M.main(["--recipes=v2", "--gpus=1,2", "--breakdown", "--", *small]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| v2 |")]
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("train step", "1", "2/4"), ("warm-up", "1", "2"), ("validation", "1", "-"),
        ("train step", "2", "1/2"), ("warm-up", "2", "1"), ("validation", "2", "-")]
    assert all(0 < float(r[4]) <= float(r[5]) for r in rows)
    state = {int(w): float(gib) for w, gib in re.findall(r"v2 train step (\d) GPU.*optimizer state ([\d.]+)", out)}
    assert state[2] < state[1], out


def test_memory_estimate_runs_the_record_recipes_step_on_fake_tensors(capsys):
    """--recipes=record at a small width (its 11 blocks: the FP8 MLPs, the FP8 head with the record's gradient
    scale, the prefix-token table, the MUDD stream; 8 packed sequences of 128 / 256 / 384 tokens): a train step on
    1 and 8 GPUs, the predicted peak at most the no-fusion bound. The real shapes' table is in bench/README.md
    (about a minute on 2 cores)."""
    from bench import memory_estimate as M
    small = ["--model_dim=128", "--n_head=2", "--head_dim=64", "--batch_tokens=3072", "--seq_len=384",
             "--val_seq_len=1024", "--val_tokens=1024", "--bigram_vocab_size=4096", "--bigram_dim=128"]
    assert M.main(["--recipes=record", "--gpus=1,8", "--phases=train", "--", *small]) == 0
    out = capsys.readouterr().out
    assert "8 packed sequences per step of 128 / 256 / 384 tokens by stage" in out and "fp8_head=True" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| record |")]
    assert [(r[1], r[2], r[3]) for r in rows] == [("train step", "1", "8"), ("train step", "8", "1")]
    assert all(0 < float(r[4]) <= float(r[5]) for r in rows)


@pytest.mark.parametrize("size", ["-1", "0", "nan", "inf"])
def test_memory_estimate_refuses_a_device_size_that_is_not_positive_and_finite(size, capsys):
    """--device_gib=-1 was accepted and printed a negative headroom for every row."""
    from bench import memory_estimate as M
    assert flags.run_cli(lambda: M.main([f"--device_gib={size}"])) == 2
    assert capsys.readouterr().err == (f"error: argument --device_gib: bad value '{size}'; valid: a finite number "
                                       "in (0, inf) (see memory_estimate.py --help)\n")


@pytest.mark.parametrize("program, bad", [
    ("ablation", "--seeds=0"), ("ablation", "--jobs=-1"), ("ablation", "--baseline-matrix-adam-lr=nan"),
    ("attention_memory", "--heads=0"), ("exit_stress", "--timeout=0"), ("gpu_check", "--budget-s=inf"),
    ("gpu_check", "--warmup=-1"), ("loader_throughput", "--accum=0"), ("step_cost", "--threads=0"),
    ("memory_estimate", "--device_gib=-1")])
def test_every_bench_programs_numbers_are_range_checked_where_parsed(program, bad, capsys):
    """Each bench program's number arguments (every CLI number is checked): a value out of its range is the one
    'error: argument ...' line naming the valid range, exit 2, before anything runs (each main() as its
    `if __name__ == "__main__"` runs it)."""
    import importlib
    module = importlib.import_module(f"bench.{program}")
    assert flags.run_cli(lambda: module.main([bad])) == 2
    flag, value = bad.split("=")
    out, err = capsys.readouterr()
    assert out == "" and re.fullmatch(rf"error: argument {flag}: bad value '{re.escape(value)}'; valid: .* "
                                      rf"\(see \S+ --help\)\n", err), err


# ---------------------------------------------------------------- hostile paths and lists

@pytest.mark.parametrize("out, said", [
    ("/proc/nope/x.json", "cannot make its folder /proc/nope (No such file or directory)"),
    ("{tmp}", "it is a folder"),
    ("{tmp}/file/x.json", "cannot make its folder {tmp}/file (a file on the way is not a folder)")])
def test_gpu_check_refuses_an_out_it_cannot_write_before_any_check(tmp_path, capsys, out, said):
    """--out=/proc/nope/x.json was a FileNotFoundError traceback, after the checks had run."""
    (tmp_path / "file").write_text("")
    out, said = out.format(tmp=tmp_path), said.format(tmp=tmp_path)
    assert flags.run_cli(lambda: G.main([f"--out={out}"])) == 2
    stdout, err = capsys.readouterr()
    assert stdout == "" and err == f"error: cannot write --out {out}: {said}; pass --out=FILE.json in a folder " \
                                   "you can write\n"


@pytest.mark.parametrize("program, bad", [
    ("memory_estimate", "--recipes="), ("memory_estimate", "--recipes=,"), ("memory_estimate", "--gpus="),
    ("memory_estimate", "--phases="), ("ablation", "--variants="), ("ablation", "--variants=,"),
    ("step_cost", "--variants="), ("exit_stress", "--cores="), ("gpu_check", "--only=")])
def test_every_bench_list_argument_refuses_an_empty_list(program, bad, capsys):
    """--recipes= printed an empty table and exited 0 (--variants= ran every variant, --cores= was a traceback)."""
    import importlib
    module = importlib.import_module(f"bench.{program}")
    assert flags.run_cli(lambda: module.main([bad])) == 2
    out, err = capsys.readouterr()
    flag = bad.split("=")[0]
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"error: argument {flag}: "), err
