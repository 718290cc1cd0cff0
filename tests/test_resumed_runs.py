"""A run stopped and resumed is the same run as one trained straight through: its files hold every launch, a crash
that tore a line loses nothing else, and the curve, the target, the report card and the reader's plots all come
from the one record of the run's validations, its metrics file."""
import json
import math
import re
import sys
import types

import pytest

import runlog
from conftest import TINY, run_main
from records import read_records as rr

STOPPED = TINY + ["--checkpoint_every=2"]


def stop_and_resume(tmp_path, run_id, first=(), second=(), between=None):
    """TINY stopped after step 2 (a checkpoint there), `between` done to its folder, then resumed to step 4."""
    stopped = run_main(STOPPED + [f"--run_id={run_id}", "--stop_after=2", *first], tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    if between:
        between(tmp_path)
    resumed = run_main(STOPPED + [f"--run_id={run_id}", "--resume=auto", *second], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    return resumed


def cut(path, n):
    path.write_bytes(path.read_bytes()[:-n])


def test_a_line_a_crash_tore_is_ended_before_the_resumed_launch_appends(tmp_path):
    """The metrics file and the run log, each cut mid-line: the resumed launch starts a line of its own, so only the
    torn line is lost (said once, as cut short) and every record around it is read."""
    def tear(folder):
        cut(folder / "torn.metrics.jsonl", 40)
        cut(folder / "torn.txt", 10)
    stop_and_resume(tmp_path, "torn", between=tear)
    metrics = rr.read_metrics(tmp_path / "torn.metrics.jsonl")
    assert len(metrics.skipped) == 1 and metrics.skipped[0].endswith(": cut short (the run stopped while writing it)")
    assert sorted(metrics.records["train"]) == [1, 2, 3, 4] and sorted(metrics.records["val"]) == [0, 2, 4]
    log = (tmp_path / "torn.txt").read_text().splitlines()
    assert log.count("==== train_gpt.py ====") == 2  # the second launch's header on a line of its own
    (run,), skipped = rr.read_runs([str(tmp_path)])
    assert [step for step, _, _ in run.val_curve] == [0, 2, 4] and run.val_tokens == {0: 0, 2: 1024, 4: 2048}
    assert [reason for _, reason in skipped] == metrics.skipped


def test_a_resumed_run_reads_as_the_same_run_trained_straight_through(tmp_path):
    """Straight through and stopped at step 2 then resumed: the same validations (steps, losses, tokens), at run
    times that only grow and end at the run's training time, in the summary, the metrics file, the reader (summary,
    log alone, metrics alone), the plots' points and the report card; and the same target."""
    target = ["--target_val_loss=10.7"]
    assert run_main(STOPPED + ["--run_id=straight", *target], tmp_path / "straight").returncode == 0
    stop_and_resume(tmp_path / "resumed", "resumed", target, target)
    for name in ("straight", "resumed"):
        folder = tmp_path / name
        summary = json.loads((folder / f"{name}.json").read_text())
        curve = summary["val_curve"]
        times = [t for _, _, t in curve]
        assert times == sorted(times) and times[-1] == summary["total_train_time_ms" if name == "resumed"
                                                                else "train_time_ms"]
        readings = {"summary": rr.read_runs([str(folder / f"{name}.json")])[0][0],
                    "log": rr.read_runs([str(folder / f"{name}.txt")])[0][0],
                    "metrics": rr.read_runs([str(folder / f"{name}.metrics.jsonl")])[0][0],
                    "folder": rr.read_runs([str(folder)])[0][0]}
        for how, run in readings.items():
            assert [p[0] for p in run.val_curve] == [p[0] for p in curve], how
            assert [p[1] for p in run.val_curve] == pytest.approx([p[1] for p in curve], abs=1e-4), how  # the log's
            assert [p[2] for p in run.val_curve] == pytest.approx(times, abs=2), how  # 4 decimals, whole milliseconds
            if how != "metrics":
                assert (run.target_step, run.target_tokens) == (summary["target"]["step"], 1024), how
        points = {axis: rr.curve_points(readings["folder"], axis) for axis in ("step", "time", "tokens")}
        card = (folder / f"{name}.md").read_text()
        card = [re.sub(r"[0-9.]+ s of training", "(time) s of training", row) for row in card.splitlines()
                if row.startswith(("| final val loss", "| target"))]
        if name == "straight":
            expected = (curve, points, card)
            continue
        assert [p[:2] for p in curve] == [p[:2] for p in expected[0]]
        assert points["step"] == expected[1]["step"] and points["tokens"] == expected[1]["tokens"]
        assert [x for x, _ in points["time"]] == sorted(x for x, _ in points["time"])
        assert card == expected[2] and len(card) == 2
        assert "reached at step 2" in card[1]


def test_a_target_changed_at_resume_is_found_among_every_validation_of_the_run(tmp_path):
    """Stopped under --target_val_loss=10.5 (not reached), resumed under 11.0: steps 0 and 2 were already below it,
    so the run reached it at step 0, as the log, summary, report card and reader say; a run resumed under
    --stop_at_target past its target stops at its first validation."""
    losses = {}

    def read_losses(folder):
        losses.update({s: r["val_loss"] for s, r in rr.read_metrics(folder / "looser.metrics.jsonl").records["val"].items()})
    resumed = stop_and_resume(tmp_path, "looser", ["--target_val_loss=10.5"], ["--target_val_loss=11.0"], read_losses)
    assert 10.5 < losses[2] and losses[0] <= 11.0, losses  # the premise: 10.5 not reached by step 2, 11.0 at step 0
    summary = json.loads((tmp_path / "looser.json").read_text())
    assert summary["target"]["step"] == 0 and summary["target"]["val_loss"] == 11.0
    assert summary["target"]["reached_val_loss"] == losses[0] and summary["target"]["tokens"] == 0
    assert "| target | val loss <= 11.0: reached at step 0," in (tmp_path / "looser.md").read_text()
    assert "target: val_loss:" in resumed.stdout and " steps:0 " in resumed.stdout
    for path in ("looser.json", "looser.txt", ""):
        (run,), _ = rr.read_runs([str(tmp_path / path)])
        assert (run.target_loss, run.target_step) == (11.0, 0), path
    again = run_main(STOPPED + ["--run_id=again", f"--resume={tmp_path / 'looser' / 'step_000002'}",
                                "--target_val_loss=11.0", "--stop_at_target=true"], tmp_path)
    assert again.returncode == 0, again.stderr
    summary = json.loads((tmp_path / "again.json").read_text())  # the run continued under another id: all of it
    assert summary["steps"] == 2 and summary["stopped_at_target"] and summary["target"]["step"] == 0
    assert [(s, loss) for s, loss, _ in summary["val_curve"]] == [(0, losses[0]), (2, losses[2])]


def test_the_trainers_reading_of_its_metrics_is_the_readers(tmp_path):
    """A file of three launches (one abandoned after a crash, one resumed from an older checkpoint) with a torn line:
    the validations the trainer reads back for its summary and target are those records/read_records.py reads."""
    def val(step, loss, ms):
        return json.dumps({"kind": "val", "step": step, "tokens": step * 10, "val_loss": loss, "train_time_ms": ms,
                           "energy_j": None})

    def train(step):
        return json.dumps({"kind": "train", "step": step, **{k: 1.0 for k in runlog.METRIC_KEYS["train"][1:]}})
    lines = [val(0, 11.0, 0), train(1), train(2), val(2, 10.0, 20), train(3), train(4), val(4, 9.0, 40), train(5),
             train(6), val(6, 8.0, 60), train(7), '{"kind": "train", "st',  # a crash at step 8; resumed at 4
             val(4, 9.0, 41), train(5), train(6), '{"kind": "val"',  # a crash again; resumed at 5
             train(6), train(7), train(8), val(8, 7.5, 80)]
    path = tmp_path / "r.metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    read = {s: (r["val_loss"], r["train_time_ms"]) for s, r in rr.read_metrics(path).records["val"].items()}
    assert read == {0: (11.0, 0), 2: (10.0, 20), 4: (9.0, 41), 8: (7.5, 80)}  # not the abandoned step 6
    mine = {s: (r["val_loss"], r["train_time_ms"]) for s, r in runlog.recorded_validations(path, 8).items()}
    assert mine == read and runlog.run_curve(path, 8) == [[s, *read[s]] for s in sorted(read)]
    assert runlog.target_among(runlog.recorded_validations(path, 8), 9.5)["step"] == 4


def test_a_tensorboard_that_fails_to_import_in_another_way_is_one_warning(tmp_path, monkeypatch):
    broken = types.ModuleType("torch.utils.tensorboard")

    def fails(name):  # importing SummaryWriter fails as a mismatched install does
        if name != "SummaryWriter":
            raise AttributeError(name)
        raise RuntimeError("tensorboard was built against another protobuf\nmore detail")
    broken.__getattr__ = fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", broken)
    result = run_main(TINY + ["--num_iterations=2", "--val_every=0", "--tensorboard=true", "--run_id=tb"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("warning: --tensorboard=true cannot load tensorboard (RuntimeError: tensorboard was "
                               "built against another protobuf); the run goes on") == 1
    assert (tmp_path / "tb.metrics.jsonl").read_text().count('"kind": "train"') == 2 and math.isfinite(
        json.loads((tmp_path / "tb.json").read_text())["final_val_loss"])
