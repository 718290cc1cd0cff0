"""Checkpoints and run folders, beside train_gpt.py: torch.distributed.checkpoint folders that any world size
resumes, written atomically (staged, then renamed), every file's size and sha256 recorded and verified before a
byte is trusted, rotated without ever deleting a resume point, and the run folder's rules (one run per run id,
a lock while a run lives, stale staging cleaned up).

The training loop's interface is Checkpoints.save() and Checkpoints.load(); start-up picks what to resume with
choose_checkpoint() and claims the run id with claim_run_id(). The tools read checkpoints through
verified_checkpoint_meta() and read_checkpoint_tensors().
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import pickle
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from flags import RunFailed, UsageError
from runlog import RunFolder, RunLog, end_torn_line


def dcp():
    """torch.distributed.checkpoint, imported when a checkpoint is first written or read (a multi-rank run: before
    its process group forms): with DTensor it takes about as long to import as torch itself, which --help, flag
    errors and the start-up checks never pay."""
    import torch.distributed.checkpoint
    return torch.distributed.checkpoint

# `place` below is train_gpt.py's Place (or Runtime): this process's rank, world_size and device.


@dataclass
class FlatShard:
    """This rank's piece of a tensor flattened to numel elements: ceil(numel / world_size) elements per
    rank, rank r's starting at r times that (torch.chunk's split, which DTensor's Shard(0) uses too)."""
    local: Tensor
    numel: int


CHECKPOINT_META = "checkpoint.json"


# A torch.distributed.checkpoint folder that any world size resumes; earlier ones had a rank<r>.pt per rank.
CHECKPOINT_FORMAT = "dcp-1"


@dataclass
class TrainingState:
    """What a run continues from. The tensors alias the live ones and are named so that they mean the
    same at any world size: model/<name> (identical on every rank), the Adam slices this rank owns as
    FlatShards, the Muon momenta of the matrices it owns. The data position is one global stream, which
    every world size walks alike. Nothing draws random numbers after the model is built, so no RNG
    state is kept (a technique that does must derive its numbers from the seed and the step)."""
    step: int
    loader: dict
    tensors: dict[str, Tensor | FlatShard]
    segments: list[dict] = dataclasses.field(default_factory=list)  # the run's history: see segment()
    target: dict | None = None  # where the run first reached its target loss, once it has


# One launch's share of a run; a checkpoint older than the last two keys records none of them.
SEGMENT_KEYS = ("run_id", "start_step", "end_step", "tokens", "train_time_ms", "energy_j", "wall_time_s")


def segment(run_id: str, start_step: int, end_step: int, tokens: int | None, train_time_ms: float | None,
            energy_j: dict | None = None, wall_time_s: float | None = None) -> dict:
    """One launch's part of a run (a resumed run has several): steps start_step+1 .. end_step, the tokens they
    trained, their training time, the joules of each energy phase summed over ranks (runlog.ENERGY_PHASES; None
    where nothing measured) and the launch's wall time; None where a checkpoint older than this record did not
    say."""
    return dict(zip(SEGMENT_KEYS, (run_id, start_step, end_step, tokens, train_time_ms, energy_j, wall_time_s)))


def recorded_segments(meta: dict) -> list[dict]:
    """The segments a checkpoint records (keys it lacks as None); one of unknown tokens, time and energy for a
    checkpoint that records none."""
    found = meta.get("segments")
    required = set(SEGMENT_KEYS[:5])
    if isinstance(found, list) and all(isinstance(x, dict) and required <= set(x) <= set(SEGMENT_KEYS) for x in found):
        return [{key: x.get(key) for key in SEGMENT_KEYS} for x in found]
    return [segment(str(meta.get("run_id")), 0, meta["step"], None, None)]


