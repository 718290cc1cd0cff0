"""Fault injection: each failure a user can meet (a diverging run, a corrupt or edited checkpoint, a full disk, a
signal, a bad flag, a bad resume), reproduced as the user would meet it.

Each test checks that the failure costs no work and says what happened: the good checkpoints kept, a corrupt file
refused rather than loaded, one line on stderr rather than a traceback, a failed run's exit status, not a success.
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoints
import train_gpt as T
from flags import run_cli
from conftest import (REPO, TINY, parse_progress_line, run_main, run_trainer, start_two_ranks_until_step_3,
                      tool_in_process, train_losses)
from tools import loading


def one_line_error(result, code=2):
    assert result.returncode == code, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def all_finite(ckpt: Path) -> bool:
    return all(torch.isfinite(t).all() for t in checkpoints.read_checkpoint_tensors(ckpt).values())


# A diverging run must not rotate its good checkpoints away (log_train_loss=false hides NaN until val).
def test_divergence_keeps_the_good_checkpoints(tmp_path, monkeypatch):
    real = T.lr_multiplier
    monkeypatch.setattr(T, "lr_multiplier", lambda step, *a: float("nan") if step >= 4 else real(step, *a))
    result = run_main(TINY + ["--num_iterations=8", "--val_every=0", "--log_train_loss=false", "--run_id=div",
                              "--checkpoint_every=1", "--checkpoint_keep=2"], tmp_path)
    line = one_line_error(result, T.EXIT_RUN_FAILED)  # the run failed; no flag was wrong
    kept = sorted((tmp_path / "div").glob("step_*"))
    assert [c.name for c in kept] == ["step_000003", "step_000004"] and all(all_finite(c) for c in kept)
    assert "non-finite between step 4 and step 5" in line and f"newest good checkpoint is {kept[-1]}" in line


# A checkpoint with flipped bytes is refused; --resume=latest falls back to the previous one.
def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def flip_bytes(file: Path, count=64):
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    file.write_bytes(bytes(data))


def test_corrupt_checkpoint_is_refused_and_latest_falls_back(tmp_path, tiny_run):
    log_dir = copy_run(tiny_run, tmp_path / "logs")
    newest, previous = log_dir / "tiny" / "step_000004", log_dir / "tiny" / "step_000002"
    os.utime(newest, (time.time() + 10, time.time() + 10))  # copytree does not keep the order of mtimes
    flip_bytes(newest / "__0_0.distcp")
    line = one_line_error(run_main(TINY + ["--num_iterations=5", f"--resume={newest}"], log_dir))
    assert "does not match the sha256 in checkpoint.json" in line
    result = run_main(TINY + ["--num_iterations=5", "--val_every=0", "--resume=latest", "--run_id=more"], log_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"--resume=latest: falling back to {previous}" in result.stdout
    assert f"resumed from {previous} at step 2" in result.stdout


# A full disk: one line, no partial file or staging folder left, the earlier checkpoint intact.
@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    # About 1.6 checkpoints of the tiny model (142 MB each): the second one cannot fit.
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=230m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}): full-disk probe not run")
    yield mount
    subprocess.run(["umount", str(mount)])


def test_full_disk_is_one_line_and_cleans_up(small_disk):
    result = run_trainer(TINY + ["--num_iterations=4", "--val_every=0", "--run_id=full", "--checkpoint_every=1"],
                         small_disk)
    line = one_line_error(result, T.EXIT_RUN_FAILED)
    assert "cannot write checkpoint" in line and "partial files removed" in line
    assert f"previous checkpoint {small_disk / 'full' / 'step_000001'} is intact" in line
    assert sorted(p.name for p in (small_disk / "full").iterdir()) == ["step_000001"]
    assert (small_disk / "full" / "step_000001" / "checkpoint.json").is_file()
    assert shutil.disk_usage(small_disk).free > 50 * 2**20  # the partial second file is gone


def test_stale_staging_folders_are_removed_at_the_next_start(tmp_path):
    stale = tmp_path / "killed" / "step_000003.tmp"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"\0" * 4096)
    result = run_main(TINY + ["--num_iterations=1", "--val_every=0", "--run_id=next"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not stale.exists() and f"removed stale checkpoint staging folder {stale}" in result.stdout


# Signals before the training loop: one line, a log entry, exit 128 + signum.
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_warmup_is_one_line_and_logged(tmp_path, sig):
    args = TINY + ["--num_iterations=2", "--val_every=0", "--run_id=early", "--warmup_steps=1000",
                   f"--log_dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py")] + args, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = tmp_path / "early.txt"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and "run early:" in log.read_text()):
        time.sleep(0.2)
    time.sleep(2)  # inside the warm-up steps
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    result = subprocess.CompletedProcess(args, proc.returncode, "", err)
    line = one_line_error(result, 128 + sig)
    assert f"stopped by signal {sig.name} before the first training step" in line
    assert "stopped by signal" not in out  # said once: the log's copy of the line is not echoed
    assert log.read_text().splitlines()[-1].startswith(f"stopped by signal {sig.name}")


# Resuming: past the end, from a truncated checkpoint.json, with other optimizer flags.
def test_resume_at_or_past_the_last_step_is_refused(tmp_path, tiny_run):
    line = one_line_error(run_main(TINY + ["--num_iterations=4", "--resume=latest"], copy_run(tiny_run, tmp_path / "l")))
    assert "at or past --num_iterations=4: nothing is left to train" in line


def test_truncated_checkpoint_json_is_one_line(tmp_path, tiny_run):
    log_dir = copy_run(tiny_run, tmp_path / "logs")
    meta = log_dir / "tiny" / "step_000002" / "checkpoint.json"
    meta.write_text(meta.read_text()[:100])
    line = one_line_error(run_main(TINY + ["--num_iterations=3", f"--resume={meta.parent}"], log_dir))
    assert "unreadable checkpoint.json (JSONDecodeError): it is truncated or corrupt" in line


def test_resume_with_other_optimizer_flags_is_refused_like_another_model_shape(tmp_path, tiny_run):
    line = one_line_error(run_main(TINY + ["--num_iterations=3", "--muon=false",
                                           f"--resume={tiny_run / 'tiny' / 'step_000002'}"], tmp_path))
    assert "has muon=True but this run has muon=False; pass the same optimizer flags" in line


@pytest.mark.parametrize("flag", ["--batch_tokens=0", "--seq_len=0", "--val_seq_len=0", "--model_dim=0",
                                  "--val_tokens=0", "--muon_lr=nan", "--adam_beta2=1.5", "--collective_timeout_s=0",
                                  "--n_head=0"])
def test_bad_flags_are_refused_before_the_run_log_opens(tmp_path, flag):
    started = time.time()
    line = one_line_error(run_main(TINY + [flag], tmp_path))
    assert line.startswith("error: bad value") and f"for {flag.split('=')[0]};" in line
    assert not list(tmp_path.glob("*.txt")) and time.time() - started < 60  # refused before the run log opens


# SIGTERM to one rank without checkpoints: every rank stops cleanly, no false collective failure.
def test_sigterm_on_one_rank_without_checkpoints_stops_every_rank(tmp_path):
    args = TINY + ["--num_iterations=500", "--val_every=0", "--run_id=sig8", f"--log_dir={tmp_path}"]
    log = tmp_path / "sig8.txt"
    proc, workers = start_two_ranks_until_step_3(args, log)
    os.kill(int(workers[-1]), signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    text = log.read_text()
    assert "a collective failed" not in err  # rank 0 used to report a false crash (exit 3)
    assert "stopped by signal SIGTERM" in text and "(no checkpoints enabled)" in text
    last_step = max(train_losses(text))
    assert last_step < 500 and not (tmp_path / "sig8").exists()


# Disk use is bounded: a resumed run writes into the same run folder, so checkpoint_keep caps the total.
def test_resumes_reuse_the_run_folder_so_checkpoint_keep_bounds_disk_use(tmp_path):
    first = run_main(TINY + ["--num_iterations=6", "--val_every=0", "--stop_after=2", "--checkpoint_keep=1"],
                     tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    for stop in (3, 4):
        again = run_main(TINY + ["--num_iterations=6", "--val_every=0", f"--stop_after={stop}",
                                    "--checkpoint_keep=1", "--resume=latest"], tmp_path)
        assert again.returncode == 0, again.stderr[-2000:]
    runs = [p for p in tmp_path.iterdir() if p.is_dir()]
    # keep=1, plus each segment's resume point (step 3 for the last one): the bound is keep + 1
    assert len(runs) == 1 and sorted(c.name for c in runs[0].iterdir()) == ["step_000003", "step_000004"]
    assert sorted(train_losses((tmp_path / f"{runs[0].name}.txt").read_text())) == [1, 2, 3, 4]


# A run id is a plain name: nothing is written outside --log_dir.
def test_run_id_with_path_separators_is_refused(tmp_path):
    logs = tmp_path / "a" / "b"
    line = one_line_error(run_main(TINY + ["--run_id=../../x"], logs))
    assert "bad value '../../x' for --run_id" in line and "no path separators" in line
    assert not (tmp_path / "x.txt").exists() and not list(tmp_path.rglob("*.txt"))


# ------------------------------------------------ resumes, edited checkpoints, the tools, schedules, data

def test_resuming_an_older_checkpoint_keeps_it_and_sets_the_newer_ones_aside(tmp_path):
    """The recovery after a divergence: --resume=<run>/step_000002 while the run folder holds steps 3 and 4.
    With --checkpoint_keep=1 rotation used to delete the resume point and the step it had just written (then
    crash); now the newer checkpoints are moved aside, named in the log, and the resume point is kept."""
    base = TINY + ["--num_iterations=5", "--val_every=0", "--checkpoint_every=1", "--stop_after=4", "--run_id=r"]
    assert run_main(base + ["--checkpoint_keep=3"], tmp_path).returncode == 0  # stopped at 4, not finished
    run = tmp_path / "r"
    old_step4 = hashlib.sha256((run / "step_000004" / "__0_0.distcp").read_bytes()).hexdigest()
    again = run_main(base + ["--checkpoint_keep=1", f"--resume={run / 'step_000002'}"], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    (aside,) = run.glob("abandoned_after_step_000002_*")
    assert sorted(p.name for p in run.glob("step_*")) == ["step_000002", "step_000004"]  # resume point, newest
    assert sorted(p.name for p in aside.iterdir()) == ["step_000003", "step_000004"]
    assert hashlib.sha256((aside / "step_000004" / "__0_0.distcp").read_bytes()).hexdigest() == old_step4
    assert f"moved 2 checkpoint(s) newer than the resume point step_000002 (step_000003, step_000004) aside to " \
           f"{aside}" in again.stdout
    latest = run_main(TINY + ["--num_iterations=5", "--val_every=0", "--resume=latest"], tmp_path)
    assert f"resumed from {run / 'step_000004'} at step 4" in latest.stdout  # the new step 4, not the abandoned one


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m.pop("files"), "it has no 'files'"),
    (lambda m: m.pop("loader"), "it has no 'loader'"),
    (lambda m: m.update(step="2"), "its 'step' is '2', not a int"),
    (lambda m: m.update(step=True), "its 'step' is True, not a int"),
    (lambda m: m["files"].update({"__0_0.distcp": {"bytes": "7"}}), "its record of file '__0_0.distcp'"),
])
def test_an_edited_checkpoint_json_is_one_line_and_latest_falls_back(tmp_path, tiny_run, edit, problem):
    log_dir = copy_run(tiny_run, tmp_path / "logs")
    newest, previous = log_dir / "tiny" / "step_000004", log_dir / "tiny" / "step_000002"
    os.utime(newest, (time.time() + 10, time.time() + 10))
    meta = json.loads((newest / "checkpoint.json").read_text())
    edit(meta)
    (newest / "checkpoint.json").write_text(json.dumps(meta))
    line = one_line_error(run_main(TINY + ["--num_iterations=5", f"--resume={newest}"], log_dir))
    assert f"checkpoint {newest} has a checkpoint.json that train_gpt.py did not write ({problem}" in line
    with pytest.raises(T.UsageError, match="did not write"):  # the tools read it through the same reader
        loading.load_model(newest, "cpu")
    result = run_main(TINY + ["--num_iterations=5", "--val_every=0", "--resume=latest", "--run_id=more"], log_dir)
    assert result.returncode == 0 and f"resumed from {previous} at step 2" in result.stdout, result.stderr
    assert (newest / "checkpoint.json").exists()  # another run's folder: left as it is


def test_the_tools_verify_checkpoint_bytes_like_the_trainer(tmp_path, tiny_run):
    """Same size, other bytes: the sha256 in checkpoint.json catches it in the tools as in the trainer."""
    folder = copy_run(tiny_run / "tiny" / "step_000004", tmp_path / "step_000004")
    flip_bytes(folder / "__0_0.distcp")
    with pytest.raises(T.UsageError) as e:
        loading.load_model(folder, "cpu")
    assert "failed verification" in str(e.value) and "does not match the sha256 in checkpoint.json" in str(e.value)
    done = tool_in_process("export", folder, tmp_path / "out")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert "does not match the sha256" in done.stderr and not (tmp_path / "out").exists()


def export_cli(*args):
    from tools import export
    return run_cli(lambda: export.main([str(a) for a in args]))


def test_export_never_replaces_a_file_it_did_not_write(tmp_path, tiny_run, capsys):
    checkpoint = tiny_run / "tiny" / "step_000004"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "settings"}')
    assert export_cli(checkpoint, mine) == 2
    assert "already holds config.json; pick an empty folder, or pass --overwrite" in capsys.readouterr().err
    assert export_cli(checkpoint, mine, "--overwrite") == 2
    assert "is not a gpt2-speedrun export; it is left as is" in capsys.readouterr().err
    assert (mine / "config.json").read_text() == '{"my": "settings"}' and not (mine / "model.safetensors").exists()
    fresh = tmp_path / "fresh"
    assert export_cli(checkpoint, fresh) == 0 and export_cli(checkpoint, fresh, "--overwrite") == 0  # its own: yes
    assert export_cli(checkpoint, fresh) == 2 and "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["parent_is_a_file", "proc"])
def test_export_into_an_unwritable_place_is_one_line(tmp_path, tiny_run, capsys, where):
    out = {"parent_is_a_file": tmp_path / "file" / "out", "proc": Path("/proc/export_here")}[where]
    (tmp_path / "file").write_text("x")
    assert export_cli(tiny_run / "tiny" / "step_000004", out) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot write the export into {out} (") and "\n" not in err


def test_a_twice_resumed_run_records_its_segments_and_the_reader_shows_them(tmp_path):
    """Stopped after step 2 and after step 4, then finished at 6, the last launch with another --batch_schedule:
    the final line and JSON count every segment's tokens at the schedule it trained with (they used to count all
    6 steps at the last schedule) and the total training time; the records reader shows the resumes."""
    base = TINY + ["--num_iterations=6", "--val_every=0", "--run_id=seg", "--checkpoint_keep=1"]
    assert run_main(base + ["--stop_after=2"], tmp_path).returncode == 0
    assert run_main(base + ["--stop_after=4", "--resume=latest"], tmp_path).returncode == 0
    last = run_main(base + ["--resume=latest", "--batch_schedule=1/2,1"], tmp_path)
    assert last.returncode == 0, last.stderr[-2000:]
    summary = json.loads((tmp_path / "seg.json").read_text())
    segments = summary["segments"]
    assert [(s["start_step"], s["end_step"]) for s in segments] == [(0, 2), (2, 4), (4, 6)]
    schedule = T.batch_schedule(T.parse_args(TINY + ["--num_iterations=6", "--batch_schedule=1/2,1"], False), 1)
    assert [s["tokens"] for s in segments] == [2 * 512, 2 * 512, schedule.tokens_before(6) - schedule.tokens_before(4)]
    assert summary["tokens"] == sum(s["tokens"] for s in segments) and summary["resumes"] == 2
    assert summary["total_train_time_ms"] == pytest.approx(sum(s["train_time_ms"] for s in segments))
    assert summary["train_time_ms"] == segments[-1]["train_time_ms"]
    final = next(line for line in (tmp_path / "seg.txt").read_text().splitlines() if line.startswith("final:"))
    fields = parse_progress_line(final).fields
    assert fields["tokens"] == summary["tokens"] and fields["resumes"] == 2
    assert fields["total_train_time"] == pytest.approx(summary["total_train_time_ms"], abs=1)
    for path in (tmp_path / "seg.txt", tmp_path / "seg.json"):  # each of the trainer's files, read alone
        out = subprocess.run([sys.executable, "-m", "records.read_records", str(path), "--json"],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out.stderr
        (parsed,) = json.loads(out.stdout)["runs"]
        assert parsed["resumes"] == 2 and parsed["tokens"] == summary["tokens"], (path, parsed)
        assert parsed["total_train_time_ms"] == pytest.approx(summary["total_train_time_ms"], abs=1)
    table = subprocess.run([sys.executable, "-m", "records.read_records", str(tmp_path / "seg.json")],
                           capture_output=True, text=True, timeout=60, cwd=REPO).stdout
    row = next(line for line in table.splitlines() if line.startswith("| seg "))
    assert f"| {summary['total_train_time_ms'] / 1000:.2f} (total) | 2 |" in row, table


@pytest.mark.parametrize("tool_args, message", [
    (["sample.py", "ckpt", "--max_new_tokens=abc"],
     "argument --max_new_tokens: bad value 'abc'; valid: an integer at least 1"),
    (["hellaswag.py"], "the following arguments are required: checkpoint"),
    (["export.py", "only_one"], "the following arguments are required: out_dir"),
])
def test_tool_argument_errors_are_one_line(tool_args, message, capsys, monkeypatch):
    import importlib
    program = importlib.import_module(f"tools.{tool_args[0].removesuffix('.py')}")
    monkeypatch.setattr(sys, "argv", [str(REPO / "tools" / tool_args[0])])  # argparse names the program from it
    assert run_cli(lambda: program.main(tool_args[1:])) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"error: {message} (see {tool_args[0]} --help)")


def test_a_checkpoint_of_other_model_switches_is_refused_by_name_not_called_corrupt(tmp_path, tiny_run):
    """A reference checkpoint resumed with a v2 technique on: the tensors differ, which is no corruption."""
    line = one_line_error(run_main(TINY + ["--num_iterations=5", "--backout=true", "--smear=true",
                                           f"--resume={tiny_run / 'tiny' / 'step_000004'}"], tmp_path))
    assert "holds other tensors than this run's model and optimizers (this run has adam/backout_lambda/" in line
    assert "it was written with smear=False here True, backout=False here True: pass its flags" in line
    assert "corrupt" not in line


def test_running_out_of_training_data_is_a_failed_run_not_a_usage_error(tmp_path):
    """Exit 4 (EXIT_RUN_FAILED) says the run failed on its own; 2 stays for what the user must fix."""
    val = np.fromfile(REPO / "data" / "sample" / "sotu_val_000000.bin", dtype="<u2", offset=T.HEADER_BYTES)
    header = np.zeros(256, dtype="<i4")
    header[:3] = (T.SHARD_MAGIC, T.SHARD_VERSION, 1200)  # a shard of 1200 tokens: 2 steps of 512 and a bit
    small = tmp_path / "small_train_000001.bin"
    small.write_bytes(header.tobytes() + val[:1200].astype("<u2").tobytes())
    line = one_line_error(run_main(TINY + [f"--train_files={small}", "--num_iterations=6", "--val_every=0"],
                                   tmp_path / "logs"), T.EXIT_RUN_FAILED)
    assert "ran out of training data after 1 pass(es) over 1 shard(s)" in line and "--train_cycle=true" in line


# ------------------------------------------------ one run per run id; resumes continue the run they resume

def file_digests(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def test_a_finished_runs_id_is_refused_and_its_files_are_untouched(tmp_path, tiny_run):
    """A fresh run with a finished run's --run_id used to replace its JSON, append to its log and rotate its
    checkpoints away; now it is refused in one line that says how to continue it or start anew."""
    logs = copy_run(tiny_run, tmp_path / "logs")
    before = file_digests(logs)
    for extra in ([], ["--checkpoint_every=1", "--checkpoint_final=true"]):
        line = one_line_error(run_main(TINY + ["--run_id=tiny", "--num_iterations=2", "--seed=5", *extra], logs))
        assert f"run tiny has finished ({logs / 'tiny.json'} holds its result, which is kept)" in line
        assert "pass another --run_id to start anew" in line and "--resume=" in line
    assert file_digests(logs) == before


def test_a_checkpointed_or_logged_runs_id_is_refused_unless_the_launch_continues_it(tmp_path):
    base = TINY + ["--num_iterations=4", "--val_every=0", "--run_id=c"]
    assert run_main(base + ["--checkpoint_every=1", "--stop_after=2"], tmp_path).returncode == 0
    before = file_digests(tmp_path)
    line = one_line_error(run_main(base, tmp_path))
    assert f"run c has checkpoints ({tmp_path / 'c' / 'step_000002'}): continue it with --resume=" in line
    assert file_digests(tmp_path) == before
    (tmp_path / "c" / "step_000001" / "checkpoint.json").unlink()  # now a log and unfinished folders only...
    (tmp_path / "c" / "step_000002" / "checkpoint.json").unlink()
    line = one_line_error(run_main(base, tmp_path))
    assert f"run c already has a log ({tmp_path / 'c.txt'}) of a launch that ended before a checkpoint" in line
    restarted = run_main(base + ["--resume=auto"], tmp_path)  # ... which an automatic restart continues
    assert restarted.returncode == 0 and "no finished checkpoint of run c yet: starting afresh" in restarted.stdout


def test_a_resumed_run_keeps_its_checkpoint_policy_and_the_log_says_what_came_from_where(tmp_path):
    """--checkpoint_every and --checkpoint_final used to be forgotten by a resume that did not repeat them, so the
    run ended without a final checkpoint; now every hyperparameter but the per-launch ones comes from the
    checkpoint unless the command line sets it, and the log names both kinds."""
    base = TINY + ["--val_every=0", "--run_id=k"]
    assert run_main(base + ["--num_iterations=4", "--checkpoint_every=3", "--checkpoint_final=true", "--stop_after=2",
                            "--muon_lr=0.03"], tmp_path).returncode == 0
    resumed = run_main(base + ["--num_iterations=5", "--resume=latest"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(c.name for c in (tmp_path / "k").glob("step_*")) == ["step_000002", "step_000003", "step_000005"]
    text = (tmp_path / "k.txt").read_text()
    assert f"resume: the hyperparameters of checkpoint {tmp_path / 'k' / 'step_000002'}, which differ from this " \
           "command line's defaults in muon_lr=0.03, checkpoint_every=3, checkpoint_final=true" in text
    assert "resume: changed on the command line: num_iterations=5 (checkpoint: 4)" in text
    assert [line for line in text.splitlines() if line.startswith("  muon_lr = ")] == ["  muon_lr = 0.03"] * 2


@pytest.mark.parametrize("edit, message", [
    (dict(muon_lr="fast"), "records muon_lr='fast', not a float: its checkpoint.json is edited or corrupt"),
    (dict(checkpoint_final=1), "records checkpoint_final=1, not a bool"),
])
def test_a_resumed_hyperparameter_of_the_wrong_kind_is_one_line(tmp_path, tiny_run, edit, message):
    logs = copy_run(tiny_run, tmp_path / "logs")
    meta_path = logs / "tiny" / "step_000002" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["hyperparameters"].update(edit)
    meta_path.write_text(json.dumps(meta))
    assert message in one_line_error(run_main(["--resume=" + str(meta_path.parent), "--run_id=x"], logs))


def test_a_resume_under_another_recipe_is_refused(tmp_path, tiny_run):
    line = one_line_error(run_main(["--recipe=v2", f"--resume={tiny_run / 'tiny' / 'step_000002'}"], tmp_path))
    assert "--recipe=v2 differs from checkpoint" in line and "a resumed run keeps its recipe" in line


def test_resume_accepts_the_checkpoint_json_inside_a_checkpoint_folder(tmp_path, tiny_run):
    meta = tiny_run / "tiny" / "step_000002" / "checkpoint.json"
    result = run_main(TINY + ["--num_iterations=3", "--val_every=0", f"--resume={meta}", "--run_id=j"], tmp_path)
    assert result.returncode == 0 and f"resumed from {meta.parent} at step 2" in result.stdout, result.stderr


def test_stopping_at_the_resume_point_keeps_its_checkpoint_as_it_is(tmp_path, tiny_run):
    """--stop_after at the step resumed from used to delete that checkpoint and write the same state again."""
    logs = copy_run(tiny_run, tmp_path / "logs")
    point = logs / "tiny" / "step_000002"
    before = file_digests(point)
    (logs / "tiny.json").unlink()  # the run may be continued under its own id
    result = run_main(TINY + ["--num_iterations=6", f"--resume={point}", "--stop_after=2"], logs)
    assert result.returncode == 0 and "is already written (the resume point); kept as it is" in result.stdout
    assert file_digests(point) == before


# ------------------------------------------------ schedules and data that would silently not train


def test_running_out_of_data_under_bos_align_names_it(tmp_path):
    val = np.fromfile(REPO / "data" / "sample" / "sotu_val_000000.bin", dtype="<u2", offset=T.HEADER_BYTES)
    document = np.where(val[:3000] == T.EOT_TOKEN, 11, val[:3000])
    document[0] = T.EOT_TOKEN  # one document of 3000 tokens: room for one 512-token sequence from its start
    header = np.zeros(256, dtype="<i4")
    header[:3] = (T.SHARD_MAGIC, T.SHARD_VERSION, len(document))
    shard = tmp_path / "one_train_000001.bin"
    shard.write_bytes(header.tobytes() + document.astype("<u2").tobytes())
    line = one_line_error(run_main(TINY + [f"--train_files={shard}", "--bos_align=true", "--val_every=0"],
                                   tmp_path / "logs"), T.EXIT_RUN_FAILED)
    assert "ran out of training data" in line and "with --bos_align=true every sequence starts at a document" in line


# ------------------------------------------------ signals at any moment of start-up: one line, printed once

def test_ctrl_c_while_torch_imports_is_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, str(REPO / "train_gpt.py"), f"--log_dir={tmp_path}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.time() + 60
    while time.time() < deadline and "libtorch" not in maps.read_text():  # torch's libraries load: mid-import
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    line = one_line_error(subprocess.CompletedProcess([], proc.returncode, out, err), 128 + signal.SIGINT)
    assert line == T.stopped_before_training(signal.SIGINT) and out == "" and not list(tmp_path.iterdir())


# ------------------------------------------------ a refused launch writes nothing

def test_a_refused_launch_writes_nothing_so_the_corrected_one_keeps_its_run_id(tmp_path):
    """--val_tokens as large as the shards was refused with 'the shards hold only 262144 tokens' after the run log
    existed, so the corrected relaunch under the same --run_id was refused as a second run of that id."""
    logs = tmp_path / "logs"
    line = one_line_error(run_main(TINY + ["--val_tokens=262144", "--run_id=same"], logs))
    assert line == ("error: --val_tokens=262144 is 1024 sequences of --val_seq_len=256 tokens, each with one token "
                    "more (its last target), and the validation shards (262144 tokens in 1 shard(s)) hold 1023: pass "
                    "--val_tokens=261888 or fewer")
    assert not logs.exists() or not list(logs.iterdir())
    result = run_main(TINY + ["--num_iterations=1", "--val_every=0", "--run_id=same"], logs)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("argv, env, message", [
    (["--attention=flex"], {}, "--attention=flex needs a CUDA GPU"),
    (["--mtp_tokens=300"], {}, "--mtp_tokens=300 predicts more tokens than a --seq_len=256 sequence holds"),
    (["--value_embed_tables=100"], {}, "--value_embed_tables=100 is more tables than --n_layer=2 uses"),
    ([], {"WORLD_SIZE": "2"}, "WORLD_SIZE=2 asks for a distributed run, but MASTER_ADDR is not set"),
    ([], {"RANK": "abc"}, "RANK='abc' is not an integer"),
    ([], {"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not an integer at least 1"),
    (["--hellaswag_every=1", "--hellaswag_data=/nope/hellaswag_val.jsonl"], {},
     "HellaSwag file /nope/hellaswag_val.jsonl does not exist"),  # was refused after the run log existed
])
def test_start_up_refusals_are_one_line_and_write_nothing(tmp_path, monkeypatch, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    logs = tmp_path / "logs"
    line = one_line_error(run_main(TINY + argv + ["--run_id=x"], logs))
    assert message in line
    assert not logs.exists() or not list(logs.iterdir())


def test_resuming_another_preset_s_checkpoint_does_not_announce_the_cpu_preset(tmp_path, tiny_run):
    """Resuming a medium checkpoint without --preset printed 'no GPU found: running the cpu preset', then ran the
    medium preset (the checkpoint's)."""
    logs = copy_run(tiny_run, tmp_path / "logs")
    point = logs / "tiny" / "step_000002"
    meta = json.loads((point / "checkpoint.json").read_text())
    meta["hyperparameters"]["preset"] = "medium"  # a checkpoint of the medium preset, in the tiny shape
    (point / "checkpoint.json").write_text(json.dumps(meta))
    argv = [a for a in TINY if a != "--preset=cpu"] + ["--num_iterations=3", "--val_every=0", f"--resume={point}",
                                                       "--run_id=m"]
    result = run_main(argv, logs)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "running the cpu preset" not in result.stdout and "run m: preset medium" in (logs / "m.txt").read_text()
