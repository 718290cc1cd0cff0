"""One command to check train_gpt.py's GPU paths on a machine with NVIDIA GPUs (no network needed).

    python -m bench.gpu_check            # all checks, capped to fit 7 minutes on one H100/H200 (cold compiles)
    python -m bench.gpu_check --plan     # each part, its time share and how it was sized (no GPU, no torch needed)
    python -m bench.gpu_check --quick    # skip (e), the timed speedrun-preset run
    python -m bench.gpu_check --only=speedrun            # rerun one part (its own results file)
    python -m bench.gpu_check --recipe=reference --skip-tests   # (e) with another recipe (default: record, the GPU
                                                                # default; reference | v2 | record)
    python -m bench.gpu_check --resume-drill-on-cpu      # (d)'s command lines, run on CPU with gloo (no GPU)

What it does, in order, each part in its own process with its share of the time (BUDGET_S below) as timeout:
  (a) the GPU tests under tests/ (`pytest tests -m gpu`; pyproject.toml registers the marker), less the 48K-token
      compiled step when (e) runs (it compiles and trains that model with the record's settings); without
      pytest (requirements-extras.txt) the row says so and the other parts run;
  (b) the FP8 head (only with compute capability >= 8.9): train_gpt.fp8_matmul vs a bf16 matmul, forward
      and both gradients, as relative errors to an fp32 matmul; then the same forward + backward under
      torch.compile(fullgraph=True) with the FP8 kernels compiled as the trainer compiles them
      (the op's insides compiled by inductor, fp8_kernel), as relative errors to the eager op;
  (c) compiled FlexAttention (the model's FlexAttention backend with sliding_window_block_mask) against the
      SDPA dense-mask path at T=4096, forward and input gradients;
  (d) with >= 2 GPUs: a 2-rank, 2-layer run of train_gpt.py under torchrun (NCCL) on synthetic shards that
      stops after step 2 with a checkpoint (--stop_after), then a second launch that resumes it
      (--resume=latest), trains step 3 and ends with a final val loss: NCCL, DCP on a CUDA mesh and the
      per-step stop-signal agreement; with one GPU the row says it was not checked;
  (e) the speedrun preset (full 393,216-token batch: 8 micro-steps on 1 GPU) under torchrun on the visible
      GPUs, on synthetic FineWeb-format shards written to a temporary folder: ms/step over the steps after
      the profiled ones, peak memory and recompilations after warm-up from its JSON summary; the top 15
      CUDA kernels by time and communication vs compute time from a profiler trace of 3 steps.
Then it prints one summary table (check | result | time | numbers; time is the part's wall time and its
timeout, shared by the rows of one part), with every skip and its reason, and writes the table and every
number as JSON (--out, default bench/results/gpu_check.json; --only and --resume-drill-on-cpu runs default to
a file of their own). A run in which nothing ran never replaces a file that holds a result: its table goes
beside it (gpu_check.nothing_ran.json), and one line says where.

It needs only the standard library and torch (numpy for the synthetic shards), so it runs under a GPU
machine's own torch with nothing installed; pytest and nvidia-ml-py are optional.

Without a CUDA GPU nothing GPU-specific can run: it says so, lists the skips and exits 0.
Exit status: 0 when nothing failed, 1 when a check failed or errored. A part that runs out of its time is
reported as "timeout", not as a failure, except (d), which compiles nothing (a hang there is the finding),
and (e) once its steps have started (a compile that outlasts the share is a timeout, a stalled run a FAIL).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flags import OneLineArgumentParser, integer, number, output_file, run_cli, write_user_file

REPO = Path(__file__).resolve().parents[1]

GLOBAL_BATCH = 8 * 48 * 1024  # the speedrun preset's tokens per optimizer step
SEQUENCES_PER_STEP = 8  # 48K-token sequences per step: the world size must divide it
VAL_SEQ_LEN = 4 * 64 * 1024  # the speedrun preset's val_seq_len (the record's)
PROFILED_STEPS = 3  # steps of the profiler trace the kernel table comes from
# train_gpt.make_profiler's schedule skips one step and warms up on one before the PROFILED_STEPS it records,
# and the trace is written inside the clock of the last of them; one step more, in case torch.profiler's
# schedule ends a step later than that: ms/step is measured from this step's line on.
STEPS_BEFORE_CLEAN = 1 + 1 + PROFILED_STEPS + 1
FP8_SHAPE = (2048, 768, 8192)  # rows, model dim, vocabulary slice of the head check; rows >= ~1024 keep the
# mean-loss gradient times the fixed 2**19 scale inside float8_e5m2's range (57344), as in training
FLEX_SHAPE = (4096, 6, 128)  # tokens, heads, head dim of the attention check (the speedrun's heads)

# The default run fits one loan of a GPU machine: 7 minutes (LOAN_S) of wall time on one H100/H200 from a cold
# start (no inductor or Triton cache), so that 15 minutes of device time hold the machine's start, this check and
# a rerun of one part (--only). Each part's share of the default --budget-s (405 s: LOAN_S less OWN_S, this
# script's start-up, the table and a killed part's grace) and how it was sized: PLAN, which --plan prints. Not
# yet timed on a GPU. A part's timeout runs to the end of its share counted from the start, so time an earlier
# part leaves unspent goes to the next one; the last part to run also gets the shares of the parts that do not
# run (with one GPU, (d)'s goes to (e)). Below the default --budget-s every share shrinks in proportion; a part
# whose time falls under its MIN_S is "skipped: budget".
LOAN_S = 420
TIMED_STEPS, WARMUP_STEPS = 12, 3  # (e)'s defaults: --steps and --warmup
OWN_S = 15  # python start-up and torch import of this script (~4 s measured on CPU), the table, KILL_GRACE_S
H100_BF16_FLOPS, H100_BYTES_PER_S = 790e12, 3.0e12  # dense bf16 peak and HBM bandwidth the estimates use
PROCESS_START_S = 10  # a part's process: python + torch + train_gpt import, 3.4 s measured on 2 CPU cores
# (torch 2.11), plus CUDA initialisation


def speedrun_step_seconds(mfu: float = 0.4) -> float:
    """One optimizer step of the speedrun preset (393,216 tokens) at `mfu` of the H100's bf16 peak: 6 FLOPs per
    matmul weight per token (forward + backward; 12 layers of 7.08M plus the 50304 x 768 head) and the attention
    scores (12 layers, 768 wide, a mean window of ~1,000 keys)."""
    matmul_weights = 12 * 12 * 768 * 768 + 50304 * 768
    flops_per_token = 6 * matmul_weights + 12 * 12 * 768 * 1000
    return flops_per_token * GLOBAL_BATCH / (H100_BF16_FLOPS * mfu)


PLAN = {  # part: (share in s, how it was sized)
    "tests": (65, "estimated: pytest's start and collection (6.6 s measured on CPU under torch 2.11), FlexAttention "
                  "compiled forward + backward at the test's small shape (~30 s cold Triton compile), the FP8 head "
                  "test in eager mode (milliseconds of matmuls); the 48K-token compiled step is left to (e)"),
    "fp8": (40, f"estimated: a process start ({PROCESS_START_S} s), a {FP8_SHAPE[0]} x {FP8_SHAPE[1]} x {FP8_SHAPE[2]} "
                f"head ({2 * FP8_SHAPE[0] * FP8_SHAPE[1] * FP8_SHAPE[2] / H100_BF16_FLOPS * 1e3:.2f} ms of matmuls at "
                "peak), then two small graphs through inductor with coordinate-descent tuning (~25 s cold)"),
    "flex": (40, f"estimated: a process start ({PROCESS_START_S} s), attention at T={FLEX_SHAPE[0]} (milliseconds at "
                 f"{H100_BYTES_PER_S / 1e12:.0f} TB/s and peak FLOP/s), one FlexAttention forward + backward Triton "
                 "compile (~25 s cold)"),
    "resume": (80, "measured on CPU: --resume-drill-on-cpu's two torchrun launches took 72 s on 2 shared cores "
                   "with gloo (38 s + 34 s, mostly start-up and the 2-layer model's CPU steps, which a GPU runs in "
                   "milliseconds); runs only with >= 2 GPUs (with one, its share goes to (e))"),
    "speedrun": (180, f"estimated: {WARMUP_STEPS + STEPS_BEFORE_CLEAN + TIMED_STEPS} steps at "
                      f"~{speedrun_step_seconds():.1f} s (6 FLOPs per weight per token at 40% of "
                      f"{H100_BF16_FLOPS / 1e12:.0f} TFLOP/s on one GPU), the cold compile of the training and "
                      "validation graphs (2-4 min in the public record logs; recipe record, the default, warms up "
                      "one graph per batch stage, YaRN state and the tie split before its clock starts: not yet "
                      "timed on a GPU), the trace export"),
}
BUDGET_S = {part: share for part, (share, _) in PLAN.items()}
# The least time in which a part can finish at all (a process starts in ~10 s; (e) compiles for 2 min or more).
MIN_S = {"tests": 30, "fp8": 20, "flex": 20, "resume": 30, "speedrun": 120}
KILL_GRACE_S = 10  # SIGTERM to the part's process group, then SIGKILL after this long
PART_LETTERS = dict(zip(BUDGET_S, "abcde"))  # (a) to (e), in the plan's order
LEFT_TO_SPEEDRUN = "tests/test_model.py::test_speedrun_model_compiled_step_on_cuda"  # (e) covers it, as trained
NOT_RUN = ("skipped", "not checked")  # a row's result when its check did not run at all

TESTS_ROW = "pytest (GPU tests)"
FP8_ROW = "fp8_matmul vs bf16"
FP8_COMPILED_ROW = "fp8_matmul compiled vs eager"
FLEX_ROW = "FlexAttention vs SDPA, T=4096"
RESUME_ROW = "2 ranks: stop, checkpoint, resume"
SPEEDRUN_ROW = "speedrun preset timing"
PART_ROWS = {"tests": [TESTS_ROW], "fp8": [FP8_ROW, FP8_COMPILED_ROW], "flex": [FLEX_ROW],
             "resume": [RESUME_ROW], "speedrun": [SPEEDRUN_ROW]}
RESUME_NEEDS = "needs >= 2 GPUs (NCCL, DCP on a CUDA mesh, stop signal)"
ROWS_PREFIX = "gpu_check rows: "  # how a part's process hands its rows back (one JSON line on stdout)

Row = tuple[str, str, str]  # check, result, numbers


def say(text: str) -> None:
    print(text, flush=True)


def run_child(cmd: list[str], timeout: float, out_path: Path, env: dict | None = None) -> tuple[int | None, str]:
    """Runs cmd in its own process group with stdout and stderr in out_path; past timeout the whole group
    (torchrun's ranks, inductor's compile workers) gets SIGTERM, then SIGKILL. Returns (exit status or None
    when it timed out, its output)."""
    say("$ " + " ".join(cmd))
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    return rc, out_path.read_text(errors="replace")


def tail(text: str, lines: int = 3, chars: int = 300) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])[:chars]


def trainer_failure(text: str, lines: int = 3) -> str:
    """train_gpt.py's own one-line 'error: ...' when it wrote one (torchrun's footer follows it), else the tail."""
    errors = [line.strip() for line in text.splitlines() if re.match(r"(\[rank\d+\]:\s*)?error: ", line.strip())]
    return errors[-1][:400] if errors else tail(text, lines, 400)


# -----------------------------------------------------------------------------
# (a) GPU tests

def pytest_counts(output: str) -> str:
    """The final 'N passed, M skipped ...' summary of a pytest run."""
    lines = [line.strip("= ") for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return lines[-1] if lines else "no summary line"


def check_tests(timeout: float, tmp: Path, deselect: tuple[str, ...] = ()) -> list[Row]:
    """The tests marked `gpu` (pyproject.toml registers the marker), less those deselected; they skip themselves without
    CUDA. pytest is an extra (requirements-extras.txt), which a GPU machine's image may not have."""
    import importlib.util
    if importlib.util.find_spec("pytest") is None:
        return [(TESTS_ROW, "skipped: no pytest", f"pytest is not installed for {sys.executable} "
                 "(requirements-extras.txt); the other parts check the same kernels")]
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider"] + [
        f"--deselect={test}" for test in deselect]
    rc, out = run_child(cmd, timeout, tmp / "pytest.txt")
    for line in out.splitlines():
        if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")):
            say("  " + line)
    if rc == 5:
        return [(TESTS_ROW, "skipped: no GPU tests found", "no test carries the gpu marker")]
    if rc is None:
        return [(TESTS_ROW, "timeout", f"stopped after {timeout:.0f}s, its share; so far: {pytest_counts(out)}")]
    if rc != 0:
        return [(TESTS_ROW, "FAIL", f"exit {rc}; {pytest_counts(out)}; {tail(out)}")]
    return [(TESTS_ROW, "ok", pytest_counts(out))]