def recorded_target(meta: dict) -> dict | None:
    """Where the checkpoint says the run reached its target loss, or None when it has not (or says so in a form
    the trainer never writes: then the run looks for its target again from here)."""
    found = meta.get("target")
    if not isinstance(found, dict) or set(found) != {"val_loss", "reached_val_loss", "step", "train_time_ms",
                                                     "tokens", "energy_j"}:
        return None
    def amount(value, none_ok=False):
        return none_ok and value is None or is_a(value, (int, float)) and math.isfinite(value) and value >= 0
    steps_ok = all(is_a(found[key], int) and 0 <= found[key] for key in ("step", "tokens"))
    amounts_ok = all(amount(found[key]) for key in ("val_loss", "reached_val_loss", "train_time_ms"))
    return found if steps_ok and amounts_ok and amount(found["energy_j"], none_ok=True) else None


def local_part(t: Tensor | FlatShard) -> Tensor:
    return t.local if isinstance(t, FlatShard) else t


def as_dcp_state(state: TrainingState, place) -> dict[str, Tensor]:
    """The tensors as torch.distributed.checkpoint sees them: each FlatShard a DTensor sharded over all
    ranks, so that DCP records which piece of the flat tensor it is and re-cuts it for any world size."""
    if place.world_size == 1:
        return {name: local_part(t) for name, t in state.tensors.items()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh(place.device.type, (place.world_size,))  # not cached: a mesh holds the process group
    return {name: DTensor.from_local(t.local, mesh, [Shard(0)], run_check=False, shape=(t.numel,), stride=(1,))
            if isinstance(t, FlatShard) else t for name, t in state.tensors.items()}


def dcp_call(fn, state: dict, path: Path, world_size: int) -> None:
    """dcp.save or dcp.load on a folder (without a process group on one rank, which DCP warns about)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=str(path), no_dist=world_size == 1)


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints (those with their metadata file) under root, oldest step first."""
    return sorted((d for d in root.glob("step_*") if (d / CHECKPOINT_META).is_file()), key=checkpoint_step)


def checkpoint_step(folder: Path) -> int:
    """The step of a step_N folder, from its name (a staging step_N.tmp or a stray name counts as -1)."""
    digits = folder.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def rotate_checkpoints(root: Path, keep: int, written: Path, resumed_from: Path | None) -> None:
    """Deletes all but the newest `keep` checkpoints of root, never the one just written nor the one this run
    resumed from (its recovery point, whatever its step)."""
    protected = {written.resolve(), resumed_from.resolve() if resumed_from else None}
    rotating = [c for c in complete_checkpoints(root) if c.resolve() not in protected]
    for old in rotating[:max(len(rotating) - (max(keep, 1) - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def set_aside_newer_checkpoints(root: Path, resumed_from: Path, place, log: RunLog) -> None:
    """A run resumed from an older checkpoint of its own folder (after a divergence, say) abandons the newer
    ones: they are moved into root/abandoned_after_step_N_<time>/, never deleted, so that neither rotation nor
    --resume=latest mistakes them for this run's."""
    if place.is_master and resumed_from.parent.resolve() == root.resolve():
        step = checkpoint_step(resumed_from)
        newer = [c for c in complete_checkpoints(root) if checkpoint_step(c) > step]
        if newer:
            aside = root / f"abandoned_after_step_{step:06d}_{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir(exist_ok=True)
            for folder in newer:
                os.replace(folder, aside / folder.name)
            log.write(f"moved {len(newer)} checkpoint(s) newer than the resume point {resumed_from.name} "
                      f"({', '.join(c.name for c in newer)}) aside to {aside}: delete it once you no longer need it")
    ranks_agree(True, place)


def ranks_agree(ok: bool, place) -> bool:
    """True when ok holds on every rank (a barrier that also carries a failure)."""
    if place.world_size == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], device=place.device)
    dist.all_reduce(flag)
    return flag.item() == 0


def file_record(path: Path) -> dict:
    """Size and sha256 of a file as it is on disk (read back, so what is recorded is what was written)."""
    with open(path, "rb") as f:
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def gather_objects(obj, place) -> list:
    if place.world_size == 1:
        return [obj]
    out = [None] * place.world_size
    dist.all_gather_object(out, obj)
    return out


def write_failure(e: BaseException) -> str:
    """One line for a failed write: DCP wraps each rank's error, and torch.save reports a full disk as a
    RuntimeError without errno."""
    if isinstance(e, dcp().CheckpointException) and e.failures:
        return write_failure(next(iter(e.failures.values()))[0])
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    lines = str(e).strip().splitlines()
    return lines[-1][:200] if lines else type(e).__name__


def free_mib(path: Path) -> str:
    for p in (path, *path.parents):
        if p.exists():
            return f"{shutil.disk_usage(p).free / 2**20:.0f} MiB free"
    return "free space unknown"


def files_written_by(folder: Path, rank: int) -> list[Path]:
    """The files of a DCP folder this rank wrote: its __<rank>_*.distcp, and .metadata on rank 0."""
    return sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / ".metadata"] if rank == 0 else [])


