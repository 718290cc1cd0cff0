"""Checkpoints of train_gpt.py: exact resume, signals, and failures that never lose a good checkpoint."""
import dataclasses
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import checkpoints
import train_gpt as T
from conftest import (IMPORT_ENV, RANK_DRIVER, REPO, SIX, TINY, parse_progress_line, run_main, run_trainer,
                      start_two_ranks_until_step_3, train_losses)
from rank_driver import REPORT as LEFT_BEHIND_REPORT

def final_model(log_dir, run_id, step=6):
    return checkpoints.read_checkpoint_tensors(Path(log_dir) / run_id / f"step_{step:06d}")


def resume_matches_uninterrupted(tmp_path, whole, nproc):
    """The session's uninterrupted six-step run (folder whole) against one stopped after step 3 and resumed."""
    parts = tmp_path / "parts"

    def launch(args):  # one rank: in this process; more: under torchrun
        return run_main(args, parts) if nproc is None else run_trainer(args, parts, nproc=nproc)
    first = launch(SIX + ["--run_id=first", "--stop_after=3", "--checkpoint_keep=1"])
    assert first.returncode == 0, first.stderr[-2000:]
    assert "stopped after step 3 as asked" in (parts / "first.txt").read_text()
    second = launch(SIX + ["--run_id=second", "--resume=latest", "--checkpoint_final=true"])
    assert second.returncode == 0, second.stderr[-2000:]
    if nproc:  # each rank wrote and read a checkpoint (a device mesh over the group), then let every gloo thread go
        for run in (first, second):
            assert run.stderr.count(LEFT_BEHIND_REPORT + "nothing") == nproc, run.stderr[-2000:]
    resumed_log = (parts / "second.txt").read_text()
    assert f"resumed from {parts / 'first' / 'step_000003'} at step 3" in resumed_log
    uninterrupted = train_losses((whole / "whole.txt").read_text())
    resumed = train_losses(resumed_log)
    assert sorted(resumed) == [4, 5, 6]
    return uninterrupted, resumed, final_model(whole, "whole"), final_model(parts, "second")


def test_single_process_resume_is_bit_identical(tmp_path, six_steps_one_rank):
    uninterrupted, resumed, a, b = resume_matches_uninterrupted(tmp_path, six_steps_one_rank, None)
    assert all(resumed[s] == uninterrupted[s] for s in resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_rank_resume_matches_within_tolerance_and_ends_every_gloo_thread(tmp_path, six_steps_two_ranks):
    # gloo reduces in a fixed order, so this is exact in practice; allow float noise anyway.
    uninterrupted, resumed, a, b = resume_matches_uninterrupted(tmp_path, six_steps_two_ranks, 2)
    assert all(abs(resumed[s] - uninterrupted[s]) < 1e-4 for s in resumed)
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) < 1e-6


def test_a_two_rank_checkpoint_resumes_on_one_and_on_four_ranks(tmp_path):
    """The saved state means the same at any world size: 2 ranks write step 3, 1 and 4 ranks continue it.
    Tolerance 1e-3: a new world size changes the float order of the gradient sums (another
    accumulation split, another reduce-scatter tree), not the math; the logged losses (4 decimals) agree
    to 1e-4 here."""
    args = TINY + ["--batch_tokens=1024", "--num_iterations=6", "--val_every=0"]
    whole = run_trainer(args + ["--run_id=two", "--checkpoint_every=3"], tmp_path, nproc=2)
    assert whole.returncode == 0, whole.stderr[-2000:]
    uninterrupted = train_losses((tmp_path / "two.txt").read_text())
    checkpoint = tmp_path / "two" / "step_000003"
    for nproc in (None, 4):
        run_id = f"on{nproc or 1}"
        resume = args + [f"--run_id={run_id}", f"--resume={checkpoint}"]
        resumed = run_main(resume, tmp_path) if nproc is None else run_trainer(resume, tmp_path, nproc=nproc)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        losses = train_losses((tmp_path / f"{run_id}.txt").read_text())
        assert sorted(losses) == [4, 5, 6]
        assert all(abs(losses[s] - uninterrupted[s]) < 1e-3 for s in losses), (nproc, losses, uninterrupted)