# -----------------------------------------------------------------------------
# (b) FP8 and (c) FlexAttention against reference paths, each run in a process of its own
# (`gpu_check.py --part=fp8|flex`), so that its share is a timeout and the GPU is free afterwards

def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def fp8_case(torch, device, shape=FP8_SHAPE):
    """The head's inputs: rms-normed rows, a weight at CastedLinear's init scale, random targets."""
    g = torch.Generator(device="cpu").manual_seed(0)
    n, d, vocab = shape
    x0 = torch.randn(n, d, generator=g)
    x0 = (x0 / x0.pow(2).mean(-1, keepdim=True).sqrt()).to(device)
    w0 = (torch.rand(vocab, d, generator=g) * 2 - 1).mul(3 ** 0.5 * 0.5 / d ** 0.5).to(device)
    targets = torch.randint(0, vocab, (n,), generator=g).to(device)
    return x0, w0, targets


def head_loss(T, kind: str, fp8_kernels: str = "eager"):
    """out and a mean cross-entropy of x @ w.T, as fp8_matmul (its insides run by fp8_kernels), a bf16 or an
    fp32 matmul computes it, so that the gradients have the magnitude the fixed FP8 scales were chosen for."""
    import torch.nn.functional as F

    def loss(x, w, targets):
        if kind == "fp8":
            out = T.fp8_matmul(x, w, T.FP8_SCALES["x_scale"], T.FP8_SCALES["w_scale"], fp8_kernels)[0]
        else:
            out = F.linear(x, w.type_as(x))
        return out, F.cross_entropy(out.float() * 8, targets)  # * 8: logits of a trained head's size
    return loss


