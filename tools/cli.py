"""How every program outside the trainer ends, without torch: data/ and records/ read and write files on
machines that may not have it (a login node, a laptop), and tools/ share the same endings.

A UsageError (an expected bad condition: a flag, a file, the network) is one 'error: ...' line and
EXIT_USAGE (the trainer's RunFailed, a usage error by type, carries EXIT_RUN_FAILED); Ctrl-C is one line and 128 + SIGINT. train_gpt.py stays one file and imports nothing from here:
its own UsageError and exit statuses carry the same meaning (tests/test_packaging.py holds the two to it), and
the tools pass it to run_cli as one more usage-error type.

Every program's arguments are read by OneLineArgumentParser (a bad one is the same one line), and every number
argument is range-checked where it is parsed, by a type= from integer() or number(): a value outside its range is
refused naming the valid one, never passed on to fail later (NaN and inf are never valid). A comma-separated list
argument is parsed by comma_list(), which never gives an empty list.

A path the user names is read through read_user_file() (or checked by user_file() where the program opens it
itself) and written through write_user_file() (checked first by output_file(), before any long work): a folder,
a FIFO or device, a missing or unreadable file, a binary file where text is wanted, a missing parent folder or
one that cannot be written is one UsageError naming the path, what it is, and what to pass instead.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import signal
import stat
import tempfile
import sys
from pathlib import Path
from typing import Callable

# Exit statuses, the same for every program here (README, "Errors and exit statuses").
EXIT_OK = 0
EXIT_SOME_FAILED = 1  # a program that runs many jobs (bench/ablation.py) finished, but some of them failed
EXIT_USAGE = 2  # a UsageError: the one-line message says what to fix
EXIT_PEER_LOST = 3  # a collective failed (the trainer), or a rendezvous did not form (tools/launch.py)
EXIT_RUN_FAILED = 4  # the run itself failed (diverged, out of data, disk full, a full KV cache), not its input


class UsageError(Exception):
    """An expected bad condition, reported as one line that says what to do, no traceback."""

    def __init__(self, message: str = "", retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable  # trying the same thing again may work (a download that timed out)


def one_line(text: object, limit: int = 1000) -> str:
    """Whitespace collapsed and cut to limit characters: how an error is printed."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit - 1] + "…"


def run_cli(main, interrupted: str = "nothing was lost", usage_errors: tuple[type, ...] = ()) -> int:
    """main()'s exit status; a UsageError (or one of usage_errors) as one 'error: ...' line and EXIT_USAGE,
    Ctrl-C as one line and 130 (128 + SIGINT)."""
    try:
        return main()
    except (UsageError, *usage_errors) as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return getattr(e, "exit_status", EXIT_USAGE)  # the trainer's RunFailed says EXIT_RUN_FAILED
    except KeyboardInterrupt:
        print(f"error: interrupted; {interrupted}", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse for every program here: a bad argument is the one 'error: ...' line (exit 2) that run_cli prints
    for every usage error, not argparse's usage block; --help still prints the whole usage."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def integer(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type= for a whole number in [lo, hi]: anything else is refused with the valid range."""
    valid = f"an integer at least {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    return ranged(int, lambda v: lo <= v and (hi is None or v <= hi), valid)


def number(lo: float, hi: float = math.inf, lo_open: bool = False, hi_open: bool = False,
           also: tuple[float, ...] = ()) -> Callable[[str], float]:
    """An argparse type= for a finite float in the interval, or one of the exact values `also` (0 for "off"):
    NaN and inf are refused everywhere, as the trainer refuses them (they only ever mean a typo)."""
    def ok(v: float) -> bool:
        inside = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        return math.isfinite(v) and (inside or v in also)
    left, right = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
    valid = f"a finite number in {left}{lo:g}, {'inf' if hi == math.inf else f'{hi:g}'}{right}"
    return ranged(float, ok, valid + "".join(f", or {v:g}" for v in also))


def ranged(parse: Callable[[str], float], ok: Callable[[float], bool], valid: str) -> Callable[[str], float]:
    """The type= callable: parse(text) when ok(value), else argparse's one error naming the valid values."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"bad value {text!r}; valid: {valid}")
        return value
    return convert


def comma_list(item: Callable[[str], object] = str, choices: tuple | list | None = None,
               items: str = "values") -> Callable[[str], list]:
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


def missing(path: Path) -> str:
    """Why a path that cannot be stat'ed is not there: the nearest of its folders that is missing, or a file
    on the way that is not a folder."""
    for parent in path.parents:
        if parent.is_dir():
            break
        if parent.exists():
            return f"{parent} is not a folder"
        if parent.parent.is_dir():
            return f"no such file (its folder {parent} does not exist either)"
    return "no such file"


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
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file on the way is not a folder" if e.errno in (errno.ENOTDIR, errno.EEXIST) else e.strerror
        raise UsageError(f"cannot write {what} {path}: cannot make its folder {folder} ({why}); {fix}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {what} {path}: its folder {folder} is not writable; {fix}")
    return path


def output_folder(path: str | os.PathLike, what: str, fix: str) -> Path:
    """path when it is a folder this process can write into, made if missing; else one UsageError."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_dir():
        raise UsageError(f"cannot write into {what} {path}: it is not a folder; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file on the way is not a folder" if e.errno in (errno.ENOTDIR, errno.EEXIST) else e.strerror
        raise UsageError(f"cannot make {what} {path} ({why}); {fix}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write into {what} {path}: permission denied; {fix}")
    return path


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
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise UsageError(f"cannot write {what} {path}: {e.strerror or e}; {fix}") from None
    return path


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