@dataclass
class Checkpoints:
    """A run's checkpoints as the training loop sees them: save() a training state, load() one.

    record: what checkpoint.json keeps besides the state (run_id, hyperparameters, the runtime's choices and
    the sources' sha256); keep: how many checkpoints rotation keeps, besides the one this run resumed from."""
    folder: RunFolder
    keep: int
    place: object
    log: RunLog
    record: dict
    resumed_from: Path | None = None

    def save(self, state: TrainingState) -> Path:
        """torch.distributed.checkpoint writes every rank's tensors into step_N.tmp/ (one copy of the shared
        weights, each Adam slice and Muon momentum by its owner); rank 0 adds the metadata (with every file's
        size and sha256, hashed by the rank that wrote it) and renames the folder.

        A failed write (a full disk, say) removes the staging folder on every rank and leaves every earlier
        checkpoint untouched. Rotation keeps `keep` checkpoints, and always the one resumed from.
        """
        place, log, root = self.place, self.log, self.folder.checkpoints
        final = root / f"step_{state.step:06d}"
        if not ranks_agree(not (final / CHECKPOINT_META).is_file(), place):  # the resume point (--stop_after at it)
            log.write(f"checkpoint: {final} step:{state.step} is already written (the resume point); kept as it is")
            return final
        staging = root / (final.name + ".tmp")
        started = time.perf_counter()
        error, records = "", {}
        try:
            staging.mkdir(parents=True, exist_ok=True)
            dcp_call(dcp().save, as_dcp_state(state, place), staging, place.world_size)
            records = {f.name: file_record(f) for f in files_written_by(staging, place.rank)}
        except (OSError, RuntimeError, dcp().CheckpointException) as e:
            error = write_failure(e)
        if ranks_agree(not error, place):
            files = {name: rec for per_rank in gather_objects(records, place) for name, rec in per_rank.items()}
            if place.is_master:
                meta = {"format": CHECKPOINT_FORMAT, **self.record, "step": state.step, "loader": state.loader,
                        "segments": state.segments, "target": state.target, "world_size": place.world_size,
                        "files": files}
                try:
                    (staging / CHECKPOINT_META).write_text(json.dumps(meta, indent=1))
                    shutil.rmtree(final, ignore_errors=True)  # an unfinished one (no checkpoint.json) only
                    os.replace(staging, final)
                except OSError as e:
                    error = write_failure(e)
        if not ranks_agree(not error, place):
            shutil.rmtree(staging, ignore_errors=True)
            previous = complete_checkpoints(root)
            raise RunFailed(f"cannot write checkpoint {final} ({error or 'failed on another rank'}); partial files "
                            f"removed, previous checkpoint {previous[-1] if previous else '(none)'} is intact; "
                            f"free disk space ({free_mib(root)}) and resume with --resume=latest")
        if place.is_master:
            rotate_checkpoints(root, self.keep, final, self.resumed_from)
            size = sum(f.stat().st_size for f in final.iterdir())
            log.write(f"checkpoint: {final} step:{state.step} size:{size / 2**20:.1f}MiB "
                      f"write_time:{time.perf_counter() - started:.2f}s")
        ranks_agree(True, place)
        return final

    def load(self, path: Path, state: TrainingState) -> TrainingState:
        """Fills the live tensors from a checkpoint folder that choose_checkpoint verified at start-up, each rank
        reading the pieces its own layout needs (DCP re-cuts the Adam slices for this world size); newer
        checkpoints of this run's own folder are set aside (set_aside_newer_checkpoints)."""
        meta = read_checkpoint_meta(path)
        if meta["source_sha256"] != self.record["source_sha256"]:
            self.log.write(f"warning: the trainer's source changed since checkpoint {path} was written")
        try:
            dcp_call(dcp().load, as_dcp_state(state, self.place), path, self.place.world_size)
        except (OSError, RuntimeError, ValueError, dcp().CheckpointException) as e:
            raise UsageError(f"checkpoint {path} is unreadable ({write_failure(e)}); it is truncated or corrupt: "
                             "resume from an earlier checkpoint") from None
        self.resumed_from = path
        set_aside_newer_checkpoints(self.folder.checkpoints, path, self.place, self.log)
        return TrainingState(step=meta["step"], loader=meta["loader"], tensors=state.tensors,
                             segments=recorded_segments(meta), target=recorded_target(meta))