def head_run(torch, case, fn, x_dtype):
    """(out, grad_x, grad_w) of fn on fresh leaves of the case's inputs."""
    x0, w0, targets = case
    x = x0.to(x_dtype, copy=True).requires_grad_()
    w = w0.clone().requires_grad_()
    out, loss = fn(x, w, targets)
    loss.backward()
    return out.detach(), x.grad, w.grad


def check_fp8(T, torch, device, shape=FP8_SHAPE) -> Row:
    """fp8_matmul (forward, grad_x, grad_w) and a bf16 matmul, each against fp32."""
    case = fp8_case(torch, device, shape)
    ref = head_run(torch, case, head_loss(T, "fp32"), torch.float32)
    fp8 = head_run(torch, case, head_loss(T, "fp8"), torch.bfloat16)
    bf16 = head_run(torch, case, head_loss(T, "bf16"), torch.bfloat16)
    names = ("out", "grad_x", "grad_w")
    e8 = [rel_err(a, r) for a, r in zip(fp8, ref)]
    e16 = [rel_err(a, r) for a, r in zip(bf16, ref)]
    limits = (0.1, 0.3, 0.3)  # e4m3 keeps 3 mantissa bits, e5m2 two
    finite = all(bool(torch.isfinite(t).all()) for t in fp8)
    ok = finite and all(e <= lim for e, lim in zip(e8, limits))
    numbers = "rel err vs fp32, fp8/bf16: " + ", ".join(f"{k} {a:.3g}/{b:.3g}" for k, a, b in zip(names, e8, e16))
    return (FP8_ROW, "ok" if ok else "FAIL", numbers + ("" if finite else " (non-finite values)"))


# Compiled vs eager FP8: both quantize the same values with power-of-two scales (exact in any precision), so
# the e4m3/e5m2 operands should be bit-identical and the differences come only from cuBLAS choosing another
# algorithm for another operand layout (summation order) and from rounding out and grad_x to bf16. 1e-2 is
# above every element moving by one bf16 step (2**-8 = 3.9e-3 relative) and several times below the FP8
# rounding itself (one e4m3 step is 2**-3 relative; the eager op is 3.7e-2 (out) and 5e-2 (gradients) from
# fp32 in a CPU dry run at 1024 x 256 x 2048, where compiled and eager agreed exactly), so a compiled kernel
# that scales, casts, saturates or transposes differently from the eager one fails the row.
FP8_COMPILED_TOLERANCE = 1e-2


