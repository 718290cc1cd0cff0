"""How often a finished multi-rank run aborts at exit: N tiny 2-rank CPU runs that write checkpoints, each
launched pinned to one core so that gloo's worker threads are starved and late, counting the runs whose
ranks were killed at exit (a signal exit status, or "terminate called" in the output).

    python -m bench.exit_stress --runs=200                 # 2 runs at a time, one pinned to each of cores 0, 1
    python -m bench.exit_stress --runs=50 --jobs=1 --cores=0

The abort it counts: a gloo thread still alive when the interpreter finalizes can take the GIL inside a C++
destructor, and the unwind through a noexcept destructor calls std::terminate (pytorch/pytorch#190489).
It hit about 1 finished 2-rank run in 36 under load. Each run here trains 4 steps of the test suite's tiny
model on the bundled sample and saves at steps 2 and 4 (a device mesh over the process group each time).
Not a test: it takes minutes, and what it measures is a rate. Prints one line per failed run and a summary;
exits 1 if any run aborted or failed otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flags import OneLineArgumentParser, comma_list, integer, run_cli

REPO = Path(__file__).resolve().parents[1]

TINY_RUN = ["--preset=cpu", "--n_layer=2", "--model_dim=64", "--n_head=2", "--head_dim=32", "--seq_len=256",
            "--batch_tokens=512", "--val_seq_len=256", "--val_tokens=512", "--num_iterations=4", "--val_every=0",
            "--warmup_steps=0", "--compile=off", "--checkpoint_every=2", "--checkpoint_keep=1",
            "--checkpoint_final=true"]
ABORT_MARKERS = ("terminate called", "Aborted", "SIGABRT", "Signal 6")


def one_run(index: int, core: int, scratch: Path, timeout: int) -> tuple[str, str]:
    """('ok' | 'abort' | 'failed', the output's tail) of one 2-rank run pinned to core."""
    log_dir = scratch / f"run{index}"
    cmd = ["taskset", "-c", str(core), sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", str(REPO / "train_gpt.py"), *TINY_RUN, f"--log_dir={log_dir}"]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired as e:
        return "failed", f"timed out after {timeout}s: {(e.stderr or b'')[-500:]!r}"
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    output = done.stdout + done.stderr
    if any(marker in output for marker in ABORT_MARKERS) or done.returncode < 0:
        return "abort", output[-800:]
    return ("ok" if done.returncode == 0 else "failed"), output[-800:]


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=integer(1), default=200, help="tiny 2-rank runs in all (default 200)")
    parser.add_argument("--jobs", type=integer(1), default=2, help="runs at a time, each pinned to its own core (default 2)")
    parser.add_argument("--cores", type=comma_list(integer(0), items="core numbers"), default="0,1",
                        help="the cores to pin runs to, comma-separated (default 0,1)")
    parser.add_argument("--timeout", type=integer(1), default=300, help="seconds before a run counts as failed")
    args = parser.parse_args(argv)
    if shutil.which("taskset") is None:
        parser.error("taskset (util-linux) is needed to pin the runs to one core")
    cores = args.cores
    counts = {"ok": 0, "abort": 0, "failed": 0}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="exit_stress_") as scratch, \
            ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(one_run, i, cores[i % min(args.jobs, len(cores))], Path(scratch), args.timeout)
                   for i in range(args.runs)]
        for i, future in enumerate(futures):
            outcome, tail = future.result()
            counts[outcome] += 1
            if outcome != "ok":
                print(f"run {i}: {outcome}\n{tail}\n", flush=True)
    print(f"exit_stress: {counts['abort']}/{args.runs} aborted at exit, {counts['failed']} failed otherwise, "
          f"{counts['ok']} clean; {time.time() - started:.0f}s, {args.jobs} at a time on cores {args.cores}; "
          f"torch {__import__('torch').__version__}", flush=True)
    return 0 if counts["ok"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
