"""The Hub shard downloaders (data/cached_*.py, data/hub_shards.py) against a local fake Hub.

The fake Hub is an http.server on 127.0.0.1 that answers the two requests
huggingface_hub's hf_hub_download / get_hf_file_metadata make for a file of a
dataset repo: HEAD and GET on /datasets/<repo>/resolve/<revision>/<file>, with
X-Repo-Commit, ETag / X-Linked-Etag (the sha256, as for an LFS file),
X-Linked-Size and Content-Length. It sends no Xet headers, so the plain HTTP
path is taken. The downloader runs as a subprocess with HF_ENDPOINT pointing
at the fake Hub, because huggingface_hub reads its settings at import time.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PROGRAM = [sys.executable, "-m", "data.cached_fineweb10B"]  # run from the project root, as the README runs it
REPO_ID = "kjj0/fineweb10B-gpt2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_shard(tokens: list[int]) -> bytes:
    """A shard built from the format's definition, independently of data/shardio.py."""
    header = struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253))
    return header + struct.pack(f"<{len(tokens)}H", *tokens)


def synthetic_shards(num_train: int) -> dict[str, bytes]:
    files = {"fineweb_val_000000.bin": make_shard([50256, 1, 2, 3, 4, 5])}
    for i in range(1, num_train + 1):
        tokens = [50256] + [(i * 7919 + j * 31) % 50257 for j in range(200 + 13 * i)]
        files[f"fineweb_train_{i:06d}.bin"] = make_shard(tokens)
    return files