def check_fp8_compiled(T, torch, device, shape=FP8_SHAPE) -> Row:
    """The head's forward + backward through fp8_matmul, eager, then under torch.compile(fullgraph=True) with the
    op's insides compiled by inductor with the trainer's settings (as build_model does with --compile=model:
    the model's graph calls the opaque op, whose insides are compiled on their own)."""
    case = fp8_case(torch, device, shape)
    eager = head_run(torch, case, head_loss(T, "fp8"), torch.bfloat16)
    started = time.time()
    T.configure_inductor(T.Hyperparameters())  # the speedrun preset's coordinate-descent tuning
    compiled = head_run(torch, case, torch.compile(head_loss(T, "fp8", "inductor"), fullgraph=True, dynamic=False),
                        torch.bfloat16)
    compile_s = time.time() - started
    names = ("out", "grad_x", "grad_w")
    errs = [rel_err(c, e) for c, e in zip(compiled, eager)]
    finite = all(bool(torch.isfinite(t).all()) for t in compiled)
    ok = finite and all(e <= FP8_COMPILED_TOLERANCE for e in errs)
    numbers = ("rel err compiled vs eager: " + ", ".join(f"{k} {e:.3g}" for k, e in zip(names, errs)) +
               f" (limit {FP8_COMPILED_TOLERANCE:g}); compile+run {compile_s:.0f}s" +
               ("" if finite else " (non-finite values)"))
    return (FP8_COMPILED_ROW, "ok" if ok else "FAIL", numbers)


def check_flex(T, torch) -> Row:
    """Compiled FlexAttention with the block mask vs banded SDPA (the fallback), T=4096, bf16, both
    against an fp32 SDPA reference; passes when flex is about as close to it as bf16 SDPA is."""
    device = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    t, h, d = FLEX_SHAPE
    tokens = torch.randint(0, 50000, (t,), generator=g)
    tokens[torch.randint(1, t, (12,), generator=g)] = T.EOT_TOKEN  # documents of random lengths
    tokens[0] = T.EOT_TOKEN
    tokens = tokens.to(device)
    window = torch.tensor(8, device=device)  # 1024 tokens: the window cuts through documents
    q0, k0, v0 = (torch.randn(1, t, h, d, generator=g).to(device) for _ in range(3))
    grad = torch.randn(1, t, h, d, generator=g).to(device)
    scale = 0.12

    def run(attend, mask, dtype):
        q, k, v = (x.to(dtype, copy=True).requires_grad_() for x in (q0, k0, v0))
        out = attend(q, k, v, mask, scale)
        out.backward(grad.to(dtype))
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    banded = T.BandedAttention.build_mask(tokens, window)
    ref = run(T.BandedAttention.attend, banded, torch.float32)
    sdpa = run(T.BandedAttention.attend, banded, torch.bfloat16)
    started = time.time()
    flex_attend = torch.compile(T.FlexAttention().attend, dynamic=False)
    flex = run(flex_attend, T.sliding_window_block_mask(tokens, window), torch.bfloat16)
    compile_s = time.time() - started
    names = ("out", "dq", "dk", "dv")
    diff_flex = [(a - r).abs().max().item() for a, r in zip(flex, ref)]
    diff_sdpa = [(a - r).abs().max().item() for a, r in zip(sdpa, ref)]
    flex_vs_sdpa = [(a - b).abs().max().item() for a, b in zip(flex, sdpa)]
    ok = all(f <= max(2 * s, 1e-2) for f, s in zip(diff_flex, diff_sdpa)) and all(
        torch.isfinite(x).all() for x in flex)
    numbers = ("max |flex - sdpa| " + ", ".join(f"{k} {v:.2e}" for k, v in zip(names, flex_vs_sdpa)) +
               "; vs fp32 ref, flex/sdpa-bf16: " + ", ".join(f"{k} {a:.1e}/{b:.1e}" for k, a, b in
                                                              zip(names, diff_flex, diff_sdpa)) +
               f"; compile+run {compile_s:.0f}s")
    return (FLEX_ROW, "ok" if ok else "FAIL", numbers)


def guarded(name: str, check, *args) -> Row:
    try:
        return check(*args)
    except Exception as e:  # a kernel that cannot run is the finding: report it and go on
        return (name, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


def part_main(part: str) -> int:
    """The body of `gpu_check.py --part=fp8|flex`: its rows as one JSON line on stdout."""
    import torch
    import train_gpt as T
    device = torch.device("cuda")
    if part == "flex":
        rows = [guarded(FLEX_ROW, check_flex, T, torch)]
    elif not T.fp8_supported(device):
        cap = torch.cuda.get_device_capability(device)
        rows = [(name, "skipped: no FP8", f"compute capability {cap[0]}.{cap[1]} < 8.9") for name in PART_ROWS["fp8"]]
    else:
        rows = [guarded(FP8_ROW, check_fp8, T, torch, device)]
        torch.cuda.empty_cache()
        rows.append(guarded(FP8_COMPILED_ROW, check_fp8_compiled, T, torch, device))
    say(ROWS_PREFIX + json.dumps(rows))
    return 0


def check_part(part: str, timeout: float, tmp: Path) -> list[Row]:
    rc, out = run_child([sys.executable, "-m", "bench.gpu_check", f"--part={part}"], timeout,
                        tmp / f"{part}.txt")
    lines = [line for line in out.splitlines() if line.startswith(ROWS_PREFIX)]
    if lines:
        return [tuple(row) for row in json.loads(lines[-1][len(ROWS_PREFIX):])]
    if rc is None:
        return [(name, "timeout", f"stopped after {timeout:.0f}s, its share (cold compiles)") for name in PART_ROWS[part]]
    return [(name, "error", f"exit {rc}: {tail(out, 1)}") for name in PART_ROWS[part]]


# -----------------------------------------------------------------------------
# Synthetic data and what the trainer leaves behind

def write_shard(path: Path, n_tokens: int, seed: int) -> None:
    """A shard in the one format data/shardio.py defines, of random tokens split into documents of
    random length, each starting with the EOT token 50256."""
    import numpy as np
    from data import shardio
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50256, size=n_tokens, dtype=np.uint16)
    starts = np.cumsum(rng.geometric(1 / 1000, size=n_tokens // 200 + 2))
    tokens[0] = 50256
    tokens[starts[starts < n_tokens]] = 50256
    shardio.write_shard(path, tokens)


def read_summary(path: Path) -> dict | None:
    """The trainer's JSON summary (its declared result, written atomically), or None when there is none."""
    return json.loads(path.read_text()) if path.is_file() else None


def step_times_ms(run_log: Path) -> dict[int, float]:
    """train_time of each step line of a run log, by step (records/read_records.py is the one reader)."""
    from records.read_records import parse_progress_line
    times = {}
    if run_log.is_file():
        for line in run_log.read_text(errors="replace").splitlines():
            p = parse_progress_line(line)
            if p is not None and p.step is not None and "train_time" in p.fields:
                times[p.step] = p.fields["train_time"]
    return times


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "train_gpt.py")]


