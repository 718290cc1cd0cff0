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
"""
from __future__ import annotations

import os
import sys

from flags import EXIT_OK, EXIT_PEER_LOST, one_line, run_cli

DEFAULT_JOIN_TIMEOUT_S = 600  # torch.distributed.elastic's c10d rendezvous default
DEFAULT_READ_TIMEOUT_S = 60  # its store's: connecting to an unreachable endpoint takes ~2 x 60 s + retries


def rdzv_conf(args) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)


def with_store_timeout(argv: list[str]) -> list[str]:
    """argv with the rendezvous store's read_timeout at most join_timeout (unless the user set it), so that an
    endpoint that never answers is given up on after about join_timeout, not after minutes of retries."""
    from torch.distributed.run import parse_args
    args = parse_args(argv)
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


def main(argv: list[str] | None = None) -> int:
    quiet_torch_import()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun_main
    argv = sys.argv[1:] if argv is None else argv
    try:
        torchrun_main(with_store_timeout(argv))
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
