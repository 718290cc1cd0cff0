"""The run's records, beside train_gpt.py: the run log (rank 0's text file, whose step lines the public speedrun's
readers parse), the JSON summary, the clock and energy counters that time the training, and what else a run
reports about itself (environment, peak memory, recompilations, a profiler trace).

train_gpt.py writes through these; records/read_records.py is the one reader of what they write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from flags import RunFailed, UsageError

REPO_DIR = Path(__file__).resolve().parent


def _named_for_the_run(ending: str) -> property:
    """A RunFolder path: the run id with this ending, in the log folder."""
    return property(lambda folder: folder.log_dir / f"{folder.run_id}{ending}")


@dataclass(frozen=True)
class RunFolder:
    """Where a run's files live under --log_dir: <run_id>.txt (its log), <run_id>.json (its summary),
    <run_id>.metrics.jsonl (a line per step and validation), <run_id>.md (its report card), <run_id>.tensorboard
    (with --tensorboard) and the folder <run_id>/ (its checkpoints)."""
    log_dir: Path
    run_id: str

    log = _named_for_the_run(".txt")
    summary = _named_for_the_run(".json")
    metrics = _named_for_the_run(".metrics.jsonl")
    report = _named_for_the_run(".md")
    tensorboard = _named_for_the_run(".tensorboard")
    checkpoints = _named_for_the_run("")


def end_torn_line(file) -> None:
    """The rule for appending to a file a crash may have cut short (the run log, the metrics file): a last line
    without its newline is ended first, so the torn line stays a line of its own and the new ones start clean."""
    if file.tell() == 0:
        return
    with open(file.name, "rb") as tail:
        tail.seek(-1, os.SEEK_END)
        torn = tail.read(1) != b"\n"
    if torn:
        file.write("\n")
        file.flush()


class RunLog:
    """Rank 0's human-readable log: every line is flushed, so a crash never loses what was written. Whoever holds
    its lock (checkpoints.lock_run_log) ends a line a crash tore (end_torn_line) before writing."""

    def __init__(self, path: Path | None):
        self.path = path
        self.file = None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.file = open(path, "a", encoding="utf-8")
            except OSError as e:
                raise UsageError(f"cannot open run log {path}: {e.strerror}; pick a writable --log_dir") from None

    def write(self, line: str, echo: bool = True) -> None:
        if self.path is None:
            return
        if echo:
            tqdm.write(line, file=sys.stdout)  # below a progress bar on a terminal, never through it
            sys.stdout.flush()
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except OSError as e:
            raise RunFailed(f"cannot write run log {self.path}: {e.strerror}; free disk space and resume "
                             "from the last checkpoint") from None


# The progress lines ("step:S/N name:value ..." and "final: name:value ...") are the run log's data:
# progress_line() is the one writer, records/read_records.py's parse_progress_line() the one reader (bench/ and
# tests use it too). A field's number is written with these decimals and unit; the public speedrun's logs use
# the same "step:S/N val_loss:... train_time:...ms step_avg:...ms" shape.
PROGRESS_FIELDS = {  # name: (decimals, unit)
    "val_loss": (4, ""), "train_loss": (4, ""), "train_time": (0, "ms"), "step_avg": (2, "ms"),
    "energy": (0, "J"), "hellaswag_acc": (4, ""), "hellaswag_acc_norm": (4, ""), "hellaswag_examples": (0, ""),
    "hellaswag_time": (0, "ms"), "steps": (0, ""), "tokens": (0, ""), "total_train_time": (0, "ms"),
    "resumes": (0, ""), "target_val_loss": (4, ""),
}


def progress_line(step: int | None, total: int, head: str = "final:", **values: float) -> str:
    """'step:S/N f:v ...' for a step, or, when step is None, 'final: f:v ...' (or another head: 'target:' marks
    where the run first reached its target loss); fields in the order given."""
    head = head if step is None else f"step:{step}/{total}"
    parts = []
    for name, value in values.items():
        decimals, unit = PROGRESS_FIELDS[name]
        parts.append(f"{name}:{value:.{decimals}f}{unit}")
    return " ".join([head, *parts])


class Clock:
    """Training time and energy. Both run only while the model trains: every pause (validation,
    HellaSwag, a checkpoint) first waits for the device, so each stretch is timed the same way."""

    def __init__(self, rt, energy: "EnergyMeter"):  # rt: train_gpt's Runtime (synchronize)
        self.rt, self.energy = rt, energy
        self.ms, self.started = 0.0, None

    def start(self) -> None:
        self.rt.synchronize()
        self.started = time.perf_counter()
        self.energy.start()

    def pause(self) -> None:
        self.rt.synchronize()
        self.ms += 1000 * (time.perf_counter() - self.started)
        self.started = None
        self.energy.stop()

    @contextlib.contextmanager
    def paused(self):
        self.pause()
        try:
            yield
        finally:
            self.start()

    def elapsed_ms(self) -> float:
        """Training milliseconds so far (without a device sync: the last step may still be running)."""
        return self.ms + (1000 * (time.perf_counter() - self.started) if self.started is not None else 0.0)


def environment_lines(rt) -> list[str]:  # rt: train_gpt's Runtime
    lines = [f"python: {platform.python_version()}", f"torch: {torch.__version__}",
             f"cuda: {torch.version.cuda if rt.is_cuda else 'n/a'}", f"device: {device_name(rt)}",
             f"world_size: {rt.world_size}",
             f"attention: {rt.attention} fp8_head: {rt.fp8_head} compile: {rt.compile} dtype: {rt.dtype} "
             f"chunked_loss: {rt.chunked_loss} compile_attention: {rt.compile_attention}",
             f"PYTORCH_CUDA_ALLOC_CONF: {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')} host_malloc: {rt.host_malloc}"]
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            lines += ["nvidia-smi:", smi.stdout.rstrip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return lines


def device_name(rt) -> str:  # rt: train_gpt's Place
    if rt.is_cuda:
        return torch.cuda.get_device_name(rt.device)
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def git_commit() -> str | None:
    """The checkout's commit, None outside a git checkout."""
    return git("rev-parse", "HEAD")