def trainer_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}


# -----------------------------------------------------------------------------
# (d) two ranks: stop with a checkpoint, resume from it

RESUME_RUN_ID = "resume_drill"
RESUME_STOP, RESUME_STEPS = 2, 3
# The speedrun preset (what a GPU run gets) shrunk to a plumbing check. --attention=banded --compile=off:
# nothing is compiled (flex attention outside a compiled model would be compiled on its own, choose_kernels'
# compile_attention), so each launch costs start-up and seconds, and the row tests the collectives, the
# checkpoint and the stop signal rather than kernels, which (b), (c) and (e) cover. The FP8 head stays on
# where supported (eager). 1024-token sequences, 2 micro-steps per rank; one validation sequence per rank.
RESUME_FLAGS = ["--preset=speedrun", "--recipe=reference",
                "--n_layer=2", "--model_dim=256", "--n_head=2", "--head_dim=128",
                "--seq_len=1024", "--batch_tokens=4096", "--val_seq_len=1024", "--val_tokens=2048",
                "--window_final_tokens=1024", "--val_every=0", "--warmup_steps=0", "--attention=banded",
                "--compile=off", f"--num_iterations={RESUME_STEPS}", f"--run_id={RESUME_RUN_ID}"]


def check_resume(timeout: float, tmp: Path, nproc: int = 2) -> tuple[Row, dict]:
    """First launch: --stop_after=2 writes step_000002 and exits 0; second: --resume=latest trains step 3 and
    writes the summary. Passes when both exit 0, the checkpoint folder exists and the summary has a finite
    final val loss after 3 steps and one resume on 2 ranks."""
    part_end = time.time() + timeout
    data, log_dir = tmp / "resume_data", tmp / "resume_logs"
    data.mkdir()
    write_shard(data / "synth_train_000001.bin", 16 * 4096 + 1, seed=3)
    write_shard(data / "synth_val_000000.bin", 2 * 2048 + 1, seed=4)
    base = torchrun(nproc) + RESUME_FLAGS + [f"--train_files={data}/synth_train_*.bin",
                                             f"--val_files={data}/synth_val_*.bin", f"--log_dir={log_dir}"]
    found: dict = {"nproc": nproc}
    checkpoint = log_dir / RESUME_RUN_ID / f"step_{RESUME_STOP:06d}"
    started = time.time()
    rc, out = run_child(base + [f"--stop_after={RESUME_STOP}"], part_end - time.time(), tmp / "resume_1.txt",
                        trainer_env())
    found["first_wall_s"] = time.time() - started
    if rc != 0:
        what = f"timed out after {found['first_wall_s']:.0f}s (a hang)" if rc is None else f"exit {rc}"
        return (RESUME_ROW, "FAIL", f"first launch (--stop_after={RESUME_STOP}) {what}: {trainer_failure(out)}"), found
    if not checkpoint.is_dir():
        return (RESUME_ROW, "FAIL", f"first launch exited 0 but wrote no {checkpoint.name}: {trainer_failure(out)}"), found
    found["checkpoint_mib"] = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) / 2 ** 20
    started = time.time()
    rc, out = run_child(base + ["--resume=latest"], part_end - time.time(), tmp / "resume_2.txt", trainer_env())
    found["second_wall_s"] = time.time() - started
    summary = read_summary(log_dir / f"{RESUME_RUN_ID}.json") or {}
    found.update({k: summary.get(k) for k in ("final_val_loss", "steps", "resumes", "world_size", "runtime")})
    walls = f"launches {found['first_wall_s']:.0f}s + {found['second_wall_s']:.0f}s"
    if rc != 0:
        what = f"timed out after {found['second_wall_s']:.0f}s (a hang)" if rc is None else f"exit {rc}"
        return (RESUME_ROW, "FAIL", f"resume (--resume=latest) {what}: {trainer_failure(out)}"), found
    loss = found.get("final_val_loss")
    loss = loss if isinstance(loss, (int, float)) else math.nan  # None: the summary is missing or holds none
    ok = (math.isfinite(loss) and found.get("steps") == RESUME_STEPS and found.get("resumes") == 1
          and found.get("world_size") == nproc)
    numbers = (f"stopped after step {RESUME_STOP} ({checkpoint.name}, {found['checkpoint_mib']:.0f} MiB), resumed "
               f"to step {found.get('steps')}: final val loss {loss:.4f}, resumes {found.get('resumes')}, world size "
               f"{found.get('world_size')}, device {(found.get('runtime') or {}).get('device')}; {walls}")
    return (RESUME_ROW, "ok" if ok else "FAIL", numbers if summary else f"no summary JSON: {trainer_failure(out)}"), found


# -----------------------------------------------------------------------------
# (e) the speedrun preset, timed

