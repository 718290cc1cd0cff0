"""--recipe=record (record #89, modded-nanogpt f411b3d3) as a whole run: the joint forward + backward and validation
graphs traced at the record's real shapes (11 x 768, its three stages' 16K, 32K and 48K packed sequences, the
final validation's 256K sequence and 20-block windows), the same weights on 1, 2 and 4 ranks across a batch stage
and the tie's split, a run resumed on either side of the split ending on the straight run's losses, and a tiny
`train_gpt.py --preset=cpu --recipe=record` that trains and validates. Its values and modules are pinned in
test_schedules.py, test_model.py, test_optim.py, test_prefix_tokens.py and test_record_attention.py."""
import contextlib
import json
import socket
import types

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

import lifecycle
import train_gpt as T
from bench import memory_estimate as M
from conftest import run_main, run_trainer, train_losses, val_losses
from test_compile import graph_ops, graph_recorder
from test_optim import params

RECORD = ["--preset=speedrun", "--recipe=record"]


def record_args(*extra):
    return T.parse_args([*RECORD, *extra], cuda_available=True)


# ----------------------------------------------------------------------------- the graphs at the record's shapes

def record_graphs(steps, validation_step=None):
    """The 11 x 768 record model as an H100 compiles it (FlexAttention, the FP8 head and MLPs, --compile=model),
    built on the meta device and traced on fake tensors (no memory, no kernel runs): one training step's forward +
    backward at each of `steps` (its stage's packed sequence, windows, loss weights, YaRN state and tie), then one
    validation sequence at validation_step. Returns the graphs AOTAutograd handed the compiler, by kind."""
    args = record_args()
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16,
                   **T.choose_kernels(args, "cuda", fp8_capable=True))
    assert (rt.attention, rt.fp8_head, rt.fp8_mlp, rt.compile) == ("flex", True, True, "model")
    graphs: dict[str, list] = {}
    backend = aot_autograd(fw_compiler=graph_recorder(graphs, "forward"), bw_compiler=graph_recorder(graphs, "backward"),
                           inference_compiler=graph_recorder(graphs, "validation"))
    batches = T.batch_schedule(args, 8)
    torch._dynamo.reset()  # no graphs of another test's model in the caches, none of this one's left behind
    with FakeTensorMode(), M.flex_attention_on_cpu_tensors(), contextlib.ExitStack() as done:
        done.callback(torch._dynamo.reset)
        model = M.fake_model(args, rt)
        compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
        inputs = T.StepTensors(args, torch.device("cpu"), batches)
        for step in steps:
            T.follow_yarn(model, step, args)
            model.embed_from_head = step <= args.tied_embed_steps  # tie_embedding
            tokens = M.fake_tokens(batches.seq_len(step))
            compiled(tokens[:-1], tokens[1:], inputs.windows(step), *inputs.mtp_weights(step)).backward()
            assert model.lm_head.weight.grad is not None
            assert (model.embed.weight.grad is None) == model.embed_from_head  # tied: the head's lookup
            model.zero_grad(set_to_none=True)
        if validation_step is not None:
            T.follow_yarn(model, validation_step, args)
            model.embed_from_head, tokens = False, M.fake_tokens(args.val_seq_len)
            model.eval()
            with torch.no_grad():
                compiled(tokens[:-1], tokens[1:], inputs.windows(validation_step))
    return graphs


def count_op(gm, op) -> int:
    return sum(node.target is op for node in gm.graph.nodes)


needs_fake_aot = pytest.mark.skipif(lifecycle.torch_release(torch.__version__) < (2, 11), reason="torch 2.10's "
                                    "AOTAutograd refuses fake inputs from a FakeTensorMode other than dynamo's "
                                    "(docs/supported-torch.md)")