def lock_run_log(log: RunLog, run_id: str) -> None:
    """Rank 0 holds an exclusive lock on its run log while it lives, which tells later runs in the same
    log_dir that this run's staging folders are in use (the lock dies with the process, even on kill -9). Then a
    last line that a crash cut short is ended, so this launch's lines start on lines of their own."""
    if log.file is None:
        return
    try:
        fcntl.flock(log.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"run {run_id} is running in another process ({log.path} is locked); wait for it to "
                         "end or pick another --run_id") from None
    except OSError:
        pass  # a filesystem without locks: stale staging folders of other runs are then left alone
    try:
        end_torn_line(log.file)  # only now: a live owner's log is never touched
    except OSError as e:
        raise UsageError(f"cannot write run log {log.path}: {e.strerror}; free disk space") from None


def owner_is_gone(log_path: Path) -> bool:
    """True when no live process holds the lock on a run log (or the log is gone)."""
    try:
        with open(log_path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def clean_stale_staging(folder: RunFolder, log: RunLog) -> None:
    """Rank 0 removes step_N.tmp/ folders under log_dir left by killed runs, so they cannot fill the disk."""
    if log.file is None:
        return
    for staging in sorted(folder.log_dir.glob("*/step_*.tmp")):
        run = staging.parent.name
        if run == folder.run_id or owner_is_gone(RunFolder(folder.log_dir, run).log):
            shutil.rmtree(staging, ignore_errors=True)
            log.write(f"removed stale checkpoint staging folder {staging} (left by a killed run)")


def checkpoint_candidates(resume: str, log_dir: Path, run_id: str) -> list[Path]:
    """The folder --resume names; for 'latest', every finished checkpoint under log_dir, newest first;
    for 'auto', those of run_id's folder (none: a fresh start, so a restarted run finds its own)."""
    if resume in ("latest", "auto"):
        runs = [RunFolder(log_dir, run_id).checkpoints] if resume == "auto" else log_dir.glob("*")
        found = [c for run in runs if run.is_dir() for c in complete_checkpoints(run)]
        if not found and resume == "latest":
            raise UsageError(f"--resume=latest: no finished checkpoint under {log_dir}/; "
                             "train with --checkpoint_every=N first")
        return sorted(found, key=lambda c: (c.stat().st_mtime, c.name), reverse=True)
    path = Path(resume)
    if path.name == CHECKPOINT_META and path.is_file():  # the file that makes the folder a checkpoint
        path = path.parent
    if not (path / CHECKPOINT_META).is_file():
        what = "not found" if not path.exists() else f"incomplete (no {CHECKPOINT_META})"
        raise UsageError(f"checkpoint {path} is {what}; pass a step_N folder or --resume=latest")
    return [path]


CHECKPOINT_META_TYPES = {"step": int, "loader": dict, "hyperparameters": dict, "files": dict, "source_sha256": str}


CHECKPOINT_FILE_TYPES = {"bytes": int, "sha256": str}


def is_a(value: object, kind: type) -> bool:
    """isinstance for JSON values, where true/false must not pass for an int."""
    return isinstance(value, kind) and not isinstance(value, bool)


def meta_problem(meta: object) -> str:
    """What is wrong with a parsed checkpoint.json ('' if nothing): the keys its readers use, with their types."""
    if not isinstance(meta, dict):
        return f"it holds a {type(meta).__name__}, not an object"
    for key, kind in CHECKPOINT_META_TYPES.items():
        if key not in meta:
            return f"it has no {key!r}"
        if not is_a(meta[key], kind):
            return f"its {key!r} is {meta[key]!r}, not a {kind.__name__}"
    for name, record in meta["files"].items():
        well_typed = isinstance(record, dict) and all(is_a(record.get(k), kind)
                                                      for k, kind in CHECKPOINT_FILE_TYPES.items())
        if not well_typed:
            return f"its record of file {name!r} is {record!r}, not {{bytes, sha256}}"
    return ""


def read_checkpoint_meta(path: Path) -> dict:
    """checkpoint.json, validated (keys and types): the one reader of it, for the trainer and the tools alike;
    a one-line error when it is truncated, from an older format, or not a checkpoint's."""
    try:
        meta = json.loads((path / CHECKPOINT_META).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"checkpoint {path} has an unreadable {CHECKPOINT_META} ({type(e).__name__}): it is "
                         "truncated or corrupt; resume from an earlier checkpoint") from None
    if isinstance(meta, dict) and meta.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"checkpoint {path} is in the per-rank format (rank<r>.pt) of a train_gpt.py older than "
                         f"the {CHECKPOINT_FORMAT} checkpoints; resume it with the train_gpt.py that wrote it "
                         "(its sha256 is in checkpoint.json) or start afresh")
    problem = meta_problem(meta)
    if problem:
        raise UsageError(f"checkpoint {path} has a {CHECKPOINT_META} that train_gpt.py did not write ({problem}): "
                         "it is corrupt or edited; resume from an earlier checkpoint") from None
    return meta


