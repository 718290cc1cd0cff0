"""HellaSwag accuracy of a trained model: python -m tools.hellaswag <checkpoint> [--data FILE.jsonl]

The usual completion-scoring protocol: each example is a context and four endings; the model scores
"<|endoftext|>" + context + " " + ending, and only the ending's tokens count. acc picks the ending
with the lowest summed loss, acc_norm the one with the lowest mean loss per token.

Without --data it scores the validation split (10,042 examples), downloaded once from its public
location into a cache and checked against the git blob id train_gpt.py pins (HELLASWAG_BLOB_SHA1). GPT-2 small (124M) scores about
0.29 acc_norm (llm.c); a model at 3.28 validation loss should land near that.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import evaluation
from flags import integer, run_cli, user_file
from tools.loading import load_model, model_parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--data", default="", help=f"a local HellaSwag JSONL file (default: the pinned {evaluation.HELLASWAG_FILE})")
    p.add_argument("--cache_dir", default="", help=f"where the download is kept (default {evaluation.download_cache_dir()})")
    p.add_argument("--limit", type=integer(0), default=0, help="score only the first N examples (0: all)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.data:  # now, not after the model loads
        user_file(opts.data, "--data", evaluation.HELLASWAG_FETCH_HINT)
    loaded = load_model(opts.checkpoint, opts.device, opts.window)
    max_tokens = min(evaluation.HELLASWAG_PACK_TOKENS, loaded.model.context_len)
    items, path = evaluation.load_hellaswag(opts.data, max_tokens, Path(opts.cache_dir) if opts.cache_dir else None)
    if opts.data:
        pinned = evaluation.git_blob_id(path.read_bytes()) == evaluation.HELLASWAG_BLOB_SHA1
        print(f"{path}: {'the pinned validation file' if pinned else 'not the pinned validation file'}",
              file=sys.stderr)
    items = items[:opts.limit] if opts.limit else items
    started = time.perf_counter()
    result = evaluation.hellaswag_score(loaded.model, items, loaded.windows, show_progress=True)
    print(f"hellaswag: acc:{result.acc:.4f} acc_norm:{result.acc_norm:.4f} examples:{result.examples} "
          f"({loaded.source}, step {loaded.step}, window {loaded.window_blocks} blocks, "
          f"{time.perf_counter() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
