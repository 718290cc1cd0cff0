"""The trainer's process, beside train_gpt.py: the torch it runs under (checked at start-up, and the calls renamed
across the supported releases resolved once), the signals that stop it, a lost peer, and the end of its process
group on every way out.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import traceback
import typing
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flags import UsageError


# -----------------------------------------------------------------------------
# Supported torch releases: every difference between them is handled here

SUPPORTED_TORCH = ((2, 10), (2, 13))  # oldest and newest minors docs/supported-torch.md says were checked


PINNED_TORCH = "2.13.0"  # requirements.txt's pin, under which the records reproduce


MIN_PYTHON = (3, 11)  # hashlib.file_digest (the checkpoints' file records)


@dataclass(frozen=True)
class TorchAPI:
    """The torch calls whose names differ across SUPPORTED_TORCH, resolved once at import. Every other call this file
    makes has the same name, signature and behaviour from 2.10 to 2.13 (compared release by release)."""
    all_gather_flat: typing.Callable  # 2.13 renamed dist.all_gather_into_tensor (now deprecated) all_gather_single
    reduce_scatter_flat: typing.Callable  # and dist.reduce_scatter_tensor reduce_scatter_single


def torch_api() -> TorchAPI:
    """The new names where this torch has them, else the old ones (never read first: a later torch may drop them)."""
    return TorchAPI(all_gather_flat=getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
                    reduce_scatter_flat=getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)


TORCH_API = torch_api()


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version: '2.11.0+cu130' and '2.14.0.dev20260101' alike."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def tested_range() -> str:
    (a, b), (c, d) = SUPPORTED_TORCH
    return f"{a}.{b} to {c}.{d}"


def torch_release_problem(version: str, python: tuple[int, int]) -> str:
    """Why this torch or Python cannot run train_gpt.py ('' when they can): a torch older than SUPPORTED_TORCH misses
    or names differently what this file calls, and fails late, inside a compiled graph or at the first checkpoint."""
    if python < MIN_PYTHON:
        return (f"Python {python[0]}.{python[1]} is older than train_gpt.py needs "
                f"(>= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}): use Python 3.11 or newer (the Dockerfile's image has 3.12)")
    if torch_release(version) < SUPPORTED_TORCH[0]:
        return (f"torch {version} is older than the releases train_gpt.py supports ({tested_range()}): "
                f"pip install torch=={PINNED_TORCH} (or any release from {tested_range()}; docs/supported-torch.md)")
    return ""


def newer_torch_warning(version: str) -> str:
    """A run log line for a torch newer than SUPPORTED_TORCH, which runs: torch keeps a renamed call's old name for
    releases (2.13 did), and the speedrun's users run nightlies; refusing them would stop runs that work."""
    if torch_release(version) <= SUPPORTED_TORCH[1]:
        return ""
    return (f"warning: torch {version} is newer than the releases train_gpt.py is tested under ({tested_range()}); "
            f"if start-up or compilation fails, pip install torch=={PINNED_TORCH}")


def nvidia_gpus() -> int:
    """The GPUs the NVIDIA driver lists (nvidia-smi, as run.sh counts them); 0 without its tools."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len(smi.stdout.splitlines()) if smi.returncode == 0 else 0


def unusable_gpus_problem(preset: object) -> str:
    """Why a GPU node's torch cannot train here ('' when it can): a CPU-only wheel, or one built for a newer CUDA
    than the driver, would otherwise train on the CPU after torch's multi-line warning. --preset=cpu asks for that."""
    with warnings.catch_warnings(record=True) as caught:  # "CUDA initialization: ... driver ... too old": said below
        warnings.simplefilter("always")
        if torch.cuda.is_available() or preset == "cpu":
            return ""
    gpus = nvidia_gpus()
    if not gpus:
        return ""
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    said = next((str(w.message).strip().splitlines()[0][:200] for w in caught if "CUDA" in str(w.message)), "")
    return (f"nvidia-smi lists {gpus} GPU(s) but torch {torch.__version__} ({build}) cannot use them"
            + (f" ({said})" if said else "") + ": install a torch wheel built for this driver's CUDA version "
            "(nvidia-smi's header names it; docs/supported-torch.md), or pass --preset=cpu to train on the CPU")


def check_torch_install(preset: object) -> None:
    """Start-up's first check, before anything touches a device (preset: the command line's --preset, if any)."""
    problem = torch_release_problem(torch.__version__, sys.version_info[:2]) or unusable_gpus_problem(preset)
    if problem:
        raise UsageError(problem)


def device_notes(fp8_asked: bool, rt, fp8_mlp_asked: bool = False) -> list[str]:
    """Run log lines on what this torch and device change (rt: train_gpt's Runtime): a torch newer than the tested
    range; a GPU without FP8 matmuls, whose LM head (and MLPs) run in bf16 although --fp8_head (--fp8_mlp) asked
    for FP8."""
    notes = [newer_torch_warning(torch.__version__)]
    for asked, used, what in [(fp8_asked, rt.fp8_head, "head"), (fp8_mlp_asked, rt.fp8_mlp, "mlp")]:
        if asked and rt.is_cuda and not used:
            major, minor = torch.cuda.get_device_capability(rt.device)
            part = "the LM head runs" if what == "head" else "the MLPs train"
            notes.append(f"fp8 {what}: off: {torch.cuda.get_device_name(rt.device)} (compute capability "
                         f"{major}.{minor}) has no FP8 matmuls (needs >= 8.9, as H100, H200, L40S); {part} in bf16")
    return [note for note in notes if note]