def git_dirty() -> bool | None:
    """Whether the checkout has changes of tracked files not in its commit (None outside a git checkout)."""
    out = git("status", "--porcelain", "--untracked-files=no")
    return None if out is None else out != ""


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


class NvmlCounter:
    """NVIDIA's total-energy counter of one GPU (millijoules since driver load), found by PCI bus id: NVML
    numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, so torch's index can name another GPU."""
    wrap_joules = None

    def __init__(self, pci_bus_id: str, nvml=None):
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py, an optional extra
        nvml.nvmlInit()
        self.nvml, self.handle = nvml, nvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)

    def read_joules(self) -> list[float]:
        return [self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0]


def nvml_bus_id(props) -> str:
    """NVML's domain:bus:device.function for torch.cuda.get_device_properties(device)."""
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


class RaplCounters:
    """Intel RAPL package counters under /sys/class/powercap (microjoules, wrapping at max_energy_range_uj)."""

    def __init__(self, root: Path):
        self.domains = sorted(d for d in root.glob("intel-rapl:*") if d.name.count(":") == 1)
        if not self.domains:
            raise OSError(f"no RAPL package domains under {root}")
        self.wrap_joules = [int((d / "max_energy_range_uj").read_text()) / 1e6 for d in self.domains]
        self.read_joules()

    def read_joules(self) -> list[float]:
        return [int((d / "energy_uj").read_text()) / 1e6 for d in self.domains]


# What a run spends energy on, counted apart: the timed training, the compile and warm-up before it, and the
# validation (and HellaSwag) pauses inside it.
ENERGY_PHASES = ("train", "warmup", "validation")


