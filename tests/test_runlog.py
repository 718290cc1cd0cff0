"""runlog.py and what the loop records with it: the energy counters and their phases, the energy line, profiler
traces, the metrics file (and TensorBoard), progress bars on a terminal, the target loss, the report card, and
energy continued across a resume."""
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import runlog
import train_gpt as T
from conftest import IMPORT_ENV, REPO, TINY, parse_progress_line, run_trainer
from records import read_records as rr

CPU_RANK0 = T.Runtime(0, 0, 1, torch.device("cpu"), torch.float32, "banded", False, "off")


class FakeNvml:
    """Scripted NVML: the total-energy counter (mJ) returns the given readings in order."""

    def __init__(self, readings_mj):
        self.readings = list(readings_mj)
        self.handles = []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        self.handles.append(bus_id)
        return f"gpu at {bus_id}"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self.readings.pop(0)


def make_powercap(root, packages):
    """A fake /sys/class/powercap: packages is a list of (energy_uj, max_energy_range_uj)."""
    for i, (energy, wrap) in enumerate(packages):
        d = root / f"intel-rapl:{i}"
        d.mkdir(parents=True)
        (d / "energy_uj").write_text(f"{energy}\n")
        (d / "max_energy_range_uj").write_text(f"{wrap}\n")
        sub = root / f"intel-rapl:{i}:0"  # a sub-domain (core): inside the package, never added again
        sub.mkdir()
        (sub / "energy_uj").write_text("999999999\n")
        (sub / "max_energy_range_uj").write_text("1000000000\n")
    return root


def set_energy(root, i, value):
    (root / f"intel-rapl:{i}" / "energy_uj").write_text(f"{value}\n")


def test_nvml_meter_sums_only_the_intervals_it_runs_for():
    rt = T.Runtime(0, 3, 1, torch.device("cpu"), torch.float32, "banded", False, "off")
    nvml = FakeNvml([1_000_000, 1_500_000, 9_000_000, 9_250_000])  # start, stop, (validation), start, stop
    meter = T.EnergyMeter(runlog.NvmlCounter("00000000:3B:00.0", nvml))
    meter.start(); meter.stop(); meter.start(); meter.stop()
    assert meter.joules["train"] == pytest.approx(500.0 + 250.0)
    assert nvml.handles == ["00000000:3B:00.0"]
    assert meter.totals(rt) == {"train": pytest.approx(750.0), "warmup": 0.0, "validation": 0.0, "ranks": 1}


def test_the_gpu_is_found_by_its_pci_bus_id_not_its_cuda_index():
    """Under CUDA_VISIBLE_DEVICES=3,5 torch's cuda:0 is NVML's GPU 3: the handle comes from the bus id."""
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)  # as torch reports them
    assert runlog.nvml_bus_id(props) == "00000000:3B:00.0"  # nvidia-smi's "Bus-Id" form
    assert runlog.nvml_bus_id(types.SimpleNamespace(pci_domain_id=1, pci_bus_id=200, pci_device_id=31)) == "00000001:C8:1F.0"


def test_rapl_sums_packages_skips_subdomains_and_survives_wraparound(tmp_path):
    root = make_powercap(tmp_path / "powercap", [(1_000_000, 2**32), (2**32 - 500_000, 2**32)])
    meter = T.EnergyMeter.open(CPU_RANK0, powercap_root=root)
    assert meter.counters is not None and len(meter.counters.domains) == 2
    meter.start()
    set_energy(root, 0, 4_000_000)  # +3 J
    set_energy(root, 1, 1_500_000)  # wrapped: +0.5 J to the top, +1.5 J after
    meter.stop()
    assert meter.joules["train"] == pytest.approx(3.0 + 2.0)


def test_rapl_is_read_by_local_rank_zero_only(tmp_path):
    root = make_powercap(tmp_path / "powercap", [(0, 2**32)])
    other = T.Runtime(1, 1, 2, torch.device("cpu"), torch.float32, "banded", False, "off")
    meter = T.EnergyMeter.open(other, powercap_root=root)
    assert meter.counters is None and "local rank 0" in meter.reason