@needs_fake_aot
def test_the_record_traces_its_first_stage_and_its_final_validation_at_their_real_shapes():
    """Step 0: 16,384 tokens per GPU, windows (3, 1) blocks, MTP (1, 0.5, 0.25) and the prefix weight 0.25, the
    embedding read from the tied head; the last validation: a 262,144-token sequence, windows (20, 6), the last
    YaRN state. One forward, one backward and one validation graph, none reading a device value on the host; the
    22 FP8 MLP matmuls in the training forward (bf16 in the backward and in validation), the FP8 head, FlexAttention
    and its backward."""
    args = record_args()
    assert (T.attention_windows(0, args), T.attention_windows(args.num_iterations, args)) == ((3, 1), (20, 6))
    graphs = record_graphs([0], validation_step=args.num_iterations)
    assert {kind: len(g) for kind, g in graphs.items()} == {"forward": 1, "backward": 1, "validation": 1}, graphs
    (forward,), (backward,), (validation,) = graphs["forward"], graphs["backward"], graphs["validation"]
    scaled_mm = torch.ops.aten._scaled_mm.default
    assert count_op(forward, scaled_mm) == 2 * 11 and count_op(backward, scaled_mm) == 0
    assert count_op(validation, scaled_mm) == 0
    assert {"flex_attention", "speedrun.fp8_matmul.default"} <= graph_ops(forward)
    assert {"flex_attention_backward", "speedrun.fp8_matmul_backward.default"} <= graph_ops(backward)
    assert "flex_attention" in graph_ops(validation)
    assert list(forward.graph.find_nodes(op="placeholder"))[0].meta["val"].shape == (16384,)  # the step's tokens


@needs_fake_aot
def test_the_record_traces_its_later_stages_at_their_real_shapes():
    """The first step of stage 1 (32,768 tokens per GPU, windows (7, 3), the prefix weight decaying, still tied)
    and the first step after the tie's split (848, the last stage: 49,152 tokens, windows (11, 5), the next token
    alone, the embedding its own table): a forward and a backward graph for each length, none reading a device
    value on the host."""
    args = record_args()
    batches = T.batch_schedule(args, 8)
    steps = [batches.first_step(1), args.tied_embed_steps + 1]
    assert [batches.seq_len(s) for s in steps] == [32768, 49152] and batches.stage(steps[1]) == 2
    assert [T.attention_windows(s, args) for s in steps] == [(7, 3), (11, 5)]
    graphs = record_graphs(steps)
    assert {kind: len(g) for kind, g in graphs.items()} == {"forward": 2, "backward": 2}, graphs
    for forward, backward, length in zip(graphs["forward"], graphs["backward"], (32768, 49152)):
        assert list(forward.graph.find_nodes(op="placeholder"))[0].meta["val"].shape == (length,)
        assert count_op(forward, torch.ops.aten._scaled_mm.default) == 2 * 11
        assert "flex_attention_backward" in graph_ops(backward)


# ----------------------------------------------------------------------------- a tiny record, on CPU

# The cpu preset's record recipe at width 64 (the record's 11 blocks and roles): 6 steps (5 scheduled + 1
# extension), whose batch stages start at steps 0, 2 and 3 (4 packed sequences of 128, 256, 384 tokens), the tie
# split after step 3 (the fourth), Adam on odd steps, YaRN at steps 2, 3 and 5, validation at 0, 3 and 6.
TINY_RECORD = ["--preset=cpu", "--recipe=record", "--train_files=data/sample/sotu_train_*.bin",
               "--val_files=data/sample/sotu_val_*.bin", "--model_dim=64", "--n_head=2", "--head_dim=32",
               "--num_iterations=6", "--extension_steps=1", "--tied_embed_steps=3", "--muon_momentum_warmup_steps=2",
               "--muon_momentum_cooldown_steps=1", "--batch_tokens=1536", "--seq_len=384", "--val_seq_len=512",
               "--val_tokens=1024", "--val_every=3", "--warmup_steps=0", "--log_train_loss=true", "--compile=off"]