class EnergyMeter:
    """Joules this rank's counters add up in each phase (ENERGY_PHASES): start(phase) ... stop().

    On CPU only local rank 0 reads RAPL: the package counters cover every process on the node.
    """

    def __init__(self, counters, reason: str = ""):
        self.counters, self.reason = counters, reason
        self.joules = dict.fromkeys(ENERGY_PHASES, 0.0)
        self.last, self.phase = None, None

    @staticmethod
    def open(rt, powercap_root: Path = Path("/sys/class/powercap"), nvml=None) -> "EnergyMeter":  # rt: a Place
        try:
            if rt.is_cuda:
                return EnergyMeter(NvmlCounter(nvml_bus_id(torch.cuda.get_device_properties(rt.device)), nvml))
            if rt.local_rank != 0:
                return EnergyMeter(None, "counted by local rank 0")
            return EnergyMeter(RaplCounters(powercap_root))
        except ImportError:
            return EnergyMeter(None, "nvidia-ml-py is not installed (pip install -r requirements-extras.txt)")
        except Exception as e:  # NVML and sysfs fail in many ways (no permission, no driver support)
            return EnergyMeter(None, f"energy counters unreadable: {e}")

    def start(self, phase: str = "train") -> None:
        if self.counters is not None:
            self.last, self.phase = self.counters.read_joules(), phase

    def stop(self) -> None:
        if self.counters is None or self.last is None:
            return
        self.joules[self.phase] += self._since_start()
        self.last, self.phase = None, None

    def _since_start(self) -> float:
        now = self.counters.read_joules()
        wraps = self.counters.wrap_joules or [None] * len(now)
        deltas = (after - before for before, after in zip(self.last, now))
        return sum(delta + wrap if delta < 0 and wrap else delta for delta, wrap in zip(deltas, wraps))

    @contextlib.contextmanager
    def measuring(self, phase: str):
        """Counts the block's joules into phase."""
        self.start(phase)
        try:
            yield
        finally:
            self.stop()

    def local_joules(self, phase: str = "train") -> float | None:
        """This rank's joules in phase so far, the running interval included (no collective): the per-step
        metrics of a one-rank run."""
        if self.counters is None:
            return None
        running = self._since_start() if self.last is not None and self.phase == phase else 0.0
        return self.joules[phase] + running

    def totals(self, rt) -> dict[str, float] | None:  # rt: train_gpt's Place
        """Each phase's joules summed over ranks (a collective: every rank calls it), or None when no rank could
        measure."""
        measured = torch.tensor([*(self.joules[p] for p in ENERGY_PHASES), float(self.counters is not None)],
                                dtype=torch.float64, device=rt.device)
        if rt.world_size > 1:
            dist.all_reduce(measured)
        *joules, ranks = measured.tolist()
        return dict(zip(ENERGY_PHASES, joules), ranks=int(ranks)) if ranks else None


def energy_line(energy: dict | None, reason: str, train_s: float, tokens: int) -> str:
    """The run log's energy line: the timed training's joules and kWh summed over ranks and launches, mean power
    per device, tokens per kWh, and apart from them the warm-up's and validation's joules. energy: a run's
    totals (run_energy), None when nothing could be measured (reason says why)."""
    if energy is None:
        return f"energy: n/a ({reason or 'no rank could read an energy counter'})"
    joules, kwh = energy["train"], energy["train"] / 3.6e6
    power = joules / max(train_s, 1e-9) / max(energy["ranks"], 1)
    per_kwh = f"{tokens / kwh:.3e}" if kwh > 0 else "n/a"
    return (f"energy: {joules:.1f} J ({kwh:.6f} kWh) mean_power:{power:.1f}W/device tokens_per_kWh:{per_kwh} "
            f"warmup:{energy['warmup']:.1f}J validation:{energy['validation']:.1f}J")


class RecompileWatch:
    """Counts torch.compile recompilations once warm-up is over, with dynamo's reason for each.

    Warm-up compiles every shape and mode the run uses, so a later recompilation is timed work and a
    sign of an unintended guard (a Python scalar that changes, a new shape).
    """
    LOGGER = "torch._dynamo.guards.__recompiles"  # dynamo's "recompiles" artifact log

    def __init__(self):
        self.count, self.pending = 0, []
        self.handler = logging.Handler(logging.DEBUG)
        self.handler.emit = self._record

    def start(self) -> "RecompileWatch":
        if "TORCH_LOGS" not in os.environ:  # the user's own TORCH_LOGS setting wins
            torch._logging.set_logs(recompiles=True)
        logging.getLogger(self.LOGGER).addHandler(self.handler)
        return self

    def _record(self, record: logging.LogRecord) -> None:
        lines = [line.strip() for line in record.getMessage().splitlines() if line.strip()]
        where = lines[0].removeprefix("Recompiling function ") if lines else "?"
        guard = next((line.lstrip("- ") for line in lines[1:] if line.startswith("-")), "no guard reported")
        self.count += 1
        self.pending.append(f"{where}: {guard}")

    def drain(self) -> list[str]:
        pending, self.pending = self.pending, []
        return pending