def kernel_table(trace_path: Path, top: int = 15) -> dict:
    """Total time per CUDA kernel in a Chrome trace, the top kernels, and NCCL (communication) vs the rest."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    totals: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            totals[e["name"]] = totals.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    comm = sum(us for name, us in totals.items() if "nccl" in name.lower())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {"top_kernels": [{"name": n[:120], "ms": us / 1000} for n, us in ranked],
            "kernel_ms": sum(totals.values()) / 1000, "communication_ms": comm / 1000,
            "compute_ms": (sum(totals.values()) - comm) / 1000}


def tokens_between(batch_stages: list, first: int, last: int) -> int:
    """Training tokens of steps first .. last-1 from the summary's batch_stages ([first step, tokens, micro-steps])."""
    total = 0
    for i, (start, tokens, _) in enumerate(batch_stages):
        end = batch_stages[i + 1][0] if i + 1 < len(batch_stages) else last
        total += tokens * max(0, min(end, last) - max(start, first))
    return total


# (e)'s run is a few steps of the recipe's schedule: record #89's step-count schedules fit a short run this way (no
# extension or momentum cool-down; the embedding untied after step 1, so the split's graph is timed too)
SHORT_RUN_FLAGS = {"record": ["--extension_steps=0", "--muon_momentum_cooldown_steps=0", "--tied_embed_steps=1"]}
RECORD_MS_PER_STEP = 57.4  # record #89 on 8xH100: 73.8 s / 1285 steps (README row 89), ~460 ms of one GPU's time


def check_speedrun(n_gpus: int, steps: int, warmup: int, timeout: float, tmp: Path,
                   recipe: str = "record") -> tuple[Row, dict]:
    nproc = max(w for w in (1, 2, 4, 8) if w <= n_gpus and SEQUENCES_PER_STEP % w == 0)
    total_steps = STEPS_BEFORE_CLEAN + steps  # the profiled steps come first, then `steps` clean timed ones
    name = f"{SPEEDRUN_ROW} ({recipe}, {nproc} GPU(s), {steps} steps)"
    val_tokens = VAL_SEQ_LEN * nproc
    found: dict = {"nproc": nproc, "steps": total_steps, "clean_steps": steps}
    data, log_dir = tmp / "speedrun_data", tmp / "speedrun_logs"
    data.mkdir()
    # v2 aligns sequences to documents, which skips the tail of each: a quarter more tokens covers it
    margin = 1.25 if recipe != "reference" else 1.0
    write_shard(data / "synth_train_000001.bin", int((max(total_steps, warmup) + 1) * GLOBAL_BATCH * margin) + 1,
                seed=1)
    write_shard(data / "synth_val_000000.bin", val_tokens + 1, seed=2)
    cmd = torchrun(nproc) + [
        "--preset=speedrun", f"--recipe={recipe}", f"--num_iterations={total_steps}", "--val_every=0",
        f"--warmup_steps={warmup}", f"--val_tokens={val_tokens}", f"--profile_steps={PROFILED_STEPS}",
        f"--train_files={data}/synth_train_*.bin", f"--val_files={data}/synth_val_*.bin",
        f"--log_dir={log_dir}", "--run_id=gpu_check", *SHORT_RUN_FLAGS.get(recipe, [])]
    started = time.time()
    rc, text = run_child(cmd, timeout, tmp / "speedrun.txt", trainer_env())
    wall = found["wall_s"] = time.time() - started
    summary = read_summary(log_dir / "gpu_check.json")
    if summary:
        found.update({k: summary.get(k) for k in ("step_avg_ms", "peak_memory_mib", "final_val_loss",
                                                   "recompiles_after_warmup", "runtime", "tokens",
                                                   "train_time_ms")})
    times = step_times_ms(log_dir / "gpu_check.txt")
    found["last_step_line"] = max(times, default=0)
    if summary and STEPS_BEFORE_CLEAN in times:
        # from the first clean step line (host time) to the end of training (synchronized before validation)
        clean_ms = summary["train_time_ms"] - times[STEPS_BEFORE_CLEAN]
        found["clean_ms_per_step"] = clean_ms / steps
        stages = summary["runtime"]["batch_stages"]
        found["clean_tokens_per_s"] = tokens_between(stages, STEPS_BEFORE_CLEAN, total_steps) / clean_ms * 1000
    trace = log_dir / "gpu_check_rank0.trace.json"
    if trace.is_file():
        found.update(kernel_table(trace))
    parts = []
    if "clean_ms_per_step" in found:
        parts.append(f"{found['clean_ms_per_step']:.1f} ms/step over steps {STEPS_BEFORE_CLEAN + 1}-{total_steps} "
                     f"({found['clean_tokens_per_s']:,.0f} tokens/s; all {total_steps} steps with the profiled ones: "
                     f"{found['step_avg_ms']:.1f} ms)")
    if recipe == "record" and "clean_tokens_per_s" in found:
        full_batch_ms = found["full_batch_ms"] = GLOBAL_BATCH / found["clean_tokens_per_s"] * 1000
        parts.append(f"a full 393,216-token step takes {full_batch_ms:.0f} ms on {nproc} GPU(s), "
                     f"{full_batch_ms * nproc / 8:.1f} ms on 8 at this rate (the record: {RECORD_MS_PER_STEP} ms on "
                     f"8xH100)")
    if found.get("peak_memory_mib") is not None:
        parts.append(f"peak memory {found['peak_memory_mib']:.0f} MiB allocated (rank 0)")
    if "recompiles_after_warmup" in found:
        parts.append(f"recompiles after warm-up: {found['recompiles_after_warmup']}")
    if "kernel_ms" in found:
        parts.append(f"{PROFILED_STEPS} profiled steps: kernels {found['kernel_ms']:.0f} ms, of which "
                     f"communication {found['communication_ms']:.0f} ms, compute {found['compute_ms']:.0f} ms")
    parts.append(f"wall {wall:.0f}s incl. compile")
    if rc is None and not times:
        return (name, "timeout", f"no training step within {timeout:.0f}s, its share (cold compile; raise "
                "--budget-s or pass --skip-tests); " + tail(text, 2)), found
    if rc is None:
        return (name, "FAIL", f"timed out after step {found['last_step_line']} of {total_steps}; "
                + "; ".join(parts)), found
    if rc != 0 or "clean_ms_per_step" not in found:
        return (name, "FAIL", f"exit {rc}: {trainer_failure(text, 4)}"), found
    result = "ok" if found.get("recompiles_after_warmup") == 0 else "FAIL"
    return (name, result, "; ".join(parts)), found


