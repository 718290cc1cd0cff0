"""The command line of every program here, without torch: how a dataclass of hyperparameters becomes
`--name=value` flags (their kinds, their one-line help and groups), the rules of what a flag or argument accepts
(Rule: the trainer checks its fields with them, and every program's argparse takes them as type=), and the one-line
errors and exit statuses every bad input ends in (UsageError, run_cli, OneLineArgumentParser). Nothing here knows
the speedrun: train_gpt.py declares its Hyperparameters with flag() and its ranges with the rules below; data/ and
records/, which run on machines without torch, end the same way through this module. A comma-separated list
argument is parsed by comma_list(), which never gives an empty list; a path the user names is read through
read_user_file() (or checked by user_file() where the program opens it itself) and written through
write_user_file() (checked first by output_file(), before any long work): a folder, a FIFO or device, a missing or
unreadable file, binary where text is wanted, a missing or unwritable folder is one UsageError naming the path,
what it is, and what to pass instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import math
import os
import signal
import stat
import sys
import tempfile
import types
import typing
from dataclasses import dataclass
from pathlib import Path

# Exit statuses, the same for every program here (docs/reliability.md).
EXIT_OK = 0
EXIT_SOME_FAILED = 1  # a program that runs many jobs (bench/ablation.py) finished, but some of them failed
EXIT_USAGE = 2  # a UsageError: the one-line message says what to fix
EXIT_PEER_LOST = 3  # a collective failed (the trainer), or a rendezvous did not form (tools/launch.py)
EXIT_RUN_FAILED = 4  # a RunFailed: the run itself failed (diverged, out of data, disk full), not its input


class UsageError(Exception):
    """An expected bad condition (flag, data, checkpoint, file, environment, the network): reported as one line
    that says what to do, no traceback."""
    exit_status = EXIT_USAGE

    def __init__(self, message: str = "", retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable  # trying the same thing again may work (a download that timed out)


class RunFailed(UsageError):
    """A run that started well and failed on its own (diverged, ran out of data, a full disk, a full KV cache):
    one line that says what to do, like a UsageError, but its own exit status, since no flag was wrong."""
    exit_status = EXIT_RUN_FAILED


# ----------------------------------------------------------------------------- how a program ends

def one_line(text: object, limit: int = 1000) -> str:
    """Whitespace collapsed and cut to limit characters: how an error is printed."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit - 1] + "…"


