"""When do post-accumulate-grad hooks fire: during backward (eager) or in one burst after it (compiled)?

    python -m bench.overlap_probe            # cpu-preset-sized model, one backward each way

GradientSync launches a bucket's reduce-scatter from these hooks, so their timing decides whether
communication can overlap backward compute. For each mode it runs one forward+backward of the model
and prints, as a fraction of the backward's wall time, when the first and the last hook fired.
Eager: hooks spread over the backward (the first fires early). torch.compile (aot_eager here, the same
autograd structure as inductor): the whole backward is one CompiledFunctionBackward node and every
hook fires after it returns. That is why train_gpt.py launches from hooks only when the model is not
compiled (see GradientSync).
"""

from __future__ import annotations

import sys
import time

import torch

import train_gpt as T


def hook_timing(compiled: bool) -> tuple[float, float, int]:
    args = T.parse_args(["--preset=cpu", "--seq_len=1024", "--zero_init=false", "--compile=off"], False)
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16,
                   attention="banded", fp8_head=False, compile="off")
    torch.manual_seed(0)
    model = T.build_model(args, rt)
    fired: list[float] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(time.perf_counter()))
    run = torch.compile(model, backend="aot_eager", dynamic=False) if compiled else model
    tokens = torch.randint(0, 50000, (args.seq_len + 1,))
    tokens[0] = T.EOT_TOKEN
    window = torch.tensor(4)
    run(tokens[:-1], tokens[1:], window).backward()  # first call compiles; time the second
    model.zero_grad(set_to_none=True)
    fired.clear()
    loss = run(tokens[:-1], tokens[1:], window)
    start = time.perf_counter()
    loss.backward()
    total = time.perf_counter() - start
    return (fired[0] - start) / total, (fired[-1] - start) / total, len(fired)


def main() -> int:
    torch.set_num_threads(1)
    for compiled in (False, True):
        first, last, n = hook_timing(compiled)
        mode = "torch.compile (aot_eager)" if compiled else "eager"
        print(f"{mode:>26}: {n} hooks; first fired at {first:6.1%} of backward, last at {last:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
