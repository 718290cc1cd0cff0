"""How the trainer is packaged and launched: run.sh's launch decisions, the Dockerfile, the pinned requirements and
pyproject.toml's ranges, CI running docs/testing.md's test command, the programs that run without torch, and the import
graph and how modules import each other (no cycles; train_gpt.py imports only its siblings, which never import it
back; no module changes sys.path or runs code before its imports; one UsageError; programs run as `python -m`;
--help and flag errors import nothing a run does not need yet). The "Supported torch releases" checks are
test_torch_support.py's."""
import ast
import io
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tokenize
import tomllib

import pytest

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
        "LAUNCH python -m tools.launch --standalone --nproc_per_node=4 train_gpt.py --preset=speedrun --seed=3"


def test_run_sh_keeps_the_users_preset(tmp_path):
    assert run_sh(tmp_path, 2, args=("--preset=cpu", "--seed=3")) == \
        "LAUNCH python -m tools.launch --standalone --nproc_per_node=2 train_gpt.py --preset=cpu --seed=3"


def test_run_sh_refuses_gpus_that_torch_cannot_use_in_one_line(tmp_path):
    """A CPU-only or too-new wheel on a GPU node: one line naming the build, never cpu training on 8 ranks."""
    message = run_sh(tmp_path, 8, env={"FAKE_NO_CUDA": "1"}, status=2)
    assert message.strip().splitlines() == [message.strip()]
    assert "nvidia-smi lists 8 GPU(s) but this Python's torch cannot use them (torch 2.13.0+cpu, CUDA None)" in message


def test_run_sh_launches_through_tools_launch_whether_or_not_torchrun_is_on_the_path(tmp_path):
    """tools/launch.py, whose signals end as the trainer's do (plain torchrun's end in a traceback and exit 1)."""
    launch = run_sh(tmp_path, 2, with_torchrun=False)
    assert launch == ("LAUNCH python -m tools.launch --standalone --nproc_per_node=2 train_gpt.py "
                      "--preset=speedrun --seed=3")


def test_run_sh_runs_the_cpu_preset_without_a_gpu(tmp_path):
    assert run_sh(tmp_path, 0) == "LAUNCH python train_gpt.py --seed=3"


def pins(name):
    """The requirement lines of a requirements file, comments and blank lines left out."""
    return [line for line in (REPO / name).read_text().splitlines() if line and not line.startswith("#")]


def test_requirements_are_pinned_and_the_runtime_set_is_minimal():
    runtime = pins("requirements.txt")
    assert {line.split("==")[0] for line in runtime} == {"torch", "numpy", "huggingface_hub", "tqdm"}
    assert "torch==2.13.0" in runtime
    extras = pins("requirements-extras.txt")
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.]*", line) for line in runtime + extras)


def test_pyproject_declares_the_pinned_releases_within_its_ranges_and_every_module():
    """pyproject.toml's dependencies are requirements.txt's packages, its optional groups together
    requirements-extras.txt's, each pin inside its range; its modules and packages are the repository's."""
    from packaging.requirements import Requirement
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    ranges = {Requirement(r).name: Requirement(r) for r in project["project"]["dependencies"]}
    extras = {Requirement(r).name: Requirement(r) for group in project["project"]["optional-dependencies"].values()
              for r in group}
    for file, declared in (("requirements.txt", ranges), ("requirements-extras.txt", extras)):
        pinned = dict(line.split("==") for line in pins(file))
        assert set(pinned) <= set(declared), (file, set(pinned) - set(declared))
        for name, version in pinned.items():
            assert declared[name].specifier.contains(version), (name, version, str(declared[name].specifier))
    assert set(ranges) == {line.split("==")[0] for line in pins("requirements.txt")}
    setup = project["tool"]["setuptools"]
    assert set(setup["py-modules"]) == {p.stem for p in REPO.glob("*.py")}
    assert set(setup["packages"]) == {p.parent.name for p in REPO.glob("*/__init__.py")} == \
        {"tools", "bench", "data", "records"}
    pytest_options = project["tool"]["pytest"]["ini_options"]
    assert pytest_options["testpaths"] == ["tests"] and pytest_options["pythonpath"] == [".", "tests"]
    assert project["tool"]["ruff"]["line-length"] == 120


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