def run_cli(main, interrupted: str = "nothing was lost") -> int:
    """main()'s exit status; a UsageError as one 'error: ...' line and its exit status, Ctrl-C as one line and 130
    (128 + SIGINT)."""
    try:
        return main()
    except UsageError as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return e.exit_status
    except KeyboardInterrupt:
        print(f"error: interrupted; {interrupted}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


def stopped_before_training(signum: int) -> str:
    """The one line a signal ends a run with before its first training step."""
    return (f"error: stopped by signal {signal.Signals(signum).name} before the first training step; nothing was "
            "trained or saved: run again (or resume from the last checkpoint)")


def exit_on_signal_while_importing(signum: int, frame) -> None:
    """Ctrl-C or SIGTERM while numpy and torch import (seconds, before train() installs StopSignal)."""
    print(stopped_before_training(signum), file=sys.stderr, flush=True)
    os._exit(128 + signum)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse for every program here: a bad argument is the one 'error: ...' line (exit 2) that run_cli prints
    for every usage error, not argparse's usage block; --help still prints the whole usage."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


# ----------------------------------------------------------------------------- fields as flags

def flag(default, doc: str = "", group: str | None = None):
    """A hyperparameter: its default, what it does (one line of --help) and, on the first field of a group, the
    group's title; the fields that follow belong to it until the next title."""
    return dataclasses.field(default=default, metadata={"doc": doc, "group": group})


@dataclass(frozen=True)
class FieldType:
    """How the command line sets a hyperparameter: its kind, and whether 'none' sets it to None."""
    kind: type  # bool | int | float | str
    optional: bool = False  # annotated `kind | None`

    def __str__(self) -> str:
        return self.kind.__name__ + (" or none" if self.optional else "")

    def parse(self, text: str):
        """The value of a command-line text; ValueError when it is not of this kind."""
        if self.optional and text.lower() == "none":
            return None
        if self.kind is bool:
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        return self.kind(text)

    def holds(self, value: object) -> bool:
        """Whether a JSON value (a checkpoint's record) is of this kind: an int passes for a float, a bool for
        nothing but a bool."""
        if value is None or isinstance(value, bool):
            return value is None and self.optional or isinstance(value, bool) and self.kind is bool
        return isinstance(value, (int, float) if self.kind is float else self.kind)


def field_types(cls: type) -> dict[str, FieldType]:
    """Every field's FieldType, read from its annotation: bool, int, float, str, or one of them | None.
    Any other annotation is refused in one line (the command line could not set it)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        kinds = [k for k in parts if k is not type(None)]
        if len(kinds) != 1 or kinds[0] not in (bool, int, float, str):
            raise UsageError(f"hyperparameter {f.name} is annotated {hint}, which the command line cannot set: "
                             "use bool, int, float, str, or one of them | None")
        out[f.name] = FieldType(kinds[0], optional=len(parts) > len(kinds))
    return out


def flag_text(value: object) -> str:
    """A value as the command line writes it: true/false, none, the rest as is."""
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def as_flags(values: dict[str, object]) -> list[str]:
    """Values as the command-line arguments that set them."""
    return [f"--{name}={flag_text(value)}" for name, value in values.items()]


def parse_overrides(cls: type, argv: list[str]) -> dict[str, object]:
    """The values the command line sets, `--name=value` each (a bare --name sets a switch true); unknown names
    and values of the wrong kind are refused."""
    kinds = field_types(cls)
    overrides: dict[str, object] = {}
    for arg in argv:
        name, sep, text = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or name not in kinds:
            raise UsageError(f"unknown argument {arg!r}; valid: " + " ".join(f"--{n}=" for n in kinds))
        if not sep:
            if kinds[name].kind is not bool:
                raise UsageError(f"--{name} needs a value: --{name}=<{kinds[name]}>")
            text = "true"
        try:
            overrides[name] = kinds[name].parse(text)
        except ValueError:
            raise UsageError(f"bad value {text!r} for --{name}: expected {kinds[name]}") from None
    return overrides


def help_lines(values: object, others: dict[str, object], same: tuple[str, ...] = (),
               sources: dict[str, str] | None = None) -> list[str]:
    """--help's flag lines: every field of the dataclass instance `values` in its group, as --name=value, then
    [other: x] for each of `others` (label: another instance) whose value differs (fields in `same` never
    show one), then (from: source) where `sources` names where the value comes from, then the field's doc."""
    lines = []
    for f in dataclasses.fields(values):
        if f.metadata.get("group"):
            lines += ["", f.metadata["group"] + ":"]
        value = getattr(values, f.name)
        differ = ", ".join(f"{label}: {flag_text(getattr(other, f.name))}" for label, other in others.items()
                           if getattr(other, f.name) != value and f.name not in same)
        doc = f.metadata.get("doc", "")
        source = (sources or {}).get(f.name)
        lines.append(f"  --{f.name}={flag_text(value)}" + (f" [{differ}]" if differ else "")
                     + (f" (from: {source})" if source else "") + (f"  {doc}" if doc else ""))
    return lines


# ----------------------------------------------------------------------------- what each flag accepts

@dataclass(frozen=True)
class Rule:
    """What one flag or argument accepts: a predicate, the valid range as the error message states it, and how a
    command-line text becomes a value when the rule is an argparse type=."""
    ok: typing.Callable[[object], bool]
    valid: str
    parse: typing.Callable[[str], object] = str

    def __call__(self, text: str):
        """As an argparse type=: the value of text, or argparse's one error naming the valid values."""
        try:
            value = self.parse(text)
        except ValueError:
            value = None
        if value is None or not self.ok(value):
            raise argparse.ArgumentTypeError(f"bad value {text!r}; valid: {self.valid}")
        return value


def integer(lo: int, hi: int | None = None) -> Rule:
    """A whole number in [lo, hi] (hi None: no upper bound)."""
    return Rule(lambda v: lo <= v and (hi is None or v <= hi),
                f"an integer at least {lo}" if hi is None else f"an integer in [{lo}, {hi}]", int)


def number(lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False,
           also: tuple[float, ...] = ()) -> Rule:
    """A finite float in the interval, or one of the exact values `also` (0 for "off"): NaN and inf are refused
    everywhere (they only ever mean a typo)."""
    def ok(v):
        inside = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        return math.isfinite(v) and (inside or v in also)
    left, right = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
    valid = f"a finite number in {left}{lo:g}, {'inf' if hi == math.inf else f'{hi:g}'}{right}"
    return Rule(ok, valid + "".join(f", or {v:g}" for v in also), float)


def one_of(*allowed: str) -> Rule:
    return Rule(lambda v: v in allowed, "one of " + ", ".join(allowed))


ANY_BOOL = Rule(lambda v: isinstance(v, bool), "true or false")  # a checkpoint's JSON could hold anything
ANY_TEXT = Rule(lambda v: True, "any text")
NON_EMPTY = Rule(lambda v: v != "", "a non-empty path or glob")
# A run id names a log file and a folder directly under --log_dir, so it must not be a path.
PLAIN_NAME = Rule(lambda v: v == "" or (v not in (".", "..") and v[0] != "." and
                                        all(c.isascii() and (c.isalnum() or c in "._+=-") for c in v)),
                  "a plain name of letters, digits and ._+=- (no path separators, no leading dot), "
                  "or empty for a fresh name")
UNIT = number(0.0, 1.0)
BETA = number(0.0, 1.0, hi_open=True)  # a decay of 1 never forgets; above 1 it diverges
OPTIONAL_BETA = Rule(lambda v: v is None or BETA.ok(v), BETA.valid + ", or none")
LR = number(0.0)


# ----------------------------------------------------------------------------- lists and the user's paths

def comma_list(item: typing.Callable[[str], object] = str, choices: tuple | list | None = None,
               items: str = "values") -> typing.Callable[[str], list]:
    """An argparse type= for a comma-separated list: each item parsed by item (an integer() or number() range
    check), or one of choices; an empty list ('', ',') is refused, as it only ever means a typo."""
    def convert(text: str) -> list:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            valid = f"one or more of {', '.join(map(str, choices))}" if choices else f"one or more {items}"
            raise argparse.ArgumentTypeError(f"empty list {text!r}; pass {valid}, comma-separated")
        unknown = [part for part in parts if choices is not None and part not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; valid: {', '.join(choices)}")
        return [item(part) for part in parts]
    return convert


def what_is_there(path: Path) -> str:
    """What is at path when it is not a regular file: 'a folder', 'a FIFO (named pipe)', ... ('' for a file)."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return ""
    return ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "not a regular file")


def missing(path: Path, said: str = "no such file") -> str:
    """Why a path that cannot be stat'ed is not there (`said`, and the nearest of its folders that is missing), or
    the file on the way that is not a folder."""
    for parent in path.parents:
        if parent.is_dir():
            break
        if parent.exists():
            return f"{parent} is not a folder"
        if parent.parent.is_dir():
            return f"{said} (its folder {parent} does not exist either)"
    return said


def user_file(path: str | os.PathLike, what: str, fix: str) -> Path:
    """path when it is a regular file this process may read; else a UsageError: 'cannot read WHAT PATH: why;
    FIX'. Never opens it (a FIFO would block until a writer came)."""
    path = Path(path)
    try:
        there = what_is_there(path)
    except OSError as e:
        why = missing(path) if e.errno in (errno.ENOENT, errno.ENOTDIR) else e.strerror or str(e)
        raise UsageError(f"cannot read {what} {path}: {why}; {fix}") from None
    if there:
        raise UsageError(f"cannot read {what} {path}: it is {there}, not a file; {fix}")
    if not os.access(path, os.R_OK):
        raise UsageError(f"cannot read {what} {path}: permission denied; {fix}")
    return path


def read_user_file(path: str | os.PathLike, what: str, fix: str, binary: bool = False) -> str | bytes:
    """The contents of a file the user named: text (UTF-8, no NUL bytes) unless binary; every way it cannot be
    read (see user_file; a binary file where text is wanted) is one UsageError that says what to pass instead."""
    path = user_file(path, what, fix)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}; {fix}") from None
    if binary:
        return data
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, data.index(b"\0"), data.index(b"\0") + 1, "NUL byte")
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"cannot read {what} {path}: not a text file (byte {e.start} is not UTF-8 text); "
                         f"{fix}") from None


