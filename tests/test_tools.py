"""The command lines of tools/ (sample.py, hellaswag.py, export.py, and loading.py under them; launch.py's are
test_training.py's): checkpoints loaded at their step's window, prompts fitted, text sampled, exports round tripped
bit for bit, and every bad input refused in one line."""
import argparse
import json
import os
import shutil
import urllib.error
import urllib.request

import pytest
import torch

import checkpoints
import evaluation
import train_gpt as T
from flags import integer, number, run_cli
from conftest import IMPORT_ENV, TINY, TOKENIZER_ENV, run_main, tool, tool_in_process
from conftest import needs_gpt2_vocab as needs_tokenizer
from tools import hellaswag as H
from tools import loading, sample
from tools.export import export
from tools.loading import load_exported
from test_evaluation import FIXTURE, FakeServer, prompt_with_documents

EOT = T.EOT_TOKEN


def one_error_line(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture
def checkpoint(tiny_run):
    """A real tiny run's final checkpoint (4 steps on the bundled sample; another at step 2 beside it)."""
    return tiny_run / "tiny" / "step_000004"


def test_a_mid_run_checkpoint_runs_with_its_step_s_window(checkpoint):
    middle = loading.load_model(checkpoint.parent / "step_000002", "cpu")
    assert (middle.step, middle.window_blocks) == (2, 4)  # 1024 final tokens * 2/4 steps = 4 blocks
    assert loading.load_model(checkpoint.parent / "step_000002", "cpu", window="final").window_blocks == 8
    final = loading.load_model(checkpoint, "cpu")
    assert (final.step, final.window_blocks) == (4, 8)
    a, b = middle.model.state_dict(), final.model.state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)  # two different points of the run


# ----------------------------------------------------------------------------- sample.py: the prompt

def test_a_long_prompt_is_cut_from_the_left_keeping_the_document_start():
    prompt = [EOT] + list(range(1, 300))
    cut, was_cut = sample.fit_prompt(prompt, 56, 256)
    assert was_cut and len(cut) == 200 and cut[0] == EOT and cut[1:] == prompt[-199:]
    assert sample.fit_prompt(prompt[:50], 56, 256) == (prompt[:50], False)
    with pytest.raises(T.UsageError, match="max_new_tokens=256 leaves no room"):
        sample.fit_prompt(prompt, 256, 256)


# ----------------------------------------------------------------------------- sample.py CLI

@needs_tokenizer
def test_sample_cli_prints_text_and_warns_on_a_long_prompt(checkpoint):
    result = tool_in_process("sample", checkpoint, "--prompt", "The President", "--max_new_tokens", 20,
                             "--num_samples", 2, env=TOKENIZER_ENV)
    assert result.returncode == 0, result.stderr
    texts = [line for line in result.stdout.splitlines() if not line.startswith("--- sample")]
    assert result.stdout.count("--- sample") == 2 and all(t.startswith("The President") for t in texts)
    assert len(texts[0]) > len("The President") and "tokens/s (kv_cache true)" in result.stderr
    long = tool_in_process("sample", checkpoint, "--prompt", "the nation " * 200, "--max_new_tokens", 16,
                           "--temperature", 0, env=TOKENIZER_ENV)
    assert long.returncode == 0, long.stderr
    assert "warning: the prompt is longer than the model's 256-token context" in long.stderr
    assert "kept its last 239 tokens" in long.stderr


def test_sample_cli_refuses_a_nan_temperature_in_one_line(checkpoint):
    """The probe as written (it was a traceback from torch.multinomial)."""
    assert one_error_line(tool_in_process("sample", checkpoint, "--temperature=nan", env=TOKENIZER_ENV)) == (
        "error: argument --temperature: bad value 'nan'; valid: a finite number in [1e-06, inf), or 0 "
        "(see sample.py --help)")


