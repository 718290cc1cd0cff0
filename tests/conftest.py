"""Shared helpers for tests that run train_gpt.py end to end (tiny shapes, the bundled sample)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# A model small enough that a step takes well under a second on 2 cores, on the bundled sample.
TINY = ["--preset=cpu", "--n_layer=2", "--model_dim=64", "--n_head=2", "--head_dim=32", "--seq_len=256",
        "--batch_tokens=512", "--val_seq_len=256", "--val_tokens=512", "--num_iterations=4", "--val_every=2",
        "--warmup_steps=0", "--log_train_loss=true", "--compile=off"]


def run_trainer(args, log_dir, nproc=None, driver=None, timeout=300, env=None):
    """Runs train_gpt.py (or a driver script) in a subprocess, under torchrun when nproc is given."""
    script = str(driver or REPO / "train_gpt.py")
    cmd = [sys.executable, script] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd + list(args) + [f"--log_dir={log_dir}"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def start_two_ranks_until_step_3(args, log):
    """Launches a 2-rank torchrun of train_gpt.py, waits until its log shows step 3 and returns the
    launcher process and its two worker pids (to signal one rank)."""
    import time
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "train_gpt.py")] + list(args)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and "step:3/" in log.read_text()):
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    return proc, workers


def progress_field(text, name):
    """{step: value} of one field of a run log's step lines, read with the trainer's own parser."""
    import train_gpt as T
    lines = (T.parse_progress_line(line) for line in text.splitlines() if line.startswith("step:"))
    return {line.step: line.fields[name] for line in lines if line is not None and name in line.fields}


def train_losses(text):
    return progress_field(text, "train_loss")


def val_losses(text):
    return progress_field(text, "val_loss")


def only_log(log_dir):
    logs = sorted(Path(log_dir).glob("*.txt"))
    assert len(logs) == 1, logs
    return logs[0]


@pytest.fixture
def tiny():
    return list(TINY)
