"""data/fineweb.py on small local inputs, with the real GPT-2 encoding.

tiktoken's gpt2 encoding is read from the offline cache in shared/ (next to the
repository); without it these tests are skipped, since fetching it needs the
internet. The program runs as a subprocess, as a user would run it.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TIKTOKEN_CACHE, needs_gpt2_vocab, skip_without_gpt2_vocab

REPO_ROOT = Path(__file__).resolve().parents[1]
PROGRAM = [sys.executable, "-m", "data.fineweb"]  # run from the project root, as the README runs it
EOT = 50256

# Tests that encode text need the GPT-2 ranks; the ones that fail before encoding do not.
needs_gpt2 = needs_gpt2_vocab


@pytest.fixture(scope="module")
def enc():
    skip_without_gpt2_vocab()
    import tiktoken

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
        yield tiktoken.get_encoding("gpt2")


def expected_tokens(enc, docs: list[str]) -> list[int]:
    out: list[int] = []
    for doc in docs:
        out.append(EOT)
        out.extend(enc.encode_ordinary(doc))
    return out


def read_shard(path: Path) -> tuple[tuple[int, ...], list[int]]:
    """(header ints, tokens), decoded from the format's definition and checked for size."""
    raw = path.read_bytes()
    header = struct.unpack("<256i", raw[:1024])
    assert header[0] == 20240520 and header[1] == 1 and all(v == 0 for v in header[3:]), path
    assert len(raw) == 1024 + 2 * header[2], path
    return header, list(struct.unpack(f"<{header[2]}H", raw[1024:]))