@pytest.mark.parametrize("program, option, valid", [
    (sample, "--temperature=inf", "a finite number in [1e-06, inf), or 0"),  # was a silent uniform draw
    (sample, "--temperature=1e-40", "a finite number in [1e-06, inf), or 0"),  # overflows the logits: NaN
    (sample, "--top_k=-1", "an integer at least 0"),
    (sample, "--max_new_tokens=0", "an integer at least 1"),
    (sample, "--num_samples=0", "an integer at least 1"),
    (sample, f"--seed={2**64}", f"an integer in [0, {2**64 - 1}]"),  # was a traceback from manual_seed
    (H, "--limit=-1", "an integer at least 0"),
])
def test_a_tool_number_out_of_range_is_one_error_line_naming_the_range(program, option, valid, checkpoint, capsys):
    assert run_cli(lambda: program.main([str(checkpoint), option])) == 2
    name, value = option.split("=")
    err = capsys.readouterr().err
    assert err.startswith(f"error: argument {name}: bad value '{value}'; valid: {valid} (see ") and \
        err.count("\n") == 1, err


def test_cli_number_types_refuse_what_is_out_of_range_naming_the_range():
    """flags.py's rules as argparse type=, which every program's number arguments use."""
    def refused(convert, text):
        with pytest.raises(argparse.ArgumentTypeError) as caught:
            convert(text)
        return str(caught.value)
    between = number(0, 1, lo_open=True, hi_open=True)
    assert between("0.5") == 0.5
    for text in ("0", "1", "nan", "inf", "-inf", "half"):
        assert refused(between, text) == f"bad value {text!r}; valid: a finite number in (0, 1)"
    greedy_or_warm = number(1e-6, also=(0.0,))
    assert greedy_or_warm("0") == 0.0 and greedy_or_warm("1e-6") == 1e-6 and greedy_or_warm("1e9") == 1e9
    assert refused(greedy_or_warm, "1e-7") == "bad value '1e-7'; valid: a finite number in [1e-06, inf), or 0"
    one_to_three = integer(1, 3)
    assert (one_to_three("1"), one_to_three("3")) == (1, 3)
    for text in ("0", "4", "1.5", "two"):
        assert refused(one_to_three, text) == f"bad value {text!r}; valid: an integer in [1, 3]"
    assert refused(integer(0), "-1") == "bad value '-1'; valid: an integer at least 0"


def test_tokenizer_unavailable_is_one_line(checkpoint, tmp_path):
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path), "HTTPS_PROXY": "http://127.0.0.1:9",
               "HTTP_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    line = one_error_line(tool("sample", checkpoint, "--prompt", "x", env=offline))
    assert "cannot load the GPT-2 tokenizer" in line and "TIKTOKEN_CACHE_DIR" in line


@needs_tokenizer
def test_checkpoint_of_another_shape_or_recipe_is_refused(checkpoint, tmp_path):
    def edited(name, change):
        folder = tmp_path / name
        shutil.copytree(checkpoint, folder)
        meta = json.loads((folder / "checkpoint.json").read_text())
        change(meta["hyperparameters"])
        (folder / "checkpoint.json").write_text(json.dumps(meta))
        return folder
    wide = edited("wide", lambda h: h.update(model_dim=128))
    line = one_error_line(tool_in_process("sample", wide, "--prompt", "x", env=TOKENIZER_ENV))
    assert "the weights have model_dim=64 but the recorded hyperparameters say model_dim=128" in line
    deep = edited("deep", lambda h: h.update(n_layer=4))
    assert "n_layer=2 but the recorded hyperparameters say n_layer=4" in \
        one_error_line(tool_in_process("hellaswag", deep, "--data", FIXTURE))
    other = edited("other", lambda h: h.update(attn_sink="sparse"))
    assert "records hyperparameter 'attn_sink'='sparse', which this train_gpt.py does not have" in \
        one_error_line(tool_in_process("export", other, tmp_path / "out"))
    not_bool = edited("not_bool", lambda h: h.update(attn_gate="sparse"))  # a switch recorded as text
    assert "refuses (bad value 'sparse' for --attn_gate; valid: true or false)" in \
        one_error_line(tool_in_process("export", not_bool, tmp_path / "out3"))
    newer = edited("newer", lambda h: h.update(recipe="v9"))
    assert "refuses (bad value 'v9' for --recipe; valid: one of auto, reference, v2, record)" in \
        one_error_line(tool_in_process("export", newer, tmp_path / "out2"))
    assert "does not exist" in one_error_line(tool_in_process("sample", tmp_path / "missing", env=TOKENIZER_ENV))


# ----------------------------------------------------------------------------- HellaSwag

