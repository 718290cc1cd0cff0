"""Set-up files: run.sh's launch decisions, the Dockerfile, the pinned requirements and CI."""
import json
import os
import posixpath
import re
import shlex
import subprocess
import warnings

import pytest

from conftest import REPO, TINY, run_main


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


def dockerfile_instructions(text):
    """(KEYWORD, arguments) for each instruction, continuation lines joined and comment lines dropped, as docker
    reads them."""
    instructions, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not (line.strip() or pending):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def pip_install_arguments(command):
    """(package specs, -r files) of each `pip install` in a shell command; none when it runs no pip."""
    installs = []
    for part in re.split(r"&&|\|\||;", command):
        words = shlex.split(part)
        for start in ([0] if words[:2] in (["pip", "install"], ["pip3", "install"]) else []) + \
                [i for i in range(len(words)) if words[i + 1:i + 4] == ["-m", "pip", "install"]]:
            rest = words[start + (2 if words[start].startswith("pip") else 4):]
            packages, files = [], []
            while rest:
                word = rest.pop(0)
                if word in ("-r", "--requirement"):
                    files.append(rest.pop(0))
                elif word.startswith("--requirement="):
                    files.append(word.split("=", 1)[1])
                elif word in ("-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"):
                    rest.pop(0)
                elif not word.startswith("-"):
                    packages.append(word)
            installs.append((packages, files))
    return installs


def test_the_docker_image_installs_the_pinned_requirements_and_starts_run_sh():
    """Read from the Dockerfile's instructions in order, not compared line by line: a CUDA 12 base; pip (the venv's,
    first on PATH) installs the repository's requirements.txt, copied in before, and nothing else, so the image's
    torch is that file's pin; the command is the repository's run.sh; the shards and logs are volumes at the
    paths train_gpt.py reads and writes by default."""
    import train_gpt as T
    steps = dockerfile_instructions((REPO / "Dockerfile").read_text())
    (base,) = [arguments for keyword, arguments in steps if keyword == "FROM"]
    image, _, tag = base.partition(":")
    assert image == "nvidia/cuda" and tag.split(".")[0] == "12", base

    workdir, copies, env, venvs, installed = "/", [], {}, [], []

    def repo_file(path):  # the repository file at this path of the image, by the copies made so far
        path = posixpath.normpath(posixpath.join(workdir, path))
        for source, target in reversed(copies):
            if path == target or path.startswith(target.rstrip("/") + "/"):
                return (REPO / source / posixpath.relpath(path, target)).resolve()
        return None

    for keyword, arguments in steps:
        if keyword == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, arguments))
        elif keyword == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(arguments))
        elif keyword == "COPY":
            *sources, target = shlex.split(arguments)
            for source in sources:  # a folder's contents land in the target; a file in it, or as it
                into = target.endswith("/") or target == "." or len(sources) > 1
                name = posixpath.basename(source) if into and not (REPO / source).is_dir() else ""
                copies.append((source, posixpath.normpath(posixpath.join(workdir, target, name))))
        elif keyword == "RUN":
            venvs += re.findall(r"python3? -m venv (\S+)", arguments)
            for packages, files in pip_install_arguments(arguments):
                assert packages == [], f"pip installs {packages} beside the pinned requirements"
                assert env.get("PATH", "").split(":")[0] in [f"{v}/bin" for v in venvs], "pip is not the venv's"
                installed += [repo_file(f) for f in files]
    assert installed == [REPO / "requirements.txt"], \
        f"pip installs {installed} (None: not copied in yet), not the repository's requirements.txt"
    assert "torch==" in (REPO / "requirements.txt").read_text()  # which version: the requirements test above

    (command,) = [json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)
                  for keyword, arguments in steps if keyword in ("CMD", "ENTRYPOINT")]
    assert repo_file(command[0]) == REPO / "run.sh" and os.access(REPO / "run.sh", os.X_OK), command

    volumes = {v for keyword, arguments in steps if keyword == "VOLUME" for v in json.loads(arguments)}
    defaults = T.Hyperparameters()
    expected = {posixpath.dirname(defaults.train_files), posixpath.dirname(defaults.val_files), defaults.log_dir}
    assert {posixpath.join(workdir, path) for path in expected} <= volumes, volumes


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


# ----------------------------------------------------------------------------- dependencies point one way

