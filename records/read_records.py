#!/usr/bin/env python3
"""Read GPT-2 speedrun training logs, tabulate the runs and test a record claim.

Usage:
    python -m records.read_records PATH [PATH ...] [options]

PATH is a log file or a folder; folders are searched recursively for *.txt
and *.json files. Two kinds of log are understood:

  * this project's logs, written by train_gpt.py: ``logs/<run_id>.txt`` (the
    script's source between ``==== train_gpt.py ====`` and
    ``==== end of train_gpt.py ====``, hyperparameters, environment, one line
    per step, and a closing ``final:`` line) and the ``logs/<run_id>.json``
    summary written next to it when the run ends. A .txt and a .json with the
    same stem in the same folder are one run: the JSON's numbers win, the
    .txt supplies the validation curve when the JSON has none.
  * the public NanoGPT speedrun record logs (modded-nanogpt
    ``records/*/<uuid>.txt``): source code, environment and nvidia-smi output,
    then ``step:S/N val_loss:... train_time:...ms`` lines.

Output: a markdown table with one row per finished run, then for each group
the mean and sample standard deviation (ddof=1) of the final validation loss
and the p-value of a one-sided one-sample t-test whose alternative is
"the mean is below --target" (scipy.stats.ttest_1samp(..., alternative='less')).
A group meets the record rule when p < --alpha.

Options:
    --target LOSS     loss the mean must be below (default 3.28; finite and > 0)
    --alpha P         significance level (default 0.01; between 0 and 1, both excluded)
    --group-by KEY    'folder' (parent folder of each log), a run field
                      ('preset', 'world_size', 'devices') or any hyperparameter
                      name; each group gets its own statistics and plot lines
    --plot DIR        write val_loss_vs_step.png and val_loss_vs_time.png into DIR
                      (made if missing); a file of those names there is replaced
                      only if this program wrote it (its PNG "Software" text says
                      so), anything else is refused and left as is
    --json            print machine-readable JSON instead of the table

Files that cannot be used (truncated, crashed, unfinished, unknown format,
unreadable JSON, or a number out of its range: a missing or non-finite loss,
a negative step count or time, true or text where a number belongs) are
reported on stderr as ``skipped <path>: <reason>`` and left out; the verdict
stands on the rest. Every format is held to the same rules (check_run). The
exit status is 2 (a usage error, one ``error:`` line) for a bad option or
--plot folder, or when no run at all could be read.

scipy (p-values) and matplotlib (plots) are optional extras:
    pip install -r requirements-extras.txt

Examples:
    python -m records.read_records logs/
    python -m records.read_records logs/ --group-by preset --plot plots/
    python -m records.read_records records/2025-01-01_cpu/ --json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flags import OneLineArgumentParser, UsageError, missing, number, one_line, run_cli, what_is_there

# The run log's progress lines, as train_gpt.py's progress_line() writes them: the one reader (bench/ and the
# tests use it too). The units are those of the trainer's PROGRESS_FIELDS (tests/test_records.py holds the two
# to each other); the public speedrun's logs use the same "step:S/N val_loss:... train_time:...ms" shape.
PROGRESS_UNITS = ("J", "ms")


@dataclass
class ProgressLine:
    step: int | None  # None for the final and target lines
    total: int | None
    fields: dict[str, float]


def parse_progress_line(line: str) -> ProgressLine | None:
    """The fields of a progress line (units stripped, 'nan' allowed), or None for any other line.
    A line holding braces is a format string quoted from source code, never data."""
    words = line.strip().split()
    if not words or "{" in line or "}" in line:
        return None
    if words[0] in ("final:", "target:"):
        step = total = None
    elif words[0].startswith("step:") and words[0].count("/") == 1:
        s, _, n = words[0][len("step:"):].partition("/")
        if not (s.isdigit() and n.isdigit()):
            return None
        step, total = int(s), int(n)
    else:
        return None
    values = {}
    for word in words[1:]:
        name, sep, text = word.partition(":")
        unit = next((u for u in PROGRESS_UNITS if text.endswith(u) and text != u), "")
        try:
            values[name] = float(text[:len(text) - len(unit)])
        except ValueError:
            return None
        if not sep or not name.replace("_", "").isalnum():
            return None
    return ProgressLine(step, total, values) if values else None


INSTALL_HINT = "pip install -r requirements-extras.txt"

SOURCE_BEGIN = "==== train_gpt.py ===="  # the first line of a project log: the trainer's own source follows
SOURCE_BLOCK_RE = re.compile(r"^==== (\S+\.py) ====$")  # each embedded source: this line, its text, the end line

HPARAM_RE = re.compile(r"^\s+([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*(.*?)\s*$")
# A GPU row of the nvidia-smi table: "|   0  NVIDIA H100 80GB HBM3   On  |   00000000:19:00.0 Off |"
SMI_GPU_RE = re.compile(
    r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|\s+[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:"
)
ENERGY_RE = re.compile(r"^energy:\s+([0-9.eE+-]+)\s*J\s*\(\s*([0-9.eE+-]+)\s*kWh\)")
RESUMED_RE = re.compile(r"^resumed from .* at step \d+ after ([0-9.]+) ms of training")
PEAK_RE = re.compile(r"^peak memory allocated:\s*([0-9.]+)\s*MiB")


@dataclass
class Run:
    """One training run, merged from whatever files describe it. A reader fills in the numbers as its file holds
    them; check_run then holds each to its range (RUN_NUMBERS) before the run is used."""

    name: str
    paths: list[str]
    folder: str
    fmt: str  # "project" or "public"
    final_val_loss: float
    steps: int | None = None
    tokens: int | None = None
    train_time_ms: float | None = None  # of the last launch (segment) of the run
    total_train_time_ms: float | None = None  # of all its segments, when it was resumed
    resumes: int = 0
    world_size: int | None = None
    devices: list[str] = field(default_factory=list)
    peak_memory_mib: float | None = None
    energy_j: float | None = None
    energy_kwh: float | None = None
    tokens_per_kwh: float | None = None
    preset: str | None = None
    git_commit: str | None = None
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    val_curve: list[tuple[int, float, float]] = field(default_factory=list)
    val_tokens: dict[int, int] = field(default_factory=dict)  # training tokens at each validation (metrics file)
    target_loss: float | None = None  # the run's --target_val_loss, where it records one
    target_step: int | None = None  # the step of the first validation at or below it
    target_train_time_ms: float | None = None  # training time up to it, every launch of the run counted
    target_tokens: int | None = None
    target_energy_j: float | None = None
    finished: bool = True  # False: read from a metrics file alone (a crashed run's curve, plotted, never judged)
    group: str = "all"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "paths": self.paths,
            "folder": self.folder,
            "format": self.fmt,
            "group": self.group,
            "devices": self.devices,
            "world_size": self.world_size,
            "steps": self.steps,
            "tokens": self.tokens,
            "final_val_loss": _finite_or_none(self.final_val_loss),
            "train_time_ms": self.train_time_ms,
            "total_train_time_ms": self.total_train_time_ms,
            "resumes": self.resumes,
            "peak_memory_mib": self.peak_memory_mib,
            "energy_j": self.energy_j,
            "energy_kwh": self.energy_kwh,
            "tokens_per_kwh": self.tokens_per_kwh,
            "preset": self.preset,
            "git_commit": self.git_commit,
            "hyperparameters": self.hyperparameters,
            "val_curve": [[s, _finite_or_none(v), t] for s, v, t in self.val_curve],
            "target_loss": self.target_loss,
            "target_step": self.target_step,
            "target_train_time_ms": self.target_train_time_ms,
            "target_tokens": self.target_tokens,
            "target_energy_j": self.target_energy_j,
            "finished": self.finished,
        }


def _finite_or_none(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return x


def _display_dir(path: Path) -> str:
    """The folder of a log, relative to the working directory when it is below it."""
    folder = path.parent.resolve()
    try:
        return str(folder.relative_to(Path.cwd().resolve())) or "."
    except ValueError:
        return str(folder)


def _gpus_from_smi(lines: list[str]) -> list[str]:
    gpus: dict[int, str] = {}
    for line in lines:
        m = SMI_GPU_RE.match(line)
        if m:
            gpus.setdefault(int(m.group(1)), m.group(2).strip())
    return [gpus[i] for i in sorted(gpus)]


def _scan_steps(lines: list[str]):
    """Collect validation points and the last step seen from data lines. A launch that resumed a run (this project's
    'resumed from ... after T ms of training' line) redoes the steps after the one it resumed from: its lines
    replace what earlier launches logged of them (as read_metrics reads a metrics file), and its launch-local times
    count the training before it, so that the curve is the run's."""
    curve: dict[int, tuple[int, float, float]] = {}
    last: tuple[int, int] | None = None
    earlier_ms = 0.0
    for line in lines:
        resumed = RESUMED_RE.match(line)
        if resumed:
            earlier_ms = float(resumed.group(1))
        parsed = parse_progress_line(line) if line.startswith("step:") else None
        if parsed is None:
            continue
        last = (parsed.step, parsed.total)
        val = "val_loss" in parsed.fields
        supersede({"val": curve}, parsed.step, "val" if val else "train")
        if val:
            curve[parsed.step] = (parsed.step, parsed.fields["val_loss"],
                                  parsed.fields.get("train_time", math.nan) + earlier_ms)
    return sorted(curve.values()), last


