"""torchrun, except that a rendezvous that cannot form ends in one line naming its endpoint.

Takes exactly torchrun's arguments (it runs torch.distributed.run's own main), for example on each
of two nodes:

    python -m tools.launch --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 --rdzv_id=job1 --rdzv_conf=join_timeout=300 \\
        train_gpt.py --run_id=two_nodes

Plain torchrun ends the same failure (a node that never starts, a wrong HOST, a blocked port) with
a 40-line traceback of its rendezvous internals after join_timeout (600 s by default). Here it is
one `error:` line and exit status 3 (EXIT_PEER_LOST: the peers did not come). A failed worker ends
it with that worker's exit status (2 for a usage error, 128 + N for signal N) instead of torchrun's 1.
SIGINT and SIGTERM end it as they end the trainer: the first is sent on to the workers, which stop at their
next step (the trainer checkpoints), then one line and exit status 128 + N; a second is sent on too, and the
workers and the launcher exit at once.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

from flags import EXIT_OK, EXIT_PEER_LOST, UsageError, one_line, run_cli, user_file

DEFAULT_JOIN_TIMEOUT_S = 600  # torch.distributed.elastic's c10d rendezvous default
DEFAULT_READ_TIMEOUT_S = 60  # its store's: connecting to an unreachable endpoint takes ~2 x 60 s + retries


def rdzv_conf(args) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)


def torchrun_args(argv: list[str]):
    """torchrun's parse of argv, checked as far as it can be before anything starts: a bad argument, node or
    process count, or a training script that is not a readable file is one UsageError (torchrun printed
    argparse's usage block, or a traceback of its agent's assertions)."""
    import io
    from torch.distributed.run import determine_local_world_size, parse_args, parse_min_max_nnodes
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parse_args(argv)
    except SystemExit as e:
        if not e.code:  # --help
            raise
        raise UsageError(said.getvalue().strip().splitlines()[-1].split(": error: ", 1)[-1]
                         + " (see python -m tools.launch --help: torchrun's arguments)") from None
    try:
        lo, hi = parse_min_max_nnodes(args.nnodes)
        procs = determine_local_world_size(args.nproc_per_node)
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"{one_line(e)}: pass --nnodes=N or MIN:MAX and --nproc_per_node=N, gpu, cpu or "
                         "auto") from None
    if not 1 <= lo <= hi or procs < 1:
        raise UsageError(f"--nnodes={args.nnodes} --nproc_per_node={args.nproc_per_node}: pass --nnodes=N or MIN:MAX "
                         "with 1 <= MIN <= MAX, and --nproc_per_node of at least 1")
    if not args.module and not args.no_python:
        user_file(args.training_script, "the training script", "pass the path of train_gpt.py")
    return args


def with_store_timeout(argv: list[str]) -> list[str]:
    """argv with the rendezvous store's read_timeout at most join_timeout (unless the user set it), so that an
    endpoint that never answers is given up on after about join_timeout, not after minutes of retries."""
    args = torchrun_args(argv)
    conf = rdzv_conf(args)
    if args.standalone or args.rdzv_backend != "c10d" or "read_timeout" in conf:
        return argv
    conf["read_timeout"] = str(min(int(conf.get("join_timeout", DEFAULT_JOIN_TIMEOUT_S)), DEFAULT_READ_TIMEOUT_S))
    script = argv.index(args.training_script)  # our --rdzv_conf goes last among the launcher's own options
    return argv[:script] + ["--rdzv_conf=" + ",".join(f"{k}={v}" for k, v in conf.items())] + argv[script:]


def rendezvous_line(argv: list[str], error: BaseException) -> str:
    """What failed, where, after how long, and what to check."""
    from torch.distributed.run import parse_args
    args = parse_args(argv)
    timeout = rdzv_conf(args).get("join_timeout", DEFAULT_JOIN_TIMEOUT_S)
    what = type(error).__name__.removeprefix("Rendezvous").removesuffix("Error").lower() or "error"
    cause = error.__cause__ if error.__cause__ is not None and str(error.__cause__).strip() else error
    detail = one_line(cause) if str(cause).strip() else what  # the inner error: its C++ log lines are off
    return (f"the rendezvous at {args.rdzv_endpoint} ({args.rdzv_backend}, id {args.rdzv_id}) did not form "
            f"within join_timeout={timeout}s ({detail}): start the same command on all {args.nnodes} node(s) "
            f"with the same --rdzv_endpoint and --rdzv_id, check that {args.rdzv_endpoint} is reachable from "
            "each, or raise the limit with --rdzv_conf=join_timeout=SECONDS")


def quiet_torch_import() -> None:
    """Imports torch with its C++ log lines off in this process only (the store's connection retries print
    dozens of lines of backtraces; the one error line below says it all). The workers keep the user's level."""
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401  (c10 reads the level once, when torch loads)
    finally:
        if before is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL")
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = before