def test_the_tiny_records_schedule_crosses_its_stages_and_the_split():
    args = T.parse_args(TINY_RECORD, False)
    batches = T.batch_schedule(args, 4)
    assert [batches.first_step(i) for i in range(3)] == [0, 2, 3] and batches.stage_seq_len == (128, 256, 384)
    assert batches.stage_accum == (1, 1, 1) and T.batch_schedule(args, 1).stage_accum == (4, 4, 4)
    assert T.graph_changes(args) == [2, 3, 4, 5]  # YaRN at 2, 3, 5; the lookup switches at 4


class SharedBatches:
    """The loader's next_batch for a test: the same global batch on any world size (a step's sequence k is the same
    on every world size; this rank reads k = rank * accum + i), of random tokens."""

    def __init__(self, rank: int, vocab_size: int):
        self.rank, self.vocab_size, self.step = rank, vocab_size, 0

    def next_batch(self, accum: int, seq_len: int, doc_cap: int):
        for i in range(accum):
            gen = torch.Generator().manual_seed(1000 * self.step + self.rank * accum + i)
            seq = torch.randint(0, self.vocab_size, (seq_len + 1,), generator=gen)
            yield seq[:-1], seq[1:]
        self.step += 1


def record_ranks_worker(rank, world_size, port, out):
    """One rank of test_a_record_run_is_the_same_on_1_2_and_4_ranks: the tiny record's first five steps through
    train_step (stages, lrs, momentum, loss weights, windows, YaRN, the tie and its split) in fp32, on
    SharedBatches; the rank's losses and (rank 0) the weights go to out."""
    import os
    import torch.distributed as dist
    torch.set_num_threads(1)
    # a small vocabulary and bigram table: the head's and tables' gradients dominate a step at the real ones
    args = T.parse_args([*TINY_RECORD, "--dtype=fp32", "--vocab_size=512", "--bigram_vocab_size=1024"], False)
    rt = T.Runtime(rank=rank, local_rank=rank, world_size=world_size, device=torch.device("cpu"),
                   dtype=torch.float32, attention="banded", fp8_head=False, compile="off")
    torch.manual_seed(0)
    model = T.build_model(args, rt)
    if world_size > 1:  # the model first: what it imports would hold gloo threads past the end
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        opt = T.build_optimizers(model, args, rank=rank, world_size=world_size)
        # fp32 in place of Polar Express's bf16, whose roundings Adam's lr 0.6 would blow up into noise
        opt.muon.orthogonalize = lambda G, steps: G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        batches = T.batch_schedule(args, world_size)
        run = types.SimpleNamespace(args=args, model=model, step_model=model, opt=opt, batches=batches,
                                    schedules=T.StepTensors(args, rt.device, batches),
                                    loader=SharedBatches(rank, args.vocab_size))
        losses = []
        for step in range(5):
            T.follow_yarn(model, step, args)
            losses.append(T.train_step(run, step).item())
        torch.save({"losses": losses, **({"params": params(model)} if rank == 0 else {})}, f"{out}.{rank}")
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_record_run_is_the_same_on_1_2_and_4_ranks(tmp_path):
    """Five steps of the tiny record in fp32 (the record's Muon head-pair groups, its Adam on odd steps without
    master weights, the tie's handover after step 3, three batch stages) over the same global batches: the same
    mean losses and weights on 1 (in this process), 2 and 4 ranks (gloo), up to the order of the sums."""
    import torch.multiprocessing as mp
    threads = torch.get_num_threads()
    try:
        record_ranks_worker(0, 1, free_port(), str(tmp_path / "w1"))
    finally:
        torch.set_num_threads(threads)
    got = {1: torch.load(tmp_path / "w1.0")}
    for world_size in (2, 4):
        mp.spawn(record_ranks_worker, args=(world_size, free_port(), str(tmp_path / f"w{world_size}")),
                 nprocs=world_size)
        ranks = [torch.load(tmp_path / f"w{world_size}.{r}") for r in range(world_size)]
        got[world_size] = {"params": ranks[0]["params"],
                           "losses": [sum(r["losses"][s] for r in ranks) / world_size for s in range(5)]}
    for world_size in (2, 4):
        assert got[world_size]["losses"] == pytest.approx(got[1]["losses"], rel=1e-3), world_size
        for name, p in got[1]["params"].items():
            # Adam's first steps are lr x sign(gradient) wherever a gradient nearly cancels (the zero-initialised
            # MUDD and gate maps' inputs, rare table rows), and the order of the sums flips a few such signs: a few
            # entries in 10^3 move by up to twice the lr; a lost or doubled gradient moves most of them
            off = (got[world_size]["params"][name] - p).abs() > 1e-2 + 1e-3 * p.abs()
            assert off.float().mean() < 1e-3, f"{name} on {world_size} ranks: {int(off.sum())} entries apart"
            near = (got[world_size]["params"][name] - p).abs() > 1e-3 + 1e-3 * p.abs()
            assert near.float().mean() < 1e-2, f"{name} on {world_size} ranks: {int(near.sum())} entries apart"