def _not_finished_reason(lines: list[str], text: str, last, what: str) -> str:
    errors = [ln.strip() for ln in lines if ln.startswith("error:") or ln.startswith("Traceback")]
    where = f"last step seen {last[0]}/{last[1]}" if last else "no step lines"
    if errors:
        return f"crashed run, {what} ({where}; {errors[-1][:120]})"
    if text and not text.endswith("\n"):
        return f"truncated log, {what} ({where}; file ends mid-line)"
    return f"unfinished run, {what} ({where})"


def log_sources(text: str) -> tuple[dict[str, str], list[str]]:
    """The sources a project log embeds (train_gpt.py and the sibling modules it imported, by file name, each
    between '==== NAME ====' and '==== end of NAME ====') and the log's other lines, in order. A launch that a
    resume appended embeds them again; the first copy of each name is kept."""
    sources: dict[str, str] = {}
    rest: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = SOURCE_BLOCK_RE.match(lines[i])
        if not m:
            rest.append(lines[i])
            i += 1
            continue
        end = f"==== end of {m.group(1)} ===="
        try:
            j = lines.index(end, i + 1)
        except ValueError:
            raise UsageError(f"truncated log: the {m.group(1)} source block is never closed") from None
        sources.setdefault(m.group(1), "\n".join(lines[i + 1:j]))  # the writer's own newline ends the text
        i = j + 1
    return sources, rest


