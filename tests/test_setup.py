"""Set-up files: run.sh's launch decisions, the Dockerfile, the pinned requirements and CI."""
import os
import re
import subprocess

from conftest import REPO


def fake_bin(tmp_path, gpus, with_torchrun):
    """A PATH folder with a fake nvidia-smi listing `gpus` GPUs and a launcher that echoes its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpus:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + "echo 'NVIDIA H100 80GB HBM3'\n" * gpus)
        smi.chmod(0o755)
    if with_torchrun:
        launcher = bin_dir / "torchrun"
        launcher.write_text("#!/bin/sh\necho LAUNCH torchrun \"$@\"\n")
        launcher.chmod(0o755)
    python = bin_dir / "python-fake"  # `-c` (run.sh's torch probe): CUDA usable unless FAKE_NO_CUDA is set
    python.write_text("#!/bin/sh\nif [ \"$1\" = -c ]; then echo 'torch 2.13.0+cpu, CUDA None'; "
                      "[ -z \"$FAKE_NO_CUDA\" ]; exit; fi\necho LAUNCH python \"$@\"\n")
    python.chmod(0o755)
    return bin_dir


def run_sh(tmp_path, gpus, with_torchrun=True, args=("--seed=3",), env=None, status=0):
    bin_dir = fake_bin(tmp_path, gpus, with_torchrun)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(bin_dir / "python-fake"), **(env or {})}
    result = subprocess.run(["bash", str(REPO / "run.sh"), *args], capture_output=True, text=True, env=env,
                            timeout=30)
    assert result.returncode == status, result.stderr
    return ([line for line in result.stdout.splitlines() if line.startswith("LAUNCH")] or [result.stderr])[0]


def test_run_sh_uses_every_gpu_through_torchrun_with_the_speedrun_preset(tmp_path):
    assert run_sh(tmp_path, 4) == \
        "LAUNCH torchrun --standalone --nproc_per_node=4 train_gpt.py --preset=speedrun --seed=3"


def test_run_sh_keeps_the_users_preset(tmp_path):
    assert run_sh(tmp_path, 2, args=("--preset=cpu", "--seed=3")) == \
        "LAUNCH torchrun --standalone --nproc_per_node=2 train_gpt.py --preset=cpu --seed=3"


def test_run_sh_refuses_gpus_that_torch_cannot_use_in_one_line(tmp_path):
    """A CPU-only or too-new wheel on a GPU node: one line naming the build, never cpu training on 8 ranks."""
    message = run_sh(tmp_path, 8, env={"FAKE_NO_CUDA": "1"}, status=2)
    assert message.strip().splitlines() == [message.strip()]
    assert "nvidia-smi lists 8 GPU(s) but this Python's torch cannot use them (torch 2.13.0+cpu, CUDA None)" in message


def test_run_sh_falls_back_to_torch_distributed_run(tmp_path):
    launch = run_sh(tmp_path, 2, with_torchrun=False)
    assert launch == ("LAUNCH python -m torch.distributed.run --standalone --nproc_per_node=2 train_gpt.py "
                      "--preset=speedrun --seed=3")


def test_run_sh_runs_the_cpu_preset_without_a_gpu(tmp_path):
    assert run_sh(tmp_path, 0) == "LAUNCH python train_gpt.py --seed=3"


def test_requirements_are_pinned_and_the_runtime_set_is_minimal():
    runtime = [l for l in (REPO / "requirements.txt").read_text().splitlines() if l and not l.startswith("#")]
    assert {l.split("==")[0] for l in runtime} == {"torch", "numpy", "huggingface_hub", "tqdm"}
    assert "torch==2.13.0" in runtime
    extras = [l for l in (REPO / "requirements-extras.txt").read_text().splitlines() if l and not l.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", l) for l in runtime + extras)


def test_dockerfile_pins_a_cuda12_base_installs_the_requirements_and_runs_run_sh():
    lines = [l.strip() for l in (REPO / "Dockerfile").read_text().splitlines() if l.strip() and not l.startswith("#")]
    base = [l for l in lines if l.startswith("FROM ")]
    assert len(base) == 1 and re.fullmatch(r"FROM nvidia/cuda:12\.\d+\.\d+-[a-z0-9.-]+", base[0]), base
    installs = [l for l in lines if "pip install" in l]
    assert installs == ["RUN pip install -r requirements.txt"]
    assert "COPY requirements.txt ." in lines
    assert lines[-1] == 'CMD ["./run.sh"]'
    assert os.access(REPO / "run.sh", os.X_OK)
    assert any(l.startswith("VOLUME") and "/speedrun/data/fineweb10B" in l for l in lines)


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"^python -m pytest tests\S*.*$", readme, re.M)
    assert command, "README names no test command"
    ci = (REPO / ".ci" / "run").read_text()
    assert "python3 -m pytest tests" in ci and "-r requirements.txt" in ci and '"$status" -eq 5' in ci


WITHOUT_TORCH = """import os, runpy, sys
sys.modules["torch"] = None  # any `import torch` now fails, as on a machine without it
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python program.py` does
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_without_torch(*argv):
    return subprocess.run(["python3", "-c", WITHOUT_TORCH, *map(str, argv)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_the_file_programs_run_without_torch(tiny_run):
    """data/ (on a login node) and records/ (on a laptop) read and write files only: no torch, no trainer."""
    for program in ("data/fineweb.py", "data/cached_fineweb10B.py"):  # (hub_shards.py: their library)
        done = run_without_torch(REPO / program, "--help")
        assert done.returncode == 0 and "usage:" in done.stdout, (program, done.stderr[-1000:])
    done = run_without_torch(REPO / "records" / "read_records.py", tiny_run / "tiny.txt", tiny_run / "tiny.json")
    assert done.returncode == 0 and "| tiny " in done.stdout, done.stderr[-1000:]
    done = run_without_torch(REPO / "records" / "read_records.py", tiny_run / "nothing_here")
    assert done.returncode == 2 and "\nerror: no run could be read" in done.stderr and "Traceback" not in done.stderr


def test_torch_free_programs_end_like_the_trainer():
    """tools/cli.py's exit statuses are the trainer's (the trainer stays one file and imports nothing)."""
    import train_gpt as T
    from tools import cli
    assert (cli.EXIT_OK, cli.EXIT_USAGE, cli.EXIT_PEER_LOST, cli.EXIT_RUN_FAILED) == \
        (T.EXIT_OK, T.EXIT_USAGE, T.EXIT_PEER_LOST, T.EXIT_RUN_FAILED)
    assert cli.run_cli(lambda: (_ for _ in ()).throw(T.RunFailed("full")), usage_errors=(T.UsageError,)) == 4