# -----------------------------------------------------------------------------

def ran(result: str) -> bool:
    """Whether a row's check ran (passed, failed, errored or timed out), as opposed to skipped."""
    return not result.startswith(NOT_RUN)


def holds_a_result(path: Path) -> bool:
    """Whether path is a file this script must not replace with a run in which nothing ran: a table with a check
    that ran, or anything it cannot read as a table (kept: it is not this script's to discard)."""
    try:
        table = json.loads(path.read_text())["table"]
        return any(ran(str(row["result"])) for row in table)
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError):
        return True


def results_path(out: Path, rows: list) -> Path:
    """Where this run's JSON goes: out, unless nothing ran and out holds a result; then beside it."""
    if any(ran(r[1]) for r in rows) or not holds_a_result(out):
        return out
    return out.with_name(out.stem + ".nothing_ran" + out.suffix)


OUT_FIX = "pass --out=FILE.json in a folder you can write"


def write_json(out: Path, rows: list, details: dict) -> None:
    path = results_path(out, rows)
    write_user_file(path, json.dumps({"table": [dict(check=c, result=r, time=t, numbers=n) for c, r, t, n in rows],
                                      **details}, indent=1), "--out", OUT_FIX + " (the table is above)")
    say(f"wrote {path}" if path == out else f"nothing ran: kept {out} (an earlier run's result); wrote this run's "
        f"table to {path}")


def print_table(rows: list) -> None:
    """rows: (check, result, time, numbers)."""
    header = ("check", "result", "time")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
    say("")
    say(" | ".join(f"{h:<{w}}" for h, w in zip(header, widths)) + " | numbers")
    say("-+-".join("-" * w for w in widths) + "-+-" + "-" * 7)
    for row in rows:
        say(" | ".join(f"{v:<{w}}" for v, w in zip(row[:3], widths)) + f" | {row[3]}")


def finish(rows: list, details: dict, out: Path) -> int:
    print_table(rows)
    write_json(out, rows, details)
    unchecked = [r for r in rows if r[1].startswith((*NOT_RUN, "timeout"))]
    if unchecked:
        say("not checked: " + "; ".join(f"{r[0]} ({r[1].removeprefix('skipped: ').removeprefix('not checked: ')})"
                                        for r in unchecked))
    return 1 if any(r[1] in ("FAIL", "error") for r in rows) else 0


def shares_line(shares: dict, budget: float) -> str:
    return ("time shares (s): " + ", ".join(f"{p} {s:.0f}" for p, s in shares.items()) +
            f" = {sum(shares.values()):.0f} of --budget-s {budget:.0f}")


def print_plan() -> int:
    """--plan: every part of the default run, its share and how the share was sized; no GPU or torch needed.
    Exit 0 when the whole run fits LOAN_S."""
    say("gpu_check.py's default run on one H100/H200 from a cold start, in order (each part's share is its timeout; "
        "time a part leaves unspent goes to the next):")
    for part, (share, how) in PLAN.items():
        say(f"  ({PART_LETTERS[part]}) {part:<8} {share:>4} s  {how}")
    say(f"      this script {OWN_S:>3} s  estimated: its start-up and torch import (~4 s measured on CPU), the table, "
        f"a killed part's {KILL_GRACE_S} s grace")
    total = sum(BUDGET_S.values()) + OWN_S
    say(f"total {total} s of {LOAN_S} s; with one GPU (d) does not run and (e) gets "
        f"{BUDGET_S['speedrun'] + BUDGET_S['resume']} s; rerun one part with --only=PART (its share, its own file)")
    return 0 if total <= LOAN_S else 1


def only_parts(text: str) -> tuple[str, ...]:
    """--only's comma-separated parts, by name (tests, fp8, flex, resume, speedrun)."""
    parts = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [part for part in parts if part not in BUDGET_S]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"unknown part(s) {', '.join(unknown) or '(none)'}; the parts are "
                                         f"{', '.join(BUDGET_S)}")
    return parts


def default_budget(only: tuple[str, ...]) -> float:
    """The whole run's shares; a rerun of some parts gets their shares, (e) with (d)'s as on one GPU."""
    if not only:
        return sum(BUDGET_S.values())
    return sum(BUDGET_S[p] for p in only) + (BUDGET_S["resume"] if "speedrun" in only and "resume" not in only else 0)


