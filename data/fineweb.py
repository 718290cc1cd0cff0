"""Tokenize FineWeb, or local text files, into GPT-2 token shards.

    python -m data.fineweb --version 10B              # FineWeb sample-10BT -> data/fineweb10B/
    python -m data.fineweb --input a.txt b.jsonl --name mine --output_dir out/

Every document becomes <|endoftext|> (50256) followed by its GPT-2 tokens
(tiktoken "gpt2", encode_ordinary: special-token text inside a document is
encoded as plain text). Documents are written in input order into shards of the
format described in data/shardio.py: first <name>_val_000000.bin with
--val_tokens tokens, then <name>_train_000001.bin, ... with --shard_size tokens
each; a document may continue from one shard into the next, and the last shard
holds what is left. Shards are written atomically (temporary file + rename).

Inputs: FineWeb through the `datasets` library (--version), or --input files:
  *.jsonl / *.json   one JSON object per line, text in --text_field (default "text")
  *.parquet          column --text_field (needs pyarrow)
  anything else      UTF-8 text, cut into documents by --text_docs:
                       file        the whole file is one document (default)
                       line        every non-empty line is a document
                       blank_line  paragraphs separated by blank lines are documents
Documents cut from text files are stripped of surrounding whitespace; values
from JSON lines, Parquet and FineWeb are used verbatim. Empty documents are
skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from data import shardio
from flags import OneLineArgumentParser, UsageError, integer, one_line, output_folder, run_cli, user_file

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_SHARD_SIZE = 100_000_000
BATCH_CHARS = 1 << 20  # text handed to a worker at a time

# --version: (dataset repo, config, default output folder, shard name)
FINEWEB = {
    "10B": ("HuggingFaceFW/fineweb", "sample-10BT", "fineweb10B", "fineweb"),
    "100B": ("HuggingFaceFW/fineweb", "sample-100BT", "fineweb100B", "fineweb"),
    "edu10B": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "finewebedu10B", "finewebedu"),
}
TEXT_DOCS = ("file", "line", "blank_line")


# --- document sources ------------------------------------------------------------------------


def _open_text(path: Path):
    try:
        return open(path, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from e


def docs_from_text(path: Path, mode: str) -> Iterator[str]:
    with _open_text(path) as f:
        if mode == "file":
            doc = f.read().strip()
            if doc:
                yield doc
        elif mode == "line":
            for line in f:
                doc = line.strip()
                if doc:
                    yield doc
        elif mode == "blank_line":
            para: list[str] = []
            for line in f:
                if line.strip():
                    para.append(line)
                elif para:
                    yield "".join(para).strip()
                    para = []
            if para:
                yield "".join(para).strip()
        else:
            raise ValueError(f"unknown text_docs mode {mode!r}")


def docs_from_jsonl(path: Path, field: str) -> Iterator[str]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or field not in record:
                raise UsageError(f"{path}:{lineno}: no {field!r} field (choose one with --text_field)")
            text = record[field]
            if not isinstance(text, str):
                raise UsageError(f"{path}:{lineno}: field {field!r} is {type(text).__name__}, not a string")
            if text:
                yield text


def _pyarrow_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise UsageError(f"reading {path.name} needs pyarrow ({e}); pip install -r requirements-extras.txt") from e
    return pq


def docs_from_parquet(path: Path, field: str) -> Iterator[str]:
    pq = _pyarrow_parquet(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for unreadable files
        raise UsageError(f"cannot read {path} as Parquet: {one_line(e, 120)}") from e
    if field not in pf.schema_arrow.names:
        raise UsageError(f"{path} has no column {field!r} (columns: {', '.join(pf.schema_arrow.names)}); use --text_field")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is None:
                continue
            if not isinstance(text, str):
                raise UsageError(f"{path}: column {field!r} holds {type(text).__name__}, not strings")
            if text:
                yield text


def input_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def docs_from_inputs(paths: list[Path], text_docs: str, text_field: str) -> Iterator[str]:
    for path in paths:
        fmt = input_format(path)
        try:
            if fmt == "jsonl":
                yield from docs_from_jsonl(path, text_field)
            elif fmt == "parquet":
                yield from docs_from_parquet(path, text_field)
            else:
                yield from docs_from_text(path, text_docs)
        except UnicodeDecodeError as e:
            raise UsageError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start} of a block)") from e
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from e


def docs_from_fineweb(version: str, streaming: bool) -> Iterator[str]:
    """Opens the dataset now (so that errors come before any output), then yields its texts."""
    repo, config, _, _ = FINEWEB[version]
    try:
        import datasets
    except ImportError as e:
        raise UsageError(f"--version needs the `datasets` package ({e}); pip install -r requirements-extras.txt") from e
    hint = "check the network, HF_ENDPOINT and HF_TOKEN"
    try:
        ds = datasets.load_dataset(repo, name=config, split="train", streaming=streaming)
    except Exception as e:  # noqa: BLE001 - datasets/hub raise many types; reported as one line
        raise UsageError(f"cannot load {repo} ({config}): {type(e).__name__}: {one_line(e, 150)}; {hint}") from e
    return _fineweb_texts(iter(ds), repo, config, hint)


def _fineweb_texts(rows, repo: str, config: str, hint: str) -> Iterator[str]:
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"reading {repo} ({config}) failed: {type(e).__name__}: {one_line(e, 150)}; {hint}") from e
        text = row["text"]
        if text:
            yield text


def limit_docs(docs: Iterable[str], max_docs: int | None) -> Iterator[str]:
    for i, doc in enumerate(docs):
        if max_docs is not None and i >= max_docs:
            return
        yield doc


def batch_docs(docs: Iterable[str], batch_chars: int = BATCH_CHARS) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --- encoding --------------------------------------------------------------------------------

_encoding = None


def load_encoding():
    """tiktoken's GPT-2 encoding (downloaded once by tiktoken, then read from its cache)."""
    global _encoding
    if _encoding is None:
        try:
            import tiktoken
        except ImportError as e:
            raise UsageError(f"tokenizing needs tiktoken ({e}); pip install -r requirements-extras.txt") from e
        try:
            _encoding = tiktoken.get_encoding("gpt2")
        except Exception as e:  # noqa: BLE001 - network errors of tiktoken's one-time download
            raise UsageError(
                f"cannot load tiktoken's gpt2 encoding ({type(e).__name__}: {one_line(e, 120)}); tiktoken downloads it "
                "once and caches it: check the network, or point TIKTOKEN_CACHE_DIR at a folder that holds it"
            ) from e
    return _encoding