def test_unreadable_counters_give_a_reason(tmp_path):
    meter = T.EnergyMeter.open(CPU_RANK0, powercap_root=tmp_path / "missing")
    assert meter.counters is None and "no RAPL package domains" in meter.reason
    assert meter.totals(CPU_RANK0) is None
    assert T.energy_line(None, meter.reason, 10.0, 1000) == f"energy: n/a ({meter.reason})"


def test_energy_line_reports_kwh_power_and_tokens_per_kwh():
    line = T.energy_line({"train": 7200.0, "warmup": 31.5, "validation": 12.25, "ranks": 2}, "", 10.0, 1_000_000)
    assert line == ("energy: 7200.0 J (0.002000 kWh) mean_power:360.0W/device tokens_per_kWh:5.000e+08 "
                    "warmup:31.5J validation:12.2J")


SUM_DRIVER = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    import train_gpt as T
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rt = T.Runtime(rank, rank, 2, torch.device("cpu"), torch.float32, "banded", False, "off")
    meter = T.EnergyMeter(object() if rank == 0 else None, "" if rank == 0 else "no counter")  # rank 1 measures nothing
    meter.joules["train"], meter.joules["validation"] = (123.5, 2.0) if rank == 0 else (0.0, 0.0)
    with open(sys.argv[1] + f"/total{rank}.txt", "w") as out:  # one file per rank: stdout lines interleave
        out.write(repr(meter.totals(rt)))
    dist.destroy_process_group()
