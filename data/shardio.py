"""The token-shard file format used by every program in data/.

A shard is a 1024-byte header of 256 little-endian int32 values followed by the
tokens as little-endian uint16:

    header[0] = 20240520   (magic)
    header[1] = 1          (version)
    header[2] = token count
    header[3:] = 0

so a complete shard is exactly 1024 + 2 * count bytes long.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import numpy as np

from flags import UsageError  # torch-free: the user-error type of every program here

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
HEADER_DTYPE = np.dtype("<i4")
MAX_TOKENS = 2**31 - 1  # the count must fit the int32 header field


def make_header(count: int) -> bytes:
    """The 1024 header bytes of a shard holding `count` tokens."""
    if not 0 <= count <= MAX_TOKENS:
        raise UsageError(f"token count {count} does not fit a shard header")
    header = np.zeros(HEADER_INTS, dtype=HEADER_DTYPE)
    header[0] = MAGIC
    header[1] = VERSION
    header[2] = count
    return header.tobytes()


def shard_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not a valid shard, or None if its header and size agree.

    Checks the magic, the version and that the file size equals 1024 + 2*count.
    It reads only the header, so it is cheap even for 200 MB shards; it cannot
    see damage inside the token body (compare a content hash for that).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"
    if len(raw) < HEADER_BYTES:
        return f"file is {size} bytes, shorter than the {HEADER_BYTES}-byte header"
    header = np.frombuffer(raw, dtype=HEADER_DTYPE)
    if int(header[0]) != MAGIC:
        return f"bad magic {int(header[0])} (expected {MAGIC})"
    if int(header[1]) != VERSION:
        return f"unsupported version {int(header[1])} (expected {VERSION})"
    count = int(header[2])
    if count < 0:
        return f"negative token count {count} in the header"
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        return f"file is {size} bytes but its header promises {count} tokens ({expected} bytes)"
    return None


def check_shard(path: str | os.PathLike) -> int:
    """Raise UsageError unless `path` is a valid shard; return its token count."""
    problem = shard_problem(path)
    if problem is not None:
        raise UsageError(f"{path}: {problem}")
    with open(path, "rb") as f:
        return int(np.frombuffer(f.read(HEADER_BYTES), dtype=HEADER_DTYPE)[2])


def read_tokens(path: str | os.PathLike) -> np.ndarray:
    """All tokens of a valid shard as a uint16 array."""
    count = check_shard(path)
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        tokens = np.frombuffer(f.read(2 * count), dtype=TOKEN_DTYPE)
    return tokens.astype(np.uint16, copy=False)


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write `tokens` as a shard at `path`, atomically.

    The bytes go to a hidden temporary file in the same folder which is renamed
    over `path` only once it is complete, so `path` never holds a partial shard.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise UsageError("tokens must be a 1-D array")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise UsageError(f"token ids must be in [0, 65535] to fit uint16; got {tokens.min()}..{tokens.max()}")
    body = tokens.astype(TOKEN_DTYPE, copy=False)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(make_header(body.size))
            f.write(body.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (the ETag the Hub gives an LFS file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def git_blob_sha1(path: str | os.PathLike) -> str:
    """Hex git blob id of a file (the ETag the Hub gives a non-LFS file): sha1 of b"blob <size>\\0" + content,
    read in blocks."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