def hyperparameter_blocks(lines: list[str]) -> list[dict[str, str]]:
    """Each launch's 'hyperparameters:' block of a project log (a resumed run's log has one per launch), as
    name -> value text, in order; a block ends at its first line that is not 'name = value'."""
    blocks: list[dict[str, str]] = []
    for i, line in enumerate(lines):
        if line.startswith("hyperparameters:"):
            blocks.append({})
            for value_line in lines[i + 1:]:
                m = HPARAM_RE.match(value_line)
                if not m:
                    break
                blocks[-1][m.group(1)] = m.group(2)
    return blocks


def parse_project_txt(path: Path, text: str) -> Run:
    """Parse a human log written by this project's train_gpt.py (parse_txt tells it by its source block)."""
    body = log_sources(text)[1]
    hyper: dict[str, Any] = {k: v for block in hyperparameter_blocks(body) for k, v in block.items()}  # last wins
    env: dict[str, str] = {}
    for line in body:
        for key in ("device", "world_size", "python", "torch", "cuda"):
            if line.startswith(key + ":") and key not in env:
                env[key] = line[len(key) + 1:].strip()

    curve, last = _scan_steps(body)
    final_line = next((ln for ln in reversed(body) if ln.startswith("final:")), None)
    if final_line is None:
        raise UsageError(_not_finished_reason(body, text, last, "no 'final:' line"))
    parsed_final = parse_progress_line(final_line)
    final = parsed_final.fields if parsed_final is not None else {}
    if "val_loss" not in final:
        raise UsageError("truncated log: the 'final:' line has no val_loss")

    run = Run(
        name=path.stem,
        paths=[str(path)],
        folder=_display_dir(path),
        fmt="project",
        final_val_loss=final["val_loss"],
        steps=final.get("steps", last[1] if last else None),
        tokens=final.get("tokens"),
        train_time_ms=final.get("train_time"),
        total_train_time_ms=final.get("total_train_time"),
        resumes=final.get("resumes", 0),
        hyperparameters=hyper,
        val_curve=curve,
        preset=hyper.get("preset"),
    )
    if run.train_time_ms is None and curve:
        run.train_time_ms = None if math.isnan(curve[-1][2]) else curve[-1][2]
    if "world_size" in env:
        try:
            run.world_size = int(env["world_size"])
        except ValueError:
            pass
    smi = _gpus_from_smi(body)
    if smi:
        run.devices = smi
    elif "device" in env:
        run.devices = [env["device"]] * (run.world_size or 1)
    for line in body:
        m = PEAK_RE.match(line)
        if m:
            run.peak_memory_mib = float(m.group(1))
        m = ENERGY_RE.match(line)
        if m:
            run.energy_j = float(m.group(1))
            run.energy_kwh = float(m.group(2))
            tpk = re.search(r"tokens_per_kWh:(\S+)", line)
            if tpk:
                try:
                    run.tokens_per_kwh = float(tpk.group(1))
                except ValueError:
                    pass
    if run.tokens_per_kwh is None and run.tokens and run.energy_kwh:
        run.tokens_per_kwh = run.tokens / run.energy_kwh
    try:
        looked_for = float(hyper["target_val_loss"]) if "target_val_loss" in hyper else None  # the last launch's
    except ValueError:
        looked_for = None
    for line in body:  # the last launch that looked for this target logged where the run reached it, if it did
        target = parse_progress_line(line) if line.startswith("target:") else None
        if target is not None and (looked_for is None or round(looked_for, 4) == target.fields.get("target_val_loss")):
            fields = target.fields
            run.target_loss, run.target_step = fields.get("target_val_loss"), fields.get("steps")
            run.target_train_time_ms, run.target_tokens = fields.get("train_time"), fields.get("tokens")
            run.target_energy_j = fields.get("energy")
    if run.target_loss is None:
        run.target_loss = looked_for
    return run


def parse_public_txt(path: Path, text: str) -> Run:
    """Parse a modded-nanogpt record log: source, environment, step lines."""
    lines = text.splitlines()
    curve, last = _scan_steps(lines)
    if last is None:
        raise UsageError("unknown format: no step lines found")
    total = last[1]
    finals = [c for c in curve if c[0] == total]
    if not finals:
        raise UsageError(_not_finished_reason(lines, text, last, f"no val_loss at step {total}/{total}"))
    step, loss, time_ms = finals[-1]
    run = Run(
        name=path.stem,
        paths=[str(path)],
        folder=_display_dir(path),
        fmt="public",
        final_val_loss=loss,
        steps=total,
        train_time_ms=None if math.isnan(time_ms) else time_ms,
        val_curve=curve,
    )
    run.devices = _gpus_from_smi(lines)
    if run.devices:
        run.world_size = len(run.devices)
    for line in lines:
        m = PEAK_RE.match(line)
        if m:
            run.peak_memory_mib = float(m.group(1))
    return run


def parse_txt(path: Path) -> Run:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"unreadable file: {exc.strerror or exc}") from None
    if SOURCE_BEGIN in text.splitlines():
        return parse_project_txt(path, text)
    return parse_public_txt(path, text)