def repo_imports(path, modules):
    """The repository modules that path imports, at any depth of its code (lazy imports included)."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            # data/'s programs import each other by bare name (their folder is on sys.path)
            candidates = [name, f"{path.parent.name}.{name}"] if path.parent != REPO else [name]
            found |= {c for c in candidates if c in modules}
    return found - {module_name(path)}


def module_name(path):
    relative = path.relative_to(REPO).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


SIBLINGS = ("flags", "runlog", "checkpoints", "evaluation")  # the trainer's modules beside it (README, Layout)


def test_no_module_imports_itself_back_and_the_trainer_imports_only_its_siblings():
    """Every module of the trainer and its siblings, tools/, data/, records/ and bench/: the graph of their imports
    of each other has no cycle, train_gpt.py imports only its siblings and they import only each other (never the
    trainer), and data/ and records/ import no module that imports torch (tools/cli.py is their one shared,
    torch-free helper)."""
    files = [REPO / "train_gpt.py"] + [REPO / f"{name}.py" for name in SIBLINGS] + \
        [p for folder in ("tools", "data", "records", "bench") for p in sorted((REPO / folder).glob("*.py"))]
    assert {p.name for p in REPO.glob("*.py")} == {f.name for f in files[:len(SIBLINGS) + 1]}  # no other module
    modules = {module_name(p): p for p in files}
    graph = {name: repo_imports(path, modules) for name, path in modules.items()}
    assert graph["train_gpt"] == set(SIBLINGS)
    assert all(graph[name] <= set(SIBLINGS) for name in SIBLINGS)
    assert "tools.loading" in graph["tools.sample"] and "train_gpt" in graph["tools.loading"]  # the walk sees imports

    def cycle_from(start, path, seen):
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return path + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                found = cycle_from(start, path + [nxt], seen)
                if found:
                    return found
        return None
    for name in modules:
        assert cycle_from(name, [name], set()) is None, " -> ".join(cycle_from(name, [name], set()))

    def reaches(name, seen=None):
        seen = set() if seen is None else seen
        for nxt in graph[name] - seen:
            seen.add(nxt)
            reaches(nxt, seen)
        return seen
    for name in modules:
        if name.startswith(("data.", "records.")):
            assert reaches(name) <= {"tools", "tools.cli", "data.shardio", "data.hub_shards", "records.read_records"}, \
                (name, reaches(name))


# ----------------------------------------------------------------------------- supported torch (README)

def supported_minors():
    import train_gpt as T
    (major, oldest), (_, newest) = T.SUPPORTED_TORCH
    return [f"{major}.{minor}" for minor in range(oldest, newest + 1)]


def test_the_readme_requirements_and_ci_agree_on_the_supported_torch():
    """The README's table has a row for every release of the trainer's range, the pin is the trainer's, and CI runs
    the torch_range subset (registered in pytest.ini) under a second release of the range."""
    import train_gpt as T
    assert f"torch=={T.PINNED_TORCH}" in (REPO / "requirements.txt").read_text().splitlines()
    section = (REPO / "README.md").read_text().split("\n## Supported torch\n")[1].split("\n## ")[0]
    rows = {m[1]: m[0] for m in re.finditer(r"^\| *(\d+\.\d+)[^|]*\|.*$", section, re.M)}
    assert sorted(rows) == supported_minors() and T.PINNED_TORCH in rows[T.PINNED_TORCH.rsplit(".", 1)[0]], rows
    ci = (REPO / ".ci" / "run").read_text()
    second = re.search(r"SUBSET_TORCH:-(\d+\.\d+)\.\d+", ci)
    assert second and second[1] in supported_minors() and second[1] != T.PINNED_TORCH.rsplit(".", 1)[0], ci
    assert "-m torch_range" in ci and "torch_range:" in (REPO / "pytest.ini").read_text()


def test_every_difference_between_supported_torch_releases_is_handled_in_one_place():
    """No scattered version checks: probes of torch (getattr/hasattr on its modules, version comparisons) live in
    train_gpt.py's "Supported torch releases" section only, not elsewhere in it or the modules beside it."""
    source = (REPO / "train_gpt.py").read_text()
    start = source.index("\n# Supported torch releases")
    end = source.index("\n# -----", start)
    source += "".join(path.read_text() for path in sorted(REPO.glob("*.py")) if path.name != "train_gpt.py")
    probe = re.compile(r"\b(getattr|hasattr)\((torch|dist|dcp|F|nn)\b|__version__\s*[<>=!]|torch_release\(|"
                       r"version\.parse")
    outside = [line.strip() for line in (source[:start] + source[end:]).splitlines() if probe.search(line)]
    assert outside == []


@pytest.mark.torch_range
def test_a_torch_older_than_the_range_is_refused_in_one_line_saying_what_to_install(monkeypatch, tmp_path):
    import torch
    import train_gpt as T
    from torch.torch_version import TorchVersion
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.9.1+cu128"))
    result = run_main(TINY, tmp_path)
    assert result.returncode == 2 and result.stderr == (
        "error: torch 2.9.1+cu128 is older than the releases train_gpt.py supports (2.10 to 2.13): pip install "
        "torch==2.13.0 (or any release from 2.10 to 2.13; README, \"Supported torch\")\n"), result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before anything is written
    assert T.torch_release_problem("2.13.0", (3, 10)).startswith("Python 3.10 is older than train_gpt.py needs")
    assert [T.torch_release(v) for v in ("2.11.0+cu130", "2.14.0.dev20260101", "2.10.0a0+gitabc")] == \
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
    import train_gpt as T

    def unavailable():
        if torch_says:
            warnings.warn(torch_says)
        return False
    monkeypatch.setattr(torch.cuda, "is_available", unavailable)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(T, "nvidia_gpus", lambda: 8)
    result = run_main([arg for arg in TINY if not arg.startswith("--preset")], tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: nvidia-smi lists 8 GPU(s) but torch {torch.__version__} (") and \
        build in result.stderr and "--preset=cpu to train on the CPU" in result.stderr, result.stderr
    assert T.unusable_gpus_problem("cpu") == ""


@pytest.mark.torch_range
@pytest.mark.parametrize("capability, flags, note", [
    ((8, 0), [], "fp8 head: off: NVIDIA A100-SXM4-80GB (compute capability 8.0) has no FP8 matmuls (needs >= 8.9, "
                 "as H100, H200, L40S); the LM head runs in bf16"),
    ((9, 0), [], None), ((8, 0), ["--fp8_head=false"], None)])
def test_a_gpu_without_fp8_says_once_that_the_head_runs_in_bf16(monkeypatch, capability, flags, note):
    """The run log's notes on what the device changes (write_log_header writes them once, on rank 0)."""
    import torch
    import train_gpt as T
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    args = T.parse_args(["--preset=speedrun", *flags], cuda_available=True)
    device = torch.device("cuda", 0)
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=device, dtype=torch.bfloat16,
                   **T.choose_kernels(args, "cuda", T.fp8_supported(device)))
    assert T.device_notes(args, rt) == ([note] if note else [])


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