WITHOUT_TORCH = """import runpy, sys
sys.modules["torch"] = None  # any `import torch` now fails, as on a machine without it
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)  # as `python -m program` runs it
"""


def run_without_torch(module, *argv):
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, module, *map(str, argv)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_the_file_programs_run_without_torch(tiny_run):
    """data/ (on a login node) and records/ (on a laptop) read and write files only: no torch, no trainer."""
    for program in ("data.fineweb", "data.cached_fineweb10B"):  # (hub_shards.py: their library)
        done = run_without_torch(program, "--help")
        assert done.returncode == 0 and "usage:" in done.stdout, (program, done.stderr[-1000:])
    done = run_without_torch("records.read_records", tiny_run / "tiny.txt", tiny_run / "tiny.json")
    assert done.returncode == 0 and "| tiny " in done.stdout, done.stderr[-1000:]
    done = run_without_torch("records.read_records", tiny_run / "nothing_here")
    assert done.returncode == 2 and "\nerror: no run could be read" in done.stderr and "Traceback" not in done.stderr


def test_every_module_of_data_and_records_imports_without_torch():
    """Imported in a fresh interpreter, every module under data/ and records/ leaves torch unimported: they run on
    machines without it."""
    modules = [module_name(p) for folder in ("data", "records") for p in sorted((REPO / folder).glob("*.py"))]
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_there_is_one_usage_error_and_every_program_ends_like_the_trainer():
    """flags.py's UsageError is the project's one: the trainer, its siblings, tools/, bench/, data/ and records/ raise
    and catch that class, and run_cli ends every program with its exit status (RunFailed's is the trainer's)."""
    import flags
    import train_gpt as T
    from data import shardio
    defined = [path.relative_to(REPO).as_posix() for path in project_files()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef) and node.name == "UsageError"]
    assert defined == ["flags.py"]
    assert T.UsageError is flags.UsageError is shardio.UsageError and T.RunFailed is flags.RunFailed
    assert flags.run_cli(lambda: (_ for _ in ()).throw(T.RunFailed("full"))) == T.EXIT_RUN_FAILED == 4
    assert flags.run_cli(lambda: (_ for _ in ()).throw(T.UsageError("bad"))) == T.EXIT_USAGE == 2


def test_the_tools_declare_the_arguments_they_share_once():
    """--window, --device and the checkpoint of the tools that run a model come from tools/loading.py's parser."""
    sources = {p.name: p.read_text() for p in sorted((REPO / "tools").glob("*.py"))}
    for argument in ('"checkpoint", help="step_N/ folder of train_gpt.py, or', '"--window"', '"--device"'):
        declared = [name for name, text in sources.items() if f"add_argument({argument}" in text]
        assert declared == ["loading.py"], (argument, declared)
    from tools import hellaswag, sample
    for tool in (sample, hellaswag):
        opts = tool.parse(["ckpt", "--window=final", "--device=cpu"])
        assert (opts.checkpoint, opts.window, opts.device) == ("ckpt", "final", "cpu")


# ----------------------------------------------------------------------------- dependencies point one way

def project_files():
    """Every Python file of the project: the trainer and its siblings, tools/, bench/, data/, records/ and tests/
    (not the sources that record folders keep)."""
    return sorted(REPO.glob("*.py")) + sorted(p for folder in ("tools", "bench", "data", "records", "tests")
                                              for p in (REPO / folder).glob("*.py"))