def encode_batch(texts: list[str]) -> np.ndarray:
    """[EOT, tokens of doc 0, EOT, tokens of doc 1, ...] as uint16."""
    enc = load_encoding()
    ids: list[int] = []
    for text in texts:
        ids.append(enc.eot_token)  # <|endoftext|> (50256), the document start train_gpt.py looks for
        ids.extend(enc.encode_ordinary(text))
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**16):
        raise UsageError(f"token id {int(arr.max())} does not fit uint16 shards")
    return arr.astype(np.uint16)


def _init_worker():
    load_encoding()


def encoded_batches(batches: Iterable[list[str]], workers: int) -> Iterator[tuple[int, np.ndarray]]:
    """(number of documents, tokens) per batch, in input order."""
    load_encoding()  # fail early, in this process, if the encoding is unavailable
    if workers <= 1:
        for batch in batches:
            yield len(batch), encode_batch(batch)
        return
    import multiprocessing

    with multiprocessing.Pool(workers, initializer=_init_worker) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((len(batch), pool.apply_async(encode_batch, (batch,))))
            if len(pending) >= 2 * workers:
                n, result = pending.popleft()
                yield n, result.get()
        while pending:
            n, result = pending.popleft()
            yield n, result.get()


# --- shards ----------------------------------------------------------------------------------


def shard_name(name: str, index: int) -> str:
    split = "val" if index == 0 else "train"
    return f"{name}_{split}_{index:06d}.bin"


class ShardWriter:
    """Fills shard 0 (val) with `val_tokens` tokens, then train shards of `shard_size` tokens."""

    def __init__(self, out_dir: Path, name: str, shard_size: int, val_tokens: int, on_write=None):
        self.out_dir = out_dir
        self.name = name
        self.shard_size = shard_size
        self.val_tokens = val_tokens
        self.buf = np.empty(max(shard_size, val_tokens), dtype=np.uint16)
        self.filled = 0
        self.index = 0
        self.written: list[tuple[Path, int]] = []
        self.on_write = on_write

    def _capacity(self) -> int:
        return self.val_tokens if self.index == 0 else self.shard_size

    def add(self, tokens: np.ndarray) -> None:
        pos = 0
        while pos < tokens.size:
            take = min(self._capacity() - self.filled, tokens.size - pos)
            self.buf[self.filled : self.filled + take] = tokens[pos : pos + take]
            self.filled += take
            pos += take
            if self.filled == self._capacity():
                self._flush()

    def _flush(self) -> None:
        path = self.out_dir / shard_name(self.name, self.index)
        shardio.write_shard(path, self.buf[: self.filled])
        self.written.append((path, self.filled))
        if self.on_write:
            self.on_write(path, self.filled)
        self.index += 1
        self.filled = 0

    def close(self) -> None:
        if self.filled:
            self._flush()


def existing_shards(out_dir: Path, name: str) -> list[Path]:
    pattern = re.compile(rf"{re.escape(name)}_(val|train)_\d{{6}}\.bin")
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if pattern.fullmatch(p.name))


