"""The bundled sample in data/sample/: checksums, format, and reproducibility."""

from __future__ import annotations

import hashlib
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TIKTOKEN_CACHE

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REPO_ROOT / "data" / "sample"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CORPUS = SHARED / "corpora" / "state_of_the_union.txt"
FILES = ["sotu_val_000000.bin", "sotu_train_000001.bin"]
VAL_TOKENS = 262_144
TOTAL_TOKENS = 2_074_288
DOCUMENTS = 233  # non-empty lines of the corpus


def documented_checksums() -> dict[str, str]:
    """file name -> sha256, from the table in data/sample/README.md."""
    text = (SAMPLE / "README.md").read_text()
    found = dict(re.findall(r"`(\w+\.bin)`.*`([0-9a-f]{64})`", text))
    assert found, "no checksums found in data/sample/README.md"
    return found


def load(name: str) -> tuple[tuple[int, ...], np.ndarray]:
    raw = (SAMPLE / name).read_bytes()
    header = struct.unpack("<256i", raw[:1024])
    return header, np.frombuffer(raw[1024:], dtype="<u2")


def test_files_match_documented_checksums():
    sums = documented_checksums()
    assert sorted(sums) == sorted(FILES)
    assert sorted(p.name for p in SAMPLE.glob("*.bin")) == sorted(FILES)
    for name, digest in sums.items():
        assert hashlib.sha256((SAMPLE / name).read_bytes()).hexdigest() == digest, name
    assert sum((SAMPLE / n).stat().st_size for n in FILES) < 5 * 2**20


def test_headers_and_tokens():
    counts = {}
    separators = 0
    for name in FILES:
        header, tokens = load(name)
        assert header[:2] == (20240520, 1) and all(v == 0 for v in header[3:]), name
        assert header[2] == tokens.size, name  # the size matches the header's count exactly
        assert int(tokens.max()) < 50257, name  # GPT-2 vocabulary
        counts[name] = tokens.size
        separators += int((tokens == 50256).sum())
    val = load("sotu_val_000000.bin")[1]
    assert counts["sotu_val_000000.bin"] == VAL_TOKENS
    assert val[0] == 50256  # the first address starts the val shard
    assert sum(counts.values()) == TOTAL_TOKENS
    assert separators == DOCUMENTS


@pytest.mark.skipif(
    not (CORPUS.is_file() and TIKTOKEN_CACHE.is_dir()),
    reason=f"needs the corpus {CORPUS} and the tiktoken cache {TIKTOKEN_CACHE} to regenerate the sample",
)
def test_regenerating_reproduces_the_files(tmp_path, monkeypatch):
    out = tmp_path / "sample"
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(TIKTOKEN_CACHE))
    proc = subprocess.run(
        [
            sys.executable, "-m", "data.fineweb",
            "--input", str(CORPUS), "--text_docs", "line", "--name", "sotu",
            "--output_dir", str(out), "--val_tokens", "262144", "--workers", "2",
        ],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (out / name).read_bytes() == (SAMPLE / name).read_bytes(), name
    # and the first document decodes back to the first address
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    import tiktoken

    val = load("sotu_val_000000.bin")[1]
    end = int(np.flatnonzero(val == 50256)[1])
    first = tiktoken.get_encoding("gpt2").decode(val[1:end].tolist())
    assert first == CORPUS.read_text(encoding="utf-8").split("\n")[0].strip()