def make_profiler(steps: int, cuda: bool, trace_path: Path):
    """Records `steps` training steps (after one skipped and one warm-up step) as a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile, schedule
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                   on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path)))


def peak_memory_mib(rt) -> tuple[float, str]:  # rt: train_gpt's Place
    if rt.is_cuda:
        allocated = torch.cuda.max_memory_allocated(rt.device) / 2**20
        reserved = torch.cuda.max_memory_reserved(rt.device) / 2**20
        return allocated, f"peak memory allocated: {allocated:.0f} MiB reserved: {reserved:.0f} MiB"
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return rss, f"peak memory: {rss:.0f} MiB (rank 0 process max RSS; no device memory on CPU)"


def write_header(log: RunLog, sources: dict[str, str], hyperparameters: dict, derived: dict[str, str],
                 environment: list[str]) -> None:
    """The run log's header, not echoed: each source between '==== NAME ====' and '==== end of NAME ====' (records/
    read_records.py's log_sources reads them back), the hyperparameters (then the derived values), the environment."""
    for name, text in sources.items():
        log.write(f"==== {name} ====", echo=False)
        log.write(text, echo=False)
        log.write(f"==== end of {name} ====", echo=False)
    log.write("hyperparameters:", echo=False)
    for name, value in hyperparameters.items():
        log.write(f"  {name} = {value}", echo=False)
    for name, value in derived.items():
        log.write(f"  (derived) {name} = {value}", echo=False)
    for line in environment:
        log.write(line, echo=False)


def write_report(path: Path, text: str, log: RunLog) -> None:
    """The run's report card next to its log, written atomically."""
    try:
        path.with_suffix(".md.part").write_text(text)
        os.replace(path.with_suffix(".md.part"), path)
    except OSError as e:
        raise RunFailed(f"cannot write {path}: {e.strerror}; the run log {log.path} and summary are complete") from None


def write_summary(path: Path, summary: dict, log: RunLog) -> None:
    """The machine-readable result next to the log, written atomically."""
    try:
        path.with_suffix(".json.part").write_text(json.dumps(summary, indent=1))
        os.replace(path.with_suffix(".json.part"), path)
    except OSError as e:
        raise RunFailed(f"cannot write {path}: {e.strerror}; the run log {log.path} is complete") from None


def trainer_sources(main: Path) -> dict[str, str]:
    """The trainer's source and that of every sibling module it has imported (a .py file beside it that is loaded
    now), by file name, the trainer first: what a run log embeds, so that the log alone rebuilds the run."""
    main = main.resolve()
    loaded = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    siblings = {Path(f) for f in loaded if f and os.path.isabs(f) and Path(f).parent == main.parent}
    files = [main] + sorted(f for f in siblings if f.suffix == ".py" and f != main and f.is_file())
    return {f.name: f.read_text() for f in files}


def sources_sha256(sources: dict[str, str]) -> str:
    """One digest of the sources, names included: what a checkpoint records of the code that wrote it."""
    digest = hashlib.sha256()
    for name, text in sources.items():
        digest.update(f"{name}\0{len(text)}\0".encode() + text.encode())
    return digest.hexdigest()


# ----------------------------------------------------------------------------- what people look at

def progress_bar(iterable, description: str, show: bool = True, unit: str = "step"):
    """The iterable behind a tqdm bar on stderr, shown only on a terminal (and where show: rank 0), so that CI logs
    and run logs stay clean; elsewhere it is the iterable as it is."""
    return tqdm(iterable, desc=description, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=None if show else True)


# Dense bf16 peak of each GPU, TFLOP/s, from NVIDIA's datasheets (the MFU denominator); a name matches its
# longest key. CPUs and unlisted GPUs get no MFU.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.4, "GH200": 989.4,
                    "B200": 2250.0, "A100": 312.0, "L40S": 362.05, "RTX 4090": 165.2, "A10G": 70.0}


def peak_tflops(device: str) -> float | None:
    """The device's bf16 peak in TFLOP/s, from its name (torch.cuda.get_device_name), or None if not known."""
    keys = [k for k in PEAK_BF16_TFLOPS if k in device and not device.startswith("cpu")]
    return PEAK_BF16_TFLOPS[max(keys, key=len)] if keys else None