def default_out(only: tuple[str, ...], drill: bool) -> Path:
    """bench/results/gpu_check.json for the whole check; a rerun of some parts and the CPU drill have files of
    their own, so that neither replaces the whole check's result."""
    name = "gpu_check_resume_drill_cpu" if drill else "gpu_check_only_" + "_".join(only) if only else "gpu_check"
    return REPO / "bench" / "results" / f"{name}.json"


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="skip (e), the timed speedrun-preset run")
    p.add_argument("--skip-tests", action="store_true", help="skip (a), the GPU pytest tests")
    p.add_argument("--plan", action="store_true",
                   help="print each part of the default run, its time share and how it was sized, and exit")
    p.add_argument("--only", type=only_parts, default=(),
                   help="run only these parts (comma-separated: tests, fp8, flex, resume, speedrun), e.g. to rerun "
                        "one; the results go to a file of their own")
    p.add_argument("--steps", type=integer(1), default=TIMED_STEPS,
                   help=f"timed steps of (e), after its first {STEPS_BEFORE_CLEAN} (profiler, trace export) "
                        f"(default {TIMED_STEPS})")
    p.add_argument("--recipe", default="record", choices=["reference", "v2", "record"],
                   help="recipe of (e) (record: the GPU default)")
    p.add_argument("--warmup", type=integer(0), default=WARMUP_STEPS,
                   help="untimed compile/warm-up steps of (e) (default 3: the first compiles, the next two catch "
                        "a recompilation that optimizer state or a changed value causes, so the timed steps run "
                        "compiled kernels only; a later one is counted in recompiles_after_warmup)")
    p.add_argument("--budget-s", type=number(0, lo_open=True), default=None,
                   help=f"overall time budget in seconds (default {sum(BUDGET_S.values())}: the sum of the shares "
                        "at the top of this file, or of the --only parts'; less shrinks every share in proportion)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file for the table and every number (default bench/results/gpu_check.json; "
                        "gpu_check_only_<parts>.json with --only, gpu_check_resume_drill_cpu.json for the drill)")
    p.add_argument("--resume-drill-on-cpu", action="store_true",
                   help="run only (d) on CPU (gloo, same flags) to check its command lines without a GPU "
                        "(about a minute on 2 cores); not a GPU check")
    p.add_argument("--part", choices=["fp8", "flex"], help=argparse.SUPPRESS)  # (b) or (c) in its own process
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.part:
        return part_main(a.part)
    if a.plan:
        return print_plan()
    started = time.time()
    a.budget_s = default_budget(a.only) if a.budget_s is None else a.budget_s
    a.out = default_out(a.only, a.resume_drill_on_cpu) if a.out is None else a.out
    output_file(a.out, "--out", OUT_FIX)  # now, not after the checks' minutes of GPU time
    scale = min(1.0, a.budget_s / sum(BUDGET_S[p] for p in a.only or BUDGET_S))
    shares = {part: s * scale for part, s in BUDGET_S.items()}

    import torch
    say(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}")
    say(shares_line(shares, a.budget_s))
    details: dict = {"budget_s": a.budget_s, "shares_s": shares, "parts": {}}
    if a.resume_drill_on_cpu:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            row, details["resume"] = check_resume(a.budget_s, Path(tmp))
        wall = details["resume"]["first_wall_s"] + details["resume"].get("second_wall_s", 0)
        return finish([(row[0] + " (CPU, gloo)", row[1], f"{wall:.0f}s", row[2])], details, a.out)
    if not torch.cuda.is_available():
        say("no CUDA GPU visible (torch.cuda.is_available() is False): nothing GPU-specific can run here")
        needs = {"tests": "needs CUDA (the tests marked gpu)", "fp8": "needs a GPU of compute capability >= 8.9",
                 "flex": "needs CUDA (compiled FlexAttention's backward)", "resume": RESUME_NEEDS,
                 "speedrun": "needs CUDA GPUs"}
        rows = [(name, "skipped: no CUDA GPU", "-", needs[part]) for part, names in PART_ROWS.items()
                for name in names]
        code = finish(rows, details, a.out)
        say("skipped: every check (no CUDA GPU); run this on a machine with NVIDIA GPUs")
        return code

    n_gpus = torch.cuda.device_count()
    for i in range(n_gpus):
        props = torch.cuda.get_device_properties(i)
        say(f"GPU {i}: {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB")

    skips = {"tests": "skipped: --skip-tests" if a.skip_tests else None,
             "resume": f"not checked: {RESUME_NEEDS}" if n_gpus < 2 else None,
             "speedrun": "skipped: --quick" if a.quick else None}
    skips.update({part: "skipped: --only" for part in BUDGET_S if a.only and part not in a.only})
    running = [part for part in BUDGET_S if not skips.get(part)]
    rows: list = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        tmp = Path(tmp)
        for part in BUDGET_S:
            if skips.get(part):
                numbers = f"{n_gpus} GPU visible" if part == "resume" else ""
                rows += [(name, skips[part], "-", numbers) for name in PART_ROWS[part]]
                continue
            # the end of this part's share counted from the start; the last part runs to the end of the budget
            done = running[:running.index(part) + 1]
            end = started + (a.budget_s if part == running[-1] else sum(shares[q] for q in done))
            timeout = end - time.time()
            if timeout < MIN_S[part]:
                rows += [(name, "skipped: budget", "-", f"{max(timeout, 0):.0f}s left for it, needs >= "
                          f"{MIN_S[part]}s (--budget-s {a.budget_s:.0f})") for name in PART_ROWS[part]]
                continue
            say(f"-- {part}: up to {timeout:.0f}s")
            part_started = time.time()
            if part == "tests":
                got = check_tests(timeout, tmp, deselect=(LEFT_TO_SPEEDRUN,) if "speedrun" in running else ())
            elif part in ("fp8", "flex"):
                got = check_part(part, timeout, tmp)
            elif part == "resume":
                row, details["resume"] = check_resume(timeout, tmp)
                got = [row]
            else:
                row, details["speedrun"] = check_speedrun(n_gpus, a.steps, a.warmup, timeout, tmp, a.recipe)
                got = [row]
                for k in details["speedrun"].get("top_kernels", []):
                    say(f"  {k['ms']:9.1f} ms  {k['name']}")
            wall = time.time() - part_started
            details["parts"][part] = {"share_s": shares[part], "timeout_s": timeout, "wall_s": wall}
            rows += [(c, r, f"{wall:.0f}s of {timeout:.0f}s", n) for c, r, n in got]
    details["wall_s"] = time.time() - started
    return finish(rows, details, a.out)


if __name__ == "__main__":
    sys.exit(run_cli(main))
