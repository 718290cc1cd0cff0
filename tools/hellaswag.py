"""HellaSwag accuracy of a trained model: python tools/hellaswag.py <checkpoint> [--data FILE.jsonl]

The usual completion-scoring protocol: each example is a context and four endings; the model scores
"<|endoftext|>" + context + " " + ending, and only the ending's tokens count. acc picks the ending
with the lowest summed loss, acc_norm the one with the lowest mean loss per token.

Without --data it scores the validation split (10,042 examples), downloaded once from its public
location into a cache and checked against the git blob id pinned below. GPT-2 small (124M) scores about
0.29 acc_norm (llm.c); a model at 3.28 validation loss should land near that.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.shardio import git_blob_sha1  # noqa: E402  (torch-free, like everything in data/)
from tools.loading import OneLineArgumentParser, T, gpt2_tokenizer, load_model, run_tool  # noqa: E402

COMMIT = "a29ff8e9a04bba4bd6588223785ce105328adc57"  # github.com/rowanz/hellaswag
URL = f"https://raw.githubusercontent.com/rowanz/hellaswag/{COMMIT}/data/hellaswag_val.jsonl"
BLOB_SHA1 = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"  # git's id of data/hellaswag_val.jsonl at COMMIT
FILE_NAME = "hellaswag_val.jsonl"
FETCH_HINT = f"fetch it by hand: curl -L -o {FILE_NAME} {URL}, then pass --data {FILE_NAME}"
PACK_TOKENS = 1024  # candidates are scored packed into sequences of at most this many tokens


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2-speedrun"


def download(url: str, target: Path, expected: str) -> None:
    """Fetches url into target, atomically, only if its content has the expected git blob id."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except Exception as e:  # DNS, refused connections, HTTP errors, timeouts
        raise T.UsageError(f"cannot download the HellaSwag validation file ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]}); {FETCH_HINT}") from None
    if git_blob_sha1(data) != expected:
        raise T.UsageError(f"the downloaded HellaSwag file has git blob id {git_blob_sha1(data)}, expected "
                           f"{expected}: corrupt or changed; {FETCH_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.part{os.getpid()}")  # ranks of one node may download at once
    part.write_bytes(data)
    os.replace(part, target)


def cached_validation_file(cache_dir: Path | None = None, url: str = URL, expected: str = BLOB_SHA1) -> Path:
    """The pinned validation file: downloaded on first use, verified on every use."""
    path = (cache_dir or default_cache_dir()) / FILE_NAME
    if path.is_file():
        found = git_blob_sha1(path.read_bytes())
        if found == expected:
            return path
        print(f"warning: cached {path} has git blob id {found}, expected {expected}; downloading it again",
              file=sys.stderr)
    download(url, path, expected)
    return path


@dataclass
class Example:
    context: str
    endings: list[str]
    label: int


def read_examples(path: Path) -> list[Example]:
    """The validation split's JSONL: one object per line with "ctx", four "endings" and the "label" index."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise T.UsageError(f"HellaSwag file {path} does not exist; {FETCH_HINT}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise T.UsageError(f"cannot read HellaSwag file {path} ({type(e).__name__}); {FETCH_HINT}") from None
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            # a list of 4 strings: a 4-letter string would pass list() as 4 one-letter endings
            example = Example(row["ctx"], row["endings"], int(row["label"]))
            ok = isinstance(example.context, str) and isinstance(example.endings, list) and \
                len(example.endings) == 4 and 0 <= example.label < 4 and all(isinstance(e, str) for e in example.endings)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise T.UsageError(f"line {number} of {path} is not a HellaSwag example (needs ctx, 4 endings and a "
                               f"label 0-3): corrupt or another format; {FETCH_HINT}")
        examples.append(example)
    if not examples:
        raise T.UsageError(f"HellaSwag file {path} holds no examples; {FETCH_HINT}")
    return examples


@dataclass
class Candidate:
    tokens: list[int]  # EOT, context, ending
    ending_start: int  # index of the ending's first token


def candidates(example: Example, enc, max_tokens: int) -> list[Candidate]:
    """The four scored sequences; a context too long for max_tokens loses its oldest tokens."""
    context = enc.encode_ordinary(example.context)
    out = []
    for ending in example.endings:
        end = enc.encode_ordinary(" " + ending)[:max_tokens - 2]
        kept = context[max(0, len(context) - (max_tokens - 1 - len(end))):]
        out.append(Candidate([T.EOT_TOKEN] + kept + end, 1 + len(kept)))
    return out


def tokenized(examples: list[Example], enc, max_tokens: int) -> list[tuple[list[Candidate], int]]:
    return [(candidates(e, enc, max_tokens), e.label) for e in examples]


def packs(rows: list[Candidate], pack_tokens: int):
    """Candidates laid out in sequences of pack_tokens, each starting on a 128-token block boundary.

    Every candidate starts with EOT, so the model's document mask keeps them apart, and on a block
    boundary its sliding windows cover what they would at position 0. Yields (tokens, [(index, start)]).
    """
    layout, used = [], 0
    for index, row in enumerate(rows):
        size = T.next_multiple(len(row.tokens), T.BLOCK_SIZE)
        if layout and used + size > pack_tokens:
            yield layout, used
            layout, used = [], 0
        layout.append((index, used))
        used += size
    if layout:
        yield layout, used


@torch.no_grad()
def ending_losses(model: T.GPT, rows: list[Candidate], window: torch.Tensor, pack_tokens: int) -> list[torch.Tensor]:
    """Per-token losses (fp32) of each candidate's ending, in order."""
    device = model.embed.weight.device
    out: list[torch.Tensor | None] = [None] * len(rows)
    for layout, used in packs(rows, pack_tokens):
        sequence = torch.full((used,), T.EOT_TOKEN, dtype=torch.int64)
        for index, start in layout:
            sequence[start:start + len(rows[index].tokens)] = torch.tensor(rows[index].tokens)
        sequence = sequence.to(device)
        logits = T.apply_softcap(model.logits(sequence, window)[0], model.softcap)
        losses = F.cross_entropy(logits[:-1], sequence[1:], reduction="none")  # losses[p]: token p + 1
        for index, start in layout:
            row = rows[index]
            out[index] = losses[start + row.ending_start - 1:start + len(row.tokens) - 1]
    return out


