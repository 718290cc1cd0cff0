"""How the trainer is packaged and launched: run.sh's launch decisions, the Dockerfile, the pinned requirements, CI
running docs/testing.md's test command, the programs that run without torch, tools/cli.py's exit statuses (the
trainer's), and the import graph (no cycles; train_gpt.py imports only its siblings, which never import it back).
The "Supported torch releases" checks are test_torch_support.py's."""
import json
import os
import posixpath
import re
import shlex
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
        "LAUNCH python tools/launch.py --standalone --nproc_per_node=4 train_gpt.py --preset=speedrun --seed=3"


def test_run_sh_keeps_the_users_preset(tmp_path):
    assert run_sh(tmp_path, 2, args=("--preset=cpu", "--seed=3")) == \
        "LAUNCH python tools/launch.py --standalone --nproc_per_node=2 train_gpt.py --preset=cpu --seed=3"


def test_run_sh_refuses_gpus_that_torch_cannot_use_in_one_line(tmp_path):
    """A CPU-only or too-new wheel on a GPU node: one line naming the build, never cpu training on 8 ranks."""
    message = run_sh(tmp_path, 8, env={"FAKE_NO_CUDA": "1"}, status=2)
    assert message.strip().splitlines() == [message.strip()]
    assert "nvidia-smi lists 8 GPU(s) but this Python's torch cannot use them (torch 2.13.0+cpu, CUDA None)" in message


def test_run_sh_launches_through_tools_launch_whether_or_not_torchrun_is_on_the_path(tmp_path):
    """tools/launch.py, whose signals end as the trainer's do (plain torchrun's end in a traceback and exit 1)."""
    launch = run_sh(tmp_path, 2, with_torchrun=False)
    assert launch == ("LAUNCH python tools/launch.py --standalone --nproc_per_node=2 train_gpt.py "
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
    readme = (REPO / "docs" / "testing.md").read_text()
    command = re.search(r"^python -m pytest tests\S*.*$", readme, re.M)
    assert command, "docs/testing.md names no test command"
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


SIBLINGS = ("flags", "runlog", "checkpoints", "evaluation", "lifecycle")  # the trainer's modules beside it (docs/layout.md)


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
