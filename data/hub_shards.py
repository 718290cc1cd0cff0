"""Download pre-tokenized FineWeb shards from the Hugging Face Hub.

Shared implementation of data/cached_fineweb10B.py, data/cached_fineweb100B.py
and data/cached_finewebedu10B.py. Each fetches the val shard and the first N
train shards of one dataset repo into data/<name>/.

How a shard gets on disk:
  * A shard already present is kept if its header is valid (magic, version and
    a size that matches the token count); no network is used for it. With
    --verify its whole content is also hashed and compared with the Hub's
    ETag, which for LFS files is the sha256 of the file.
  * A missing or invalid shard is downloaded with huggingface_hub into the
    hidden folder <local_dir>/.incoming/, its header is checked and its sha256
    is compared with the ETag the Hub announced; only then is it moved over
    the final name with os.replace. A final name never holds a partial file.

huggingface_hub reads HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE, HF_HOME (and the
rest of its settings) from the environment when it is imported.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from data import shardio
from flags import OneLineArgumentParser, UsageError, integer, one_line, output_folder, run_cli

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_TRAIN_SHARDS = 8  # 800M tokens; one speedrun (1770 steps x 393,216 tokens) reads fewer than 9 shards
STAGING = ".incoming"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")
_RETRY_STATUS = (408, 429, 500, 502, 503, 504)


@dataclass(frozen=True)
class HubDataset:
    repo_id: str  # dataset repo on the Hub, shards at its root
    prefix: str  # file names are <prefix>_val_000000.bin and <prefix>_train_%06d.bin
    num_train: int  # train shards the repo holds
    folder: str  # default local folder under data/


DATASETS = {
    "fineweb10B": HubDataset("kjj0/fineweb10B-gpt2", "fineweb", 103, "fineweb10B"),
    "fineweb100B": HubDataset("kjj0/fineweb100B-gpt2", "fineweb", 1030, "fineweb100B"),
    "finewebedu10B": HubDataset("kjj0/finewebedu10B-gpt2", "finewebedu", 99, "finewebedu10B"),
}


def shard_names(ds: HubDataset, num_train: int) -> list[str]:
    """The val shard, then train shards 1..num_train."""
    names = [f"{ds.prefix}_val_000000.bin"]
    names += [f"{ds.prefix}_train_{i:06d}.bin" for i in range(1, num_train + 1)]
    return names


def _content_matches(path: Path, etag: str | None) -> bool | None:
    """Whether the file's bytes match the Hub's ETag; None if the ETag is not a content hash."""
    etag = (etag or "").strip('"').lower()
    if _SHA256.fullmatch(etag):
        return shardio.file_sha256(path) == etag
    if _SHA1.fullmatch(etag):
        return shardio.git_blob_sha1(path) == etag
    return None


class Downloader:
    def __init__(self, hub, ds: HubDataset, local_dir: Path, revision: str, retries: int, verify: bool):
        self.hub = hub
        self.ds = ds
        self.local_dir = local_dir
        self.staging = local_dir / STAGING
        self.revision = revision
        self.retries = retries
        self.verify = verify
        self.stop = threading.Event()
        self.endpoint = hub.constants.ENDPOINT

    # --- error translation -------------------------------------------------------------------
    def _explain(self, name: str, exc: BaseException) -> UsageError:
        """Turn an exception from huggingface_hub/httpx into a one-line UsageError."""
        import httpx2  # huggingface_hub's HTTP client

        errors = self.hub.errors
        where = f"{self.ds.repo_id}/{name} from {self.endpoint}"
        manual = f"or copy the shards into {self.local_dir} by hand"
        if isinstance(exc, errors.OfflineModeIsEnabled):
            return UsageError(f"cannot download {where}: HF_HUB_OFFLINE is set; unset it, {manual}")
        if isinstance(exc, (httpx2.ConnectError, httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError)):
            return UsageError(
                f"cannot reach the Hub to download {where} ({type(exc).__name__}: {one_line(exc, 80)}); "
                f"check the network and proxy settings and HF_ENDPOINT, {manual}",
                retryable=True,
            )
        if isinstance(exc, (errors.RepositoryNotFoundError, errors.GatedRepoError)):
            return UsageError(
                f"the Hub at {self.endpoint} denies access to dataset {self.ds.repo_id} "
                f"({type(exc).__name__}); check HF_TOKEN and HF_ENDPOINT"
            )
        if isinstance(exc, errors.RevisionNotFoundError):
            return UsageError(f"revision {self.revision!r} of dataset {self.ds.repo_id} not found at {self.endpoint}; check --revision")
        if isinstance(exc, errors.RemoteEntryNotFoundError):
            return UsageError(f"{name} not found in dataset {self.ds.repo_id} at revision {self.revision!r} on {self.endpoint}")
        if isinstance(exc, errors.FileMetadataError):
            return UsageError(
                f"{self.endpoint} did not answer like the Hugging Face Hub for {name} ({one_line(exc, 80)}); "
                f"check HF_ENDPOINT, {manual}"
            )
        if isinstance(exc, errors.HfHubHTTPError):
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status in (401, 403):
                hint = "check HF_TOKEN"
            elif status is not None and status >= 500:
                hint = f"the server failed; try again later, check HF_ENDPOINT, {manual}"
            else:
                hint = f"check HF_ENDPOINT and HF_TOKEN, {manual}"
            return UsageError(f"the Hub answered HTTP {status} for {where}; {hint}", retryable=status in _RETRY_STATUS)
        if isinstance(exc, OSError):
            # huggingface_hub reports a body shorter or longer than announced as
            # OSError("Consistency check failed: file should be of size N but has size M ...")
            sizes = re.search(r"should be of size (\d+) but has size (\d+)", str(exc))
            if sizes:
                return UsageError(
                    f"download of {where} was cut off (got {sizes[2]} of {sizes[1]} bytes); "
                    f"check the network and run the same command again",
                    retryable=True,
                )
            return UsageError(f"download of {where} failed: {one_line(exc, 120)}")
        return UsageError(f"download of {where} failed: {type(exc).__name__}: {one_line(exc, 120)}")

    # --- one shard ---------------------------------------------------------------------------
    def _fetch_once(self, name: str) -> str:
        hub = self.hub
        final = self.local_dir / name
        try:
            url = hub.hf_hub_url(self.ds.repo_id, name, repo_type="dataset", revision=self.revision)
            meta = hub.get_hf_file_metadata(url)
        except Exception as e:  # noqa: BLE001 - translated into a one-line UsageError
            raise self._explain(name, e) from e

        if self.verify and final.is_file() and shardio.shard_problem(final) is None:
            match = _content_matches(final, meta.etag)
            if match is None:
                return f"kept {name} (the Hub's ETag {meta.etag!r} is not a content hash, so it cannot be verified)"
            if match:
                return f"verified {name}"
            note = f"{name} on disk does not match the Hub's hash; fetched it again: "
        else:
            note = ""

        staged = self.staging / name
        staged.unlink(missing_ok=True)
        start = time.perf_counter()
        try:
            path = Path(
                hub.hf_hub_download(
                    self.ds.repo_id,
                    name,
                    repo_type="dataset",
                    revision=meta.commit_hash or self.revision,  # the commit the ETag belongs to
                    local_dir=self.staging,
                )
            )
        except Exception as e:  # noqa: BLE001
            raise self._explain(name, e) from e
        try:
            problem = shardio.shard_problem(path)
            if problem is None and meta.size is not None and path.stat().st_size != meta.size:
                problem = f"it is {path.stat().st_size} bytes, the Hub said {meta.size}"
            if problem is None and _content_matches(path, meta.etag) is False:
                problem = f"its content does not match the Hub's hash {meta.etag}"
            if problem is not None:
                raise UsageError(
                    f"downloaded {name} from {self.endpoint} is corrupt: {problem}; run the same command again "
                    f"(if it persists, the file on the Hub or a proxy on the way is at fault)",
                    retryable=True,
                )
            os.replace(path, final)
        finally:
            path.unlink(missing_ok=True)
        seconds = time.perf_counter() - start
        size = final.stat().st_size
        return f"{note}downloaded {name} ({size / 1e6:.1f} MB in {seconds:.1f} s)"

    def fetch(self, name: str) -> str:
        attempt = 0
        while True:
            try:
                return self._fetch_once(name)
            except UsageError as f:
                if not f.retryable or attempt >= self.retries or self.stop.is_set():
                    raise
            attempt += 1
            time.sleep(min(2.0 ** (attempt - 1), 8.0))


def _import_hub():
    try:
        import huggingface_hub
        import huggingface_hub.errors  # noqa: F401
        from huggingface_hub.utils import disable_progress_bars, logging as hf_logging
    except ImportError as e:
        raise UsageError(f"huggingface_hub is needed to download shards ({e}); pip install -r requirements.txt") from e
    # Our own progress bar and one-line errors replace the library's per-file bars and warnings.
    disable_progress_bars()
    hf_logging.set_verbosity_error()
    return huggingface_hub


def parse_args(key: str, argv: list[str] | None) -> argparse.Namespace:
    ds = DATASETS[key]
    p = OneLineArgumentParser(
        prog=f"cached_{key}.py",
        description=f"Download the val shard and the first N train shards of the Hub dataset {ds.repo_id} "
        f"({ds.num_train} train shards of 100M GPT-2 tokens) into data/{ds.folder}/.",
    )
    p.add_argument(
        "num_train",
        nargs="?",
        type=integer(0, ds.num_train),
        default=DEFAULT_TRAIN_SHARDS,
        metavar="N",
        help=f"train shards to fetch, 0..{ds.num_train} (default {DEFAULT_TRAIN_SHARDS}; one speedrun reads fewer than 9)",
    )
    p.add_argument("--local_dir", type=Path, default=DATA_DIR / ds.folder, help="where to put the shards (default %(default)s)")
    p.add_argument("--workers", type=integer(1), default=8, help="parallel downloads (default %(default)s)")
    p.add_argument("--revision", default="main", help="branch, tag or commit of the dataset repo (default %(default)s)")
    p.add_argument("--retries", type=integer(0), default=3, help="extra tries per shard on network/server errors (default %(default)s)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="also hash every shard already on disk and compare it with the Hub's sha256 (needs the Hub; reads every byte)",
    )
    return p.parse_args(argv)


def run(key: str, argv: list[str] | None = None) -> int:
    args = parse_args(key, argv)
    ds = DATASETS[key]
    local_dir = args.local_dir.expanduser().resolve()
    hub = _import_hub()
    from tqdm import tqdm

    output_folder(local_dir, "--local_dir", "pass a folder you can write (made if missing)")

    names = shard_names(ds, args.num_train)
    todo = []
    for name in names:
        path = local_dir / name
        if path.exists():
            problem = shardio.shard_problem(path)
            if problem is not None:
                print(f"{name} on disk is invalid ({problem}); fetching it again", flush=True)
            elif not args.verify:
                continue
        todo.append(name)
    on_disk = sum(1 for name in names if (local_dir / name).exists() and shardio.shard_problem(local_dir / name) is None)
    if not todo:
        print(f"all {len(names)} shards of {ds.repo_id} are present in {local_dir}", flush=True)
        return 0
    if hub.constants.is_offline_mode():
        what = "--verify needs the Hub" if args.verify else f"{len(todo)} shard(s) are missing or invalid"
        raise UsageError(
            f"HF_HUB_OFFLINE is set and {what} in {local_dir} (first: {todo[0]}); "
            f"unset HF_HUB_OFFLINE to download them, or copy the shards there by hand"
        )

    action = "checking" if args.verify else "fetching"
    print(f"{ds.repo_id}: {on_disk} of {len(names)} shards on disk, {action} {len(todo)} in {local_dir}", flush=True)
    dl = Downloader(hub, ds, local_dir, args.revision, args.retries, args.verify)
    start = time.perf_counter()
    failures: dict[str, UsageError] = {}
    bar = tqdm(total=len(todo), unit="shard", desc=ds.folder, disable=None, file=sys.stderr)
    pool = ThreadPoolExecutor(max_workers=min(args.workers, len(todo)), thread_name_prefix="shard")
    try:
        futures = {pool.submit(dl.fetch, name): name for name in todo}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for fut in done:
                name = futures[fut]
                exc = fut.exception()
                if exc is None:
                    bar.update(1)
                    tqdm.write(fut.result(), file=sys.stdout)
                    continue
                failures[name] = exc if isinstance(exc, UsageError) else UsageError(f"{name}: {type(exc).__name__}: {one_line(exc)}")
                dl.stop.set()
                for other in pending:
                    other.cancel()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        shutil.rmtree(local_dir / STAGING, ignore_errors=True)
    if failures:
        first = min(failures, key=names.index)
        more = f" ({len(failures) - 1} more shard(s) failed too)" if len(failures) > 1 else ""
        raise UsageError(str(failures[first]) + more)
    print(f"done in {time.perf_counter() - start:.1f} s: {len(names)} valid shards in {local_dir}", flush=True)
    return 0


def main(key: str, argv: list[str] | None = None) -> int:
    """Entry point of the cached_*.py programs: returns the exit status, errors are one line on stderr."""
    return run_cli(lambda: run(key, argv),
                           "shards already complete are kept, run the same command again to resume")
