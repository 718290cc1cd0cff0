"""Memory of one attention call at the speedrun shape: dense mask (computed) vs banded (measured on CPU).

    python -m bench.attention_memory                       # 48K tokens, 1,792-token window, 6 heads x 128
    python -m bench.attention_memory --seq_len=8192 --window_tokens=1024

The dense numbers are arithmetic: the (T, T) boolean mask, the additive bf16 mask SDPA turns it into,
and the fp32 attention weights SDPA's math backend holds per head. The banded number is measured:
train_gpt.banded_attention forward and backward on random bf16 inputs with documents, peak resident
memory of this process (max RSS) above what it held before the call, inputs and their gradients
included.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

import train_gpt as T
from flags import OneLineArgumentParser, integer, run_cli

GIB = 2 ** 30


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def dense_bytes(seq_len: int, heads: int) -> dict[str, int]:
    pairs = seq_len * seq_len
    return {"bool mask": pairs, "additive bf16 mask": 2 * pairs, "fp32 weights, all heads (math backend)":
            4 * pairs * heads}


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq_len", type=integer(1), default=48 * 1024)
    p.add_argument("--window_tokens", type=integer(1), default=1792)
    p.add_argument("--heads", type=integer(1), default=6)
    p.add_argument("--head_dim", type=integer(1), default=128)
    a = p.parse_args(argv)
    if a.seq_len % T.BLOCK_SIZE or a.window_tokens % T.BLOCK_SIZE:
        p.error(f"--seq_len and --window_tokens must be multiples of the {T.BLOCK_SIZE}-token block")
    torch.set_num_threads(1)
    t, window = a.seq_len, a.window_tokens // T.BLOCK_SIZE
    print(f"one attention call: T={t:,}, window {a.window_tokens} tokens ({window} blocks), "
          f"{a.heads} heads x {a.head_dim}, bf16")
    for what, n in dense_bytes(t, a.heads).items():
        print(f"  dense (computed)  {what}: {n / GIB:.2f} GiB")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, T.EOT_TOKEN, (t,), generator=gen)
    tokens[torch.randint(0, t, (t // 1000,), generator=gen)] = T.EOT_TOKEN
    q, k, v = (torch.randn(1, t, a.heads, a.head_dim, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(1, t, a.heads, a.head_dim, generator=gen).bfloat16()
    inputs = 4 * q.numel() * q.element_size()
    before = max_rss_bytes()
    started = time.perf_counter()
    mask = T.banded_window_mask(tokens, torch.tensor(window))
    out = T.banded_attention(q, k, v, mask, 0.12)
    out.backward(grad)
    seconds = time.perf_counter() - started
    peak = max_rss_bytes() - before
    print(f"  banded (measured) peak above start, forward + backward: {peak / GIB:.2f} GiB "
          f"(inputs q, k, v and the output gradient: {inputs / GIB:.2f} GiB; {len(mask.chunks)} SDPA calls; "
          f"{seconds:.0f} s on one thread)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
