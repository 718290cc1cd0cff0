"""How every program outside the trainer ends, without torch: data/ and records/ read and write files on
machines that may not have it (a login node, a laptop), and tools/ share the same endings.

A UsageError (an expected bad condition: a flag, a file, the network) is one 'error: ...' line and
EXIT_USAGE (the trainer's RunFailed, a usage error by type, carries EXIT_RUN_FAILED); Ctrl-C is one line and 128 + SIGINT. train_gpt.py stays one file and imports nothing from here:
its own UsageError and exit statuses carry the same meaning (tests/test_packaging.py holds the two to it), and
the tools pass it to run_cli as one more usage-error type.

Every program's arguments are read by OneLineArgumentParser (a bad one is the same one line), and every number
argument is range-checked where it is parsed, by a type= from integer() or number(): a value outside its range is
refused naming the valid one, never passed on to fail later (NaN and inf are never valid).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
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
