"""GPT-2's prefix-token table for record #89's prefix-token loss, written once and committed.

    python -m data.prefix_tokens                      # from ../shared/data/gpt2/gpt2.tiktoken
    python -m data.prefix_tokens --vocab path/to/gpt2.tiktoken --output data/gpt2_prefix_tokens.npy

Entry v of the table is the id of the longest *proper* byte prefix of token v's bytes that is itself one of
GPT-2's 50,256 mergeable tokens, or -1 where there is none (modded-nanogpt f411b3d3, train_gpt.py:1175-1198,
build_prefix_table). The 256 single bytes, <|endoftext|> (50256) and the head's padding ids 50257-50303 get -1:
304 entries -1, 50,000 valid; "The" -> "Th", " the" -> " th", " gazed" -> " gaze".

The vocabulary is tiktoken's file format (one "base64(bytes) rank" per line), read here without tiktoken, so the
trainer (which must run offline, with numpy and no tokenizer) only loads the committed .npy (its one reader:
train_gpt.load_prefix_table).
No torch.
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TABLE_PATH = HERE / "gpt2_prefix_tokens.npy"  # the committed table: int32, TABLE_ROWS entries (train_gpt.PREFIX_TABLE)
DEFAULT_VOCAB = HERE.parent.parent / "shared" / "data" / "gpt2" / "gpt2.tiktoken"
TABLE_ROWS = 50304  # the head's padded vocabulary (50257 rounded up to a multiple of 128)
MERGEABLE_TOKENS = 50256  # GPT-2's byte-level BPE tokens; 50256 is <|endoftext|>, a special token


def read_vocab(path: Path) -> dict[bytes, int]:
    """tiktoken's format: every line is base64(token bytes), a space, its rank (= its id)."""
    ranks = {}
    for line in path.read_text().splitlines():
        if line:
            encoded, rank = line.split()
            ranks[base64.b64decode(encoded)] = int(rank)
    return ranks


def build_prefix_table(ranks: dict[bytes, int], rows: int = TABLE_ROWS) -> np.ndarray:
    """Every id's longest proper-prefix token, -1 for none. Sorted byte strings put a prefix before every
    extension of it, so a stack of the current token's ancestors holds its longest prefix on top (T:1175-1198)."""
    table = np.full(rows, -1, dtype=np.int32)
    ancestors: list[tuple[bytes, int]] = []  # shortest first
    for token, rank in sorted(ranks.items()):
        while ancestors and not token.startswith(ancestors[-1][0]):
            ancestors.pop()
        if ancestors:
            table[rank] = ancestors[-1][1]
        ancestors.append((token, rank))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=Path, default=DEFAULT_VOCAB, help="GPT-2's vocabulary, tiktoken's format")
    parser.add_argument("--output", type=Path, default=TABLE_PATH)
    args = parser.parse_args(argv)
    if not args.vocab.is_file():
        print(f"error: no GPT-2 vocabulary at {args.vocab}; pass --vocab path/to/gpt2.tiktoken", file=sys.stderr)
        return 2
    table = build_prefix_table(read_vocab(args.vocab))
    np.save(args.output, table, allow_pickle=False)
    print(f"{args.output}: {int((table >= 0).sum())} of {TABLE_ROWS} tokens have a prefix token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