''')


def test_energy_is_summed_over_ranks(tmp_path):
    driver = tmp_path / "sum.py"
    driver.write_text(SUM_DRIVER)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(driver), str(tmp_path)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **IMPORT_ENV})
    assert result.returncode == 0, result.stderr[-2000:]
    assert [(tmp_path / f"total{r}.txt").read_text() for r in range(2)] == \
        ["{'train': 123.5, 'warmup': 0.0, 'validation': 2.0, 'ranks': 1}"] * 2


def test_profiler_writes_a_chrome_trace_per_rank(tmp_path):
    result = run_trainer(TINY + ["--num_iterations=4", "--val_every=0", "--profile_steps=1", "--run_id=prof"],
                         tmp_path)
    assert result.returncode == 0, result.stderr
    trace = json.loads((tmp_path / "prof_rank0.trace.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any("aten::" in n for n in names)


# ---------------------------------------------------------------- progress lines

def test_progress_lines_round_trip_through_the_one_parser():
    line = T.progress_line(7, 60, train_loss=5.123456, train_time=1234.4, step_avg=176.34)
    assert line == "step:7/60 train_loss:5.1235 train_time:1234ms step_avg:176.34ms"
    parsed = parse_progress_line(line)
    assert (parsed.step, parsed.total, parsed.fields) == (7, 60, {"train_loss": 5.1235, "train_time": 1234.0,
                                                                  "step_avg": 176.34})
    final = T.progress_line(None, 60, val_loss=5.5, steps=60, tokens=122880, train_time=9.6)
    assert final == "final: val_loss:5.5000 steps:60 tokens:122880 train_time:10ms"
    assert parse_progress_line(final).fields == {"val_loss": 5.5, "steps": 60, "tokens": 122880, "train_time": 10}
    with pytest.raises(KeyError):
        T.progress_line(1, 2, no_such_field=1.0)  # every field has its declared format


def test_the_loop_counts_training_energy_and_not_validation(tmp_path, monkeypatch):
    """The real loop with a counter that validation moves by 1000 J and each training step by 1 J: the
    Clock must pause the meter around every validation (steps 0, 2 and 4 of 4), so 4 J are counted."""
    class Counter:
        wrap_joules, joules = None, 0.0

        def read_joules(self):
            return [self.joules]

    counter = Counter()
    evaluate, train_step = T.evaluate, T.train_step

    def validation(*a, **k):
        counter.joules += 1000.0
        return evaluate(*a, **k)

    def training(*a, **k):
        counter.joules += 1.0
        return train_step(*a, **k)

    monkeypatch.setattr(T, "evaluate", validation)
    monkeypatch.setattr(T, "train_step", training)
    monkeypatch.setattr(T.EnergyMeter, "open", staticmethod(lambda rt, *a, **k: T.EnergyMeter(counter)))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert T.main(TINY + ["--run_id=energy", f"--log_dir={tmp_path}"]) == 0
    summary = json.loads((tmp_path / "energy.json").read_text())
    assert summary["energy_j"] == pytest.approx(4.0)
    assert summary["energy"] == {"train": pytest.approx(4.0), "warmup": 0.0, "validation": pytest.approx(3000.0),
                                 "ranks": 1}  # the three validations, counted apart
    assert [line.fields.get("energy") for line in map(parse_progress_line, (tmp_path / "energy.txt").read_text()
            .splitlines()) if line is not None and "val_loss" in line.fields and line.step is not None] == [0, 2, 4]


# ---------------------------------------------------------------- the metrics file, read back by its one reader

def test_a_runs_metrics_file_holds_every_step_and_validation_and_the_reader_reads_it_back(tiny_run):
    """The tiny run (4 steps of 512 tokens, validations at 0, 2, 4): one train record per step and one val record
    per validation, with the log's losses, the schedule's lr multipliers, cumulative tokens and positive
    throughput; no MFU on a CPU (no peak known), no energy without a counter."""
    metrics = rr.read_metrics(tiny_run / "tiny.metrics.jsonl")
    assert metrics.skipped == []
    train, val = metrics.records["train"], metrics.records["val"]
    assert sorted(train) == [1, 2, 3, 4] and sorted(val) == [0, 2, 4]
    args = T.parse_args(TINY, False)
    log = (tiny_run / "tiny.txt").read_text()
    logged_train = {s: v for s, v in train_losses_of(log).items()}
    for step, record in train.items():
        assert set(record) == set(rr.METRIC_KINDS["train"])
        assert record["tokens"] == 512 * step and record["step_ms"] > 0 and record["tokens_per_s"] > 0
        assert record["lr_mult"] == T.lr_multiplier(step - 1, 4, args.cooldown_frac, args.lr_final_frac)
        assert round(record["train_loss"], 4) == logged_train[step] and record["tflops"] > 0
        assert record["mfu"] is None and record["peak_memory_mib"] > 0
    assert train[4]["train_time_ms"] == pytest.approx(sum(r["step_ms"] for r in train.values()))
    summary = json.loads((tiny_run / "tiny.json").read_text())
    assert [[s, r["val_loss"], r["train_time_ms"]] for s, r in sorted(val.items())] == summary["val_curve"]
    assert [val[s]["tokens"] for s in (0, 2, 4)] == [0, 1024, 2048]
    (run,), skipped = rr.read_runs([str(tiny_run)])  # the log folder, its checkpoints' checkpoint.json included
    assert skipped == [] and run.finished and run.val_tokens == {0: 0, 2: 1024, 4: 2048}


def train_losses_of(log):
    from conftest import train_losses
    return train_losses(log)


def test_the_readers_metric_keys_are_the_writers(tiny_run):
    assert rr.METRIC_KINDS == {kind: keys for kind, keys in runlog.METRIC_KEYS.items()}
    assert set(rr.METRIC_RULES) == {key for keys in runlog.METRIC_KEYS.values() for key in keys}


def test_a_torn_or_odd_metrics_file_is_read_as_far_as_it_can_be(tmp_path):
    """A crash mid-line, a wrong type, a kind or key this reader does not know: each skipped with a reason, the rest
    read; a later record of a step (a resumed run) replaces the earlier one; the command line never fails on it."""
    path = tmp_path / "r.metrics.jsonl"
    good = {"kind": "val", "step": 0, "tokens": 0, "val_loss": 10.8, "train_time_ms": 0.0, "energy_j": None}
    lines = [json.dumps(good), json.dumps({**good, "step": 2, "val_loss": "low"}),
             json.dumps({**good, "step": 4, "val_loss": 9.0, "mystery": 1}), json.dumps({"kind": "hellaswag", "step": 4}),
             json.dumps({**good, "step": 4, "val_loss": 8.5}), '{"kind": "val", "step": 6, "val_lo']
    path.write_text("\n".join(lines))
    metrics = rr.read_metrics(path)
    assert sorted(metrics.records["val"]) == [0, 4] and metrics.records["val"][4]["val_loss"] == 8.5
    assert metrics.skipped == ['line 2: bad value "low" for val_loss; valid: a finite number >= 0',
                               "line 4: not a metrics record (kind 'hellaswag'; known: train, val, target)",
                               "line 6: cut short (the run stopped while writing it)", "unknown key(s) mystery left out"]
    out = subprocess.run([sys.executable, "-m", "records.read_records", str(path)], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and "| r |" in out.stdout and "(unfinished)" in out.stdout, out.stderr
    assert out.stderr.splitlines() == [f"skipped {path}: {reason}" for reason in metrics.skipped], out.stderr
    # bytes of another file under this name, and a line nested deeper than Python's JSON parser goes: a few
    # reasons and a count, never a traceback
    path.write_bytes(bytes(range(256)) * 8 + b"\n" + json.dumps(good).encode() + b"\n" + b"[" * 100_000 +
                     b"]" * 100_000 + b"\n" + b"\n".join(bytes([n]) * 9 for n in range(40, 60)))
    metrics = rr.read_metrics(path)
    assert sorted(metrics.records["val"]) == [0] and len(metrics.skipped) == 4, metrics.skipped
    assert metrics.skipped[3].startswith("and ") and metrics.skipped[3].endswith(" more line(s) that could not be read")
    out = subprocess.run([sys.executable, "-m", "records.read_records", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and "(unfinished)" in out.stdout and len(out.stderr.splitlines()) == 4, out.stderr


def test_tensorboard_gets_the_same_scalars_or_one_line_when_it_is_missing(tmp_path, monkeypatch):
    base = TINY + ["--num_iterations=2", "--val_every=0", "--tensorboard=true"]
    pytest.importorskip("tensorboard", reason="the tensorboard package (requirements-extras.txt) is not installed")
    assert T.main(base + ["--run_id=tb", f"--log_dir={tmp_path}"]) == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb.tensorboard"))
    events.Reload()
    assert {"train/train_loss", "train/tokens_per_s", "val/val_loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/train_loss")] == [1, 2]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    from conftest import run_main
    result = run_main(base + ["--run_id=no_tb"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--tensorboard=true needs the tensorboard package: pip install tensorboard") == 1
    assert (tmp_path / "no_tb.metrics.jsonl").read_text().count('"kind": "train"') == 2  # the metrics file has them
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard")
    (tmp_path / "taken.tensorboard").write_text("a file where the events folder goes")
    taken = run_main(base + ["--run_id=taken"], tmp_path)
    assert taken.returncode == 0 and taken.stdout.count(f"--tensorboard=true cannot write {tmp_path}/taken"
                                                        ".tensorboard (File exists); the run goes on") == 1, \
        taken.stderr


# ---------------------------------------------------------------- progress a person can read

def test_progress_bars_show_on_a_terminal_and_nowhere_else(tmp_path):
    """On a terminal, stderr carries tqdm bars for the shard checks, the warm-up and the training; through a pipe
    (CI, a redirected log) not a byte of them, and the run log never holds one."""
    import fcntl
    import os
    import pty
    import struct
    import termios
    args = [sys.executable, str(REPO / "train_gpt.py")] + TINY + ["--warmup_steps=1", "--val_every=0"]
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 columns wide
    proc = subprocess.Popen(args + ["--run_id=tty", f"--log_dir={tmp_path}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=terminal, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(terminal)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the piped run meanwhile, on the other core
        piped = pool.submit(run_trainer, TINY + ["--warmup_steps=1", "--val_every=0", "--run_id=pipe"], tmp_path)
        shown = read_until_closed(controller)
        assert proc.wait(timeout=300) == 0
        piped = piped.result()
    os.close(controller)
    text = shown.decode(errors="replace")
    assert "checking shards" in text and "compile and warm-up" in text and "training: " in text and "step/s" in text
    assert piped.returncode == 0 and piped.stderr == "" and "\r" not in piped.stdout
    assert "step/s" not in (tmp_path / "tty.txt").read_text()


def read_until_closed(controller: int) -> bytes:
    """What a pseudo-terminal shows until its other end closes."""
    import os
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed: the run ended
            break
        if not chunk:
            break
        shown += chunk
    return shown


# ---------------------------------------------------------------- the target loss, the report card

def test_the_target_marks_the_run_and_can_stop_it(tmp_path):
    """--target_val_loss: the first validation at or below it writes one target line (steps, time, tokens) into the
    log and its place into the summary, the metrics and the report card; --stop_at_target ends the run there,
    with a final line at that step. The reader reports steps and time to target from the log or the summary."""
    from conftest import run_main
    base = TINY + ["--num_iterations=6", "--val_every=2", "--target_val_loss=10.7"]
    assert run_main(base + ["--run_id=marks"], tmp_path).returncode == 0
    marks = json.loads((tmp_path / "marks.json").read_text())
    reached = marks["target"]
    assert reached["step"] == 2 and reached["val_loss"] == 10.7 and reached["tokens"] == 1024
    assert reached["reached_val_loss"] == marks["val_curve"][1][1] <= 10.7 < marks["val_curve"][0][1]
    assert marks["steps"] == 6 and not marks["stopped_at_target"]
    log = (tmp_path / "marks.txt").read_text()
    (target_line,) = [line for line in log.splitlines() if line.startswith("target:")]
    assert parse_progress_line(target_line).fields == {
        "val_loss": round(reached["reached_val_loss"], 4), "target_val_loss": 10.7, "steps": 2, "tokens": 1024,
        "train_time": round(reached["train_time_ms"])}
    card = (tmp_path / "marks.md").read_text()
    assert "| target | val loss <= 10.7: reached at step 2, " in card
    metrics = rr.read_metrics(tmp_path / "marks.metrics.jsonl")
    assert metrics.records["target"] == {2: {
        "step": 2, "tokens": 1024, "val_loss": reached["reached_val_loss"], "target_val_loss": 10.7,
        "train_time_ms": reached["train_time_ms"], "energy_j": reached["energy_j"]}}, metrics.skipped
    stopped = run_main(base + ["--run_id=stops", "--stop_at_target=true"], tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    summary = json.loads((tmp_path / "stops.json").read_text())
    assert summary["steps"] == 2 and summary["stopped_at_target"] and summary["target"]["step"] == 2
    assert [p[0] for p in summary["val_curve"]] == [0, 2] and "final: val_loss:" in stopped.stdout
    for path in (tmp_path / "marks.txt", tmp_path / "marks.json"):  # each of the trainer's files, read alone
        (run,), skipped = rr.read_runs([str(path)])
        assert not skipped and (run.target_step, run.target_loss) == (2, 10.7), path
        assert run.target_train_time_ms == pytest.approx(reached["train_time_ms"], abs=1), path
    table = subprocess.run([sys.executable, "-m", "records.read_records", str(tmp_path / "marks.json")],
                           capture_output=True, text=True, timeout=60, cwd=REPO).stdout
    assert f"| 10.7 | 2 | {reached['train_time_ms'] / 1000:.2f} |" in table


def test_a_resume_under_another_target_looks_for_that_one_and_a_malformed_recorded_target_is_ignored(tmp_path):
    """A run that reached 10.7 at step 2, resumed with --target_val_loss set lower and --stop_at_target: the
    checkpoint's target is not this one, so the run does not stop at step 2 but trains on (and says so); a
    checkpoint whose recorded target the trainer never writes (an edited checkpoint.json) is resumed as if it
    recorded none, and the run ends with its summary and report card."""
    from conftest import run_main
    base = TINY + ["--num_iterations=4", "--val_every=2", "--checkpoint_every=2"]
    assert run_main(base + ["--run_id=a", "--target_val_loss=10.7", "--stop_after=2"], tmp_path).returncode == 0
    first = json.loads((tmp_path / "a" / "step_000002" / "checkpoint.json").read_text())["target"]
    assert first["step"] == 2 and first["val_loss"] == 10.7
    resumed = run_main(base + ["--run_id=a", "--resume=latest", "--target_val_loss=1.0", "--stop_at_target=true"],
                       tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((tmp_path / "a.json").read_text())
    assert summary["steps"] == 4 and summary["target"] == {"val_loss": 1.0, "step": None} and \
        not summary["stopped_at_target"]
    assert "note: the checkpoint's target, val loss <= 10.7, was reached at step 2; this launch's " \
           "--target_val_loss=1.0 is looked for from here" in (tmp_path / "a.txt").read_text()
    meta_path = tmp_path / "a" / "step_000002" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["target"] = {**first, "train_time_ms": None}
    meta_path.write_text(json.dumps(meta))
    edited = run_main(base + ["--run_id=b", f"--resume={meta_path.parent}", "--target_val_loss=10.7"], tmp_path)
    assert edited.returncode == 0, edited.stderr
    target = json.loads((tmp_path / "b.json").read_text())["target"]  # found again by the resumed validation
    assert target["step"] == 2 and target["train_time_ms"] >= 0 and (tmp_path / "b.md").is_file()


def test_the_report_card_says_what_a_person_reads_first(tiny_run):
    card = (tiny_run / "tiny.md").read_text()
    summary = json.loads((tiny_run / "tiny.json").read_text())
    for row in ("| run | tiny: preset cpu, recipe reference, seed 0 |", f"| code | commit {summary['git_commit']}",
                f"| hardware | 1 x {summary['devices'][0]} |", f"| software | torch {torch.__version__}, python",
                f"| final val loss | {summary['final_val_loss']:.4f} after 4 steps, 2,048 tokens |",
                "| target | val loss <= 5.7: not reached |", "| throughput | ", "MFU n/a",
                "| peak memory | ", "| energy | n/a: "):
        assert row in card, (row, card)
    assert "| cost |" not in card  # a CPU run is not priced per GPU-hour
    gpu = {**summary, "devices": ["NVIDIA H100 80GB HBM3"] * 8, "world_size": 8, "total_train_time_ms": 180_000,
           "wall_time_s": 600.0, "energy": {"train": 7.2e6, "warmup": 1e5, "validation": 2e4, "ranks": 8},
           "tokens_per_kwh": 3e8, "target": {"val_loss": 3.28, "step": 1750, "train_time_ms": 178_000,
                                             "tokens": 688_128_000, "energy_j": 7.1e6}}
    priced = runlog.report_card(gpu, usd_per_gpu_hour=3.0)
    assert "| cost | $1.20 of training, $4.00 wall clock at $3 per GPU-hour x 8 GPU(s) |" in priced
    assert "| target | val loss <= 3.28: reached at step 1750, 178.0 s of training, 688,128,000 tokens, energy 7100000 J |" \
        in priced
    assert "training 7200000 J (2.000000 kWh, 3.000e+08 tokens/kWh); warm-up and compile 100000 J; validation " \
           "20000 J" in priced
    assert "pass --usd_per_gpu_hour=PRICE" in runlog.report_card(gpu, usd_per_gpu_hour=0)


def test_mfu_uses_the_devices_bf16_peak_where_it_is_known():
    assert runlog.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4 and runlog.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert runlog.peak_tflops("NVIDIA H200") == 989.4 and runlog.peak_tflops("cpu: x86_64 (2 cores)") is None
    assert runlog.peak_tflops("Some Future GPU") is None


def test_model_flops_per_token_count_the_matrices_and_each_layers_window():
    """6 per weight of every matrix product (not the embedding tables) and 12 per attended key and channel, each
    attention layer at its window, capped at the sequence: written out for the speedrun shape."""
    args = T.parse_args(["--preset=speedrun", "--recipe=reference"], False)
    with torch.device("meta"):
        model = T.GPT(T.ModelConfig.of(args))
    d, layers = 768, 12
    weights = layers * (3 * d * d + d * d + 2 * 4 * d * d) - (3 * d * d + d * d) + 50304 * d  # layer 7: no attention
    long_keys, short_keys = 3 * 1792, 8 * 896  # L S S S L S | S L S S S L, and layer 7 (long) does not attend
    assert model.roles.long_window.count(True) == 4 and not model.roles.attention[7] and model.roles.long_window[7]
    expected = 6 * weights + 12 * 6 * 128 * (long_keys + short_keys)
    assert model.flops_per_token((14, 7), seq_len=48 * 1024) == pytest.approx(expected)
    assert model.flops_per_token((1000, 500), seq_len=1024) == pytest.approx(6 * weights + 12 * 768 * 1024 * 11)
    exact = dataclasses.replace(model.config, token_exact_windows=True)
    with torch.device("meta"):
        model = T.GPT(exact)
    extra = 12 * 6 * 128 * 11  # one key more per attention layer: q - 128 * w <= j <= q
    assert model.flops_per_token((14, 7), seq_len=48 * 1024) == pytest.approx(expected + extra)


# ---------------------------------------------------------------- energy continued across a resume

ENERGY_DRIVER = textwrap.dedent('''
    import time
    import runlog, train_gpt as T
    from rank_driver import exit_checked

    class HundredWatts:  # an NVML-like counter: 100 W, for as long as the process has run
        wrap_joules = None

        def read_joules(self):
            return [100.0 * time.perf_counter()]

    T.EnergyMeter.open = staticmethod(lambda rt, *a, **k: runlog.EnergyMeter(HundredWatts()))
    stop = T.StopSignal()
    exit_checked(T.main(stop=stop), stop)