def output_file(path: str | os.PathLike, what: str, fix: str) -> Path:
    """path when a file can be written there: checked before a program's work, so that a bad output path is
    refused at once, not after the work is done. Its folder is made if missing."""
    path = Path(path)
    try:
        there = what_is_there(path) if os.path.lexists(path) else ""
    except OSError as e:  # a dangling link, or no permission to look
        there = "" if e.errno == errno.ENOENT else e.strerror or str(e)
    if there:
        raise UsageError(f"cannot write {what} {path}: it is {there}; {fix}")
    folder = path.parent
    writable_folder(folder, f"cannot write {what} {path}: cannot make its folder {folder}",
                    f"cannot write {what} {path}: its folder {folder} is not writable", fix)
    return path


def output_folder(path: str | os.PathLike, what: str, fix: str) -> Path:
    """path when it is a folder this process can write into, made if missing; else one UsageError."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise UsageError(f"cannot write into {what} {path}: it is not a folder; {fix}")
    writable_folder(path, f"cannot make {what} {path}", f"cannot write into {what} {path}: permission denied", fix)
    return path


def writable_folder(folder: Path, cannot_make: str, cannot_write: str, fix: str) -> None:
    """Makes folder (and the folders above it) if missing; one UsageError if it cannot, or cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file on the way is not a folder" if e.errno in (errno.ENOTDIR, errno.EEXIST) else e.strerror
        raise UsageError(f"{cannot_make} ({why}); {fix}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{cannot_write}; {fix}")


def write_user_file(path: str | os.PathLike, data: str | bytes, what: str, fix: str) -> Path:
    """Writes data to a file the user named, whole or not at all (a temporary file beside it, renamed over it):
    an earlier file there is never left half written. Any failure is one UsageError."""
    path = output_file(path, what, fix)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise UsageError(f"cannot write {what} {path}: {e.strerror or e}; {fix}") from None
    return path


def new_file_mode() -> int:
    """The permissions open() gives a new file under this process's umask (0644 under the usual 022)."""
    umask = os.umask(0o022)  # reading the umask means setting it: set it straight back
    os.umask(umask)
    return 0o666 & ~umask
