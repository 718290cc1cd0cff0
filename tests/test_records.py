"""Tests for records/read_records.py, the speedrun log reader.

The fixture logs under tests/fixtures/records/ are synthetic: ours/ holds this
project's format (.txt and .json, presets 'cpu' and 'h100'), public/ and
public_old/ the modded-nanogpt record format (with and without train_loss),
mixed/ good runs next to truncated, crashed, unknown-format and broken-JSON files.
"""

import importlib.util
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from records import read_records as rr

REPO = Path(__file__).resolve().parents[1]
READER = [sys.executable, "-m", "records.read_records"]  # as the README runs it, from the project root
FIX = REPO / "tests" / "fixtures" / "records"


def run_cli(*args, block=()):
    """Run the reader as a program; `block` names modules made unimportable."""
    if block:
        prelude = "import sys, runpy\n"
        prelude += "".join(f"sys.modules[{m!r}] = None\n" for m in block)
        prelude += f"sys.argv = {['read_records.py'] + [str(a) for a in args]!r}\n"
        prelude += "runpy.run_module('records.read_records', run_name='__main__', alter_sys=True)\n"
        cmd = [sys.executable, "-c", prelude]
    else:
        cmd = READER + [str(a) for a in args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


def _have(module):
    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------- statistics

KNOWN = [3.2761, 3.2774, 3.2790, 3.2755, 3.2782, 3.2769]


def test_mean_and_std_match_numpy():
    mean, std = rr.mean_std(KNOWN)
    assert mean == pytest.approx(np.mean(KNOWN), abs=1e-12)
    assert std == pytest.approx(np.std(KNOWN, ddof=1), abs=1e-12)
    # hand-checked values for these six numbers
    assert mean == pytest.approx(3.2771833333, abs=1e-9)
    assert std == pytest.approx(0.0013014, abs=1e-6)


def test_std_needs_two_values():
    mean, std = rr.mean_std([3.27])
    assert mean == 3.27 and math.isnan(std)


def test_pvalue_equals_scipy():
    stats = pytest.importorskip("scipy.stats", reason="scipy not installed: pip install -r requirements-extras.txt")
    for target in (3.28, 3.279, 3.2775, 3.3):
        expected = stats.ttest_1samp(KNOWN, target, alternative="less").pvalue
        assert rr.one_sided_pvalue(KNOWN, target) == pytest.approx(expected, rel=1e-12, abs=0)
    # mean 3.27718 is well below 3.28 with this spread: a small p-value
    assert rr.one_sided_pvalue(KNOWN, 3.28) < 0.01
    # and far above 3.27: p close to 1
    assert rr.one_sided_pvalue(KNOWN, 3.27) > 0.99


def test_group_stats_verdict():
    pytest.importorskip("scipy.stats", reason="scipy not installed: pip install -r requirements-extras.txt")
    runs = [rr.Run(name=f"r{i}", paths=[], folder=".", fmt="public", final_val_loss=v)
            for i, v in enumerate(KNOWN)]
    notes = []
    [s] = rr.group_stats(runs, target=3.28, alpha=0.01, notes=notes)
    assert s["n"] == 6 and s["meets"] is True and notes == []
    [s] = rr.group_stats(runs, target=3.2775, alpha=0.01, notes=notes)
    assert s["meets"] is False and s["p_value"] > 0.01


# ---------------------------------------------------------------- parsing

def test_the_reader_parses_what_the_trainers_one_writer_writes():
    import runlog
    import train_gpt as T
    # the units the reader strips are the ones the trainer writes
    assert set(rr.PROGRESS_UNITS) == {unit for _, unit in runlog.PROGRESS_FIELDS.values() if unit}
    written = T.progress_line(3, 80, val_loss=6.12345, train_time=98.4, step_avg=32.666, energy=12.3)
    line = rr.parse_progress_line(written)
    assert (line.step, line.total) == (3, 80)
    assert line.fields == {"val_loss": 6.1235, "train_time": 98.0, "step_avg": pytest.approx(32.67), "energy": 12.0}
    assert rr.parse_progress_line("step:{step}/{train_steps} val_loss:{val_loss:.4f}") is None
    assert rr.parse_progress_line('    print0(f"step:{step}/{n} train_time:{t:.0f}ms")') is None
    assert rr.parse_progress_line("step:1/2") is None
    assert rr.parse_progress_line("step:1/2 loss:abc") is None
    assert math.isnan(rr.parse_progress_line("step:0/80 val_loss:10.8258 train_time:0ms step_avg:nanms")
                      .fields["step_avg"])  # the public logs' first line
    final = rr.parse_progress_line(T.progress_line(None, 1770, val_loss=3.279, steps=1770, tokens=696000000,
                                                   train_time=175000, total_train_time=180000, resumes=1))
    assert final.step is None and final.fields["tokens"] == 696_000_000 and final.fields["total_train_time"] == 180000


def test_project_txt_and_json_pair_is_one_run():
    runs, skipped = rr.read_runs([str(FIX / "ours" / "gpu_s1.txt"), str(FIX / "ours" / "gpu_s1.json")])
    assert skipped == []
    [run] = runs
    assert run.name == "gpu_s1" and run.fmt == "project"
    assert len(run.paths) == 2
    assert run.final_val_loss == pytest.approx(3.2712)
    assert run.steps == 20 and run.tokens == 20 * 524288
    assert run.world_size == 8 and run.devices == ["NVIDIA H100 80GB HBM3"] * 8
    assert run.energy_j == pytest.approx(1523456.7)
    assert run.energy_kwh == pytest.approx(1523456.7 / 3.6e6, rel=1e-6)
    assert run.tokens_per_kwh == pytest.approx(run.tokens / run.energy_kwh, rel=1e-6)
    assert run.preset == "h100" and run.hyperparameters["seed"] == 1
    assert [p[0] for p in run.val_curve] == [0, 5, 10, 15, 20]
    assert run.val_curve[-1][1] == pytest.approx(3.2712)


def test_project_txt_alone():
    run = rr.parse_txt(FIX / "ours" / "cpu_s2.txt")
    assert run.fmt == "project"
    assert run.final_val_loss == pytest.approx(6.1302)
    assert run.steps == 20 and run.tokens == 20 * 4096
    assert run.devices == ["cpu"] and run.world_size == 1
    assert run.energy_kwh is None and run.tokens_per_kwh is None
    assert run.peak_memory_mib == 812.0
    assert run.hyperparameters["preset"] == "cpu"
    assert run.hyperparameters["num_iterations"] == "20"
    assert run.train_time_ms == pytest.approx(run.val_curve[-1][2])
    # The docstring inside the source block holds a data-looking "step:5/5" and
    # "final:" line; neither may be read, only the steps after the block.
    assert [p[0] for p in run.val_curve] == [0, 5, 10, 15, 20]
    assert all(p[1] != pytest.approx(0.1) for p in run.val_curve)


def test_json_numbers_win_and_txt_supplies_missing_curve(tmp_path):
    txt = (FIX / "ours" / "cpu_s1.txt").read_text()
    summary = json.loads((FIX / "ours" / "cpu_s1.json").read_text())
    assert "val_curve" not in summary  # the fixture JSON has no curve
    summary["final_val_loss"] = 6.0001  # differs from the txt's final line
    summary["train_time_ms"] = 11111.0
    (tmp_path / "r.txt").write_text(txt)
    (tmp_path / "r.json").write_text(json.dumps(summary))
    runs, skipped = rr.read_runs([str(tmp_path)])
    assert skipped == []
    [run] = runs
    assert run.final_val_loss == pytest.approx(6.0001)
    assert run.train_time_ms == 11111.0
    assert [p[0] for p in run.val_curve] == [0, 5, 10, 15, 20]
    txt_curve = rr.parse_txt(tmp_path / "r.txt").val_curve
    assert run.val_curve == txt_curve


def test_json_curve_used_when_present():
    run = rr.parse_json(FIX / "ours" / "gpu_s2.json")
    assert [p[0] for p in run.val_curve] == [0, 5, 10, 15, 20]
    assert run.val_curve[-1][1] == pytest.approx(3.2745)


def test_public_format_with_code_on_top():
    path = FIX / "public" / "3f2a9c1e-0b7d-4e55-9a41-6c2d8e1f0a01.txt"
    text = path.read_text()
    assert "step:{step}/{train_steps} val_loss:{val_loss:.4f}" in text  # the trap is there
    run = rr.parse_txt(path)
    assert run.fmt == "public"
    assert run.name == "3f2a9c1e-0b7d-4e55-9a41-6c2d8e1f0a01"
    assert run.steps == 40 and run.tokens is None
    assert run.final_val_loss == pytest.approx(3.2768)
    assert [p[0] for p in run.val_curve] == [0, 10, 20, 30, 40]
    assert run.val_curve[0][1] == pytest.approx(10.8258)
    # train time of the final val line, as written in the log
    last_val = [ln for ln in text.splitlines() if ln.startswith("step:40/40 val_loss:")][0]
    ms = float(last_val.split("train_time:")[1].split("ms")[0])
    assert run.train_time_ms == ms
    assert run.devices == ["NVIDIA H100 80GB HBM3"] * 8 and run.world_size == 8
    assert run.peak_memory_mib == 23001.0


def test_public_old_format_with_train_loss():
    [run] = rr.read_runs([str(FIX / "public_old")])[0]
    assert run.steps == 30 and run.final_val_loss == pytest.approx(3.2801)
    assert [p[0] for p in run.val_curve] == [0, 10, 20, 30]


# ---------------------------------------------------------------- bad input

BAD = {
    "truncated.txt": "truncated",
    "truncated_public.txt": "truncated",
    "crashed.txt": "crashed",
    "unknown.txt": "unknown format",
    "broken.json": "unreadable JSON",
}


def test_bad_files_are_skipped_by_name_and_good_runs_kept():
    runs, skipped = rr.read_runs([str(FIX / "mixed")])
    assert sorted(r.name for r in runs) == ["good_a", "good_public"]
    reasons = {Path(p).name: why for p, why in skipped}
    assert set(reasons) == set(BAD)
    for name, word in BAD.items():
        assert word in reasons[name], (name, reasons[name])


def test_cli_reports_bad_files_on_stderr_one_line_each():
    proc = run_cli(FIX / "mixed")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    for name, word in BAD.items():
        hits = [ln for ln in lines if ln.startswith("skipped ") and name + ":" in ln]
        assert len(hits) == 1, (name, proc.stderr)
        assert word in hits[0]
    assert "| good_a |" in proc.stdout and "| good_public |" in proc.stdout
    for name in BAD:
        assert Path(name).stem + " |" not in proc.stdout


def test_cli_exits_nonzero_when_nothing_readable(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here\n")
    (tmp_path / "bad.json").write_text("{not json")
    proc = run_cli(tmp_path)
    assert proc.returncode != 0
    assert "skipped" in proc.stderr and "notes.txt" in proc.stderr and "bad.json" in proc.stderr
    proc = run_cli(tmp_path / "does_not_exist")
    assert proc.returncode != 0 and "does_not_exist" in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = run_cli(tmp_path / "empty")  # nothing skipped: no reasons to point at
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: no log or summary found in {tmp_path / 'empty'}")


H100 = {"gpu_s1": 3.2712, "gpu_s2": 3.2745, "gpu_s3": 3.2731}  # the fixture's runs of one preset: a record


def beside_a_record(tmp_path, name, text):
    """read_runs of the h100 fixture runs plus one more file, `name` holding `text`; also that file's path."""
    for run in H100:
        for found in (FIX / "ours").glob(run + ".*"):
            shutil.copy(found, tmp_path / found.name)
    (tmp_path / name).write_text(text)
    return rr.read_runs([str(tmp_path)]), str(tmp_path / name)


def assert_the_record_stands(runs):
    """The verdict on the good runs is the one they get alone: one bad file hides nothing."""
    assert sorted(r.name for r in runs) == sorted(H100)
    [s] = rr.group_stats(runs, target=3.28, alpha=0.01, notes=[])
    assert s["n"] == 3 and s["mean"] == pytest.approx(np.mean(list(H100.values())))
    if _have("scipy"):
        assert s["meets"] is True


@pytest.mark.parametrize("field, value, reason", [
    ("final_val_loss", None, "bad value null for final_val_loss; valid: a finite number >= 0"),
    ("final_val_loss", True, "bad value true for final_val_loss; valid: a finite number >= 0"),
    ("final_val_loss", math.nan, "bad value NaN for final_val_loss; valid: a finite number >= 0"),
    ("final_val_loss", "abc", 'bad value "abc" for final_val_loss; valid: a finite number >= 0'),
    ("steps", -5, "bad value -5 for steps; valid: an integer >= 0"),
    ("train_time_ms", -1, "bad value -1 for train_time_ms; valid: a finite number >= 0"),
    ("world_size", True, "bad value true for world_size; valid: an integer >= 1"),
    ("val_curve", [[0, 10.8, 0.0], [5, math.inf, 9.0]], "bad value Infinity for val_loss at step 5; valid: a finite"),
])
def test_a_summary_with_a_number_out_of_range_is_skipped_and_the_verdict_stands(tmp_path, field, value, reason):
    summary = json.loads((FIX / "ours" / "gpu_s2.json").read_text())
    summary.update({"run_id": "bad", field: value})
    (runs, skipped), path = beside_a_record(tmp_path, "bad.json", json.dumps(summary))
    assert len(skipped) == 1 and skipped[0][0] == path and skipped[0][1].startswith(reason), skipped
    assert_the_record_stands(runs)


@pytest.mark.parametrize("log, line, bad_line, reason", [
    ("ours/gpu_s1.txt", "final: val_loss:3.2712 steps:20", "final: val_loss:nan steps:20",
     "bad value NaN for final_val_loss"),
    ("ours/gpu_s1.txt", "final: val_loss:3.2712 steps:20", "final: val_loss:3.2712 steps:-5",
     "bad value -5.0 for steps; valid: an integer >= 0"),
    ("public/3f2a9c1e-0b7d-4e55-9a41-6c2d8e1f0a01.txt", "step:40/40 val_loss:3.2768", "step:40/40 val_loss:inf",
     "bad value Infinity for final_val_loss"),
    ("public/3f2a9c1e-0b7d-4e55-9a41-6c2d8e1f0a01.txt", "step:0/40 val_loss:10.8258 train_time:0ms",
     "step:0/40 val_loss:10.8258 train_time:-5ms", "bad value -5.0 for train_time at step 0"),
])
def test_a_txt_log_with_a_number_out_of_range_is_skipped_by_the_same_rule(tmp_path, log, line, bad_line, reason):
    """The project's and the public .txt logs are held to the summaries' rules (read_records.check_run)."""
    text = (FIX / log).read_text()
    assert text.count(line) == 1  # the real line, not the look-alike in the logged source
    (runs, skipped), path = beside_a_record(tmp_path, "bad.txt", text.replace(line, bad_line))
    assert len(skipped) == 1 and skipped[0][0] == path and skipped[0][1].startswith(reason), skipped
    assert_the_record_stands(runs)


def test_cli_skips_a_nan_loss_in_one_line_and_keeps_the_verdict(tmp_path):
    summary = json.loads((FIX / "ours" / "gpu_s2.json").read_text())
    summary.update({"run_id": "bad", "final_val_loss": math.nan})
    _, path = beside_a_record(tmp_path, "bad.json", json.dumps(summary))
    proc = run_cli(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"skipped {path}: bad value NaN for final_val_loss; valid: a finite number >= 0\n" in proc.stderr
    assert f"n=3 finished runs, mean final val loss {np.mean(list(H100.values())):.4f}" in proc.stdout
    assert "| bad |" not in proc.stdout


# ---------------------------------------------------------------- CLI output

def test_cli_table_and_stats():
    proc = run_cli(FIX / "ours", "--target", "3.28", "--alpha", "0.01")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    header = out.splitlines()[0]
    for col in ("run", "devices", "world size", "steps", "tokens", "final val loss",
                "train time (s)", "energy (kWh)", "tokens/kWh"):
        assert col in header
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and not ln.startswith("| run")]
    assert len(rows) == 5
    gpu1 = [r for r in rows if r.startswith("| gpu_s1 |")][0]
    assert "8x NVIDIA H100 80GB HBM3" in gpu1 and "3.2712" in gpu1 and "10485760" in gpu1
    cpu2 = [r for r in rows if r.startswith("| cpu_s2 |")][0]
    assert cpu2.endswith("| n/a | n/a | n/a | n/a | n/a |")  # no energy, no tokens/kWh, no target recorded
    losses = [6.1234, 6.1302, 3.2712, 3.2745, 3.2731]
    assert f"mean final val loss {np.mean(losses):.4f}" in out
    assert f"std {np.std(losses, ddof=1):.4f}" in out


def test_cli_json_output():
    proc = run_cli(FIX / "ours", FIX / "public", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert len(data["runs"]) == 8 and data["skipped"] == []
    [s] = data["stats"]
    losses = [r["final_val_loss"] for r in data["runs"]]
    assert s["n"] == 8
    assert s["mean"] == pytest.approx(np.mean(losses))
    assert s["std"] == pytest.approx(np.std(losses, ddof=1))
    if _have("scipy"):
        from scipy import stats
        assert s["p_value"] == pytest.approx(stats.ttest_1samp(losses, 3.28, alternative="less").pvalue)
        assert s["meets"] is False


def test_group_by_gives_separate_stats():
    proc = run_cli(FIX / "ours", "--group-by", "preset", "--json")
    data = json.loads(proc.stdout)
    stats = {s["group"]: s for s in data["stats"]}
    assert set(stats) == {"preset=cpu", "preset=h100"}
    assert stats["preset=cpu"]["n"] == 2 and stats["preset=h100"]["n"] == 3
    h100 = [3.2712, 3.2745, 3.2731]
    assert stats["preset=h100"]["mean"] == pytest.approx(np.mean(h100))
    assert stats["preset=h100"]["std"] == pytest.approx(np.std(h100, ddof=1))
    assert stats["preset=cpu"]["mean"] == pytest.approx(np.mean([6.1234, 6.1302]))
    if _have("scipy"):
        from scipy import stats as sst
        assert stats["preset=h100"]["p_value"] == pytest.approx(
            sst.ttest_1samp(h100, 3.28, alternative="less").pvalue)
        assert stats["preset=h100"]["meets"] is True
        assert stats["preset=cpu"]["meets"] is False

    proc = run_cli(FIX / "public", FIX / "public_old", "--group-by", "folder")
    assert proc.returncode == 0, proc.stderr
    stat_lines = [ln for ln in proc.stdout.splitlines() if "finished runs" in ln]
    assert len(stat_lines) == 2
    assert any(ln.startswith(str(Path("tests/fixtures/records/public")) + ":") and "n=3" in ln
               for ln in stat_lines)
    assert any("public_old:" in ln and "n=1" in ln and "needs at least 2 runs" in ln
               for ln in stat_lines)


@pytest.mark.parametrize("option, valid", [
    ("--alpha=1", "a finite number in (0, 1)"), ("--alpha=0", "a finite number in (0, 1)"),
    ("--target=nan", "a finite number in (0, inf)"), ("--target=-3.28", "a finite number in (0, inf)"),
])
def test_an_option_out_of_range_is_one_error_line(option, valid, capsys):
    assert rr.main([str(FIX / "ours"), option]) == 2
    err = capsys.readouterr().err
    name, value = option.split("=")
    assert err == f"error: argument {name}: bad value '{value}'; valid: {valid} (see read_records.py --help)\n"


# ---------------------------------------------------------------- plots and extras

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not _have("matplotlib"),
                    reason="matplotlib not installed: pip install -r requirements-extras.txt")
def test_plots_are_written(tmp_path):
    proc = run_cli(FIX / "ours", FIX / "public", "--group-by", "folder", "--plot", tmp_path / "plots")
    assert proc.returncode == 0, proc.stderr
    for name in ("val_loss_vs_step.png", "val_loss_vs_time.png"):
        path = tmp_path / "plots" / name
        assert path.is_file(), proc.stdout
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE
        assert len(data) > 10_000
        assert f"wrote {path}" in proc.stdout


needs_matplotlib = pytest.mark.skipif(not _have("matplotlib"),
                                      reason="matplotlib not installed: pip install -r requirements-extras.txt")


@needs_matplotlib
@pytest.mark.parametrize("under", [False, True])
def test_a_plot_folder_that_is_a_file_or_under_one_is_one_line(tmp_path, under):
    (tmp_path / "notes").write_bytes(b"a file of the user's")
    folder = tmp_path / "notes" / "plots" if under else tmp_path / "notes"
    proc = run_cli(FIX / "ours", "--plot", folder)
    expected = (f"error: cannot make the --plot folder {folder} (Not a directory); pass a folder you can write"
                if under else f"error: --plot {folder} is a file, not a folder; pass a folder (it is made if missing)")
    assert proc.returncode == 2 and proc.stderr == expected + "\n", proc.stderr
    assert (tmp_path / "notes").read_bytes() == b"a file of the user's"


@needs_matplotlib
def test_a_plot_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure
    folder = tmp_path / "plots"
    folder.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes into any folder: refuse the write as the folder would anyone else's
        def refused(self, path, **kwargs):
            raise PermissionError(13, "Permission denied", str(path))
        monkeypatch.setattr(Figure, "savefig", refused)
    assert rr.main([str(FIX / "ours"), "--plot", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: cannot write {folder / 'val_loss_vs_step.png'} (Permission denied); pass a --plot "
                   "folder you can write\n")


@needs_matplotlib
def test_plots_replace_only_the_files_this_program_wrote(tmp_path):
    folder = tmp_path / "plots"
    assert run_cli(FIX / "ours", "--plot", folder).returncode == 0
    step, time = folder / "val_loss_vs_step.png", folder / "val_loss_vs_time.png"
    first = step.read_bytes()
    assert run_cli(FIX / "public", "--plot", folder).returncode == 0  # its own plots: replaced
    assert step.read_bytes() != first
    time.write_bytes(PNG_SIGNATURE + b"the user's own plot")
    ours = step.read_bytes()
    proc = run_cli(FIX / "ours", "--plot", folder)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {time} is not a plot read_records.py wrote, so it is left as is; move it or pass another --plot "
        "folder\n"), proc.stderr
    assert time.read_bytes() == PNG_SIGNATURE + b"the user's own plot" and step.read_bytes() == ours


def test_without_scipy_and_matplotlib_table_still_works(tmp_path):
    proc = run_cli(FIX / "ours", "--plot", tmp_path / "plots", block=("scipy", "matplotlib"))
    assert proc.returncode == 0, proc.stderr
    assert "| gpu_s1 |" in proc.stdout
    assert "mean final val loss" in proc.stdout and "std " in proc.stdout
    err = proc.stderr.splitlines()
    scipy_lines = [ln for ln in err if "scipy is not installed" in ln]
    mpl_lines = [ln for ln in err if "matplotlib is not installed" in ln]
    assert len(scipy_lines) == 1 and "pip install -r requirements-extras.txt" in scipy_lines[0]
    assert len(mpl_lines) == 1 and "pip install -r requirements-extras.txt" in mpl_lines[0]
    assert not (tmp_path / "plots" / "val_loss_vs_step.png").exists()


def test_reader_parses_a_real_log_written_by_the_trainer(tmp_path, tiny_run):
    """End to end: a tiny CPU run of train_gpt.py, then the reader on its log alone (the .txt must be enough)."""
    from conftest import val_losses
    shutil.copy(tiny_run / "tiny.txt", tmp_path / "real.txt")
    out = subprocess.run(READER + [str(tmp_path / "real.txt"), "--json"], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    (parsed,) = json.loads(out.stdout)["runs"]
    log_vals = val_losses((tmp_path / "real.txt").read_text())
    assert parsed["steps"] == 4 and parsed["world_size"] == 1
    assert parsed["final_val_loss"] == pytest.approx(log_vals[4], abs=1e-4)
    assert [point[0] for point in parsed["val_curve"]] == sorted(log_vals)


# ---------------------------------------------------------------- a run rebuilt from its log alone

def test_a_run_rebuilt_from_its_logs_embedded_sources_reruns_to_the_same_losses(tmp_path, tiny_run):
    """The log embeds train_gpt.py and every sibling module it imported; records/rebuild_run.py writes them into
    an empty folder and prints the command with every logged hyperparameter. Rerun from there (only the log
    folder and run id changed, checkpoints off), it imports its siblings from that folder and trains to the
    same losses, bit for bit."""
    from conftest import train_losses, val_losses
    log = tiny_run / "tiny.txt"
    sources, _ = rr.log_sources(log.read_text())
    assert {"train_gpt.py", "flags.py", "runlog.py", "checkpoints.py"} <= set(sources)
    assert all(sources[name] == (REPO / name).read_text() for name in sources)  # byte for byte
    out = tmp_path / "rebuilt"
    done = subprocess.run([sys.executable, "-m", "records.rebuild_run", str(log), str(out)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    command = shlex.split(done.stdout.strip().splitlines()[-1])
    assert command[1] == str(out / "train_gpt.py") and "--n_layer=2" in command and "--seed=0" in command
    again = subprocess.run(command + [f"--log_dir={tmp_path / 'logs'}", "--run_id=again", "--checkpoint_every=0",
                                      "--checkpoint_final=false"], cwd=REPO, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-2000:]
    rerun = (tmp_path / "logs" / "again.txt").read_text()
    assert rr.log_sources(rerun)[0] == sources  # the rebuilt files, and nothing from the checkout, ran
    original = log.read_text()
    assert train_losses(rerun) == train_losses(original) and val_losses(rerun) == val_losses(original)
    refused = subprocess.run([sys.executable, "-m", "records.rebuild_run", str(log), str(out)], capture_output=True,
                             text=True, timeout=60, cwd=REPO)
    assert refused.returncode == 2 and "already holds train_gpt.py" in refused.stderr  # never over a file


@needs_matplotlib
def test_curves_of_several_runs_are_plotted_from_their_metrics_files_against_steps_time_and_tokens(tmp_path, tiny_run):
    """Two real runs (the tiny run, and a copy whose log and summary are gone, as after a crash): both curves are
    drawn on each of the three plots from their metrics files; the log-less one is in the table as unfinished and
    left out of the statistics; the legend names each run with its final loss."""
    logs = tmp_path / "logs"
    logs.mkdir()
    for suffix in (".txt", ".json", ".metrics.jsonl"):
        shutil.copy(tiny_run / f"tiny{suffix}", logs / f"tiny{suffix}")
    shutil.copy(tiny_run / "tiny.metrics.jsonl", logs / "crashed.metrics.jsonl")
    runs, skipped = rr.read_runs([str(logs)])
    assert not skipped and [(r.name, r.finished) for r in runs] == [("crashed", False), ("tiny", True)]
    assert runs[1].val_tokens == {0: 0, 2: 1024, 4: 2048} and rr.curve_points(runs[1], "tokens")[-1][0] == 2048
    proc = run_cli(logs, "--plot", tmp_path / "plots", "--target", "5.7")
    assert proc.returncode == 0, proc.stderr
    assert "n=1 finished runs" in proc.stdout and "(unfinished)" in proc.stdout
    import matplotlib.pyplot as plt
    drawn = {}
    real_save = rr.save_png

    def keep_legend(fig, path):  # what each plot shows: its legend's entries and the lines' points
        ax = fig.axes[0]
        drawn[Path(path).name] = ([t.get_text() for t in ax.get_legend().get_texts()],
                                  [list(line.get_xdata()) for line in ax.get_lines() if line.get_label() != "_nolegend_"])
        real_save(fig, path)
    rr.save_png = keep_legend
    try:
        runs = rr.read_runs([str(logs)])[0]
        rr.write_plots(runs, str(tmp_path / "again"), grouped=False, target=5.7)
    finally:
        rr.save_png = real_save
    plt.close("all")
    final = runs[1].final_val_loss
    assert sorted(drawn) == sorted(rr.PLOT_NAMES) and len(rr.PLOT_NAMES) == 3
    for name, (legend, lines) in drawn.items():
        assert legend == [f"crashed: {final:.4f} (unfinished)", f"tiny: {final:.4f}", "target 5.7"], name
    assert drawn["val_loss_vs_tokens.png"][1][:2] == [[0.0, 1024.0, 2048.0]] * 2
    assert drawn["val_loss_vs_step.png"][1][:2] == [[0.0, 2.0, 4.0]] * 2


@pytest.mark.parametrize("folder", sorted(p.name for p in (REPO / "records").iterdir() if p.is_dir()))
def test_every_committed_record_reads_whole_and_its_readme_quotes_its_losses(folder):
    """Each records/<folder> as the reader reads it today: no file skipped, every run finished, and each final
    loss its README's table quotes (to 4 decimals) is one the reader finds."""
    runs, skipped = rr.read_runs([str(REPO / "records" / folder)])
    assert skipped == [] and runs and all(run.finished for run in runs), skipped
    readme = (REPO / "records" / folder / "README.md").read_text()
    for run in runs:
        assert f"{run.final_val_loss:.4f}" in readme, (folder, run.name)


# ---------------------------------------------------------------- hostile paths

REBUILD = [sys.executable, "-m", "records.rebuild_run"]  # from the project root


def test_rebuilding_from_a_binary_file_is_one_line(tmp_path):
    """Was a UnicodeDecodeError traceback."""
    log = tmp_path / "run.txt"
    log.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    proc = subprocess.run([*REBUILD, str(log), str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 2 and proc.stderr == (f"error: cannot read the log {log}: not a text file (byte 8 is "
                                                    "not UTF-8 text); pass a <run_id>.txt that train_gpt.py wrote\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make, said", [
    (lambda d: d / "missing" / "run.txt", "no such file (its folder"),
    (lambda d: d, "it is a folder, not a file"),
    (lambda d: (os.mkfifo(d / "fifo.txt"), d / "fifo.txt")[1], "it is a FIFO (named pipe), not a file")],
    ids=["missing parent", "folder", "fifo"])
def test_rebuilding_from_what_is_not_a_log_file_is_one_line(tmp_path, make, said):
    proc = subprocess.run([*REBUILD, str(make(tmp_path)), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_rebuilding_into_a_file_or_an_unmakeable_folder_is_one_line(tmp_path):
    log = next((REPO / "records" / "2026-12-02_cpu_sample").glob("*.txt"))
    (tmp_path / "file").write_text("mine\n")
    for out, said in [(tmp_path / "file", "it is not a folder"), (tmp_path / "file" / "sub", "a file on the way"),
                      (Path("/proc/nope/out"), "cannot make OUT_DIR /proc/nope/out")]:
        proc = subprocess.run([*REBUILD, str(log), str(out)], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert (tmp_path / "file").read_text() == "mine\n"


def test_the_reader_names_a_fifo_or_a_device_for_what_it_is_and_never_blocks_on_it(tmp_path):
    """A FIFO was 'no such file or folder'; one inside a folder is passed over (reading it would block)."""
    os.mkfifo(tmp_path / "pipe")
    os.mkfifo(tmp_path / "inside.txt")
    proc = run_cli(tmp_path / "pipe", "/dev/null", tmp_path / "nope" / "x.txt", tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert f"skipped {tmp_path / 'pipe'}: it is a FIFO (named pipe), not a log file or a folder of them" in lines
    assert "skipped /dev/null: it is a device, not a log file or a folder of them" in lines
    assert (f"skipped {tmp_path / 'nope' / 'x.txt'}: no such file or folder (its folder {tmp_path / 'nope'} does "
            "not exist either)") in lines
    assert lines[-1].startswith("error: no run could be read")


@needs_matplotlib
def test_a_plot_folder_that_is_a_fifo_says_so(tmp_path):
    """It was called 'a file'."""
    os.mkfifo(tmp_path / "pipe")
    proc = run_cli(FIX / "ours", "--plot", tmp_path / "pipe")
    assert proc.returncode == 2 and proc.stderr == (f"error: --plot {tmp_path / 'pipe'} is a FIFO (named pipe), not a "
                                                    "folder; pass a folder (it is made if missing)\n"), proc.stderr