def checkpoint_files_problem(path: Path, meta: dict, rank: int = 0, world_size: int = 1) -> str:
    """Why a file does not match the size and sha256 in checkpoint.json ('' when all match); each rank
    checks every world_size-th file, so the ranks share the reading (one process checks them all)."""
    for name in sorted(meta["files"])[rank::world_size]:
        recorded, file = meta["files"][name], path / name
        if not file.is_file():
            return f"{file} is missing"
        actual = file_record(file)
        if actual["bytes"] != recorded["bytes"]:
            return (f"{file} is unreadable ({actual['bytes']} bytes, {CHECKPOINT_META} recorded "
                    f"{recorded['bytes']}): it is truncated or corrupt")
        if actual["sha256"] != recorded["sha256"]:
            return f"{file} does not match the sha256 in {CHECKPOINT_META} (corrupt)"
    return ""


def choose_checkpoint(resume: str, log_dir: Path, run_id: str, place) -> tuple[Path | None, list[str]]:
    """The checkpoint --resume names, verified on every rank at start-up, and lines for the run log.

    An explicit folder that fails verification is refused; --resume=latest falls back to the newest
    complete checkpoint that verifies, and says so.
    """
    candidates = checkpoint_candidates(resume, log_dir, run_id)
    if place.world_size > 1:  # every rank walks rank 0's list
        shared = [candidates]
        dist.broadcast_object_list(shared, src=0)
        candidates = shared[0]
    fallback = resume in ("latest", "auto")
    if not candidates:  # --resume=auto before this run's first checkpoint
        return None, [f"--resume=auto: no finished checkpoint of run {run_id} yet: starting afresh"]
    notes = []
    for path in candidates:
        try:
            meta, problem = read_checkpoint_meta(path), ""
        except UsageError as e:
            if not fallback:
                raise
            meta, problem = None, str(e)
        if meta is not None:
            problem = checkpoint_files_problem(path, meta, place.rank, place.world_size)
        if ranks_agree(not problem, place):
            if path != candidates[0]:
                notes.append(f"--resume={resume}: falling back to {path}")
            return path, notes
        problem = problem or "a file failed verification on another rank"
        if not fallback:
            raise UsageError(f"checkpoint {path} failed verification: {problem}; resume from an earlier checkpoint "
                             "or pass --resume=latest to use the newest one that verifies")
        notes.append(f"--resume={resume}: skipping checkpoint {path}: {problem}")
    raise UsageError(f"--resume={resume}: none of the {len(candidates)} checkpoint(s) under {log_dir}/ "
                     f"verifies (newest: {notes[0].split(': ', 2)[-1]}); start afresh without --resume")