# -----------------------------------------------------------------------------
# Signals, a lost peer, and the end of the process group

class Interrupted(BaseException):
    """A signal before the training loop: nothing to save yet. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way (compilers, loaders) swallows or rewraps it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopSignal:
    """SIGTERM/SIGINT. Before the training loop the first one ends the run at once (Interrupted); in the
    loop it asks every rank to stop after the current step. A second signal exits at once."""

    def __init__(self):
        self.signum: int | None = None
        self.deferred = False
        self._pending = None  # the previous step's agreement: (waiter, result)

    def install(self) -> "StopSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def defer(self) -> "StopSignal":
        """From here on, a signal is acted upon at a step boundary, where a checkpoint can be written."""
        self.deferred = True
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        if not self.deferred:
            raise Interrupted(signum)

    def settle(self) -> int | None:
        """Waits for the last agreement started, lets go of it, and returns its signal (None: no signal, or
        none pending). Holding it past the run is not safe: a gloo work still referenced when the interpreter
        exits is freed after Python is gone (pytorch/pytorch#179291), one way a finished rank can abort at exit."""
        if self._pending is None:
            return None
        waiter, result = self._pending
        self._pending = None
        waiter.synchronize() if isinstance(waiter, torch.cuda.Event) else waiter.wait()
        return int(result.item()) or None  # a host tensor: no device sync

    def agreed(self, rt) -> int | None:  # rt: train_gpt's Place
        """The signal all ranks act on at this step: the largest any rank had one call earlier.

        No host sync per step: each call starts an asynchronous MAX all-reduce of this rank's signal
        and reads the one the previous call started, which finished long ago (on CUDA, waiting for it
        only keeps the host from running more than about a step ahead of the GPU). Every rank reads the
        same value at the same step, so all of them stop together, one step after the signal.
        """
        if rt.world_size == 1:
            return self.signum
        agreed = self.settle()
        flag = torch.full((1,), self.signum or 0, dtype=torch.int32, device=rt.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if rt.is_cuda:
            work.wait()  # the stream waits for the reduce, the host does not
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending = (done, host)
        else:
            self._pending = (work, flag)
        return agreed


# gloo words a dead peer differently per operation (a reduce-scatter wait says "Application timeout
# caused pair closure").
COLLECTIVE_FAILURE_MARKERS = ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out",
                              "ProcessGroup", "pair closure")


def is_collective_failure(e: Exception) -> bool:
    """A peer rank died or stopped answering (gloo and NCCL report it as RuntimeError or DistError)."""
    return isinstance(e, dist.DistError) or (
        dist.is_initialized() and isinstance(e, RuntimeError) and any(m in str(e) for m in COLLECTIVE_FAILURE_MARKERS))


def end_distributed(stop: StopSignal) -> None:
    """The one way a run lets go of its process group, on every way out: the pending stop-signal agreement
    waited for and dropped, objects that still hold the group (meshes, works, in reference cycles) collected,
    then the group destroyed, which joins gloo's threads. A gloo thread alive when the interpreter exits can
    take the GIL inside a C++ destructor and abort a finished rank (pytorch/pytorch#190489)."""
    with contextlib.suppress(RuntimeError, dist.DistError):  # a failed run's error was reported already
        stop.settle()
    if dist.is_initialized():
        failure = sys.exc_info()[1]  # an error on its way out: its traceback's frames may hold a mesh or work
        if failure is not None:
            traceback.clear_frames(failure.__traceback__)
        gc.collect()
        dist.destroy_process_group()


# glibc's mallopt parameters and what a CPU run sets them to, unless its MALLOC_<name>_ variable is set: blocks
# up to 256 MiB (a 512-row chunk of fp32 logits is 103 MB) from the heap, not mmap; freed heap kept up to 1 GiB;
# the heap grown 256 MiB at a time.
HOST_MALLOC = {"MMAP_THRESHOLD": (-3, 256 << 20), "TRIM_THRESHOLD": (-1, 1 << 30), "TOP_PAD": (-2, 256 << 20)}


def keep_freed_host_memory() -> str:
    """Keeps freed memory in glibc's heap for reuse. Every micro-step frees and allocates the same activation
    buffers, and by default glibc hands blocks over 128 KiB back to the kernel, which zero-fills their pages
    again on the next touch: a third of a cpu-preset step (bench/README.md). Math unchanged. Returns what
    was set, for the run log; "default" where there is no glibc."""
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "default"
    done = [f"{name.lower()}={value}" for name, (param, value) in HOST_MALLOC.items()
            if f"MALLOC_{name}_" not in os.environ and mallopt(param, value) == 1]
    return "glibc " + ",".join(done) if done else "default"