''')


@pytest.mark.parametrize("ranks", [1, 2])
def test_energy_is_stored_in_checkpoints_and_continued_on_resume(tmp_path, ranks):
    """A fake 100 W counter per rank, a run stopped after step 2 and resumed to step 4: the summary's training
    energy is 100 W x the training time of both launches x the ranks (with only the last launch it would be about
    half), each launch's share is in its segment, the energy at the target (reached after the resume) counts the
    first launch too, and warm-up and validation are counted apart."""
    driver = tmp_path / "energy.py"
    driver.write_text(ENERGY_DRIVER)
    base = TINY + ["--num_iterations=4", "--val_every=2", "--run_id=e", "--warmup_steps=1", "--target_val_loss=10.5"]
    first = run_trainer(base + ["--stop_after=2"], tmp_path, nproc=ranks, driver=driver)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_trainer(base + ["--resume=latest"], tmp_path, nproc=ranks, driver=driver)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads((tmp_path / "e.json").read_text())
    segments = summary["segments"]
    assert len(segments) == 2 and all(s["energy_j"]["ranks"] == ranks for s in segments)
    total_s = summary["total_train_time_ms"] / 1000
    assert summary["energy"]["train"] == pytest.approx(100 * total_s * ranks, rel=0.05)
    assert summary["energy"]["train"] == pytest.approx(sum(s["energy_j"]["train"] for s in segments))
    assert segments[0]["energy_j"]["train"] == pytest.approx(100 * segments[0]["train_time_ms"] / 1000 * ranks, rel=0.05)
    assert summary["energy_j"] == summary["energy"]["train"]
    assert summary["tokens_per_kwh"] == pytest.approx(summary["tokens"] / (summary["energy"]["train"] / 3.6e6))
    assert summary["energy"]["warmup"] > 0 and summary["energy"]["validation"] > 0
    target = summary["target"]
    assert target["step"] == 4 and target["energy_j"] == pytest.approx(summary["energy"]["train"], rel=0.02)
    assert target["energy_j"] > segments[1]["energy_j"]["train"]  # the first launch's energy is in it
    val = rr.read_metrics(tmp_path / "e.metrics.jsonl").records["val"]
    assert val[4]["energy_j"] == pytest.approx(target["energy_j"])
