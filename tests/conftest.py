"""Shared helpers for tests that run train_gpt.py end to end (tiny shapes, the bundled sample), the runs that
many tests only read (made once per session), and the one way a test that needs something optional skips."""
import concurrent.futures
import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from records.read_records import parse_progress_line  # the run log's one reader

REPO = Path(__file__).resolve().parents[1]
# pyproject.toml's pythonpath for pytest (the project root, tests/), for the scripts tests start in subprocesses:
# rank_driver.py and the tests' own drivers import the trainer and rank_driver from there.
IMPORT_ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}

# The offline GPT-2 vocabulary: where .ci/run points TIKTOKEN_CACHE_DIR, else shared/ beside the checkout.
TIKTOKEN_CACHE = Path(os.environ.get("TIKTOKEN_CACHE_DIR") or REPO.parent / "shared" / "data" / "gpt2" / "tiktoken_cache")
TOKENIZER_ENV = {"TIKTOKEN_CACHE_DIR": str(TIKTOKEN_CACHE)}
NO_GPT2_VOCAB = f"tiktoken's gpt2 cache not found at {TIKTOKEN_CACHE}; the GPT-2 encoding cannot be loaded offline"
needs_gpt2_vocab = pytest.mark.skipif(not TIKTOKEN_CACHE.is_dir(), reason=NO_GPT2_VOCAB)  # for tests


def skip_without_gpt2_vocab():
    """needs_gpt2_vocab for a fixture (marks do not apply to fixtures)."""
    if not TIKTOKEN_CACHE.is_dir():
        pytest.skip(NO_GPT2_VOCAB)


def needs_cuda(what, available=torch.cuda.is_available()):
    """Marks a GPU-only test: selected by `pytest -m gpu`, skipped with a visible reason without one."""
    def mark(test):
        return pytest.mark.gpu(pytest.mark.skipif(not available, reason=f"needs a CUDA GPU: {what}")(test))
    return mark

# A model small enough that a step takes well under a second on 2 cores, on the bundled sample.
TINY = ["--preset=cpu", "--n_layer=2", "--model_dim=64", "--n_head=2", "--head_dim=32", "--seq_len=256",
        "--batch_tokens=512", "--val_seq_len=256", "--val_tokens=512", "--num_iterations=4", "--val_every=2",
        "--warmup_steps=0", "--log_train_loss=true", "--compile=off"]


# torchrun's worker in multi-rank tests: train_gpt.main(), then a check that nothing distributed outlived it.
RANK_DRIVER = REPO / "tests" / "rank_driver.py"


def run_trainer(args, log_dir, nproc=None, driver=None, timeout=300, env=None):
    """Runs train_gpt.py (or a driver script) in a subprocess; under torchrun when nproc is given, each rank
    through rank_driver.py unless another driver is given."""
    script = str(driver or (REPO / "train_gpt.py" if nproc is None else RANK_DRIVER))
    cmd = [sys.executable, script] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **IMPORT_ENV, **(env or {})}
    return subprocess.run(cmd + list(args) + [f"--log_dir={log_dir}"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def tool(name, *args, env=None):
    """Runs `python -m tools.<name>` with these arguments in a subprocess (one thread, as run_trainer does)."""
    return subprocess.run([sys.executable, "-m", f"tools.{name}", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def tool_in_process(name, *args, env=None):
    """tools/<name>.py in this process as `python -m tools.<name> args` runs it (run_cli(main): its exit status,
    its one error line), with env added to the environment: what tool() returns, without an interpreter and a
    torch import to pay for. Not for a tokenizer that must fail to load: tiktoken keeps what it loaded."""
    import importlib
    from unittest import mock
    from flags import run_cli
    program = importlib.import_module(f"tools.{name}")
    argv = [str(arg) for arg in args]
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as tool()'s OMP_NUM_THREADS=1
    try:
        with mock.patch.dict(os.environ, env or {}), mock.patch.object(sys, "argv", [str(REPO / "tools" / f"{name}.py"),
                                                                                    *argv]), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = run_cli(lambda: program.main(argv))
    finally:
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


def run_main(args, log_dir):
    """train_gpt.main(args) in this process, for runs refused or ended before training and one-rank runs that need
    no process of their own: no interpreter and torch import to pay for. Returns what run_trainer returns (exit
    status, stdout, stderr); restores the signal handlers that main() installs. Not for a run whose log must embed
    only the siblings train_gpt.py imports itself (it embeds every one this process has imported), nor for one
    whose files must be closed when it ends (a failed run's may stay open until garbage collection)."""
    import train_gpt as T
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    out, err = io.StringIO(), io.StringIO()
    argv = list(args) + [f"--log_dir={log_dir}"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as run_trainer's OMP_NUM_THREADS=1: the same kernels, the same float order
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = T.main(argv)
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


def side_by_side(here, *elsewhere):
    """Independent runs at once, the suite's 2 cores each busy: here (a call of run_main) in this thread while each
    of elsewhere (calls of run_trainer) waits on its processes in a thread of its own. Their results, in order."""
    with concurrent.futures.ThreadPoolExecutor(len(elsewhere)) as pool:
        launched = [pool.submit(run) for run in elsewhere]
        return [here()] + [future.result() for future in launched]


def start_two_ranks_until_step_3(args, log):
    """Launches a 2-rank torchrun of train_gpt.py, waits until its log shows step 3 and returns the
    launcher process and its two worker pids (to signal one rank)."""
    import time
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(RANK_DRIVER)] + list(args)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **IMPORT_ENV})
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and "step:3/" in log.read_text()):
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    return proc, workers


def progress_field(text, name):
    """{step: value} of one field of a run log's step lines, read with the trainer's own parser."""
    lines = (parse_progress_line(line) for line in text.splitlines() if line.startswith("step:"))
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


# ---------------------------------------------------------------- runs that many tests read (never write)

def read_only_run(tmp_path_factory, name, args, nproc=None):
    log_dir = tmp_path_factory.mktemp(name)
    result = run_trainer(args + [f"--run_id={name}"], log_dir, nproc=nproc)
    assert result.returncode == 0, result.stderr[-2000:]
    return log_dir


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The folder of one TINY run, run id "tiny": 4 steps, validation at 0, 2 and 4, checkpoints at steps 2
    and 4 (tiny/step_000002, tiny/step_000004), its log tiny.txt and summary tiny.json. Copy before changing."""
    return read_only_run(tmp_path_factory, "tiny", TINY + ["--checkpoint_every=2", "--checkpoint_final=true"])


SIX = TINY + ["--num_iterations=6", "--val_every=0"]


@pytest.fixture(scope="session")
def six_steps_one_rank(tmp_path_factory):
    """SIX on one rank, run id "whole", with its final checkpoint whole/step_000006."""
    return read_only_run(tmp_path_factory, "whole", SIX + ["--checkpoint_final=true"])


@pytest.fixture(scope="session")
def six_steps_two_ranks(tmp_path_factory):
    """SIX on two ranks, run id "whole", with its final checkpoint whole/step_000006."""
    return read_only_run(tmp_path_factory, "whole", SIX + ["--checkpoint_final=true"], nproc=2)