def test_recipe_v2_resumes_bit_identically_across_a_batch_stage_change(tmp_path):
    """Stopped after step 3 of a 2-stage ramp over 8 steps (stage 1 starts at step 5): the resumed run changes
    stage itself, with NorMuon's moments, the cautious decay and the capped-document loader position
    restored. (Not earlier: zero-init output layers leave the hidden matrices without gradient for the
    first steps, so their NorMuon moments would still be zero and a lost moment would not show.)"""
    from test_training import V2_TINY
    args = TINY + V2_TINY + ["--num_iterations=8", "--val_every=0", "--checkpoint_final=true"]
    assert run_main(args + ["--run_id=whole"], tmp_path / "whole").returncode == 0
    first = run_main(args + ["--run_id=first", "--stop_after=3"], tmp_path / "parts")
    assert first.returncode == 0, first.stderr[-2000:]
    moments = checkpoints.read_checkpoint_tensors(tmp_path / "parts" / "first" / "step_000003", "normuon/")
    assert moments and all(m.abs().sum() > 0 for m in moments.values())
    second = run_main(args + ["--run_id=second", "--resume=latest"], tmp_path / "parts")
    assert second.returncode == 0, second.stderr[-2000:]
    uninterrupted = train_losses((tmp_path / "whole" / "whole.txt").read_text())
    resumed = train_losses((tmp_path / "parts" / "second.txt").read_text())
    assert sorted(resumed) == [4, 5, 6, 7, 8] and all(resumed[s] == uninterrupted[s] for s in resumed)
    a, b = final_model(tmp_path / "whole", "whole", 8), final_model(tmp_path / "parts", "second", 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((tmp_path / "parts" / "second.json").read_text())
    assert summary["tokens"] == 4 * 512 + 4 * 1024  # the tokens of all 8 steps, the resumed ones at their stage


def test_checkpoint_every_keeps_the_last_k(tmp_path):
    result = run_main(SIX + ["--run_id=keep", "--checkpoint_every=1", "--checkpoint_keep=2"], tmp_path)
    assert result.returncode == 0, result.stderr
    kept = sorted(p.name for p in (tmp_path / "keep").iterdir())
    assert kept == ["step_000004", "step_000005"]
    log = (tmp_path / "keep.txt").read_text()
    lines = [line for line in log.splitlines() if line.startswith("checkpoint: ")]
    assert len(lines) == 5 and all("size:" in line and "write_time:" in line for line in lines)


def test_sigterm_on_one_rank_checkpoints_all_ranks_and_resume_continues(tmp_path):
    args = TINY + ["--num_iterations=500", "--val_every=0", "--run_id=sig", "--checkpoint_every=1000",
                   f"--log_dir={tmp_path}"]
    log = tmp_path / "sig.txt"
    proc, workers = start_two_ranks_until_step_3(args, log)
    os.kill(int(workers[-1]), signal.SIGTERM)  # one rank only: the others must follow
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    text = log.read_text()
    assert "stopped by signal SIGTERM" in text and "resume with --resume=latest" in text
    ckpts = list((tmp_path / "sig").glob("step_*"))
    assert len(ckpts) == 1 and sorted(p.name for p in ckpts[0].iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint.json"]
    stopped_at = int(ckpts[0].name.split("_")[1])
    meta = json.loads((ckpts[0] / "checkpoint.json").read_text())
    assert meta["runtime"] == {"attention": "banded", "fp8_head": False, "compile": "off", "dtype": "bfloat16",
                               "device": "cpu", "chunked_loss": True, "compile_attention": False,
                               "compile_fp8": False, "fp8_mlp": False,
                               "compile_newton_schulz": False, "grad_sync_from_hooks": True,
                               "host_malloc": "glibc mmap_threshold=268435456,trim_threshold=1073741824,top_pad=268435456",
                               "world_size": 2}  # resolved, not "auto"/true
    assert meta["step"] == stopped_at and meta["format"] == checkpoints.CHECKPOINT_FORMAT
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    resumed = run_trainer(TINY + [f"--num_iterations={stopped_at + 2}", "--val_every=0", "--run_id=after",
                                  "--resume=latest"], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(train_losses((tmp_path / "after.txt").read_text())) == [stopped_at + 1, stopped_at + 2]


@pytest.fixture
def good_checkpoint(tiny_run):
    return tiny_run / "tiny" / "step_000002"


def resume_error(tmp_path, path, *extra):
    result = run_main(TINY + ["--num_iterations=3", f"--resume={path}", *extra], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    return result.stderr


def test_truncated_checkpoint_is_a_clear_error(tmp_path, good_checkpoint):
    broken = tmp_path / "step_000002"
    broken.mkdir()
    for f in good_checkpoint.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".distcp" else data)
    assert "is unreadable (" in resume_error(tmp_path, broken) and "truncated or corrupt" in \
        resume_error(tmp_path, broken)


def test_checkpoint_of_another_shape_is_refused(tmp_path, good_checkpoint):
    err = resume_error(tmp_path, good_checkpoint, "--model_dim=128", "--head_dim=64")
    assert "has model_dim=64 but this run has model_dim=128" in err


def test_checkpoint_of_the_older_per_rank_format_is_refused(tmp_path, good_checkpoint):
    old = tmp_path / "step_000002"
    old.mkdir()
    meta = json.loads((good_checkpoint / "checkpoint.json").read_text())
    del meta["format"]
    meta["files"] = {"rank0.pt": {"bytes": 7, "sha256": "0" * 64}}
    (old / "checkpoint.json").write_text(json.dumps(meta))
    (old / "rank0.pt").write_bytes(b"old pkl")
    assert "is in the per-rank format (rank<r>.pt) of a train_gpt.py older than" in resume_error(tmp_path, old)


def test_missing_checkpoint_paths_are_clear_errors(tmp_path):
    assert "is not found" in resume_error(tmp_path, tmp_path / "nope")
    assert "no finished checkpoint under" in resume_error(tmp_path, "latest")


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    rt = T.Runtime(0, 0, 1, torch.device("cpu"), torch.float32, "banded", False, "off")
    log = T.RunLog(None)
    state = checkpoints.TrainingState(step=1, loader={"epoch": 0, "shard": 0, "pos": 0}, tensors={"model/w": torch.arange(1e3)})
    saver = checkpoints.Checkpoints(T.RunFolder(tmp_path, "run"), keep=2, place=rt, log=log,
                                    record={"run_id": "run", "source_sha256": "0"})
    good = saver.save(state)
    before = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in good.iterdir()}

    def disk_full(obj, stream):  # DCP's file writer serialises each tensor with torch.save into its file
        stream.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(T.UsageError) as err:
        saver.save(dataclasses.replace(state, step=2))
    assert "No space left on device" in str(err.value) and f"previous checkpoint {good} is intact" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_000001"]
    assert before == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in good.iterdir()}


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_hung_rank_stops_the_others_after_the_collective_timeout(tmp_path):
    """Without torchrun to tear the group down, a rank that stops answering makes the others fail in
    --collective_timeout_s with one line, instead of hanging forever."""
    port = free_port()
    args = TINY + ["--num_iterations=500", "--val_every=0", "--run_id=hung", "--collective_timeout_s=8",
                   f"--log_dir={tmp_path}"]
    procs = []
    for rank in range(2):
        env = {**os.environ, **IMPORT_ENV, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen([sys.executable, str(RANK_DRIVER)] + args, cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    log = tmp_path / "hung.txt"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and "step:3/500" in log.read_text()):
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGSTOP)
    try:
        stopped = time.time()
        _, err = procs[0].communicate(timeout=90)
        waited = time.time() - stopped
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 3 and waited < 60, err[-2000:]
    assert "error: a collective failed on rank 0" in err and "Traceback" not in err
    # the one error line, then the driver's word that no gloo worker outlived the failed run (its socket loop may)
    assert err.strip().splitlines()[1:] in ([LEFT_BEHIND_REPORT + "nothing"],
                                            [LEFT_BEHIND_REPORT + "['gloo_tcp_loop']"]), err[-2000:]
    assert log.read_text().splitlines()[-1].startswith("error: ")


def final_val_loss(text):
    lines = [parse_progress_line(line) for line in text.splitlines() if line.startswith("final:")]
    return lines[-1].fields["val_loss"]


def test_a_killed_rank_restarts_from_the_last_checkpoint_with_the_same_final_loss(tmp_path):
    """torchrun --max_restarts=1 with --resume=auto: one rank is SIGKILLed mid-run, torchrun restarts both,
    they resume from the newest checkpoint and end at the final loss of an uninterrupted run that took the
    same checkpoints (2-rank resume is exact in practice; 1e-4 as in the resume test above)."""
    args = TINY + ["--num_iterations=12", "--val_every=0", "--checkpoint_every=4", "--checkpoint_keep=2",
                   "--run_id=auto", "--resume=auto"]
    whole = run_trainer(args, tmp_path / "whole", nproc=2)
    assert whole.returncode == 0, whole.stderr[-2000:]
    log_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max_restarts=1",
           str(REPO / "train_gpt.py"), *args, f"--log_dir={log_dir}"]
    # pytorch/pytorch#135712: with the rendezvous store shared, a restarted worker can read its peer's address
    # from the previous attempt (gloo "connectFullMesh ... Connection refused"); a separate store avoids that.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    log = log_dir / "auto.txt"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and "step:6/" in log.read_text()):
        time.sleep(0.1)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    text = log.read_text()
    assert "--resume=auto: no finished checkpoint of run auto yet: starting afresh" in text
    resumed = [line for line in text.splitlines() if line.startswith("resumed from ")]
    assert len(resumed) == 1 and str(log_dir / "auto" / "step_0000") in resumed[0], resumed
    assert abs(final_val_loss(text) - final_val_loss((tmp_path / "whole" / "auto.txt").read_text())) < 1e-4