class LauncherSignals:
    """The signals torchrun handles (SIGINT, SIGTERM, SIGHUP, SIGQUIT), taken as the trainer's StopSignal takes
    them. torchrun's own handler raises SignalException on every signal: the first one, with the workers running,
    still does (its agent sends the signal on to each worker and waits for them), and main() ends in one line;
    a signal before any worker starts, or a second one, is sent on to the workers and ends the launcher at once,
    not in a second traceback chained to the first."""

    def __init__(self):
        self.signum: int | None = None
        self.contexts: list = []  # torchrun's process contexts: each one's workers, in their own sessions

    def install(self) -> "LauncherSignals":
        """Before torch loads (a signal while it imports is one line too), then in place of torchrun's handler,
        which each worker start registers again from its module."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)
        quiet_torch_import()
        from torch.distributed.elastic.multiprocessing import api
        start = api.PContext.start

        def start_noting(context) -> None:
            self.contexts.append(context)
            start(context)

        api.PContext.start = start_noting
        api._terminate_process_handler = self.handle
        self.signal_exception = api.SignalException
        for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
            logging.getLogger(name).addFilter(self.quiet_after_signal)
        return self

    def quiet_after_signal(self, record: logging.LogRecord) -> bool:
        """torchrun's warnings while it stops the workers ("death signal", "closing signal") are said by the one
        line; a worker that must be killed (SIGKILL) still is."""
        return self.signum is None or record.levelno > logging.WARNING or "forcefully" in record.getMessage()

    def handle(self, signum: int, frame) -> None:
        if self.signum is None and self.contexts:
            self.signum = signum
            raise self.signal_exception(f"got signal {signal.Signals(signum).name}", sigval=signal.Signals(signum))
        self.send_on(signum)
        print(f"error: {self.line(signum, again=self.signum is not None)}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def send_on(self, signum: int) -> None:
        for context in self.contexts:
            for pid in context.pids().values():
                with contextlib.suppress(OSError):  # a worker already gone
                    os.killpg(pid, signum)

    def line(self, signum: int, again: bool = False) -> str:
        name = signal.Signals(signum).name
        if not self.contexts:
            return f"stopped by signal {name} before any worker started; nothing was run: run again"
        if again:
            return (f"stopped by a second signal ({name}): sent on to the workers, which exit at once; resume from "
                    "the last checkpoint")
        return (f"stopped by signal {name}: sent on to the workers, which stopped (a run stops at its next step, "
                "after a checkpoint); resume from the last checkpoint")


def main(argv: list[str] | None = None) -> int:
    signals = LauncherSignals().install()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun_main
    argv = sys.argv[1:] if argv is None else argv
    try:
        torchrun_main(with_store_timeout(argv))
    except signals.signal_exception as e:  # torchrun has stopped the workers
        print(f"error: {signals.line(e.sigval)}", file=sys.stderr, flush=True)
        return 128 + e.sigval
    except RendezvousError as e:
        print(f"error: {rendezvous_line(argv, e)}", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    except ChildFailedError as e:  # the worker's own error line is already on stderr
        rank, failure = e.get_first_failure()
        status = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        print(f"error: worker rank {rank} ended with exit status {status} (its own error line is above)",
              file=sys.stderr, flush=True)
        return status
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(run_cli(main, interrupted="the workers were stopped"))