@pytest.fixture(scope="module")
def straight_record_run(tmp_path_factory):
    """`python train_gpt.py` with TINY_RECORD, run id "whole", in a subprocess: the folder of its log and summary."""
    log_dir = tmp_path_factory.mktemp("record")
    result = run_trainer(TINY_RECORD + ["--run_id=whole"], log_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    return log_dir


def test_a_tiny_record_trains_and_validates_on_cpu(straight_record_run):
    """The record's 11 blocks (MUDD, XSA, DC, paired heads, five value tables, the prefix-token loss) at width 64:
    six steps through its three batch stages, the tie's split and an extension step; validation at 0, 3 and 6
    falls, and the run records the record recipe."""
    log = (straight_record_run / "whole.txt").read_text()
    summary = json.loads((straight_record_run / "whole.json").read_text())
    assert summary["hyperparameters"]["recipe"] == "record" and summary["hyperparameters"]["n_layer"] == 11
    assert summary["runtime"]["batch_stages"] == [[0, 512, 4], [2, 1024, 4], [3, 1536, 4]]
    assert summary["tokens"] == 2 * 512 + 1024 + 3 * 1536
    losses, vals = train_losses(log), val_losses(log)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and sorted(vals) == [0, 3, 6]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert vals[6] < vals[3] < vals[0] and summary["final_val_loss"] == pytest.approx(vals[6], abs=1e-4)
    assert [line.split(",")[0] for line in log.splitlines() if line.startswith("yarn:")] == [
        f"yarn: from step {step}" for step in (2, 3, 5)]  # long windows 3 -> 7 -> 11 -> 13 blocks


def test_a_tiny_record_resumes_on_either_side_of_the_split_as_if_never_stopped(tmp_path, straight_record_run):
    """Stopped after 2 steps (tied; the next step opens stage 1) and after 4 (past the split, in stage 2), each
    right after an Adam step (--stop_after is a multiple of --adam_every), resumed each time: the straight run's
    losses and final validation, bit for bit."""
    for launch in (["--stop_after=2"], ["--resume=auto", "--stop_after=4"], ["--resume=auto"]):
        part = run_main(TINY_RECORD + ["--run_id=part", *launch], tmp_path)
        assert part.returncode == 0, part.stderr[-2000:]
    log = (tmp_path / "part.txt").read_text()
    assert " resumes:2" in log.splitlines()[-1]
    want, got = (json.loads(path.read_text()) for path in (straight_record_run / "whole.json", tmp_path / "part.json"))
    assert got["final_val_loss"] == want["final_val_loss"]
    assert train_losses(log) == train_losses((straight_record_run / "whole.txt").read_text())