OWNER_ONLY_PREFIXES = ("muon/", "normuon/")  # state that only the rank owning its matrix holds


def check_same_tensors(path: Path, state: TrainingState, place, structure: dict[str, object]) -> None:
    """Refuses, on every rank, a checkpoint whose tensors are not this run's (another technique switched on or
    off, say), naming the first difference and those of the `structure` hyperparameters (the model's and the
    optimizers' layout: name -> this run's value) that differ, rather than calling a healthy checkpoint corrupt
    when DCP misses a key. Each rank holds the Muon state of its own matrices only."""
    stored = set(dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    live = set(as_dcp_state(state, place))
    lacking = sorted(live - stored)
    extra = sorted(name for name in stored - live if not name.startswith(OWNER_ONLY_PREFIXES))
    first = (f"this run has {lacking[0]}, which it lacks" if lacking
             else f"it has {extra[0]}, which this run lacks" if extra else "")
    if ranks_agree(not first, place):
        return
    recorded = read_checkpoint_meta(path)["hyperparameters"]
    differ = [f"{name}={recorded.get(name, '(not recorded)')} here {value}" for name, value in structure.items()
              if recorded.get(name) != value]
    raise UsageError(f"checkpoint {path} holds other tensors than this run's model and optimizers "
                     f"({first or 'on another rank'}); it was written with {', '.join(differ[:4]) or 'other flags'}: "
                     "pass its flags to resume it")


def verified_checkpoint_meta(path: Path) -> dict:
    """checkpoint.json of a folder whose every file matches its recorded size and sha256, checked in this one
    process as the trainer checks them: what a program reading a checkpoint outside training trusts."""
    meta = read_checkpoint_meta(path)
    problem = checkpoint_files_problem(path, meta)
    if problem:
        raise UsageError(f"checkpoint {path} failed verification: {problem}; use another step_N folder")
    return meta


def read_checkpoint_tensors(path: Path, prefix: str = "model/") -> dict[str, Tensor]:
    """The whole (unsharded) tensors under prefix in a verified checkpoint folder, read in one process on CPU:
    model/ for the weights (tools/: sampling, export), adam/ or muon/ for the optimizer state."""
    verified_checkpoint_meta(path)
    try:
        stored = dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
        tensors = {name: torch.empty(tuple(m.size), dtype=m.properties.dtype) for name, m in stored.items()
                   if name.startswith(prefix)}
        dcp_call(dcp().load, tensors, path, 1)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError,
            dcp().CheckpointException) as e:
        raise UsageError(f"checkpoint {path} is unreadable ({write_failure(e)}); it is truncated or corrupt: "
                         "use another step_N folder") from None
    return {name.removeprefix(prefix): t for name, t in tensors.items()}