def test_unreachable_file_is_one_line_with_the_url(monkeypatch, tmp_path, capsys, checkpoint):
    monkeypatch.setattr(urllib.request, "urlopen", FakeServer(None))
    assert run_cli(lambda: H.main([str(checkpoint), "--cache_dir", str(tmp_path)])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot download the HellaSwag validation file" in err[0] and evaluation.HELLASWAG_URL in err[0]


def test_missing_or_malformed_local_file_is_one_line_with_the_url(tmp_path, checkpoint):
    assert evaluation.HELLASWAG_URL in one_error_line(tool("hellaswag", checkpoint, "--data", tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(FIXTURE.read_text().splitlines()[0] + "\n" + '{"ctx": "x", "endings": ["a"], "label": 0}\n')
    line = one_error_line(tool_in_process("hellaswag", checkpoint, "--data", bad))
    assert "line 2 of" in line and "is not a HellaSwag example" in line and evaluation.HELLASWAG_URL in line


# ----------------------------------------------------------------------------- export

def test_export_round_trip_is_bit_identical(checkpoint, tmp_path):
    result = tool("export", checkpoint, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    original = loading.load_model(checkpoint, "cpu")
    from safetensors.torch import load_file
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    trained = checkpoints.read_checkpoint_tensors(checkpoint)
    assert stored.keys() == trained.keys() and all(stored[k].dtype == trained[k].dtype for k in trained)
    assert {t.dtype for t in stored.values()} == {torch.float32, torch.bfloat16}  # embeddings trained in bf16
    shutil.copytree(tmp_path / "out", tmp_path / "alone")  # only the two files, away from the checkpoint
    rebuilt = load_exported(tmp_path / "alone", "cpu")
    a, b = original.model.state_dict(), rebuilt.model.state_dict()
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert rebuilt.args == original.args and rebuilt.windows == original.windows
    tokens = torch.tensor(prompt_with_documents(256, [0, 99]))
    window = original.model.window(original.windows)
    with torch.no_grad():
        assert torch.equal(original.model.logits(tokens, window), rebuilt.model.logits(tokens, window))


def test_both_export_files_get_the_permissions_of_a_new_file(checkpoint, tmp_path):
    """safetensors writes its file 0600; the export's weights and config both get what the umask gives."""
    loaded = loading.load_model(checkpoint, "cpu")
    before = os.umask(0o002)  # a shared project's umask: group-writable files
    try:
        export(loaded, tmp_path / "out")
    finally:
        os.umask(before)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in (tmp_path / "out").iterdir()}
    assert modes == {"config.json": oct(0o664), "model.safetensors": oct(0o664)}


def test_export_of_a_shape_mismatch_is_refused(checkpoint, tmp_path):
    export(loading.load_model(checkpoint, "cpu"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hyperparameters"]["vocab_size"] = 50304
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(T.UsageError, match="the weights have vocab_size=50257 but the recorded hyperparameters "
                                           "say vocab_size=50304"):
        load_exported(tmp_path)


# ----------------------------------------------------------------------------- recipe v2 checkpoints

@pytest.fixture(scope="module")
def v2_checkpoint(tmp_path_factory):
    """A real tiny run of recipe v2 (every model technique) and its final checkpoint."""
    from test_training import V2_TINY
    logs = tmp_path_factory.mktemp("run_v2")
    result = run_main(TINY + V2_TINY + ["--run_id=v2", "--checkpoint_final=true"], logs)
    assert result.returncode == 0, result.stderr[-2000:]
    return logs / "v2" / "step_000004"


def test_v2_checkpoint_exports_like_the_trained_model(v2_checkpoint, tmp_path):
    """export round trip bit for bit (the bigram table and every gate; the sign table is rebuilt, not stored)."""
    loaded = loading.load_model(v2_checkpoint, "cpu")
    assert loaded.args.recipe == "v2" and loaded.model.bigram_embed is not None and loaded.model.decodes_from_history
    result = tool_in_process("export", v2_checkpoint, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    from safetensors.torch import load_file
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "bigram_embed.weight" in stored and "smear_gate" in stored and "bigram_signs" not in stored
    rebuilt = load_exported(tmp_path / "out", "cpu")
    tokens = torch.tensor(prompt_with_documents(256, [0, 99]))
    window = loaded.model.window(loaded.windows)
    with torch.no_grad():
        assert torch.equal(loaded.model.logits(tokens, window), rebuilt.model.logits(tokens, window))


@needs_tokenizer
def test_v2_checkpoint_samples_through_decode_s_history_path(v2_checkpoint):
    sampled = tool_in_process("sample", v2_checkpoint, "--prompt", "The President", "--max_new_tokens", 8,
                              "--temperature", 0, env=TOKENIZER_ENV)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.count("The President") == 1


# ----------------------------------------------------------------------------- launch.py: the signals that stop it

STOPPING_WORKER = """
import os, signal, sys, time
got = []
def stop(signum, frame):  # as the trainer's StopSignal: the first stops at the next step, a second exits at once
    if got:
        os._exit(128 + signum)
    got.append(signum)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
print("ready", os.getpid(), flush=True)
while not got:
    time.sleep(0.05)
time.sleep(float(sys.argv[1]))  # the step and the checkpoint
print("stopped cleanly", flush=True)
sys.exit(128 + got[0])
"""


def launch_and_signal(tmp_path, signals, stop_s):
    """tools/launch.py with one worker that stops as the trainer does, sent these signals once it runs: the
    launcher's exit status and stderr, the worker's stdout, and whether the worker outlived the launcher."""
    import signal
    import subprocess
    import sys
    import time
    worker = tmp_path / "worker.py"
    worker.write_text(STOPPING_WORKER)
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "tools.launch", "--standalone",
                                 "--nproc_per_node=1", str(worker), str(stop_s)], cwd=tmp_path, stdout=stdout,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **IMPORT_ENV})
        deadline = time.monotonic() + 120
        while "ready" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        worker_pid = int(out.read_text().split()[1])
        for sig in signals:
            proc.send_signal(getattr(signal, sig))
            time.sleep(0.5)
        _, stderr = proc.communicate(timeout=60)
    time.sleep(0.5)
    alive = os.path.exists(f"/proc/{worker_pid}") and "zombie" not in open(f"/proc/{worker_pid}/status").read()
    return proc.returncode, stderr, out.read_text(), alive


@pytest.mark.parametrize("sig, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_stops_the_launcher_s_workers_then_it_in_one_line(tmp_path, sig, status):
    """As the trainer: the worker gets the signal and stops cleanly, the launcher says so in one line and exits
    128 + the signal (was torchrun's SignalException traceback and exit status 1)."""
    rc, stderr, stdout, alive = launch_and_signal(tmp_path, [sig], stop_s=1)
    assert rc == status and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
    assert stderr.startswith(f"error: stopped by signal {sig}: sent on to the workers, which stopped")
    assert "stopped cleanly" in stdout and not alive


def test_a_second_ctrl_c_ends_the_launcher_and_its_workers_at_once_in_one_line(tmp_path):
    """The worker's graceful stop would take a minute; the second Ctrl-C ends it and the launcher at once (was two
    chained tracebacks, and the worker left running)."""
    rc, stderr, stdout, alive = launch_and_signal(tmp_path, ["SIGINT", "SIGINT"], stop_s=60)
    assert rc == 130 and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
    assert stderr.startswith("error: stopped by a second signal (SIGINT): sent on to the workers, which exit at once")
    assert "stopped cleanly" not in stdout and not alive


# ----------------------------------------------------------------------------- flags.py: a user's paths and lists

def test_a_users_path_to_read_is_one_line_for_each_way_it_cannot_be_read(tmp_path):
    from flags import UsageError, read_user_file
    (tmp_path / "binary").write_bytes(b"ok\x00\xff")
    (tmp_path / "file").write_text("text")
    os.mkfifo(tmp_path / "fifo")
    for path, said in [(tmp_path / "binary", "not a text file (byte 2 is not UTF-8 text)"),
                       (tmp_path, "it is a folder, not a file"),
                       (tmp_path / "fifo", "it is a FIFO (named pipe), not a file"),
                       (tmp_path / "a" / "b", f"no such file (its folder {tmp_path / 'a'} does not exist either)"),
                       (tmp_path / "file" / "b", f"{tmp_path / 'file'} is not a folder"),
                       ("/proc/nope/x", "no such file (its folder /proc/nope does not exist either)")]:
        with pytest.raises(UsageError) as e:
            read_user_file(path, "the log", "pass a log")
        assert str(e.value) == f"cannot read the log {path}: {said}; pass a log"
    assert read_user_file(tmp_path / "binary", "the log", "", binary=True) == b"ok\x00\xff"
    assert read_user_file(tmp_path / "file", "the log", "") == "text"


def test_a_users_path_to_write_is_checked_then_written_whole(tmp_path):
    from flags import UsageError, write_user_file
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("kept")
    for path, said in [(tmp_path, "it is a folder"), (tmp_path / "fifo", "it is a FIFO (named pipe)"),
                       (tmp_path / "file" / "x", f"cannot make its folder {tmp_path / 'file'} (a file on the way"),
                       ("/proc/nope/x.json", "cannot make its folder /proc/nope (No such file or directory)")]:
        with pytest.raises(UsageError, match=f"^cannot write --out {path}: " + re_escape(said)):
            write_user_file(path, "data", "--out", "pass another")
    write_user_file(tmp_path / "new" / "x.json", "data", "--out", "")
    write_user_file(tmp_path / "file", "replaced", "--out", "")
    assert (tmp_path / "new" / "x.json").read_text() == "data" and (tmp_path / "file").read_text() == "replaced"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file", "new"]  # no temporary file left


def re_escape(text):
    import re
    return re.escape(text)


def test_a_list_argument_is_never_empty():
    from flags import comma_list, integer
    sizes = comma_list(integer(1), items="world sizes")
    assert sizes("1, 8,") == [1, 8]
    for text, said in [("", "empty list ''; pass one or more world sizes"), (",", "empty list ','"),
                       ("1,0", "bad value '0'; valid: an integer at least 1")]:
        with pytest.raises(argparse.ArgumentTypeError, match=re_escape(said)):
            sizes(text)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown 'x'; valid: a, b"):
        comma_list(choices=("a", "b"))("a,x")


def test_a_checkpoint_path_that_is_not_a_folder_says_what_it_is(tmp_path):
    """A FIFO or a file was 'has no checkpoint.json'; a missing one names its missing folder."""
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "file").write_text("")
    for path, said in [(tmp_path / "pipe", "is a FIFO (named pipe), not a folder"),
                       (tmp_path / "file", "is a file, not a folder"),
                       (tmp_path / "a" / "b", f"does not exist (its folder {tmp_path / 'a'} does not exist either)")]:
        with pytest.raises(T.UsageError, match="^" + re_escape(f"{path} {said}; pass a step_N folder")):
            loading.load_model(path, "cpu")


def test_hellaswag_data_that_is_not_a_file_is_refused_before_the_model_loads(tmp_path):
    os.mkfifo(tmp_path / "pipe.jsonl")
    result = tool_in_process("hellaswag", tmp_path / "no_checkpoint", "--data", tmp_path / "pipe.jsonl")
    assert one_error_line(result) == (f"error: cannot read --data {tmp_path / 'pipe.jsonl'}: it is a FIFO (named "
                                      f"pipe), not a file; {evaluation.HELLASWAG_FETCH_HINT}")


def test_export_into_a_file_is_refused_before_the_model_loads(tmp_path):
    (tmp_path / "file").write_text("mine")
    result = tool_in_process("export", tmp_path / "no_checkpoint", tmp_path / "file")
    assert one_error_line(result) == f"error: OUT_DIR {tmp_path / 'file'} is not a folder; pick a folder (made if " \
                                     "missing)"
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("args, said", [
    (["--nproc_per_node=0", "w.py"], "--nproc_per_node of at least 1"),
    (["--nnodes=0", "w.py"], "with 1 <= MIN <= MAX"),
    (["--bogus", "w.py"], "unrecognized arguments: --bogus (see python -m tools.launch --help"),
    (["--standalone", "--nproc_per_node=1", "nope.py"], "cannot read the training script nope.py: no such file")])
def test_a_bad_launcher_argument_is_one_line_before_anything_starts(tmp_path, args, said):
    """torchrun printed its usage block, or an AssertionError traceback from its agent (--nproc_per_node=0)."""
    import subprocess
    import sys
    (tmp_path / "w.py").write_text("")
    done = subprocess.run([sys.executable, "-m", "tools.launch", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", **IMPORT_ENV})
    assert said in one_error_line(done)
