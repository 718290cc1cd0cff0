"""How every program outside the trainer ends, without torch: data/ and records/ read and write files on
machines that may not have it (a login node, a laptop), and tools/ share the same endings.

A UsageError (an expected bad condition: a flag, a file, the network) is one 'error: ...' line and
EXIT_USAGE (the trainer's RunFailed, a usage error by type, carries EXIT_RUN_FAILED); Ctrl-C is one line and 128 + SIGINT. train_gpt.py stays one file and imports nothing from here:
its own UsageError and exit statuses carry the same meaning (tests/test_setup.py holds the two to it), and
the tools pass it to run_cli as one more usage-error type.
"""

from __future__ import annotations

import signal
import sys

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
