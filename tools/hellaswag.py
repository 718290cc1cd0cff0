"""HellaSwag accuracy of a trained model: python tools/hellaswag.py <checkpoint> [--data FILE.jsonl]

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

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.cli import OneLineArgumentParser, integer  # noqa: E402
import evaluation  # noqa: E402
from tools.loading import load_model, run_tool  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="step_N/ folder of train_gpt.py, or a tools/export.py folder")
    p.add_argument("--data", default="", help=f"a local HellaSwag JSONL file (default: the pinned {evaluation.HELLASWAG_FILE})")
    p.add_argument("--cache_dir", default="", help=f"where the download is kept (default {evaluation.download_cache_dir()})")
    p.add_argument("--limit", type=integer(0), default=0, help="score only the first N examples (0: all)")
    p.add_argument("--window", default="step", choices=["step", "final"],
                   help="attention window of the checkpoint's step, or the schedule's final one")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
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
    sys.exit(run_tool(main))
