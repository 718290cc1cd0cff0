"""lifecycle.py's "Supported torch releases" section (docs/supported-torch.md): the range that the docs' table,
the requirements' pin and CI's second torch agree on, every difference between releases handled in that one place,
and start-up under a torch it cannot use or does not know: one line for a torch older than the range (or a GPU node
whose torch cannot use its GPUs), one warning for a newer one, one note for a GPU without FP8; and the torch_range
subset's end-to-end runs on one and two ranks, under whichever torch runs the suite."""
import json
import re
import warnings

import pytest

from conftest import REPO, TINY, run_main
import lifecycle


def supported_minors():
    (major, oldest), (_, newest) = lifecycle.SUPPORTED_TORCH
    return [f"{major}.{minor}" for minor in range(oldest, newest + 1)]


def test_the_readme_requirements_and_ci_agree_on_the_supported_torch():
    """docs/supported-torch.md's table has a row for every release of the trainer's range, the pin is the
    trainer's, and CI runs the torch_range subset (registered in pyproject.toml) under a second release of the range."""
    assert f"torch=={lifecycle.PINNED_TORCH}" in (REPO / "requirements.txt").read_text().splitlines()
    section = (REPO / "docs" / "supported-torch.md").read_text()
    rows = {m[1]: m[0] for m in re.finditer(r"^\| *(\d+\.\d+)[^|]*\|.*$", section, re.M)}
    assert sorted(rows) == supported_minors() and lifecycle.PINNED_TORCH in rows[lifecycle.PINNED_TORCH.rsplit(".", 1)[0]], rows
    ci = (REPO / ".ci" / "run").read_text()
    second = re.search(r"SUBSET_TORCH:-(\d+\.\d+)\.\d+", ci)
    assert second and second[1] in supported_minors() and second[1] != lifecycle.PINNED_TORCH.rsplit(".", 1)[0], ci
    assert "-m torch_range" in ci and "torch_range:" in (REPO / "pyproject.toml").read_text()


def test_every_difference_between_supported_torch_releases_is_handled_in_one_place():
    """No scattered version checks: probes of torch (getattr/hasattr on its modules, version comparisons) live in
    lifecycle.py's "Supported torch releases" section only, not in train_gpt.py or elsewhere beside it."""
    section = (REPO / "lifecycle.py").read_text()
    start = section.index("\n# Supported torch releases")
    end = section.index("\n# -----", start)
    source = section[:start] + section[end:] + "".join(
        path.read_text() for path in sorted(REPO.glob("*.py")) if path.name != "lifecycle.py")
    probe = re.compile(r"\b(getattr|hasattr)\((torch|dist|dcp|F|nn)\b|__version__\s*[<>=!]|torch_release\(|"
                       r"version\.parse")
    assert [m for m in probe.finditer(section[start:end])], "the section holds the probes"
    outside = [line.strip() for line in source.splitlines() if probe.search(line)]
    assert outside == []


@pytest.mark.torch_range
def test_a_torch_older_than_the_range_is_refused_in_one_line_saying_what_to_install(monkeypatch, tmp_path):
    import torch
    from torch.torch_version import TorchVersion
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.9.1+cu128"))
    result = run_main(TINY, tmp_path)
    assert result.returncode == 2 and result.stderr == (
        "error: torch 2.9.1+cu128 is older than the releases train_gpt.py supports (2.10 to 2.13): pip install "
        "torch==2.13.0 (or any release from 2.10 to 2.13; docs/supported-torch.md)\n"), result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before anything is written
    assert lifecycle.torch_release_problem("2.13.0", (3, 10)).startswith("Python 3.10 is older than train_gpt.py needs")
    assert [lifecycle.torch_release(v) for v in ("2.11.0+cu130", "2.14.0.dev20260101", "2.10.0a0+gitabc")] == \
        [(2, 11), (2, 14), (2, 10)]