def test_resume_auto_needs_a_run_id(tmp_path):
    result = run_main(TINY + ["--resume=auto"], tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: --resume=auto needs --run_id=NAME: a restarted run finds its checkpoints under log_dir/NAME (and "
        "never another run's)")


def test_an_fp8_mlp_run_resumes_bit_identically_with_its_scales(tmp_path, monkeypatch):
    """--fp8_mlp (here on the CPU's _scaled_mm): the checkpoint holds each MLP's four FP8 scales, P's delayed one
    included, and the resumed run's losses, weights and scales equal the uninterrupted run's."""
    monkeypatch.setattr(T, "fp8_supported", lambda device: True)
    args = SIX + ["--fp8_mlp=true", "--fp8_head=false", "--zero_init=false", "--checkpoint_final=true"]
    assert run_main(args + ["--run_id=whole"], tmp_path / "whole").returncode == 0
    first = run_main(args + ["--run_id=first", "--stop_after=3"], tmp_path / "parts")
    assert first.returncode == 0, first.stderr[-2000:]
    scales = checkpoints.read_checkpoint_tensors(tmp_path / "parts" / "first" / "step_000003", "model/")
    scales = {k: v for k, v in scales.items() if ".mlp.fp8_" in k}
    assert len(scales) == 8 and scales["blocks.0.mlp.fp8_act_scale"].item() != 1.0
    second = run_main(args + ["--run_id=second", "--resume=latest"], tmp_path / "parts")
    assert second.returncode == 0, second.stderr[-2000:]
    uninterrupted = train_losses((tmp_path / "whole" / "whole.txt").read_text())
    resumed = train_losses((tmp_path / "parts" / "second.txt").read_text())
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == uninterrupted[s] for s in resumed)
    a, b = final_model(tmp_path / "whole", "whole"), final_model(tmp_path / "parts", "second")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