def parse_json(path: Path) -> Run:
    """Parse a logs/<run_id>.json summary written by train_gpt.py."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"unreadable file: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"unreadable JSON: {exc}") from None
    if not isinstance(data, dict) or "final_val_loss" not in data:
        raise UsageError("unknown format: JSON is not a run summary (no final_val_loss)")
    status = data.get("status")
    if status != "finished":
        raise UsageError(f"unfinished run: JSON status is {status!r}, not 'finished'")
    curve = []
    raw_curve = data.get("val_curve") or []
    if not isinstance(raw_curve, list):
        raise UsageError("unknown format: JSON val_curve is not a list")
    for point in raw_curve:
        if not isinstance(point, (list, tuple)) or len(point) < 2:
            raise UsageError("unknown format: JSON val_curve entries must be [step, val_loss, train_time_ms]")
        curve.append((point[0], point[1], point[2] if len(point) > 2 else None))
    devices = data.get("devices") or []
    hyper = data.get("hyperparameters") or {}
    target = data.get("target") if isinstance(data.get("target"), dict) else {}
    reached = {"target_loss": target.get("val_loss"), "target_step": target.get("step"),
               "target_train_time_ms": target.get("train_time_ms"), "target_tokens": target.get("tokens"),
               "target_energy_j": target.get("energy_j")}
    # The numbers as the file holds them (null: not recorded, for all but the loss); check_run judges them.
    numbers = {name: data[name] for name in RUN_NUMBERS if data.get(name) is not None}
    return Run(
        name=str(data.get("run_id") or path.stem),
        paths=[str(path)],
        folder=_display_dir(path),
        fmt="project",
        **{"final_val_loss": None, **numbers, **{k: v for k, v in reached.items() if v is not None}},
        devices=[str(d) for d in devices] if isinstance(devices, list) else [str(devices)],
        preset=None if data.get("preset") is None else str(data["preset"]),
        git_commit=data.get("git_commit"),
        hyperparameters=hyper if isinstance(hyper, dict) else {},
        val_curve=curve,
    )


def merge(from_json: Run, from_txt: Run) -> Run:
    """One run from a JSON summary and its .txt log: JSON numbers win."""
    run = from_json
    run.paths = from_txt.paths + from_json.paths
    if not run.val_curve:
        run.val_curve = from_txt.val_curve
    for name in ("steps", "tokens", "train_time_ms", "total_train_time_ms", "world_size", "peak_memory_mib",
                 "energy_j", "energy_kwh", "tokens_per_kwh", "preset", "target_loss", "target_step",
                 "target_train_time_ms", "target_tokens", "target_energy_j"):
        if getattr(run, name) is None:
            setattr(run, name, getattr(from_txt, name))
    if not run.devices:
        run.devices = from_txt.devices
    if not run.hyperparameters:
        run.hyperparameters = from_txt.hyperparameters
    return run


@dataclass(frozen=True)
class Range:
    """What one number of a run may be, as a skip reason states it."""
    whole: bool  # a count: an integer (the .txt logs write every number as a float; 20.0 is 20)
    lo: float

    def describe(self) -> str:
        return f"{'an integer' if self.whole else 'a finite number'} >= {self.lo:g}"


COUNT = Range(whole=True, lo=0)
AMOUNT = Range(whole=False, lo=0)  # a loss, a time, memory, energy: finite and never negative
# Every number a reader fills into a Run, and what it may be. None means "not recorded", except for the loss:
# a finished run without one is no run.
RUN_NUMBERS = {"final_val_loss": AMOUNT, "steps": COUNT, "tokens": COUNT, "train_time_ms": AMOUNT,
               "total_train_time_ms": AMOUNT, "resumes": COUNT, "world_size": Range(whole=True, lo=1),
               "peak_memory_mib": AMOUNT, "energy_j": AMOUNT, "energy_kwh": AMOUNT, "tokens_per_kwh": AMOUNT,
               "target_loss": AMOUNT, "target_step": COUNT, "target_train_time_ms": AMOUNT, "target_tokens": COUNT,
               "target_energy_j": AMOUNT}
# The metrics file's keys, the rule each value meets, and its kinds of record, as runlog.METRIC_KEYS writes them
# (tests/test_records.py holds the two to each other); a value may be null where the run could not measure it.
METRIC_RULES = {"step": COUNT, "tokens": COUNT, "train_loss": AMOUNT, "val_loss": AMOUNT, "lr_mult": AMOUNT,
                "step_ms": AMOUNT, "train_time_ms": AMOUNT, "tokens_per_s": AMOUNT, "tflops": AMOUNT, "mfu": AMOUNT,
                "peak_memory_mib": AMOUNT, "energy_j": AMOUNT, "target_val_loss": AMOUNT}
METRIC_KINDS = {
    "train": ("step", "tokens", "train_loss", "lr_mult", "step_ms", "train_time_ms", "tokens_per_s", "tflops",
              "mfu", "peak_memory_mib", "energy_j"),
    "val": ("step", "tokens", "val_loss", "train_time_ms", "energy_j"),
    "target": ("step", "tokens", "val_loss", "target_val_loss", "train_time_ms", "energy_j"),
}
METRICS_SUFFIX = ".metrics.jsonl"
LINE_REASONS = 3  # the most lines of one metrics file said apart when skipped; the rest are counted


def check_run(run: Run) -> Run:
    """The one validation of what every reader read (JSON summaries, this project's and the public .txt logs):
    each number of RUN_NUMBERS and of the validation curve is of its type and range, counts become ints. A bad
    value is a UsageError naming it, so its file is skipped with that reason and the verdict stands on the rest."""
    for name, rule in RUN_NUMBERS.items():
        value = getattr(run, name)
        if value is not None or name == "final_val_loss":
            setattr(run, name, valid_number(name, value, rule))
    run.val_curve = [checked_point(point) for point in run.val_curve]
    return run


def checked_point(point: tuple) -> tuple[int, float, float]:
    """One point of the validation curve: its step, its loss and its time (NaN where the log has none)."""
    step, loss, time_ms = point
    step = valid_number("a val_curve step", step, COUNT)
    loss = valid_number(f"val_loss at step {step}", loss, AMOUNT)
    if time_ms is None or (isinstance(time_ms, float) and math.isnan(time_ms)):
        return step, loss, math.nan
    return step, loss, valid_number(f"train_time at step {step}", time_ms, AMOUNT)


def valid_number(name: str, value: object, rule: Range) -> int | float:
    """value as rule's type, or a UsageError: no bool passes as a number, no NaN or inf, no negative count."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer beyond any float
        number = math.inf
    if not (math.isfinite(number) and number >= rule.lo and (number.is_integer() or not rule.whole)):
        shown = one_line(json.dumps(value, default=repr), 40)  # as a JSON file writes it: null, true, NaN, "abc"
        raise UsageError(f"bad value {shown} for {name}; valid: {rule.describe()}")
    return int(value) if rule.whole else number


def find_files(paths: list[str], skipped: list[tuple[str, str]]) -> list[Path]:
    """Expand the command-line paths into .txt/.json/.metrics.jsonl files, in a stable order."""
    found: list[Path] = []
    seen: set[Path] = set()
    for arg in paths:
        p = Path(arg)
        if p.is_dir() and not os.access(p, os.R_OK | os.X_OK):  # rglob would find nothing there, saying nothing
            skipped.append((arg, "permission denied: a folder this user cannot list"))
            continue
        if p.is_dir():
            candidates = sorted(  # a checkpoint's checkpoint.json (beside its DCP .metadata) is not a run
                q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in (".txt", ".json", ".jsonl")
                and not (q.name == "checkpoint.json" and (q.parent / ".metadata").exists())
            )
        elif p.is_file():
            candidates = [p]
        else:
            skipped.append((arg, not_a_log_path(p)))
            continue
        for q in candidates:
            key = q.resolve()
            if key not in seen:
                seen.add(key)
                found.append(q)
    return found


def not_a_log_path(path: Path) -> str:
    """Why a command-line path that is neither a file nor a folder is skipped (a FIFO would block the reader)."""
    try:
        return f"it is {what_is_there(path)}, not a log file or a folder of them"
    except (FileNotFoundError, NotADirectoryError):
        return missing(path, said="no such file or folder")
    except OSError as e:
        return e.strerror or str(e)


def read_runs(paths: list[str]) -> tuple[list[Run], list[tuple[str, str]]]:
    """Read every run under `paths`; return (runs, [(path, reason), ...] skipped)."""
    skipped: list[tuple[str, str]] = []
    files = find_files(paths, skipped)
    # Pair files by (folder, stem) so a .txt and its .json become one run.
    by_key: dict[tuple[Path, str], dict[str, Path]] = {}
    order: list[tuple[Path, str]] = []
    for f in files:
        metrics = f.name.endswith(METRICS_SUFFIX)
        key = (f.parent.resolve(), f.name.removesuffix(METRICS_SUFFIX) if metrics else f.stem)
        if f.suffix.lower() == ".jsonl" and not metrics:
            continue  # some other JSON-lines file
        if key not in by_key:
            by_key[key] = {}
            order.append(key)
        kind = "metrics" if metrics else "json" if f.suffix.lower() == ".json" else "txt"
        by_key[key][kind] = f

    runs: list[Run] = []
    for key in order:
        pair = by_key[key]
        parsed: dict[str, Run] = {}
        for kind, parser in (("json", parse_json), ("txt", parse_txt),
                             ("metrics", lambda path: parse_metrics_run(path, skipped))):
            if kind not in pair or kind == "metrics" and parsed:
                continue
            try:
                parsed[kind] = check_run(parser(pair[kind]))
            except UsageError as exc:
                skipped.append((str(pair[kind]), str(exc)))
            except Exception as exc:  # one odd file must never stop the rest
                skipped.append((str(pair[kind]), f"could not parse: {type(exc).__name__}: {exc}"))
        if "json" in parsed and "txt" in parsed:
            run = merge(parsed["json"], parsed["txt"])
        elif parsed:
            run = next(iter(parsed.values()))
        else:
            continue
        if "metrics" in pair and run.finished:  # the run's curve, every launch of it, is its metrics file's
            from_metrics(run, pair["metrics"], skipped)
        runs.append(run)
    return runs, skipped


@dataclass
class Metrics:
    """What a metrics file held that could be read: its records of each kind by step, as the run's last timeline
    has them (a resumed launch appends, and its records replace what earlier launches recorded of the steps it
    redoes: supersede), and why each line that could not be read was skipped."""
    records: dict[str, dict[int, dict]]
    skipped: list[str]


def read_metrics(path: Path) -> Metrics:
    """The one reader of <run_id>.metrics.jsonl (runlog.Metrics writes it): every line a JSON object of a known kind
    whose values meet METRIC_RULES (a number, or null where the run could not measure it). A line that does not (a
    line a crash cut short, a wrong type) is skipped with its reason; a key this reader does not know is left out
    and said once; the rest is read."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise UsageError(f"unreadable file: {exc.strerror or exc}") from None
    records: dict[str, dict[int, dict]] = {kind: {} for kind in METRIC_KINDS}
    skipped: list[str] = []
    unknown: set[str] = set()
    highest = -1  # the highest step read so far: a record below it starts a launch that redoes the steps after it
    for index, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than Python's parser goes
            torn = line.startswith("{") and not line.rstrip().endswith("}")  # the writer's line, its end missing
            skipped.append(f"line {index}: " + ("cut short (the run stopped while writing it)" if torn else
                                                "not JSON"))
            continue
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind not in METRIC_KINDS:
            skipped.append(f"line {index}: not a metrics record (kind {kind!r}; known: {', '.join(METRIC_KINDS)})")
            continue
        unknown |= set(record) - set(METRIC_KINDS[kind]) - {"kind"}
        try:
            values = {key: None if record.get(key) is None else valid_number(key, record[key], METRIC_RULES[key])
                      for key in METRIC_KINDS[kind]}
        except UsageError as exc:
            skipped.append(f"line {index}: {exc}")
            continue
        if values["step"] is None:
            skipped.append(f"line {index}: no step")
            continue
        step = values["step"]
        if kind != "target" and (step < highest or kind == "train" and step == highest):
            supersede(records, step, kind)
        highest = highest if kind == "target" else step  # a target record notes an earlier validation: no launch
        records[kind][step] = values
    if len(skipped) > LINE_REASONS:  # a file of another kind under this name: a few reasons say it
        skipped[LINE_REASONS:] = [f"and {len(skipped) - LINE_REASONS} more line(s) that could not be read"]
    if unknown:
        skipped.append(f"unknown key(s) {', '.join(sorted(unknown))} left out")
    return Metrics(records, skipped)


def supersede(records: dict[str, dict[int, dict]], step: int, kind: str) -> None:
    """A resumed launch redoes every step after the one it resumed from: its train or val record of `step` leaves out
    what earlier launches recorded after it, and its train record also what they measured at `step` itself."""
    for of_kind in records.values():
        for stale in [s for s in of_kind if s > step or s == step and kind == "train"]:
            del of_kind[stale]


def parse_metrics_run(path: Path, skipped: list[tuple[str, str]]) -> Run:
    """A run known only by its metrics file (its log unfinished or gone): its validation curve, to be plotted; it
    is never judged against the target. What could not be read goes into skipped."""
    metrics = read_metrics_noting(path, skipped)
    val = [metrics.records["val"][step] for step in sorted(metrics.records["val"])]
    if not val:
        raise UsageError("no validation record")
    last = val[-1]
    return Run(name=path.name.removesuffix(METRICS_SUFFIX), paths=[str(path)], folder=_display_dir(path),
               fmt="metrics", final_val_loss=last["val_loss"], steps=last["step"], tokens=last["tokens"],
               train_time_ms=last["train_time_ms"], finished=False,
               val_curve=val_curve(val),
               val_tokens=val_tokens(metrics))


def read_metrics_noting(path: Path, skipped: list[tuple[str, str]]) -> Metrics:
    """read_metrics, with the reason for each line it could not read added to skipped."""
    metrics = read_metrics(path)
    skipped += [(str(path), reason) for reason in metrics.skipped]
    return metrics


def val_tokens(metrics: Metrics) -> dict[int, int]:
    """The training tokens at each validation step."""
    return {step: r["tokens"] for step, r in metrics.records["val"].items() if r["tokens"] is not None}


def from_metrics(run: Run, path: Path, skipped: list[tuple[str, str]]) -> None:
    """A finished run's validations as its metrics file holds them, every launch's with the run's training time and
    tokens: its curve, and where it first reached its target (a summary or log of one launch may hold less). Kept
    as read when the file does not end at the run's last step (another run's, or cut short); what could not be
    read is said once."""
    try:
        metrics = read_metrics_noting(path, skipped)
    except UsageError as exc:
        skipped.append((str(path), str(exc)))
        return
    run.val_tokens = val_tokens(metrics)
    val = [metrics.records["val"][step] for step in sorted(metrics.records["val"]) if step <= (run.steps or 0)]
    curve = val_curve(val)
    if not curve or curve[-1][0] != run.steps:
        return
    run.val_curve = curve
    if run.target_loss is not None:
        reached = next((r for r in val if r["val_loss"] is not None and r["val_loss"] <= run.target_loss), None)
        run.target_step, run.target_train_time_ms, run.target_tokens, run.target_energy_j = (
            (reached["step"], reached["train_time_ms"], reached["tokens"], reached["energy_j"]) if reached else
            (None, None, None, None))


def val_curve(val: list[dict]) -> list[tuple[int, float, float]]:
    """The curve of val records in step order: (step, loss, run's training time, NaN where not recorded)."""
    return [(r["step"], r["val_loss"], math.nan if r["train_time_ms"] is None else r["train_time_ms"]) for r in val
            if r["val_loss"] is not None]


def group_label(run: Run, key: str | None) -> str:
    if not key:
        return "all"
    if key == "folder":
        return run.folder
    if key == "devices":
        return describe_devices(run.devices)
    value = getattr(run, key, None) if key in ("preset", "world_size", "fmt") else None
    if value is None:
        value = run.hyperparameters.get(key)
    return f"{key}={'n/a' if value is None else value}"


def describe_devices(devices: list[str]) -> str:
    if not devices:
        return "n/a"
    names = list(dict.fromkeys(devices))
    if len(names) == 1:
        return names[0] if len(devices) == 1 else f"{len(devices)}x {names[0]}"
    return ", ".join(devices)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; nan for fewer than 2 values)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = math.fsum(values) / n
    if n < 2:
        return mean, math.nan
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var)