# The metrics file, <run_id>.metrics.jsonl: one JSON object per line, "kind" "train" (after each training step),
# "val" (each validation) or "target" (the validation that first reached --target_val_loss), with
# these keys, each a number or null; records/read_records.py's read_metrics is its one reader (recorded, below, the
# trainer's reading of its own). It is the run's one record of its curve: a resumed launch appends to it (after
# ending a line a crash tore), and its train and val records replace what earlier launches recorded of the steps
# it redoes.
METRIC_KEYS = {
    "train": ("step", "tokens", "train_loss", "lr_mult", "step_ms", "train_time_ms", "tokens_per_s", "tflops",
              "mfu", "peak_memory_mib", "energy_j"),
    "val": ("step", "tokens", "val_loss", "train_time_ms", "energy_j"),
    "target": ("step", "tokens", "val_loss", "target_val_loss", "train_time_ms", "energy_j"),
}


class Metrics:
    """Rank 0's metrics: every record goes to the metrics file (flushed, so a crash loses at most the line being
    written) and, with --tensorboard, to TensorBoard as scalars of the same names."""

    def __init__(self, path: Path | None, tensorboard: Path | None = None, say=print):
        self.path, self.file, self.board = path, None, None
        if path is None:
            return
        try:
            self.file = open(path, "a", encoding="utf-8")
            end_torn_line(self.file)
        except OSError as e:
            raise UsageError(f"cannot open metrics file {path}: {e.strerror}; pick a writable --log_dir") from None
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.board = SummaryWriter(str(tensorboard))
            except ImportError:  # the package is missing
                say("warning: --tensorboard=true needs the tensorboard package: pip install tensorboard; the run "
                    "goes on without it (the metrics file has the same numbers)")
            except OSError as e:  # its folder's name is taken by a file, or cannot be made
                say(f"warning: --tensorboard=true cannot write {tensorboard} ({e.strerror}); the run goes on "
                    "without it (the metrics file has the same numbers)")
            except Exception as e:  # a broken or mismatched install fails on import in its own ways
                reason = (str(e).strip().splitlines() or [""])[0][:160]
                say(f"warning: --tensorboard=true cannot load tensorboard ({type(e).__name__}: {reason}); the run goes "
                    "on without it (the metrics file has the same numbers); reinstall it: pip install tensorboard")

    def write(self, kind: str, **values) -> None:
        if self.file is None:
            return
        record = {"kind": kind, **{k: finite_or_none(values.get(k)) for k in METRIC_KEYS[kind]}}
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            raise RunFailed(f"cannot write metrics file {self.path}: {e.strerror}; free disk space and resume "
                            "from the last checkpoint") from None
        if self.board is not None:
            for key, value in record.items():
                if key not in ("kind", "step") and value is not None:
                    self.board.add_scalar(f"{kind}/{key}", value, record["step"])

    def carry_over(self, checkpoint: Path, step: int) -> None:
        """A run resumed from another run's checkpoint (<log_dir>/<run_id>/step_N) continues that run: its records
        through `step` come first, so that this run's metrics file holds the whole run."""
        other = RunFolder(checkpoint.parent.parent, checkpoint.parent.name).metrics
        if self.file is None or not other.is_file() or other.resolve() == self.path.resolve():
            return
        order = list(METRIC_KEYS)  # at a step: its training, its validation, the target it reached
        earlier = recorded(other, step)
        for _, _, record in sorted((s, order.index(kind), r) for kind, of_kind in earlier.items()
                                   for s, r in of_kind.items()):
            self.write(record["kind"], **{k: v for k, v in record.items() if k != "kind"})

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
        if self.file is not None:
            self.file.close()


def recorded(path: Path | None, through: int) -> dict[str, dict[int, dict]]:
    """The records of a metrics file by kind and step, through step `through`, as records/read_records.py's
    read_metrics keeps them (a launch's train or val record of a step leaves out what earlier launches recorded after
    it, and its train record what they recorded at it): the trainer reading back what it wrote, every launch of the
    run, for its summary's curve and its target. Lines it cannot read are passed over."""
    records, highest = {kind: {} for kind in METRIC_KEYS}, -1
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path else []
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        step, kind = (record.get("step"), record.get("kind")) if isinstance(record, dict) else (None, None)
        if not isinstance(step, int) or isinstance(step, bool) or kind not in METRIC_KEYS:
            continue
        if kind != "target" and (step < highest or kind == "train" and step == highest):
            for of_kind in records.values():
                for stale in [s for s in of_kind if s > step or s == step and kind == "train"]:
                    del of_kind[stale]
        highest = highest if kind == "target" else step
        records[kind][step] = record
    return {kind: {s: r for s, r in of_kind.items() if s <= through} for kind, of_kind in records.items()}