def repo_imports(path, modules):
    """The repository modules that path imports, at any depth of its code (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found - {module_name(path)}


def module_name(path):
    relative = path.relative_to(REPO).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


SIBLINGS = ("flags", "runlog", "checkpoints", "evaluation", "lifecycle")  # the trainer's modules beside it (docs/layout.md)


def test_no_module_imports_itself_back_and_the_trainer_imports_only_its_siblings():
    """Every module of the trainer and its siblings, tools/, data/, records/ and bench/: the graph of their imports
    of each other has no cycle, train_gpt.py imports only its siblings and they import only each other (never the
    trainer), the library modules beside it import no program folder (tools/, bench/, data/, records/), and data/ and
    records/ import no module that imports torch (flags.py is their one shared, torch-free helper)."""
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
            assert reaches(name) <= {"flags", "data", "data.shardio", "data.hub_shards", "records",
                                     "records.read_records"}, (name, reaches(name))


# ----------------------------------------------------------------------------- how modules find each other

def test_no_module_changes_sys_path_or_puts_code_before_its_imports():
    """Every module imports the trainer and its neighbours as pyproject.toml lays them out (the project root on the
    path: `python -m`, pytest's pythonpath): none changes sys.path, and none silences E402 (an import after code).
    With ruff installed (requirements-extras.txt), the whole project passes pyproject.toml's lint settings too."""
    changed, silenced = [], []
    for path in project_files():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                changed.append(f"{path.relative_to(REPO)}:{node.lineno}")
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT and "E402" in token.string:
                silenced.append(f"{path.relative_to(REPO)}:{token.start[0]}")
    assert changed == [] and silenced == [], (changed, silenced)
    ruff = shutil.which("ruff")
    if ruff:
        done = subprocess.run([ruff, "check", "--no-cache", "."], capture_output=True, text=True, cwd=REPO,
                              timeout=120)
        assert done.returncode == 0, done.stdout[-3000:]


def test_pytest_runs_from_the_tests_folder_as_from_the_root():
    """pyproject.toml's pythonpath: `cd tests && python -m pytest test_flags.py` finds the trainer and conftest."""
    done = subprocess.run([sys.executable, "-m", "pytest", "test_flags.py", "--collect-only", "-q", "-p",
                           "no:cacheprovider"], capture_output=True, text=True, cwd=REPO / "tests", timeout=120)
    assert done.returncode == 0 and "test_flags.py::" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


# Commands that run a program by its path; the one documented way is `python -m folder.program` from the root.
RUN_BY_PATH = re.compile(r"python3? +(?:\./)?(?:tools|bench|data|records)/\w+\.py")


def test_every_program_is_run_one_way_as_a_module_from_the_project_root():
    """Docs, docstrings, messages, scripts and tests name `python -m tools.sample`, never python and the program's
    file path (the record folders' logs, which embed the sources of their time, aside)."""
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO).stdout.split()
    texts = [name for name in tracked if not re.match(r"records/\d{4}-[^/]+/.*\.(txt|json)$", name)
             and (REPO / name).is_file() and not (REPO / name).read_bytes()[:1024].count(0)]
    by_path = [f"{name}: {m[0]}" for name in texts for m in RUN_BY_PATH.finditer((REPO / name).read_text())]
    assert by_path == [], by_path[:10]
    for program in ("tools/sample.py", "bench/gpu_check.py", "data/cached_fineweb10B.py", "records/read_records.py"):
        assert f"python -m {program[:-3].replace('/', '.')}" in (REPO / "README.md").read_text() + \
            (REPO / program).read_text(), program


# The modules a run imports only when it needs them: checkpointing (DCP and DTensor), evaluation, TensorBoard and
# dynamo (torch.compile), about as long to import as torch itself.
LAZY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "evaluation", "tensorboard", "torch._dynamo")
IMPORTED_AT_EXIT = f"""import atexit, runpy, sys
lazy = {LAZY!r}
atexit.register(lambda: print("imported:", sorted({{m.split(".")[0] if not m.startswith("torch") else m
                                                   for m in sys.modules if m.startswith(lazy)}}), file=sys.stderr))
sys.argv = ["train_gpt.py", *sys.argv[1:]]
runpy.run_path("train_gpt.py", run_name="__main__")
"""


@pytest.mark.parametrize("argv, status", [(["--help"], 0), (["--n_layer=1"], 2), (["--nope=1"], 2),
                                           (["--preset=cpu", "--seq_len=100"], 2)])
def test_help_and_flag_errors_import_no_checkpointing_evaluation_or_tensorboard(argv, status):
    """`python train_gpt.py --help` and a refused flag print without importing what only a run uses (the modules
    in sys.modules when the process ends, not a timing; bench/startup_time.py measures the time)."""
    done = subprocess.run([sys.executable, "-c", IMPORTED_AT_EXIT, *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == status, done.stderr[-2000:]
    imported = [line for line in done.stderr.splitlines() if line.startswith("imported:")]
    assert imported == ["imported: []"], done.stderr[-2000:]