class MissingExtra(Exception):
    """An optional package (scipy, matplotlib) is not installed."""


def one_sided_pvalue(values: list[float], target: float) -> float:
    """p-value of the one-sample t-test with alternative 'mean < target'.

    Equal to scipy.stats.ttest_1samp(values, target, alternative='less').pvalue.
    Raises MissingExtra when scipy is not installed.
    """
    try:
        from scipy import stats
    except ImportError:
        raise MissingExtra(
            f"scipy is not installed, so no p-value is computed; install it with: {INSTALL_HINT}"
        ) from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_1samp(values, target, alternative="less").pvalue)


def group_stats(runs: list[Run], target: float, alpha: float, notes: list[str]) -> list[dict]:
    """Per-group statistics of the final validation loss, groups in first-seen order."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        if run.finished:  # a crashed run's last validation is not its result
            groups.setdefault(run.group, []).append(run)
    out = []
    for label, members in groups.items():
        losses = [r.final_val_loss for r in members]
        mean, std = mean_std(losses)
        p = None
        if len(losses) >= 2:
            try:
                p = one_sided_pvalue(losses, target)
            except MissingExtra as exc:
                if str(exc) not in notes:
                    notes.append(str(exc))
        if p is not None and math.isnan(p):
            p = None
        meets = None if p is None else bool(p < alpha and mean <= target)
        out.append({
            "group": label,
            "n": len(losses),
            "mean": _finite_or_none(mean),
            "std": _finite_or_none(std),
            "target": target,
            "alpha": alpha,
            "p_value": p,
            "meets": meets,
        })
    return out


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table(runs: list[Run], grouped: bool) -> str:
    headers = ["run"] + (["group"] if grouped else []) + [
        "devices", "world size", "steps", "tokens", "final val loss",
        "train time (s)", "resumes", "energy (kWh)", "tokens/kWh", "target", "steps to target",
        "time to target (s)"]
    rows = []
    for r in runs:
        ms = r.total_train_time_ms if r.resumes else r.train_time_ms  # a resumed run: all of its segments
        time_s = None if ms is None else ms / 1000.0
        row = [r.name] + ([r.group] if grouped else []) + [
            describe_devices(r.devices),
            _fmt(r.world_size, "d"),
            _fmt(r.steps, "d"),
            _fmt(r.tokens, "d"),
            _fmt(r.final_val_loss, ".4f") + ("" if r.finished else " (unfinished)"),
            _fmt(time_s, ".2f") + (" (total)" if r.resumes and ms is not None else ""),
            _fmt(r.resumes, "d"),
            _fmt(r.energy_kwh, ".4g"),
            _fmt(r.tokens_per_kwh, ".3e"),
            _fmt(r.target_loss, "g"),
            _fmt(r.target_step, "d") if r.target_step is not None else ("not reached" if r.target_loss else "n/a"),
            _fmt(None if r.target_train_time_ms is None else r.target_train_time_ms / 1000.0, ".2f"),
        ]
        rows.append([_cell(c) for c in row])
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render_stats(stats: list[dict]) -> str:
    lines = []
    for s in stats:
        head = f"{s['group']}: " if len(stats) > 1 or s["group"] != "all" else ""
        mean = _fmt(s["mean"], ".4f")
        std = _fmt(s["std"], ".4f")
        line = f"{head}n={s['n']} finished runs, mean final val loss {mean}, std {std} (ddof=1)"
        if s["p_value"] is None:
            why = "needs at least 2 runs" if s["n"] < 2 else "not available"
            line += f"; p-value (mean < {s['target']}) {why}"
        else:
            verdict = "MEETS" if s["meets"] else "does NOT meet"
            line += (f"; one-sided t-test mean < {s['target']}: p={s['p_value']:.3g}"
                     f" -> {verdict} the rule (p < {s['alpha']})")
        lines.append(line)
    return "\n".join(lines)


PLOT_NAMES = ("val_loss_vs_step.png", "val_loss_vs_time.png", "val_loss_vs_tokens.png")
# Written into each plot's PNG "Software" text: how --plot knows a file of these names is its own to replace.
PLOT_SOFTWARE = "records/read_records.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def curve_points(run: Run, axis: str) -> list[tuple[float, float]]:
    """(x, val loss) of a run's validations along an axis: step, training time (s) or training tokens (those
    known from its metrics file); points without a finite x or loss left out."""
    pick = {"step": lambda s, t: s, "time": lambda s, t: t / 1000.0,
            "tokens": lambda s, t: run.val_tokens.get(s, math.nan)}[axis]
    points = [(float(pick(step, time_ms)), loss) for step, loss, time_ms in run.val_curve]
    return [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]


def write_plots(runs: list[Run], outdir: str, grouped: bool, target: float) -> list[str]:
    """Write val loss against steps, training time and training tokens, a PNG each, every run a line (a group a
    colour with --group-by) whose legend entry names it and its final loss; return the PNG paths."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtra(
            f"matplotlib is not installed, so no plots are written; install it with: {INSTALL_HINT}"
        ) from None
    prepare_plot_folder(outdir)
    with_curve = [r for r in runs if r.val_curve]
    groups = list(dict.fromkeys(r.group for r in with_curve))
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    written = []
    for name, axis, xlabel in zip(PLOT_NAMES, ("step", "time", "tokens"),
                                  ("step", "training time (s)", "training tokens")):
        fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
        labelled: set[str] = set()
        drawn = 0
        for i, run in enumerate(with_curve):
            points = curve_points(run, axis)
            if not points:
                continue
            xs, ys = zip(*points)
            if grouped:
                color = colors[groups.index(run.group) % len(colors)]
                label = None
                if run.group not in labelled:
                    n = sum(1 for r in with_curve if r.group == run.group)
                    label = f"{run.group} ({n} run{'s' if n != 1 else ''})"
                    labelled.add(run.group)
            else:
                color = colors[i % len(colors)]
                label = f"{run.name}: {run.final_val_loss:.4f}" + ("" if run.finished else " (unfinished)")
            ax.plot(xs, ys, marker=".", color=color, label=label, linewidth=1.2, alpha=0.85)
            drawn += 1
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target}")
        if drawn == 0:
            ax.text(0.5, 0.5, f"no run records its {xlabel} at each validation (the metrics file does)",
                    transform=ax.transAxes, ha="center")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.set_title(f"validation loss vs {xlabel}")
        ax.grid(True, alpha=0.3)
        entries = len(ax.get_legend_handles_labels()[1])
        if entries > 8:  # beside the axes, so that many runs never hide the curves
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        else:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = os.path.join(outdir, name)
        save_png(fig, path)
        plt.close(fig)
        written.append(path)
    return written


