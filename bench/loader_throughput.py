"""Token loader throughput: how many tokens/s train_gpt.py's DistributedTokenLoader delivers.

Writes a synthetic shard (data/shardio.py's format) of documents to a temporary folder and times
the loader at the speedrun shape (48K-token sequences, 8 micro-batches per step) on CPU tensors:

    python -m bench.loader_throughput                 # 4M tokens, 8 steps
    python -m bench.loader_throughput --tokens=20000000 --steps=40

Prints one line: tokens/s, tokens and seconds. A number for benchmarks and closing notes, not a test.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import train_gpt as T
from data import shardio
from flags import OneLineArgumentParser, integer, run_cli



def synthetic_documents(n: int, seed: int = 1, mean_doc: int = 40) -> np.ndarray:
    """n token ids: documents of geometric length, each starting with EOT."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, T.EOT_TOKEN, n)
    tokens[0] = T.EOT_TOKEN
    tokens[rng.random(n) < 1 / mean_doc] = T.EOT_TOKEN
    return tokens


def measure(tokens: int, steps: int, seq_len: int, accum: int) -> tuple[int, float]:
    """(tokens loaded, seconds) for `steps` loader steps over a fresh shard."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench_train_000001.bin"
        shardio.write_shard(path, synthetic_documents(tokens))
        stream = T.TokenStream([path], 50257, cycle=True)
        loader = T.DistributedTokenLoader(stream, 0, 1, False, 0, torch.device("cpu"))
        start, loaded = time.perf_counter(), 0
        for _ in range(steps):
            loaded += sum(x.numel() for x, _ in loader.next_batch(accum, seq_len))
        return loaded, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=integer(1), default=4_000_000, help="tokens in the synthetic shard")
    p.add_argument("--steps", type=integer(1), default=8, help="loader steps to time")
    p.add_argument("--seq_len", type=integer(1), default=48 * 1024, help="tokens per sequence (the speedrun's 48K)")
    p.add_argument("--accum", type=integer(1), default=8, help="micro-batches per step (one rank of 1 = 8 GPUs' worth)")
    a = p.parse_args(argv)
    loaded, seconds = measure(a.tokens, a.steps, a.seq_len, a.accum)
    print(f"loader throughput: {loaded / seconds / 1e6:.1f}M tokens/s ({loaded:,} tokens in {seconds:.2f} s; "
          "one process, CPU tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