class FakeHub:
    """Serves `files` as the root of the dataset repo REPO_ID at every revision."""

    def __init__(self, files: dict[str, bytes]):
        self.files = dict(files)
        self.requests: list[tuple[str, str]] = []  # (method, file name)
        self.auth: list[str | None] = []
        self.status: int | None = None  # when set, every request gets this HTTP error
        self.corrupt_body: set[str] = set()  # files whose GET body is damaged (headers stay right)
        self.short_body: set[str] = set()  # files whose GET sends only the first half
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _answer(self, with_body: bool):
                prefix = f"/datasets/{REPO_ID}/resolve/"
                path = unquote(self.path.split("?")[0])
                name = path[len(prefix):].split("/", 1)[-1] if path.startswith(prefix) else None
                with hub._lock:
                    hub.requests.append((self.command, name or path))
                    hub.auth.append(self.headers.get("Authorization"))
                if hub.status is not None:
                    body = b"fake hub failure"
                    self.send_response(hub.status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if with_body:
                        self.wfile.write(body)
                    return
                if name not in hub.files:
                    body = b"Entry not found"
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if with_body:
                        self.wfile.write(body)
                    return
                data = hub.files[name]
                sha = hashlib.sha256(data).hexdigest()
                if with_body and name in hub.corrupt_body:
                    data = data[:-2] + bytes([data[-2] ^ 0xFF, data[-1] ^ 0x0F])
                if with_body and name in hub.short_body:
                    data = data[: len(data) // 2]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))
                self.end_headers()
                if with_body:
                    self.wfile.write(data)

            def do_HEAD(self):
                self._answer(with_body=False)

            def do_GET(self):
                self._answer(with_body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def count(self, method: str, name: str | None = None) -> int:
        with self._lock:
            return sum(1 for m, n in self.requests if m == method and (name is None or n == name))

    def reset(self):
        with self._lock:
            self.requests.clear()
            self.auth.clear()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub():
    server = FakeHub(synthetic_shards(3))
    yield server
    server.close()


def run_download(endpoint: str, tmp_path: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "PROXY" not in k.upper()}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
    )
    env.update(env_extra)
    return subprocess.run(
        [*PROGRAM, *args, "--local_dir", str(tmp_path / "shards")],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str):
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


def bin_files(folder: Path) -> list[str]:
    """Every file below `folder` (hidden ones included) whose name mentions a shard."""
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "fineweb_" in p.name)


def test_downloads_val_and_first_n_train_shards_exactly(hub, tmp_path):
    proc = run_download(hub.url, tmp_path, "2")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "shards"
    expected = ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin"]
    assert bin_files(out) == expected  # nothing else: no train 3, no temporary files
    for name in expected:
        assert (out / name).read_bytes() == hub.files[name]
    assert not (out / ".incoming").exists()
    assert hub.count("GET") == 3
    assert hub.count("GET", "fineweb_train_000003.bin") == 0
    assert all(a is None for a in hub.auth)  # no HF_TOKEN in the environment => no credentials sent


def test_second_run_uses_no_network(hub, tmp_path):
    assert run_download(hub.url, tmp_path, "3").returncode == 0
    hub.reset()
    proc = run_download(hub.url, tmp_path, "3")
    assert proc.returncode == 0, proc.stderr
    assert hub.requests == []
    assert "all 4 shards" in proc.stdout
    # and it works offline as well once everything is there
    proc = run_download(hub.url, tmp_path, "3", HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr
    assert hub.requests == []


def _truncate(b: bytes) -> bytes:
    return b[: len(b) - 10]


def _bad_magic(b: bytes) -> bytes:
    return struct.pack("<i", 12345) + b[4:]


def _bad_version(b: bytes) -> bytes:
    return b[:4] + struct.pack("<i", 7) + b[8:]


def _header_only(b: bytes) -> bytes:
    return b[:100]


@pytest.mark.parametrize("damage", [_truncate, _bad_magic, _bad_version, _header_only])
def test_invalid_shard_on_disk_is_fetched_again(hub, tmp_path, damage):
    assert run_download(hub.url, tmp_path, "2").returncode == 0
    target = tmp_path / "shards" / "fineweb_train_000001.bin"
    target.write_bytes(damage(hub.files[target.name]))
    hub.reset()
    proc = run_download(hub.url, tmp_path, "2")
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == hub.files[target.name]
    assert hub.count("GET") == 1 and hub.count("GET", target.name) == 1
    assert f"{target.name} on disk is invalid" in proc.stdout


def test_verify_finds_damaged_token_body(hub, tmp_path):
    assert run_download(hub.url, tmp_path, "3").returncode == 0
    target = tmp_path / "shards" / "fineweb_train_000002.bin"
    good = hub.files[target.name]
    damaged = bytearray(good)
    damaged[1100] ^= 0x55  # a token in the body: header and size stay valid
    target.write_bytes(bytes(damaged))
    hub.reset()

    # The default check reads headers only: it keeps the file and makes no request.
    proc = run_download(hub.url, tmp_path, "3")
    assert proc.returncode == 0 and hub.requests == []
    assert target.read_bytes() == bytes(damaged)

    # --verify hashes every shard and compares it with the Hub's sha256.
    proc = run_download(hub.url, tmp_path, "3", "--verify")
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == good
    assert hub.count("HEAD") >= 4  # every shard was checked against the Hub
    assert hub.count("GET") == 1 and hub.count("GET", target.name) == 1
    assert proc.stdout.count("verified ") == 3


def test_verify_needs_the_hub(hub, tmp_path):
    assert run_download(hub.url, tmp_path, "1").returncode == 0
    hub.reset()
    proc = run_download(hub.url, tmp_path, "1", "--verify", HF_HUB_OFFLINE="1")
    assert_one_line_error(proc, "HF_HUB_OFFLINE", "--verify")
    assert hub.requests == []


def test_corrupt_download_is_rejected(hub, tmp_path):
    hub.corrupt_body.add("fineweb_train_000001.bin")
    proc = run_download(hub.url, tmp_path, "1", "--retries", "1", "--workers", "1")
    assert_one_line_error(proc, "fineweb_train_000001.bin", "does not match")
    out = tmp_path / "shards"
    assert not (out / "fineweb_train_000001.bin").exists()
    assert hub.count("GET", "fineweb_train_000001.bin") == 2  # tried again once, then gave up
    assert "fineweb_train_000001.bin" not in " ".join(bin_files(out))  # no leftover temporary copy


def test_server_errors_give_one_line(hub, tmp_path):
    hub.status = 500
    proc = run_download(hub.url, tmp_path, "2", "--retries", "1")
    assert_one_line_error(proc, "HTTP 500", "fineweb_val_000000.bin", "HF_ENDPOINT")
    assert bin_files(tmp_path / "shards") == []
    assert hub.count("HEAD", "fineweb_val_000000.bin") == 2  # one retry


def test_server_down_gives_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the socket is closed: nothing listens on that port
    proc = run_download(f"http://127.0.0.1:{port}", tmp_path, "2", "--retries", "0")
    assert_one_line_error(proc, "cannot reach", "HF_ENDPOINT")
    assert bin_files(tmp_path / "shards") == []


def test_short_body_leaves_no_file(hub, tmp_path):
    # The GET delivers fewer bytes than the HEAD announced (as after a dropped connection).
    name = "fineweb_train_000001.bin"
    hub.short_body.add(name)
    proc = run_download(hub.url, tmp_path, "1", "--retries", "1", "--workers", "1")
    assert_one_line_error(proc, name, "cut off", "726 of 1452 bytes")
    assert hub.count("GET", name) == 2
    assert not (tmp_path / "shards" / name).exists()
    assert name not in " ".join(bin_files(tmp_path / "shards"))


def test_offline_with_missing_files_gives_one_line(hub, tmp_path):
    proc = run_download(hub.url, tmp_path, "2", HF_HUB_OFFLINE="1")
    assert_one_line_error(proc, "HF_HUB_OFFLINE", "missing")
    assert hub.requests == []
    assert bin_files(tmp_path / "shards") == []


def test_hf_token_is_sent(hub, tmp_path):
    proc = run_download(hub.url, tmp_path, "1", HF_TOKEN="hf_testtoken123")
    assert proc.returncode == 0, proc.stderr
    assert hub.auth and all(a == "Bearer hf_testtoken123" for a in hub.auth)


def test_missing_file_on_the_hub(hub, tmp_path):
    del hub.files["fineweb_train_000002.bin"]
    proc = run_download(hub.url, tmp_path, "2")
    assert_one_line_error(proc, "fineweb_train_000002.bin", "not found")
    assert not (tmp_path / "shards" / "fineweb_train_000002.bin").exists()


@pytest.mark.parametrize("args, refused", [
    (["104"], "argument N: bad value '104'; valid: an integer in [0, 103]"),
    (["-1"], "argument N: bad value '-1'; valid: an integer in [0, 103]"),
    (["--workers", "0"], "argument --workers: bad value '0'; valid: an integer at least 1"),
    (["--retries", "-1"], "argument --retries: bad value '-1'; valid: an integer at least 0"),
])
def test_a_number_out_of_range_is_refused_in_one_line_before_any_request(hub, tmp_path, args, refused):
    proc = run_download(hub.url, tmp_path, *args)
    assert proc.returncode == 2
    assert_one_line_error(proc, refused + " (see cached_fineweb10B.py --help)")
    assert hub.requests == []


def test_a_local_dir_that_cannot_be_a_folder_is_one_line(hub, tmp_path):
    """A file where the shards' folder goes was 'cannot create ...: File exists', nothing said of what to pass."""
    (tmp_path / "shards").write_text("mine")
    proc = run_download(hub.url, tmp_path, "1")
    assert_one_line_error(proc, f"cannot write into --local_dir {tmp_path / 'shards'}: it is not a folder",
                          "pass a folder you can write")
    assert (tmp_path / "shards").read_text() == "mine"