def prepare_plot_folder(outdir: str) -> None:
    """Makes the --plot folder if missing; refuses one that holds a file of the plots' names this program did not
    write (a user's file is never replaced)."""
    folder = Path(outdir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--plot {outdir} is {what_is_there(folder) or 'a file'}, not a folder; pass a folder (it is "
                         "made if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make the --plot folder {outdir} ({exc.strerror}); pass a folder you can write") \
            from None
    for name in PLOT_NAMES:
        path = folder / name
        if (path.exists() or path.is_symlink()) and png_software(path) != PLOT_SOFTWARE:
            raise UsageError(f"{path} is not a plot read_records.py wrote, so it is left as is; move it or pass "
                             "another --plot folder")


def png_software(path: Path) -> str | None:
    """The "Software" text chunk of a PNG (matplotlib writes it before the image data), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    if not head.startswith(PNG_SIGNATURE):
        return None
    at = len(PNG_SIGNATURE)
    while at + 8 <= len(head):
        length, kind = int.from_bytes(head[at:at + 4], "big"), head[at + 4:at + 8]
        key, _, text = head[at + 8:at + 8 + length].partition(b"\0")
        if kind == b"tEXt" and key == b"Software":
            return text.decode("latin-1")
        at += 12 + length  # length, type, data, CRC
    return None


def save_png(fig, path: str) -> None:
    """One plot, marked as this program's (PLOT_SOFTWARE) so that a later --plot may replace it."""
    try:
        fig.savefig(path, metadata={"Software": PLOT_SOFTWARE})
    except OSError as exc:
        raise UsageError(f"cannot write {path} ({exc.strerror}); pass a --plot folder you can write") from None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="read_records.py",
        description="Tabulate speedrun training logs and test mean final val loss < target.",
        epilog=f"p-values need scipy and plots need matplotlib: {INSTALL_HINT}",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="log file or folder (searched recursively)")
    parser.add_argument("--target", type=number(0, lo_open=True), default=3.28,
                        help="val loss the mean must be below (default 3.28)")
    parser.add_argument("--alpha", type=number(0, 1, lo_open=True, hi_open=True), default=0.01,
                        help="significance level, in (0, 1) (default 0.01)")
    parser.add_argument("--group-by", metavar="KEY", default=None,
                        help="'folder', 'preset', 'world_size', 'devices' or a hyperparameter name")
    parser.add_argument("--plot", metavar="DIR", default=None,
                        help="write PNG plots into DIR; a file of theirs there is replaced only if this program "
                        "wrote it, anything else is refused")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: report(build_parser().parse_args(argv)))


def report(args: argparse.Namespace) -> int:
    runs, skipped = read_runs(args.paths)
    for path, reason in skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    if not runs:
        why = "no run could be read (the reasons are above)" if skipped else \
            f"no log or summary found in {', '.join(args.paths)}"
        raise UsageError(f"{why}: pass a folder or file of train_gpt.py logs or summaries, or public speedrun logs")
    for run in runs:
        run.group = group_label(run, args.group_by)
    notes: list[str] = []
    stats = group_stats(runs, args.target, args.alpha, notes)
    plots: list[str] = []
    if args.plot:
        try:
            plots = write_plots(runs, args.plot, bool(args.group_by), args.target)
        except MissingExtra as exc:
            notes.append(str(exc))
    for note in notes:
        print(note, file=sys.stderr)
    if args.json:
        print(json.dumps({
            "runs": [r.to_dict() for r in runs],
            "stats": stats,
            "skipped": [{"path": p, "reason": r} for p, r in skipped],
            "plots": plots,
            "notes": notes,
        }, indent=2))
    else:
        print(render_table(runs, bool(args.group_by)))
        print()
        print(render_stats(stats))
        for path in plots:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
