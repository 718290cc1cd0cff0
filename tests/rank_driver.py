"""torchrun's worker in the multi-rank tests: runs train_gpt.main(), then checks that the run let go of
everything distributed. A gloo thread still alive, or a stop-signal agreement still pending, when the
interpreter exits can abort a finished rank at random (pytorch/pytorch#190489); here it fails every time,
with exit status LEFT_BEHIND and a line naming what was left."""
import sys
from pathlib import Path

import train_gpt as T

LEFT_BEHIND = 86
REPORT = "left behind after main(): "


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads (pt_gloo_runloop, gloo_tcp_loop, ...), from the kernel's list."""
    names = (comm.read_text().strip() for comm in Path("/proc/self/task").glob("*/comm"))
    return sorted(name for name in names if "gloo" in name)


def exit_checked(status: int, stop: T.StopSignal) -> None:
    """Exits LEFT_BEHIND if anything that can take the GIL at exit is left: a gloo worker thread (it releases
    finished works' tensors) or a pending agreement. gloo's socket loop (gloo_tcp_loop) touches no Python object;
    it is reported, and a run with a lost peer can leave it (its connections are torn down by the exit)."""
    left = gloo_threads() + (["a pending stop-signal agreement"] if stop._pending is not None else [])
    print(f"{REPORT}{left or 'nothing'}", file=sys.stderr, flush=True)
    sys.exit(LEFT_BEHIND if any(item != "gloo_tcp_loop" for item in left) else status)


if __name__ == "__main__":
    stop = T.StopSignal()
    exit_checked(T.main(stop=stop), stop)
