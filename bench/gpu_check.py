"""One command to check train_gpt.py's GPU paths on a machine with NVIDIA GPUs (no network needed).

    python bench/gpu_check.py            # all checks, about 10 minutes on one H200 (compiles dominate)
    python bench/gpu_check.py --quick    # skip the timed speedrun-preset run
    python bench/gpu_check.py --recipe=v2 --skip-tests   # (c) with recipe v2 (batch stages, model techniques)

What it does, in order:
  (a) the GPU tests under tests/ (`pytest tests -m gpu`; pytest.ini registers the marker);
  (b) the FP8 head against a reference: train_gpt.fp8_matmul vs a bf16 matmul, forward and both
      gradients, as relative errors to an fp32 matmul (only with compute capability >= 8.9), and
      compiled FlexAttention (the model's FlexAttention backend with sliding_window_block_mask)
      against the SDPA dense-mask path at T=4096, forward and input gradients;
  (c) the speedrun preset (full 393,216-token batch: 8 micro-steps on 1 GPU) for a few dozen steps under
      torchrun on the visible GPUs, on synthetic FineWeb-format shards written to a temporary folder:
      ms/step after warm-up, peak memory and recompilations after warm-up from its JSON summary; the top
      15 CUDA kernels by time and communication vs compute time from a profiler trace of 3 steps.
Then it prints one summary table (check | result | numbers), with every skip and its reason, and writes
the table and every number as JSON (--out, default bench/results/gpu_check.json).

Without a CUDA GPU nothing GPU-specific can run: it says so, lists the skips and exits 0.
Exit status: 0 when nothing failed, 1 when a check failed or errored (a pytest part that runs out of
its time share is reported as "timeout", not as a failure).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 8 * 48 * 1024  # the speedrun preset's tokens per optimizer step
SEQUENCES_PER_STEP = 8  # 48K-token sequences per step: the world size must divide it
VAL_SEQ_LEN = 4 * 64 * 1024  # the speedrun preset's val_seq_len (the record's)
PROFILED_STEPS = 3  # steps of the profiler trace the kernel table comes from
FP8_SHAPE = (2048, 768, 8192)  # rows, model dim, vocabulary slice of the head check; rows >= ~1024 keep the
# mean-loss gradient times the fixed 2**19 scale inside float8_e5m2's range (57344), as in training
FLEX_SHAPE = (4096, 6, 128)  # tokens, heads, head dim of the attention check (the speedrun's heads)

Row = tuple[str, str, str]  # check, result, numbers


def say(text: str) -> None:
    print(text, flush=True)


# -----------------------------------------------------------------------------
# (a) GPU tests

def pytest_counts(output: str) -> str:
    """The final 'N passed, M skipped ...' summary of a pytest run."""
    lines = [line.strip("= ") for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return lines[-1] if lines else "no summary line"


def run_pytest(selection: list[str], timeout: float) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", *selection, "-q", "-rA", "-p", "no:cacheprovider"]
    say("$ " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return proc.returncode, proc.stdout + proc.stderr


def check_tests(timeout: float) -> list[Row]:
    """The tests marked `gpu` (pytest.ini registers the marker); they skip themselves without CUDA."""
    started = time.time()
    rc, out = run_pytest(["tests", "-m", "gpu"], timeout)
    for line in out.splitlines():
        if line.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")):
            say("  " + line)
    if rc == 5:
        return [("pytest -m gpu", "skipped: no GPU tests found", "no test carries the gpu marker")]
    if rc is None:
        return [("pytest -m gpu", "timeout", f"stopped after {timeout:.0f}s (raise --tests-timeout-s); "
                 f"so far: {pytest_counts(out)}")]
    if rc != 0:
        tail = " | ".join(out.strip().splitlines()[-3:])
        return [("pytest -m gpu", "FAIL", f"exit {rc}; {pytest_counts(out)}; {tail[:300]}")]
    return [("pytest -m gpu", "ok", f"{pytest_counts(out)} in {time.time() - started:.0f}s")]


# -----------------------------------------------------------------------------
# (b) FP8 and FlexAttention against reference paths

def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_fp8(T, torch) -> Row:
    """fp8_matmul (forward, grad_x, grad_w) and a bf16 matmul, each against fp32, under a mean
    cross-entropy loss, so the gradients have the magnitude the fixed FP8 scales were chosen for."""
    import torch.nn.functional as F
    device = torch.device("cuda")
    if not T.fp8_supported(device):
        cap = torch.cuda.get_device_capability(device)
        return ("fp8_matmul vs bf16", "skipped: no FP8", f"compute capability {cap[0]}.{cap[1]} < 8.9")
    g = torch.Generator(device="cpu").manual_seed(0)
    n, d, vocab = FP8_SHAPE
    x0 = torch.randn(n, d, generator=g)
    x0 = (x0 / x0.pow(2).mean(-1, keepdim=True).sqrt()).to(device)  # rms-normed, like the head's input
    w0 = (torch.rand(vocab, d, generator=g) * 2 - 1).mul(3 ** 0.5 * 0.5 / d ** 0.5).to(device)
    targets = torch.randint(0, vocab, (n,), generator=g).to(device)

    def run(kind: str):
        x = x0.to(torch.float32 if kind == "fp32" else torch.bfloat16, copy=True).requires_grad_()
        w = w0.clone().requires_grad_()
        if kind == "fp8":
            out = T.fp8_matmul(x, w, T.FP8_SCALES["x_scale"], T.FP8_SCALES["w_scale"])[0]
        elif kind == "bf16":
            out = F.linear(x, w.type_as(x))
        else:
            out = F.linear(x, w)
        F.cross_entropy(out.float() * 8, targets).backward()  # * 8: logits of a trained head's size
        return out.detach(), x.grad, w.grad

    ref, fp8, bf16 = run("fp32"), run("fp8"), run("bf16")
    names = ("out", "grad_x", "grad_w")
    e8 = [rel_err(a, r) for a, r in zip(fp8, ref)]
    e16 = [rel_err(a, r) for a, r in zip(bf16, ref)]
    limits = (0.1, 0.3, 0.3)  # e4m3 keeps 3 mantissa bits, e5m2 two
    finite = all(bool(torch.isfinite(t).all()) for t in fp8)
    ok = finite and all(e <= lim for e, lim in zip(e8, limits))
    numbers = "rel err vs fp32, fp8/bf16: " + ", ".join(f"{k} {a:.3g}/{b:.3g}" for k, a, b in zip(names, e8, e16))
    return ("fp8_matmul vs bf16", "ok" if ok else "FAIL", numbers + ("" if finite else " (non-finite values)"))


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
    flex_attend = torch.compile(T.FlexAttention.attend, dynamic=False)
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
    return ("FlexAttention vs SDPA, T=4096", "ok" if ok else "FAIL", numbers)


def check_kernels(torch) -> list[Row]:
    sys.path.insert(0, str(REPO))
    import train_gpt as T
    rows = []
    for check in (check_fp8, check_flex):
        try:
            rows.append(check(T, torch))
        except Exception as e:  # a kernel that cannot run is the finding: report it and go on
            name = "fp8_matmul vs bf16" if check is check_fp8 else "FlexAttention vs SDPA, T=4096"
            rows.append((name, "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"))
        finally:
            torch.cuda.empty_cache()
    return rows


# -----------------------------------------------------------------------------
# (c) the speedrun preset, timed

def write_shard(path: Path, n_tokens: int, seed: int) -> None:
    """A shard in the one format data/shardio.py defines, of random tokens split into documents of
    random length, each starting with the EOT token 50256."""
    import numpy as np
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from data import shardio
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50256, size=n_tokens, dtype=np.uint16)
    starts = np.cumsum(rng.geometric(1 / 1000, size=n_tokens // 200 + 2))
    tokens[0] = 50256
    tokens[starts[starts < n_tokens]] = 50256
    shardio.write_shard(path, tokens)


def kernel_table(trace_path: Path, top: int = 15) -> dict:
    """Total time per CUDA kernel in a Chrome trace, the top kernels, and NCCL (communication) vs the rest."""
    import json
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


def check_speedrun(n_gpus: int, steps: int, warmup: int, timeout: float, recipe: str = "reference") -> tuple[Row, dict]:
    import json
    nproc = max(w for w in (1, 2, 4, 8) if w <= n_gpus and SEQUENCES_PER_STEP % w == 0)
    name = f"speedrun preset, recipe {recipe}, {nproc} GPU(s), {steps} steps"
    val_tokens = VAL_SEQ_LEN * nproc
    found: dict = {"nproc": nproc}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        tmp = Path(tmp)
        # v2 aligns sequences to documents, which skips the tail of each: a quarter more tokens covers it
        margin = 1.25 if recipe != "reference" else 1.0
        write_shard(tmp / "synth_train_000001.bin", int((max(steps, warmup) + 1) * GLOBAL_BATCH * margin) + 1, seed=1)
        write_shard(tmp / "synth_val_000000.bin", val_tokens + 1, seed=2)
        log_dir = tmp / "logs"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / "train_gpt.py"), "--preset=speedrun", f"--recipe={recipe}", f"--num_iterations={steps}",
               "--val_every=0",
               f"--warmup_steps={warmup}", f"--val_tokens={val_tokens}", f"--profile_steps={PROFILED_STEPS}",
               f"--train_files={tmp}/synth_train_*.bin", f"--val_files={tmp}/synth_val_*.bin",
               f"--log_dir={log_dir}", "--run_id=gpu_check"]
        say("$ " + " ".join(cmd))
        out_path = tmp / "stdout.txt"
        started = time.time()
        with open(out_path, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")})
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = None
        wall = time.time() - started
        text = out_path.read_text(errors="replace")
        summary_path = log_dir / "gpu_check.json"
        if summary_path.is_file():  # the trainer's declared result file, not its log lines
            summary = json.loads(summary_path.read_text())
            found.update({k: summary.get(k) for k in ("step_avg_ms", "peak_memory_mib", "final_val_loss",
                                                       "recompiles_after_warmup", "runtime", "tokens",
                                                       "train_time_ms")})
        trace = log_dir / "gpu_check_rank0.trace.json"
        if trace.is_file():
            found.update(kernel_table(trace))
    found["wall_s"] = wall
    parts = []
    if found.get("step_avg_ms") and found.get("train_time_ms"):  # v2's batch stages: tokens vary per step
        parts.append(f"{found['step_avg_ms']:.1f} ms/step ({found['tokens'] / found['train_time_ms'] * 1000:,.0f} "
                     "tokens/s)")
    if found.get("peak_memory_mib") is not None:
        parts.append(f"peak memory {found['peak_memory_mib']:.0f} MiB allocated (rank 0)")
    if "recompiles_after_warmup" in found:
        parts.append(f"recompiles after warm-up: {found['recompiles_after_warmup']}")
    if "kernel_ms" in found:
        parts.append(f"{PROFILED_STEPS} profiled steps: kernels {found['kernel_ms']:.0f} ms, of which "
                     f"communication {found['communication_ms']:.0f} ms, compute {found['compute_ms']:.0f} ms")
    parts.append(f"wall {wall:.0f}s incl. compile")
    if rc is None:
        return (name, "FAIL", f"timed out after {timeout:.0f}s; " + "; ".join(parts)), found
    if rc != 0 or not found.get("step_avg_ms"):
        tail = " | ".join(line for line in text.strip().splitlines()[-4:])
        return (name, "FAIL", f"exit {rc}: {tail[:400]}"), found
    result = "ok" if found.get("recompiles_after_warmup") == 0 else "FAIL"
    return (name, result, "; ".join(parts)), found


# -----------------------------------------------------------------------------

def write_json(path: Path, rows: list[Row], details: dict) -> None:
    import json
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"table": [dict(check=c, result=r, numbers=n) for c, r, n in rows],
                                "speedrun": details}, indent=1))
    say(f"wrote {path}")


def print_table(rows: list[Row]) -> None:
    widths = [max(len(r[i]) for r in rows + [("check", "result", "numbers")]) for i in range(2)]
    say("")
    say(f"{'check':<{widths[0]}} | {'result':<{widths[1]}} | numbers")
    say(f"{'-' * widths[0]}-+-{'-' * widths[1]}-+-{'-' * 7}")
    for check, result, numbers in rows:
        say(f"{check:<{widths[0]}} | {result:<{widths[1]}} | {numbers}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="skip (c), the timed speedrun-preset run")
    p.add_argument("--skip-tests", action="store_true", help="skip (a), the GPU pytest tests")
    p.add_argument("--steps", type=int, default=40, help="timed steps of the speedrun preset (default 40)")
    p.add_argument("--recipe", default="reference", choices=["reference", "v2"], help="recipe of (c) (reference)")
    p.add_argument("--warmup", type=int, default=10, help="untimed compile/warm-up steps (default 10)")
    p.add_argument("--budget-s", type=float, default=570, help="overall time budget in seconds (default 570)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_check.json",
                   help="JSON file for the table and every number (default bench/results/gpu_check.json)")
    p.add_argument("--tests-timeout-s", type=float, default=0,
                   help="time limit of the pytest part (default: 35%% of the budget, 70%% with --quick)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    deadline = time.time() + a.budget_s

    import torch
    say(f"python {platform.python_version()}, torch {torch.__version__}, CUDA build {torch.version.cuda}")
    rows: list[Row] = []
    details: dict = {}
    names = ("pytest (GPU tests)", "fp8_matmul vs bf16", "FlexAttention vs SDPA, T=4096", "speedrun preset timing")
    if not torch.cuda.is_available():
        reason = "skipped: no CUDA GPU"
        say("no CUDA GPU visible (torch.cuda.is_available() is False): nothing GPU-specific can run here")
        print_table([(n, reason, "") for n in names])
        write_json(a.out, [(n, reason, "") for n in names], details)
        say("skipped: every check (no CUDA GPU); run this on a machine with NVIDIA GPUs")
        return 0

    n_gpus = torch.cuda.device_count()
    for i in range(n_gpus):
        props = torch.cuda.get_device_properties(i)
        say(f"GPU {i}: {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB")

    if a.skip_tests:
        rows.append((names[0], "skipped: --skip-tests", ""))
    else:
        cap = a.tests_timeout_s or (deadline - time.time()) * (0.35 if not a.quick else 0.7)
        rows += check_tests(cap)
    rows += check_kernels(torch)
    if a.quick:
        rows.append((names[3], "skipped: --quick", ""))
    else:
        remaining = deadline - time.time()
        if remaining < 120:
            rows.append((names[3], "skipped: out of time", f"{remaining:.0f}s of --budget-s left, need >= 120"))
        else:
            row, details = check_speedrun(n_gpus, a.steps, a.warmup, remaining, a.recipe)
            rows.append(row)
            for k in details.get("top_kernels", []):
                say(f"  {k['ms']:9.1f} ms  {k['name']}")
    print_table(rows)
    write_json(a.out, rows, details)
    skipped = [r for r in rows if r[1].startswith("skipped")]
    if skipped:
        say("skipped: " + "; ".join(f"{r[0]} ({r[1].removeprefix('skipped: ')})" for r in skipped))
    return 1 if any(r[1] in ("FAIL", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
