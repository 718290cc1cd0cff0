"""Training loop of train_gpt.py end to end: world-size equivalence, the run log, bad input."""
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import checkpoints
import train_gpt as T
from conftest import REPO, SIX, only_log, run_main, run_trainer, side_by_side, train_losses, val_losses

ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

# Losses agree across world sizes up to float summation order (bf16 gradients reduced in a
# different order). A missing average halves or doubles the step; a wrong shard trains on other
# tokens: both move the losses by far more than this.
WORLD_SIZE_TOLERANCE = 2e-3
# Relative L2 error of every optimizer moment between 1 and 2 ranks (bf16 embedding gradients).
STATE_TOLERANCE = 2e-2


@pytest.mark.torch_range
def test_cpu_run_writes_a_complete_log_and_summary(tiny_run):
    tmp_path = tiny_run
    log = (tmp_path / "tiny.txt").read_text()
    source = (REPO / "train_gpt.py").read_text()
    assert "==== train_gpt.py ====\n" + source in log
    for line in ["  n_layer = 2", "  model_dim = 64", "  preset = cpu", "  seed = 0", "  muon_lr = 0.05",
                 "  (derived) grad_accum_steps = 2", "world_size: 1", "torch: "]:
        assert line in log
    # the header says how many buckets (collectives per step) the gradients travel in: 2 layers of 4 matrices,
    # the head, the embedding and one value-embedding table, and the small parameters together
    assert "\ngradient buckets: 12 on 1 rank(s) (muon 8 x 4.1K-16.4K, adam 3 x 3.2M, small 1 x 9 elements)\n" in log
    assert sorted(train_losses(log)) == [1, 2, 3, 4]
    vals = val_losses(log)
    assert sorted(vals) == [0, 2, 4] and abs(vals[0] - math.log(50304)) < 1e-3
    assert "final: val_loss:" in log and "energy: " in log and "peak memory" in log
    summary = json.loads((tmp_path / "tiny.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 4 and summary["tokens"] == 4 * 512
    assert [row[0] for row in summary["val_curve"]] == [0, 2, 4]
    assert summary["final_val_loss"] == pytest.approx(vals[4], abs=1e-4)
    assert summary["hyperparameters"]["n_layer"] == 2


def test_same_seed_gives_the_same_losses(tmp_path, tiny):
    runs = [run_main(tiny + [f"--run_id=r{i}", "--num_iterations=2", "--val_every=0"], tmp_path) for i in range(2)]
    assert all(r.returncode == 0 for r in runs)
    first, second = (train_losses((tmp_path / f"r{i}.txt").read_text()) for i in range(2))
    assert first == second and len(first) == 2


DRIVER = textwrap.dedent('''
    """Runs train_gpt.main with one deliberate fault, to prove the equivalence test catches it."""
    import sys
    import train_gpt as T
    from rank_driver import exit_checked
    fault = sys.argv.pop(1)
    if fault == "missing_average":
        step = T.Optimizers.step
        def no_average(self, lr_mult, momentum, accum):  # forget to divide the summed gradients by the world size
            self.world_size, world_size = 1, self.world_size
            step(self, lr_mult, momentum, accum)
            self.world_size = world_size
        T.Optimizers.step = no_average
    elif fault == "wrong_shard":
        def same_data_everywhere(self, accum, seq_len, doc_cap=None):
            chunks = [self.stream.take(seq_len, self.bos_align) for _ in range(self.world_size * accum)]
            return [T.to_device(chunks[i], self.device) for i in range(0, len(chunks), self.world_size)]
        T.DistributedTokenLoader.next_batch = same_data_everywhere
    stop = T.StopSignal()
    exit_checked(T.main(stop=stop), stop)
''')


def losses_with_fault(tmp_path, fault):
    """The session's six-step runs (SIX, final checkpoint), on two ranks with one deliberate fault."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    result = run_trainer([fault] + SIX + [f"--run_id={fault}", "--checkpoint_final=true"], tmp_path, nproc=2,
                         driver=driver)
    assert result.returncode == 0, result.stderr[-2000:]
    return train_losses((tmp_path / f"{fault}.txt").read_text())


def optimizer_state(tmp_path, run_id, step=4):
    """Adam masters and moments, Muon momenta and NorMuon's second moments (when on) after the run, as whole
    tensors (DCP joins the shards)."""
    folder = tmp_path / run_id / f"step_{step:06d}"
    state = {f"adam {name}": t.float() for name, t in checkpoints.read_checkpoint_tensors(folder, "adam/").items()
             if not name.endswith("/step")}
    for prefix in ("muon/", "normuon/"):
        state.update({f"{prefix}{name}": t.float() for name, t in checkpoints.read_checkpoint_tensors(folder, prefix).items()})
    return state


def worst_state_error(a, b):
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in a)


def test_one_and_two_ranks_give_the_same_losses_and_faults_are_caught(tmp_path, six_steps_one_rank,
                                                                      six_steps_two_ranks):
    one, two = (train_losses((run / "whole.txt").read_text()) for run in (six_steps_one_rank, six_steps_two_ranks))
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    for step in one:
        assert abs(one[step] - two[step]) < WORLD_SIZE_TOLERANCE, (step, one, two)
    # Losses barely see a gradient scale (Adam and Muon normalise it away); the optimizer state does.
    state_one = optimizer_state(six_steps_one_rank, "whole", 6)
    assert worst_state_error(optimizer_state(six_steps_two_ranks, "whole", 6), state_one) < STATE_TOLERANCE
    broken = losses_with_fault(tmp_path, "wrong_shard")
    assert max(abs(broken[s] - one[s]) for s in one) > 10 * WORLD_SIZE_TOLERANCE, (one, broken)
    losses_with_fault(tmp_path, "missing_average")
    assert worst_state_error(optimizer_state(tmp_path, "missing_average", 6), state_one) > 0.5


# Every recipe-v2 switch at once on TINY's shape: a 2-stage batch ramp (2 then 4 sequences of 256), capped
# documents packed from their starts, the logit rescale and multi-token loss the cpu v2 leaves out; 4 layers,
# so that there are short-window layers to pair, and a small bigram table
V2_TINY = ["--recipe=v2", "--batch_tokens=1024", "--seq_len=256", "--window_final_tokens=1024", "--batch_schedule=1/2,1",
           "--bos_align=true", "--doc_len_cap=64", "--n_layer=4", "--bigram_vocab_size=4096", "--bigram_dim=32",
           "--logit_softcap=23", "--logit_offset=5", "--mtp_tokens=3"]


# The cpu preset's recipe v2 as `--recipe=v2` gives it (its batch ramp of 4 -> 8 -> 12 sequences of 512, Polar
# Express, NorMuon, cautious decay, the scalars' own betas, every model switch it keeps), on a narrow model with a
# small bigram table: one step per batch stage.
V2_CPU = ["--preset=cpu", "--recipe=v2", "--model_dim=64", "--n_head=2", "--head_dim=32", "--bigram_vocab_size=4096",
          "--bigram_dim=32", "--num_iterations=3", "--val_seq_len=512", "--val_tokens=1024", "--val_every=0",
          "--warmup_steps=0", "--log_train_loss=true", "--compile=off"]


def test_recipe_v2_gives_the_same_losses_and_state_on_one_and_two_ranks(tmp_path):
    from bench import ablation
    # fp32 activations: v2's many bf16 stream ops, summed in another order per world size, would drift the
    # optimizer state past STATE_TOLERANCE; Muon's iterations stay bf16
    args = {nproc: V2_CPU + [f"--run_id=v2ws{nproc}", "--checkpoint_final=true", "--dtype=fp32"] for nproc in (1, 2)}
    results = side_by_side(lambda: run_main(args[1], tmp_path), lambda: run_trainer(args[2], tmp_path, nproc=2))
    runs = {}
    for nproc, result in zip((1, 2), results):
        assert result.returncode == 0, result.stderr[-2000:]
        runs[nproc] = train_losses((tmp_path / f"v2ws{nproc}.txt").read_text())
        summary = json.loads((tmp_path / f"v2ws{nproc}.json").read_text())
        assert summary["tokens"] == 2048 + 4096 + 6144 and math.isfinite(summary["final_val_loss"])
        assert summary["runtime"]["batch_stages"] == [[0, 2048, 4 // nproc], [1, 4096, 8 // nproc],
                                                      [2, 6144, 12 // nproc]]
        # the ablation reads the stages back to put validation points on a token axis
        assert [ablation.tokens_before(summary, s) for s in range(4)] == [0, 2048, 6144, 12288]
    assert sorted(runs[1]) == sorted(runs[2]) == [1, 2, 3]
    assert all(abs(runs[1][s] - runs[2][s]) < WORLD_SIZE_TOLERANCE for s in runs[1]), runs
    one, two = optimizer_state(tmp_path, "v2ws1", 3), optimizer_state(tmp_path, "v2ws2", 3)
    assert any(k.startswith("normuon/") for k in one)
    squares = lambda state, keep: {k: v for k, v in state.items()  # noqa: E731
                                   if (k.startswith("normuon/") or k.endswith("exp_avg_sq")) == keep}
    # The skip gates start at zero and barely move in 3 steps (|w| <= 3e-4): cautious decay's sign test flips on
    # such weights with the summation order, so their masters are held to 1e-4 absolute (a tenth of one Adam step)
    zero_init = {k for k in one if k.startswith("adam skip_gate/master")}
    assert max((two[k] - one[k]).abs().max().item() for k in zero_init) < 1e-4
    assert worst_state_error(squares({k: v for k, v in two.items() if k not in zero_init}, False),
                             squares({k: v for k, v in one.items() if k not in zero_init}, False)) < STATE_TOLERANCE
    # mean squares of bf16-noisy updates: a relative error of e in the update is 2e in its square (measured 0.043,
    # NorMuon's moments of 64-wide projections; a rank missing half its gradient is off by more than 0.5)
    assert worst_state_error(squares(two, True), squares(one, True)) < 3 * STATE_TOLERANCE


@pytest.mark.parametrize("flag, message", [
    ("--train_files=/nowhere/fineweb_train_*.bin", "no training shards match '/nowhere/fineweb_train_*.bin'"),
    ("--val_files=/nowhere/*.bin", "no validation shards match"),
    ("--no_such_flag=1", "unknown argument '--no_such_flag=1'; valid: --preset="),
    ("--preset=fast", "unknown preset 'fast'; valid presets: speedrun, cpu"),
    ("--seq_len=300", "--seq_len=300 is not a multiple of the 128-token block"),
    ("--num_iterations=ten", "bad value 'ten' for --num_iterations: expected int"),
    ("--batch_tokens=700", "world size 1 cannot split --batch_tokens=700"),
])
def test_bad_input_is_one_line_without_a_traceback(tmp_path, tiny, flag, message):
    result = run_main(tiny + [flag], tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_refusal_reaches_the_terminal_as_one_line(tmp_path, tiny):
    """The same through a real interpreter (the tests above run main() in-process): nothing else is printed."""
    result = run_trainer(tiny + ["--no_such_flag=1"], tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: unknown argument '--no_such_flag=1'; valid: --preset=")


def test_nan_loss_stops_the_run_naming_the_step(tmp_path, tiny):
    # A finite but absurd lr (a NaN one is refused at start-up) overflows the scalars in one step.
    result = run_main(tiny + ["--scalar_lr=1e38", "--val_every=0"], tmp_path)
    assert result.returncode == T.EXIT_RUN_FAILED
    assert "training loss is nan at step 2" in result.stderr
    assert "Traceback" not in result.stderr
    assert "step:2/4" not in only_log(tmp_path).read_text()


def test_impossible_world_size_is_refused_with_the_sizes_that_work(tmp_path, tiny):
    result = run_trainer(tiny + ["--batch_tokens=768", "--seq_len=256"], tmp_path, nproc=2)
    assert result.returncode != 0
    assert "world size 2 cannot split --batch_tokens=768" in result.stderr
    assert "world sizes that work: [1, 3]" in result.stderr


def test_compiled_runs_match_eager_on_cpu(tmp_path, tiny):
    """--compile=loss (the CPU default) and --compile=model give the eager losses up to kernel rounding."""
    args = {mode: tiny + [f"--compile={mode}", f"--run_id={mode}", "--num_iterations=2", "--val_every=0"]
            for mode in ("off", "loss", "model")}
    # eager in this process; each compiled run in its own (its compiled graphs and inductor settings stay there)
    results = side_by_side(lambda: run_main(args["off"], tmp_path), lambda: run_trainer(args["loss"], tmp_path),
                           lambda: run_trainer(args["model"], tmp_path))
    runs = {}
    for compile_mode, result in zip(args, results):
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"compile {compile_mode}" in result.stdout
        runs[compile_mode] = train_losses((tmp_path / f"{compile_mode}.txt").read_text())
    for mode in ("loss", "model"):
        assert sorted(runs[mode]) == [1, 2]
        assert all(abs(runs[mode][s] - runs["off"][s]) < 2e-3 for s in runs["off"]), (mode, runs)


def test_two_nodes_of_one_process_equal_one_node_of_two(tmp_path, six_steps_two_ranks):
    """Two launchers (tools/launch.py, torchrun's main) on loopback (c10d rendezvous, gloo) are a 2-rank
    run like --nproc_per_node=2 (the session's six-step run on two ranks)."""
    port = free_port()
    args = SIX + ["--run_id=nodes", f"--log_dir={tmp_path / 'nodes'}"]
    launch = [sys.executable, "-m", "tools.launch", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
              f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two_nodes", str(REPO / "train_gpt.py"), *args]
    nodes = [subprocess.Popen(launch, cwd=REPO, env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    two_nodes = train_losses((tmp_path / "nodes" / "nodes.txt").read_text())
    summary = json.loads((tmp_path / "nodes" / "nodes.json").read_text())
    assert summary["world_size"] == 2 and summary["runtime"]["world_size"] == 2
    assert two_nodes == train_losses((six_steps_two_ranks / "whole.txt").read_text()) and len(two_nodes) == 6


@pytest.mark.parametrize("host, conf", [("127.0.0.1", ""), ("127.0.0.2", ",is_host=false")],
                         ids=["the other node never starts", "the endpoint is unreachable"])
def test_a_rendezvous_that_cannot_form_ends_in_one_line_naming_the_endpoint(host, conf):
    """Unreachable: this node only connects (is_host=false) to a loopback address where nothing listens; plain
    torchrun retried for ~2 minutes whatever join_timeout said, printing dozens of C++ backtrace lines."""
    endpoint = f"{host}:{free_port()}"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tools.launch", "--nnodes=2", "--nproc_per_node=1",
                           "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=alone",
                           f"--rdzv_conf=join_timeout=3{conf}", str(REPO / "train_gpt.py")],
                          cwd=REPO, env=ONE_THREAD, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == T.EXIT_PEER_LOST and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"error: the rendezvous at {endpoint} (c10d, id alone) did not form within "
                               "join_timeout=3s")
    assert time.monotonic() - started < 40  # join_timeout bounds it (was 68-128 s when unreachable)


def test_the_launcher_ends_with_the_failed_workers_exit_status(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tools.launch", "--standalone", "--nproc_per_node=1",
                           str(REPO / "train_gpt.py"), "--preset=cpu", "--model_dim=96", f"--log_dir={tmp_path}"],
                          cwd=REPO, env=ONE_THREAD, capture_output=True, text=True, timeout=120)
    assert done.returncode == T.EXIT_USAGE, done.stderr[-3000:]
    assert "--model_dim=96 must equal --n_head x --head_dim" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("error: worker rank 0 ended with exit status 2 (its own error "
                                                    "line is above)")