def recorded_validations(path: Path | None, through: int) -> dict[int, dict]:
    """The val records of a metrics file by step, through step `through` (recorded)."""
    return recorded(path, through)["val"]


def target_among(validations: dict[int, dict], target: float) -> dict | None:
    """Where the first of these validations reached the target loss (as train_gpt's target_reached records it)."""
    first = next((r for _, r in sorted(validations.items()) if r.get("val_loss") is not None and
                  r["val_loss"] <= target), None)
    return first and {"val_loss": target, "reached_val_loss": first["val_loss"], "step": first["step"],
                      "train_time_ms": first["train_time_ms"], "tokens": first["tokens"], "energy_j": first["energy_j"]}


def run_curve(path: Path | None, end_step: int) -> list[list]:
    """The run's validation curve through end_step, [step, val_loss, train_time_ms] at the run's training time (every
    launch counted), from its metrics file: the summary's val_curve."""
    return [[step, record["val_loss"], record["train_time_ms"]]
            for step, record in sorted(recorded_validations(path, end_step).items()) if record["val_loss"] is not None]


def finite_or_none(value):
    """A JSON-safe number: NaN and infinities (JSON has none) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def report_card(summary: dict, usd_per_gpu_hour: float) -> str:
    """The run's report card, markdown, from its JSON summary: what a person reads first."""
    hp, target, energy = summary["hyperparameters"], summary.get("target") or {}, summary.get("energy") or {}

    def number(value, spec: str, unit: str = "") -> str:
        return "n/a" if value is None else f"{value:{spec}}{unit}"
    train_s = (summary.get("total_train_time_ms") or summary["train_time_ms"]) / 1000
    wall_s = summary.get("wall_time_s")
    gpus = summary["world_size"] if summary["devices"] and not summary["devices"][0].startswith("cpu") else 0
    rows = [
        ("run", f"{summary['run_id']}: preset {summary['preset']}, recipe {hp.get('recipe')}, seed {hp.get('seed')}"),
        ("code", f"commit {summary.get('git_commit') or 'unknown'}"
                 + {True: " with uncommitted changes", False: " (clean)", None: ""}[summary.get("git_dirty")]),
        ("hardware", f"{summary['world_size']} x {summary['devices'][0] if summary['devices'] else '?'}"),
        ("software", f"torch {summary.get('torch', '?')}, python {summary.get('python', '?')}"),
        ("final val loss", f"{number(summary['final_val_loss'], '.4f')} after {summary['steps']} steps, "
                           f"{summary['tokens']:,} tokens"),
        ("target", f"val loss <= {target.get('val_loss')}: " + (
            f"reached at step {target['step']}, {target['train_time_ms'] / 1000:.1f} s of training, "
            f"{target['tokens']:,} tokens, energy {number(target.get('energy_j'), '.0f', ' J')}"
            if target.get("step") is not None else "not reached")),
        ("training time", f"{train_s:.1f} s over {summary.get('resumes', 0) + 1} launch(es)"
                          + (f"; {wall_s:.1f} s wall clock with start-up, compile and validation" if wall_s else "")),
        ("throughput", f"{number(summary.get('tokens_per_s'), ',.0f', ' tokens/s')}, "
                       f"{number(summary.get('tflops'), '.1f', ' TFLOP/s')}, MFU {number(summary.get('mfu'), '.1%')}"),
        ("peak memory", f"{number(summary.get('peak_memory_mib'), ',.0f', ' MiB')} (rank 0)"),
        ("energy", "n/a: " + summary.get("energy_reason", "no counter") if not energy else
                   f"training {energy['train']:.0f} J ({energy['train'] / 3.6e6:.6f} kWh, "
                   f"{number(summary.get('tokens_per_kwh'), '.3e', ' tokens/kWh')}); warm-up and compile "
                   f"{energy['warmup']:.0f} J; validation {energy['validation']:.0f} J"),
    ]
    if usd_per_gpu_hour > 0 and gpus:
        cost = usd_per_gpu_hour * gpus / 3600
        rows.append(("cost", f"${cost * train_s:.2f} of training" + (f", ${cost * wall_s:.2f} wall clock"
                                                                       if wall_s else "")
                     + f" at ${usd_per_gpu_hour:g} per GPU-hour x {gpus} GPU(s)"))
    elif gpus:
        rows.append(("cost", "pass --usd_per_gpu_hour=PRICE to price the run"))
    lines = [f"# Run {summary['run_id']}", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n"
