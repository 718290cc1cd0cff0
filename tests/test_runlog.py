"""Run log and accounting of train_gpt.py: energy counters, the energy line, profiler traces."""
import json
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import runlog  # noqa: E402
import train_gpt as T
from conftest import parse_progress_line, REPO, TINY, run_trainer

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
    sys.path.insert(0, {repo!r})
    import train_gpt as T
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rt = T.Runtime(rank, rank, 2, torch.device("cpu"), torch.float32, "banded", False, "off")
    meter = T.EnergyMeter(object() if rank == 0 else None, "" if rank == 0 else "no counter")  # rank 1 measures nothing
    meter.joules["train"], meter.joules["validation"] = (123.5, 2.0) if rank == 0 else (0.0, 0.0)
    with open(sys.argv[1] + f"/total{{rank}}.txt", "w") as out:  # one file per rank: stdout lines interleave
        out.write(repr(meter.totals(rt)))
    dist.destroy_process_group()
''')


def test_energy_is_summed_over_ranks(tmp_path):
    driver = tmp_path / "sum.py"
    driver.write_text(SUM_DRIVER.format(repo=str(REPO)))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(driver), str(tmp_path)], capture_output=True, text=True, timeout=120)
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
    assert [line.fields.get("energy") for line in map(parse_progress_line, (tmp_path / "energy.txt").read_text()
            .splitlines()) if line is not None and "val_loss" in line.fields and line.step is not None] == [0, 2, 4]