@dataclass
class Score:
    examples: int
    correct: int  # acc: lowest summed ending loss
    correct_norm: int  # acc_norm: lowest mean ending loss
    predictions: list[tuple[int, int]]  # (acc choice, acc_norm choice) per example

    @property
    def acc(self) -> float:
        return self.correct / max(self.examples, 1)

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / max(self.examples, 1)


def score(model: T.GPT, items: list[tuple[list[Candidate], int]], window_blocks: int,
          pack_tokens: int = PACK_TOKENS) -> Score:
    """acc and acc_norm over tokenized examples (ties go to the first ending)."""
    device = model.embed.weight.device
    pack_tokens = min(pack_tokens, model.context_len)
    window = T.window_tensor(window_blocks, device)
    flat = [row for rows, _ in items for row in rows]
    losses = ending_losses(model, flat, window, pack_tokens)
    predictions, correct, correct_norm = [], 0, 0
    for i, (_, label) in enumerate(items):
        mine = losses[4 * i:4 * i + 4]
        sums = torch.stack([l.sum() for l in mine])
        means = torch.stack([l.mean() for l in mine])
        choice = (int(sums.argmin()), int(means.argmin()))
        predictions.append(choice)
        correct += choice[0] == label
        correct_norm += choice[1] == label
    return Score(len(items), correct, correct_norm, predictions)


def load_items(data: str, max_tokens: int, cache_dir: Path | None = None) -> tuple[list, Path]:
    """Tokenized examples of a local file (data), or of the pinned validation file when data is empty."""
    path = Path(data) if data else cached_validation_file(cache_dir)
    return tokenized(read_examples(path), gpt2_tokenizer(), max_tokens), path


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="step_N/ folder of train_gpt.py, or a tools/export.py folder")
    p.add_argument("--data", default="", help=f"a local HellaSwag JSONL file (default: the pinned {FILE_NAME})")
    p.add_argument("--cache_dir", default="", help=f"where the download is kept (default {default_cache_dir()})")
    p.add_argument("--limit", type=int, default=0, help="score only the first N examples (0: all)")
    p.add_argument("--window", default="step", choices=["step", "final"],
                   help="attention window of the checkpoint's step, or the schedule's final one")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    opts = p.parse_args(argv)
    if opts.limit < 0:
        p.error("--limit must not be negative")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    loaded = load_model(opts.checkpoint, opts.device, opts.window)
    max_tokens = min(PACK_TOKENS, loaded.model.context_len)
    items, path = load_items(opts.data, max_tokens, Path(opts.cache_dir) if opts.cache_dir else None)
    if opts.data:
        pinned = git_blob_sha1(path.read_bytes()) == BLOB_SHA1
        print(f"{path}: {'the pinned validation file' if pinned else 'not the pinned validation file'}",
              file=sys.stderr)
    items = items[:opts.limit] if opts.limit else items
    started = time.perf_counter()
    result = score(loaded.model, items, loaded.window_blocks)
    print(f"hellaswag: acc:{result.acc:.4f} acc_norm:{result.acc_norm:.4f} examples:{result.examples} "
          f"({loaded.source}, step {loaded.step}, window {loaded.window_blocks} blocks, "
          f"{time.perf_counter() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
