"""torchrun, except that a rendezvous that cannot form ends in one line naming its endpoint.

Takes exactly torchrun's arguments (it runs torch.distributed.run's own main), for example on each
of two nodes:

    python tools/launch.py --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 --rdzv_id=job1 --rdzv_conf=join_timeout=300 \\
        train_gpt.py --run_id=two_nodes

Plain torchrun ends the same failure (a node that never starts, a wrong HOST, a blocked port) with
a 40-line traceback of its rendezvous internals after join_timeout (600 s by default). Here it is
one `error:` line and exit status 3 (EXIT_PEER_LOST: the peers did not come). A failed worker ends
it with that worker's exit status (2 for a usage error, 128 + N for signal N) instead of torchrun's 1.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.cli import EXIT_OK, EXIT_PEER_LOST, one_line, run_cli  # noqa: E402

DEFAULT_JOIN_TIMEOUT_S = 600  # torch.distributed.elastic's c10d rendezvous default


def rendezvous_line(argv: list[str], error: BaseException) -> str:
    """What failed, where, after how long, and what to check."""
    from torch.distributed.run import parse_args
    args = parse_args(argv)
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    timeout = conf.get("join_timeout", DEFAULT_JOIN_TIMEOUT_S)
    what = type(error).__name__.removeprefix("Rendezvous").removesuffix("Error").lower() or "error"
    detail = one_line(error) if str(error).strip() else what
    return (f"the rendezvous at {args.rdzv_endpoint} ({args.rdzv_backend}, id {args.rdzv_id}) did not form "
            f"within join_timeout={timeout}s ({detail}): start the same command on all {args.nnodes} node(s) "
            f"with the same --rdzv_endpoint and --rdzv_id, check that {args.rdzv_endpoint} is reachable from "
            "each, or raise the limit with --rdzv_conf=join_timeout=SECONDS")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun_main
    argv = sys.argv[1:] if argv is None else argv
    try:
        torchrun_main(argv)
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