def run_tool(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(TIKTOKEN_CACHE), PYTHONUNBUFFERED="1")
    env.update(env_extra or {})
    return subprocess.run([*PROGRAM, *args], env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def shards_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str):
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_hello_world_exact_ids_and_header(tmp_path, enc):
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    src = tmp_path / "hello.txt"
    src.write_text("Hello world\n")
    out = tmp_path / "out"
    proc = run_tool("--input", str(src), "--output_dir", str(out), "--name", "hi", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert shards_in(out) == ["hi_val_000000.bin"]
    raw = (out / "hi_val_000000.bin").read_bytes()
    assert raw == struct.pack("<256i", 20240520, 1, 3, *([0] * 253)) + struct.pack("<3H", 50256, 15496, 995)


TEXT = "  First line of doc one.\nSecond line, same paragraph.\n\n\nA second paragraph.\n   \nThird <|endoftext|> para\n"


@pytest.mark.parametrize(
    "mode, docs",
    [
        ("file", [TEXT.strip()]),
        ("line", ["First line of doc one.", "Second line, same paragraph.", "A second paragraph.", "Third <|endoftext|> para"]),
        ("blank_line", ["First line of doc one.\nSecond line, same paragraph.", "A second paragraph.", "Third <|endoftext|> para"]),
    ],
)
def test_text_document_modes(tmp_path, enc, mode, docs):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    out = tmp_path / "out"
    proc = run_tool("--input", str(src), "--text_docs", mode, "--output_dir", str(out), "--name", "c", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    _, tokens = read_shard(out / "c_val_000000.bin")
    assert tokens == expected_tokens(enc, docs)
    # one separator per document: the literal "<|endoftext|>" text is not the special token
    assert tokens.count(EOT) == len(docs)
    assert f"{len(docs)} documents" in proc.stdout


def test_jsonl_field_order_and_empty_records(tmp_path, enc):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text(
        json.dumps({"body": "  keeps its spaces ", "id": 1})
        + "\n\n"
        + json.dumps({"body": ""})
        + "\n"
        + json.dumps({"body": "ünïcode — ok"})
        + "\n"
    )
    b.write_text(json.dumps({"body": "from the second file"}) + "\n")
    out = tmp_path / "out"
    proc = run_tool("--input", str(a), str(b), "--text_field", "body", "--output_dir", str(out), "--name", "j", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    _, tokens = read_shard(out / "j_val_000000.bin")
    assert tokens == expected_tokens(enc, ["  keeps its spaces ", "ünïcode — ok", "from the second file"])


def test_parquet_input(tmp_path, enc):
    pa = pytest.importorskip("pyarrow", reason="pyarrow (optional extra) is not installed")
    import pyarrow.parquet as pq

    texts = ["parquet row one", "row two", None, "row three"]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": texts, "n": [1, 2, 3, 4]}), path)
    out = tmp_path / "out"
    proc = run_tool("--input", str(path), "--output_dir", str(out), "--name", "p", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    _, tokens = read_shard(out / "p_val_000000.bin")
    assert tokens == expected_tokens(enc, ["parquet row one", "row two", "row three"])


def test_shard_boundaries_split_documents(tmp_path, enc):
    docs = [f"Document number {i} has a few words in it." for i in range(7)]
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(docs) + "\n")
    want = expected_tokens(enc, docs)
    shard, val = 17, 11
    out = tmp_path / "out"
    proc = run_tool(
        "--input", str(src), "--text_docs", "line", "--output_dir", str(out), "--name", "s",
        "--shard_size", str(shard), "--val_tokens", str(val), "--workers", "2",
    )
    assert proc.returncode == 0, proc.stderr
    n_train = -(-(len(want) - val) // shard)
    names = ["s_val_000000.bin"] + [f"s_train_{i:06d}.bin" for i in range(1, n_train + 1)]
    assert shards_in(out) == sorted(names)  # val first, train numbered from 1, nothing else left behind
    pieces = [want[:val]] + [want[val + i * shard : val + (i + 1) * shard] for i in range(n_train)]
    for name, piece in zip(names, pieces):
        header, tokens = read_shard(out / name)
        assert header[2] == len(piece) and tokens == piece, name
    assert len(pieces[-1]) < shard  # the last shard holds the remainder
    # at least one document runs across a shard boundary
    assert any(read_shard(out / name)[1][0] != EOT for name in names[1:])


def test_small_corpus_only_val_shard(tmp_path, enc):
    src = tmp_path / "tiny.txt"
    src.write_text("just a few tokens")
    out = tmp_path / "out"
    proc = run_tool("--input", str(src), "--output_dir", str(out), "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert shards_in(out) == ["tiny_val_000000.bin"]  # the name defaults to the input's stem
    assert "went into the val shard" in proc.stdout


def test_existing_shards_need_overwrite_and_stale_ones_go(tmp_path, enc):
    src = tmp_path / "docs.txt"
    src.write_text(" ".join(["word"] * 60))
    out = tmp_path / "out"
    common = ["--input", str(src), "--output_dir", str(out), "--name", "o", "--workers", "1"]
    assert run_tool(*common, "--shard_size", "10").returncode == 0
    assert len(shards_in(out)) == 7
    proc = run_tool(*common, "--shard_size", "40")
    assert_one_line_error(proc, "--overwrite")
    assert len(shards_in(out)) == 7
    proc = run_tool(*common, "--shard_size", "40", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert shards_in(out) == ["o_train_000001.bin", "o_val_000000.bin"]
    assert read_shard(out / "o_val_000000.bin")[0][2] == 40 and read_shard(out / "o_train_000001.bin")[0][2] == 21


def test_missing_input_is_one_line(tmp_path):
    proc = run_tool("--input", str(tmp_path / "nope.txt"), "--output_dir", str(tmp_path / "out"))
    assert_one_line_error(proc, "nope.txt", "no such file")
    assert not (tmp_path / "out").exists()


def test_an_input_that_is_not_a_file_is_one_line_naming_what_it_is(tmp_path):
    """A FIFO or a folder was 'does not exist or is not a file'; a FIFO is never opened (it would block)."""
    os.mkfifo(tmp_path / "pipe.txt")
    for path, said in [(tmp_path / "pipe.txt", "it is a FIFO (named pipe), not a file"),
                       (tmp_path, "it is a folder, not a file"),
                       (tmp_path / "no" / "x.txt", f"no such file (its folder {tmp_path / 'no'} does not exist")]:
        proc = run_tool("--input", str(path), "--output_dir", str(tmp_path / "out"))
        assert_one_line_error(proc, f"cannot read --input {path}: {said}", "pass .txt, .jsonl or .parquet files")
    assert not (tmp_path / "out").exists()


def test_an_output_dir_that_cannot_be_a_folder_is_one_line(tmp_path):
    """A file in its place was 'cannot create ...: File exists', nothing said of what to pass."""
    (tmp_path / "doc.txt").write_text("hello world\n")
    (tmp_path / "file").write_text("mine")
    for out, said in [(tmp_path / "file", "it is not a folder"), (tmp_path / "file" / "sub", "a file on the way"),
                      ("/proc/nope/out", "cannot make --output_dir /proc/nope/out")]:
        proc = run_tool("--input", str(tmp_path / "doc.txt"), "--output_dir", str(out))
        assert_one_line_error(proc, said, "pass a folder you can write")
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("option, value, valid", [
    ("--workers", "0", "an integer at least 1"),
    ("--shard_size", "0", "an integer in [1, 2147483647]"),
    ("--val_tokens", str(2**31), "an integer in [1, 2147483647]"),  # more than a shard's header can count
    ("--max_docs", "-1", "an integer at least 0"),
])
def test_a_number_out_of_range_is_one_line_naming_the_range(tmp_path, option, value, valid):
    proc = run_tool("--input", str(tmp_path / "a.txt"), "--output_dir", str(tmp_path / "out"), option, value)
    assert_one_line_error(proc, f"argument {option}: bad value '{value}'; valid: {valid} (see fineweb.py --help)")
    assert not (tmp_path / "out").exists()


@needs_gpt2
def test_bad_json_line_is_one_line_and_removes_partial_output(tmp_path):
    src = tmp_path / "bad.jsonl"
    good = "\n".join(json.dumps({"text": f"record {i} " * 50}) for i in range(40))
    src.write_text(good + "\n{not json}\n")
    out = tmp_path / "out"
    proc = run_tool("--input", str(src), "--output_dir", str(out), "--name", "b", "--shard_size", "50", "--workers", "1")
    assert_one_line_error(proc, "bad.jsonl:41", "not valid JSON")
    assert shards_in(out) == []  # shards written before the error were removed


@needs_gpt2
def test_missing_json_field_is_one_line(tmp_path):
    src = tmp_path / "f.jsonl"
    src.write_text(json.dumps({"content": "x"}) + "\n")
    proc = run_tool("--input", str(src), "--output_dir", str(tmp_path / "out"), "--workers", "1")
    assert_one_line_error(proc, "f.jsonl:1", "'text'", "--text_field")


@needs_gpt2
def test_non_utf8_text_is_one_line(tmp_path):
    src = tmp_path / "latin1.txt"
    src.write_bytes("café au lait".encode("latin-1"))
    proc = run_tool("--input", str(src), "--output_dir", str(tmp_path / "out"), "--workers", "1")
    assert_one_line_error(proc, "latin1.txt", "not UTF-8")


@needs_gpt2
def test_empty_input_is_one_line(tmp_path):
    src = tmp_path / "empty.txt"
    src.write_text("\n   \n")
    proc = run_tool("--input", str(src), "--text_docs", "line", "--output_dir", str(tmp_path / "out" / "deeper"),
                    "--workers", "1")
    assert_one_line_error(proc, "no documents")
    assert not (tmp_path / "out").exists()  # refused: neither shards nor the folders made for them are left


def _blocker(tmp_path: Path, module: str) -> dict:
    """Environment in which `import <module>` fails, as on a machine without that optional extra."""
    shim = tmp_path / f"block_{module}" / module
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(f"raise ImportError('No module named {module} (blocked by the test)')\n")
    return {"PYTHONPATH": str(shim.parent)}


def test_missing_datasets_is_one_line(tmp_path):
    proc = run_tool("--version", "10B", "--output_dir", str(tmp_path / "out"), env_extra=_blocker(tmp_path, "datasets"))
    assert_one_line_error(proc, "datasets", "requirements-extras.txt")
    assert not (tmp_path / "out").exists()


def test_missing_pyarrow_is_one_line(tmp_path):
    src = tmp_path / "rows.parquet"
    src.write_bytes(b"PAR1")
    proc = run_tool("--input", str(src), "--output_dir", str(tmp_path / "out"), env_extra=_blocker(tmp_path, "pyarrow"))
    assert_one_line_error(proc, "pyarrow", "requirements-extras.txt")
