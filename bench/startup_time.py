"""What start-up costs: `python train_gpt.py --help` against `python -c "import torch"` on this machine.

    python -m bench.startup_time [--repeat=5]

Each command runs --repeat times in a fresh interpreter (one thread, from the project root); the best wall time of
each is printed, then their ratio. --help pays for torch and the trainer's own modules only: checkpointing
(torch.distributed.checkpoint, DTensor), evaluation, TensorBoard and dynamo are imported by the runs that use them.
The target is a ratio of at most 1.5 (tests/test_packaging.py checks the imports themselves, not the time).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from flags import OneLineArgumentParser, UsageError, integer, run_cli

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 1.5
COMMANDS = {"import torch": [sys.executable, "-c", "import torch"],
            "train_gpt.py --help": [sys.executable, "train_gpt.py", "--help"]}


def best_seconds(command: list[str], repeat: int) -> float:
    """The shortest of `repeat` wall times of command, run from the project root on one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - started)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise UsageError(f"{' '.join(command[1:])} exited {done.returncode}: {last[0]}")
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=integer(1), default=5, help="runs of each command; the best counts (default 5)")
    opts = p.parse_args(argv)
    best = {name: best_seconds(command, opts.repeat) for name, command in COMMANDS.items()}
    for name, seconds in best.items():
        print(f"{name:<20} {seconds:6.2f} s  (best of {opts.repeat})")
    ratio = best["train_gpt.py --help"] / best["import torch"]
    print(f"ratio {ratio:.2f} (target at most {TARGET_RATIO})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