def run_id_problem(folder: RunFolder, resume: str, checkpoint: Path | None) -> str:
    """Why this launch may not write into a run folder ('' if it may): never two runs' results or checkpoints
    under one id. A finished run's id is refused; so is one with checkpoints or a log, unless this launch continues
    that run (it resumes one of the run's own checkpoints, or --resume=auto starts afresh before the first one)."""
    run_id, log, summary, root = folder.run_id, folder.log, folder.summary, folder.checkpoints
    if log.exists() and not owner_is_gone(log):
        return (f"run {run_id} is running in another process ({log} is locked); wait for it to end or pick another "
                "--run_id")
    if summary.exists():
        return (f"run {run_id} has finished ({summary} holds its result, which is kept): pass another --run_id to "
                f"start anew, or to train it further from one of its checkpoints (--resume={root}/step_N --run_id=NEW)")
    if resume == "auto" or checkpoint is not None and checkpoint.parent.resolve() == root.resolve():
        return ""
    if checkpoints := complete_checkpoints(root):
        return (f"run {run_id} has checkpoints ({checkpoints[-1]}): continue it with --resume={checkpoints[-1]}, or "
                "pass another --run_id to start anew")
    if log.exists():
        return (f"run {run_id} already has a log ({log}) of a launch that ended before a checkpoint or a result: pass "
                f"another --run_id, or delete {log} to reuse the name")
    return ""


def claim_run_folder(log_dir: Path, run_id: str, preset: str, resume: str, place,
                     checkpoint: Path | None = None) -> RunFolder:
    """The run's folder under log_dir: named by run_id; else a resumed run keeps its checkpoint's run folder (so
    checkpoint_keep caps its disk use), and a fresh run gets time, preset and a random suffix. Rank 0 decides,
    and checks that the folder is free (run_id_problem); every rank refuses together."""
    run_id = (run_id or (checkpoint.parent.name if checkpoint else None)
              or f"{time.strftime('%Y%m%d-%H%M%S')}_{preset}_{uuid.uuid4().hex[:6]}")
    decided = [run_id, run_id_problem(RunFolder(log_dir, run_id), resume, checkpoint) if place.is_master else ""]
    if place.world_size > 1:
        dist.broadcast_object_list(decided, src=0)
    if decided[1]:
        raise UsageError(decided[1])
    return RunFolder(log_dir, decided[0])


def training_state(model, opt, stream, step: int, segments: list[dict] | None = None) -> TrainingState:
    """What a checkpoint keeps of a run at a step (train_gpt's GPT, Optimizers and TokenStream): the live tensors
    (aliased, not copied) and the data position."""
    tensors = {f"model/{name}": t for name, t in model.state_dict().items()}
    return TrainingState(step=step, loader=stream.state(), tensors={**tensors, **opt.state_tensors()},
                         segments=segments or [])


class FiniteWatch:
    """Whether any training loss was non-finite, accumulated on the device (no host sync per step),
    so that a diverged state is never checkpointed and never rotates a good checkpoint away."""

    def __init__(self, device: torch.device, start_step: int, resumed_from: Path | None):
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.good_step, self.newest_good = start_step, resumed_from

    def observe(self, loss: Tensor) -> None:
        self.bad |= ~torch.isfinite(loss)

    def check(self, model: torch.nn.Module, place, step: int) -> None:
        """Stops the run, on every rank, once a loss so far or a weight is not finite (one reduction, one sync)."""
        flags = torch.stack([self.bad, *(~torch.isfinite(p).all() for p in model.parameters())])
        if not ranks_agree(not bool(flags.any()), place):
            raise RunFailed(f"the loss or the weights became non-finite between step {self.good_step} and step "
                            f"{step}; no checkpoint written, {self.hint()}: resume from it with lower learning rates")
        self.good_step = step

    def hint(self) -> str:
        return f"the newest good checkpoint is {self.newest_good or '(none)'}"