@pytest.mark.torch_range
def test_a_torch_newer_than_the_range_trains_with_one_warning_in_the_log(monkeypatch, tmp_path):
    """Newer releases keep a renamed call's old name for a while (2.13 did), and the speedrun's users run nightlies:
    a warning, not a refusal."""
    import torch
    from torch.torch_version import TorchVersion
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.14.1"))
    result = run_main(TINY + ["--num_iterations=1", "--val_every=0", "--run_id=newer"], tmp_path)
    assert result.returncode == 0, result.stderr
    said = [line for line in (tmp_path / "newer.txt").read_text().splitlines() if line.startswith("warning: torch")]
    assert said == ["warning: torch 2.14.1 is newer than the releases train_gpt.py is tested under (2.10 to 2.13); "
                    "if start-up or compilation fails, pip install torch==2.13.0"]


DRIVER_TOO_OLD = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12080). Please "
                  "update your GPU driver by downloading and installing a new version from the URL: "
                  "http://www.nvidia.com/Download/index.aspx\nAlternatively, go to: https://pytorch.org to install a "
                  "PyTorch version that has been compiled with your version of the CUDA driver.")


@pytest.mark.torch_range
@pytest.mark.parametrize("cuda, torch_says, build", [
    ("13.0", DRIVER_TOO_OLD, "built for CUDA 13.0) cannot use them (CUDA initialization: The NVIDIA driver on your "
                             "system is too old (found version 12080). Please update"),
    (None, None, "a CPU-only build) cannot use them: install")])
def test_a_gpu_node_whose_torch_cannot_use_its_gpus_is_refused_in_one_line(monkeypatch, tmp_path, cuda, torch_says,
                                                                          build):
    """A driver older than the wheel's CUDA, or a CPU-only wheel, on a node with GPUs: one line naming the build
    (torch's own multi-line warning folded into it), not a cpu run; --preset=cpu still asks for the CPU."""
    import torch

    def unavailable():
        if torch_says:
            warnings.warn(torch_says)
        return False
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(lifecycle, "nvidia_gpus", lambda: 8)
    result = run_main([arg for arg in TINY if not arg.startswith("--preset")], tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: nvidia-smi lists 8 GPU(s) but torch {torch.__version__} (") and \
        build in result.stderr and "--preset=cpu to train on the CPU" in result.stderr, result.stderr
    assert lifecycle.unusable_gpus_problem("cpu") == ""


@pytest.mark.torch_range
@pytest.mark.parametrize("capability, flags, note", [
    ((8, 0), [], "fp8 head: off: NVIDIA A100-SXM4-80GB (compute capability 8.0) has no FP8 matmuls (needs >= 8.9, "
                 "as H100, H200, L40S); the LM head runs in bf16"),
    ((9, 0), [], None), ((8, 0), ["--fp8_head=false"], None),
    ((8, 0), ["--fp8_head=false", "--fp8_mlp=true"], "fp8 mlp: off: NVIDIA A100-SXM4-80GB (compute capability 8.0) "
                                                     "has no FP8 matmuls (needs >= 8.9, as H100, H200, L40S); the "
                                                     "MLPs train in bf16"), ((9, 0), ["--fp8_mlp=true"], None)])
def test_a_gpu_without_fp8_says_once_that_the_head_runs_in_bf16(monkeypatch, capability, flags, note):
    """The run log's notes on what the device changes (write_log_header writes them once, on rank 0)."""
    import torch
    import train_gpt as T
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    args = T.parse_args(["--preset=speedrun", "--recipe=reference", *flags], cuda_available=True)
    device = torch.device("cuda", 0)
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=device, dtype=torch.bfloat16,
                   **T.choose_kernels(args, "cuda", T.fp8_supported(device)))
    assert T.device_notes(args.fp8_head, rt, args.fp8_mlp) == ([note] if note else [])


@pytest.mark.torch_range
def test_this_torch_trains_and_checkpoints_on_one_and_two_ranks(tiny_run, six_steps_two_ranks):
    """The torch_range subset's runs end to end: start-up, gloo collectives (the flat reduce-scatter and all-gather),
    validation and DCP checkpoints of DTensors on a mesh, each run's log naming this torch."""
    import torch
    for run, name, steps in ((tiny_run, "tiny", 4), (six_steps_two_ranks, "whole", 6)):
        summary = json.loads((run / f"{name}.json").read_text())
        assert summary["status"] == "finished" and summary["steps"] == steps, summary
        assert (run / name / f"step_{steps:06d}" / "checkpoint.json").is_file()
        assert f"torch: {torch.__version__}" in (run / f"{name}.txt").read_text().splitlines()