# --- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(
        prog="fineweb.py",
        description="Tokenize FineWeb (--version) or local files (--input) with GPT-2 BPE into token shards.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--version", choices=sorted(FINEWEB), help="FineWeb sample to tokenize (needs `datasets` and the network)")
    src.add_argument("--input", nargs="+", type=Path, metavar="PATH", help="local .txt / .jsonl / .parquet files")
    p.add_argument("--output_dir", type=Path, help="default: data/<fineweb10B|fineweb100B|finewebedu10B> or data/<name>")
    p.add_argument("--name", help="shard file name prefix (default: fineweb / finewebedu, or the first input's stem)")
    p.add_argument("--shard_size", type=integer(1, shardio.MAX_TOKENS), default=DEFAULT_SHARD_SIZE, help="tokens per train shard (default %(default)s)")
    p.add_argument("--val_tokens", type=integer(1, shardio.MAX_TOKENS), help="tokens in the val shard (default: --shard_size)")
    p.add_argument("--text_docs", choices=TEXT_DOCS, default="file", help="how text files split into documents (default %(default)s)")
    p.add_argument("--text_field", default="text", help="JSON field / Parquet column holding the text (default %(default)s)")
    p.add_argument("--workers", type=integer(1), default=os.cpu_count() or 1, help="encoding processes; 1 encodes in this process (default %(default)s)")
    p.add_argument("--max_docs", type=integer(0), help="stop after this many documents (for quick trials)")
    p.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=True, help="stream FineWeb instead of downloading it first (default on)")
    p.add_argument("--overwrite", action="store_true", help="replace shards with the same name already in --output_dir")
    args = p.parse_args(argv)
    if args.val_tokens is None:
        args.val_tokens = args.shard_size
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]*", args.name):
        p.error("--name may hold letters, digits, '.' and '-' only (it is followed by _val_/_train_)")
    return args


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.version:
        _, _, folder, default_name = FINEWEB[args.version]
        name = args.name or default_name
        out_dir = args.output_dir or DATA_DIR / folder
        docs = docs_from_fineweb(args.version, args.streaming)
    else:
        for path in args.input:
            user_file(path, "--input", "pass .txt, .jsonl or .parquet files")
            if input_format(path) == "parquet":
                _pyarrow_parquet(path)  # say now, not after other inputs were tokenized
        name = args.name or re.sub(r"[^A-Za-z0-9.-]+", "-", args.input[0].stem).strip("-.") or "corpus"
        out_dir = args.output_dir or DATA_DIR / name
        docs = docs_from_inputs(args.input, args.text_docs, args.text_field)

    old = existing_shards(out_dir, name)
    if old and not args.overwrite:
        raise UsageError(f"{out_dir} already holds {len(old)} shard(s) named {name}_*; pass --overwrite to replace them")
    created = [folder for folder in (out_dir, *out_dir.parents) if not folder.exists()]  # deepest first
    output_folder(out_dir, "--output_dir", "pass a folder you can write (made if missing)")

    from tqdm import tqdm

    bar = tqdm(unit="tok", unit_scale=True, desc=name, disable=None, file=sys.stderr)
    writer = ShardWriter(
        out_dir,
        name,
        args.shard_size,
        args.val_tokens,
        on_write=lambda path, n: tqdm.write(f"wrote {path} ({n:,} tokens)", file=sys.stdout),
    )
    start = time.perf_counter()
    num_docs = 0
    try:
        batches = batch_docs(limit_docs(docs, args.max_docs))
        for n, tokens in encoded_batches(batches, args.workers):
            writer.add(tokens)
            num_docs += n
            bar.update(tokens.size)
        writer.close()
        if num_docs == 0:
            raise UsageError("the input holds no documents")
    except BaseException:
        # Leave no half-finished set of shards behind, nor the folders this run created for them.
        for path, _ in writer.written:
            path.unlink(missing_ok=True)
        for folder in created:
            with contextlib.suppress(OSError):  # not empty: something else was put there meanwhile
                folder.rmdir()
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    new = {path for path, _ in writer.written}
    for path in old:
        if path not in new:
            path.unlink(missing_ok=True)  # a stale shard of an earlier, longer run
    total = sum(n for _, n in writer.written)
    val = writer.written[0][1]
    if len(writer.written) == 1:
        print(f"note: all {total:,} tokens went into the val shard; lower --val_tokens to get train shards", file=sys.stdout)
    print(
        f"{num_docs:,} documents, {total:,} tokens ({val:,} val + {total - val:,} train) in "
        f"{len(writer.written)} shard(s) in {out_dir}; {seconds:.2f} s, {total / max(seconds, 1e-9):,.0f} tokens/s",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: run(argv), "the shards of this run were removed")


if __name__ == "__main__":
    sys.exit(main())
