"""Predicted peak GPU memory per rank of the speedrun's training step and validation, computed on CPU.

    python -m bench.memory_estimate                            # reference and v2, 1 and 8 GPUs (~2 min, 2 cores)
    python -m bench.memory_estimate --recipes=v2 --gpus=8
    python -m bench.memory_estimate --recipes=record            # record #89's model (~1 min, 2 cores)
    python -m bench.memory_estimate --recipes=reference -- --seq_len=24576   # train_gpt.py flags after --

What it measures. train_gpt.py's own model, optimizers and step, at the real shapes of --preset=speedrun
(training: seq_len tokens per micro-step, or with --batch_sequences the longest stage's packed sequence;
validation: one val_seq_len sequence), on fake tensors
(torch's FakeTensorMode: shapes, dtypes and storage sharing, no memory and no kernels). Every storage
that is alive is counted once (views share their base's storage) and the peak of the sum is kept:
- parameters and buffers (build_model, with the H100 kernel choices: FlexAttention, FP8 head,
  --compile=model), the optimizer state and communication buffers this rank holds (build_optimizers for
  rank 0 of the world size: Muon keeps momentum only for the matrices a rank owns, ShardedAdam an fp32
  master and two moments of a 1/world_size slice; one GPU shards nothing);
- a training step as train_step runs it: micro-steps of forward + backward (two of them when the step has
  more, so that the gradients of the earlier ones are alive) and the optimizer step, collectives on a
  fake process group; the gradients are set to None after the step, as the trainer does;
- warm_up(): its steps (the first stage's micro-steps; with --batch_sequences also each longer stage's, which
  it compiles) and its validation, while it holds a copy of the
  whole training state ("warm-up" rows);
- validation as evaluate() calls the model: model.eval(), torch.no_grad(), model(tokens, targets, window),
  on the parameters and optimizer state of a run in progress (no gradients).
The model runs through torch.compile as the trainer compiles it: AOTAutograd with inductor's
decompositions, joint-graph passes and min-cut partitioner (which decides what the forward saves for the
backward). The graphs are then executed node by node on fake tensors, in two ways, giving two columns:
- "no fusion": every op's output is a buffer (an upper bound for these graphs);
- "predicted": inductor's fusion approximated: an elementwise op's result gets a buffer only when a
  matmul, custom op, FlexAttention call or other non-fusible op reads it, when it leaves the graph, or
  when more than 4 ops read it; otherwise it is computed inside its consumers' kernels (reductions always
  get one; they are small). The FP8 head's
  custom ops are expanded into their math (train_gpt.fp8_forward_math / fp8_backward_math, which
  the ops compile inside) so that their transposed FP8 copies count. FlexAttention runs as the
  compiled kernel would: outputs and logsumexp, no score matrix.

What it cannot see: the CUDA context and cuBLAS/cuDNN handles (~0.5-1 GiB per process, outside
torch.cuda.max_memory_allocated), NCCL's buffers, the caching allocator's fragmentation and rounding
(reserved minus allocated; the trainer sets expandable_segments to limit it), the workspaces of compiled
kernels and cuBLAS, inductor's exact fusion and buffer reuse decisions (the predicted column is a
heuristic; the truth should lie between the two columns, near the first), and Triton autotuning's
trial buffers. Compare with the "peak memory allocated" line of a real run's log (peak_memory_mib).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import operator
import sys
import time
import types
import typing
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.fx.node import map_arg
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt as T
from flags import OneLineArgumentParser, comma_list, integer, number, run_cli

GIB = 2 ** 30
H100_GIB = 81559 / 1024  # nvidia-smi's total for an H100 80GB (SXM): 81,559 MiB
LARGEST = 12  # storages listed per peak by --breakdown


# ----------------------------------------------------------------------------- counting live storages

class Tally:
    """Bytes of the storages alive now, each counted once, by what made them; and the peak of their sum."""

    def __init__(self):
        self.live: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.made_by: dict[int, str] = {}  # storage -> the op that made it
        self.by_label: Counter = Counter()
        self.peak, self.peak_by_label, self.peak_at, self.peak_largest = 0, Counter(), "", []

    def purge(self) -> None:
        for key, (ref, nbytes, label) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.by_label[label] -= nbytes

    def add(self, out, label: str, where: str) -> None:
        grew = False
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            if ref.cdata in self.live and not self.live[ref.cdata][0].expired():
                continue
            self.purge()
            self.live[ref.cdata] = (ref, storage.nbytes(), label)
            self.made_by[ref.cdata] = where
            self.by_label[label] += storage.nbytes()
            grew = True
        if grew:
            now = sum(self.by_label.values())
            if now > self.peak:
                self.peak, self.peak_by_label, self.peak_at = now, Counter(self.by_label), where
                self.peak_largest = sorted(((n, self.made_by[k]) for k, (_, n, _) in self.live.items()),
                                           reverse=True)[:LARGEST]

    def relabel(self, tensors, label: str) -> None:
        for t in tensors:
            ref = StorageWeakRef(t.untyped_storage())
            if ref.cdata in self.live:
                _, nbytes, old = self.live[ref.cdata]
                self.live[ref.cdata] = (ref, nbytes, label)
                self.by_label[old] -= nbytes
                self.by_label[label] += nbytes

    def current(self) -> int:
        self.purge()
        return sum(self.by_label.values())


class LiveMemory(TorchDispatchMode):
    """Counts the output storages of every op run outside compiled graphs (the graphs count their own, in
    run_graph); ignore_compile_internals keeps torch.compile working while the mode is on."""
    supports_higher_order_operators = True  # FlexAttention's calls pass through, counted like any op

    def __init__(self, fused: Tally, unfused: Tally):
        super().__init__()
        self.fused, self.unfused = fused, unfused
        self.label, self.in_graph = "", False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.in_graph:
            self.fused.add(out, self.label, f"{self.label}: {func}")
            self.unfused.add(out, self.label, f"{self.label}: {func}")
        return out

    @contextlib.contextmanager
    def phase(self, label: str):
        before, self.label = self.label, label
        try:
            yield
        finally:
            self.label = before


# ----------------------------------------------------------------------------- compiled graphs, node by node

VIEWLIKE = {torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}
FUSIBLE = {  # not tagged pointwise, but inductor computes them inside the kernels that read them
    "aten::embedding", "aten::index", "aten::gather", "aten::index_select", "aten::constant_pad_nd", "aten::cat",
    "aten::_to_copy", "aten::full", "aten::full_like", "aten::zeros", "aten::ones", "aten::zeros_like",
    "aten::ones_like", "aten::scalar_tensor", "aten::arange", "aten::lift_fresh_copy", "aten::copy",
    "prims::iota", "prims::convert_element_type", "aten::slice_scatter", "aten::select_scatter", "aten::where",
}
REALIZE_READS = 4  # inductor's realize_reads_threshold: a result read by more ops than this gets a buffer


def node_kind(n: torch.fx.Node) -> str:
    if n.op != "call_function":
        return n.op
    t = n.target
    if t is operator.getitem:
        return "view"
    if isinstance(t, torch._ops.OpOverload):
        if t.namespace not in ("aten", "prims"):
            return "extern"  # custom ops (the FP8 head's)
        if t in VIEWLIKE or any(r.alias_info is not None for r in t._schema.returns):
            return "view"
        if torch.Tag.pointwise in t.tags or t._schema.name in FUSIBLE:
            return "pointwise"
        if torch.Tag.reduction in t.tags:
            return "reduction"
    return "extern"  # matmuls, FlexAttention, scatters, sorts, scans


def buffers_inductor_would_make(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose results get a buffer under the fusion rule in the module docstring."""
    forcing: dict[torch.fx.Node, bool] = {}

    def forces(user: torch.fx.Node) -> bool:  # does reading through this node need a buffer?
        if user not in forcing:
            kind = node_kind(user)
            forcing[user] = user.op == "output" or kind == "extern" or \
                (kind == "view" and any(forces(u) for u in user.users))
        return forcing[user]

    made = set()
    for n in gm.graph.nodes:
        kind = node_kind(n)
        if kind in ("extern", "reduction"):
            made.add(n)
        elif kind == "pointwise" and (len(n.users) > REALIZE_READS or any(forces(u) for u in n.users)):
            made.add(n)
    return made


def expansions() -> dict:
    """Custom ops run as their math (what the ops compile inside, train_gpt.fp8_kernel), so that their buffers
    count."""
    return {torch.ops.speedrun.fp8_matmul.default: T.fp8_forward_math,
            torch.ops.speedrun.fp8_matmul_backward.default: T.fp8_backward_math}


def run_graph(gm: torch.fx.GraphModule, args: list, meter: LiveMemory, label: str, cache: dict, prefix: str = ""):
    """Executes gm on fake tensors, adding each node's result to the unfused tally and, where inductor would
    make a buffer, to the fused one; drops every value after its last use, and the caller's argument list
    as AOTAutograd's boxed calling convention allows (so that saved activations die during the backward)."""
    if gm not in cache:
        nodes = list(gm.graph.nodes)
        last_use = {}
        for i, n in enumerate(nodes):
            for inp in n.all_input_nodes:
                last_use[inp] = i
        dead_after: dict[int, list] = {}
        for n, i in last_use.items():
            dead_after.setdefault(i, []).append(n)
        cache[gm] = (nodes, dead_after, buffers_inductor_would_make(gm))
    nodes, dead_after, buffered = cache[gm]
    env: dict = {}
    pending = list(reversed(args))
    args.clear()
    for i, n in enumerate(nodes):
        where = f"{prefix or label + ':'} {n.name}"
        if n.op == "placeholder":
            env[n] = pending.pop()
        elif n.op == "get_attr":
            env[n] = operator.attrgetter(n.target)(gm)
        elif n.op == "output":
            return map_arg(n.args[0], lambda x: env[x])
        else:
            fn_args, fn_kwargs = map_arg((n.args, n.kwargs), lambda x: env[x])
            if n.target in expansions():
                out = run_expanded(n.target, math_arguments(n.target, fn_args, fn_kwargs), meter, label,
                                   f"{where} >", cache)
            else:
                out = n.target(*fn_args, **fn_kwargs)
            meter.unfused.add(out, label, where)
            if n in buffered:
                meter.fused.add(out, label, where)
            env[n] = out
        if not n.users:
            env.pop(n, None)
        for dead in dead_after.get(i, ()):
            env.pop(dead, None)
    raise AssertionError("graph without output")


def math_arguments(op, fn_args, fn_kwargs) -> list:
    """The op's arguments that its math takes, by name: not the kernels' backend (the math is the same), nor the
    forward's gradient scale (record #89's head passes it to the op, for its backward)."""
    given = {**dict(zip((a.name for a in op._schema.arguments), fn_args)), **fn_kwargs}
    return [given[name] for name in inspect.signature(expansions()[op]).parameters]


def run_expanded(op, fn_args, meter: LiveMemory, label: str, prefix: str, cache: dict):
    from torch.fx.experimental.proxy_tensor import make_fx
    key = (op, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in fn_args))
    if key not in cache:
        gm = make_fx(expansions()[op])(*fn_args)
        for n in gm.graph.nodes:  # the trace's example values are this call's tensors: keeping them would leak
            n.meta.clear()
        cache[key] = gm
    return tuple(run_graph(cache[key], list(fn_args), meter, label, cache, prefix))


def counting_backend(meter_box: list, graphs: Counter):
    """torch.compile's backend: AOTAutograd as inductor configures it, with graphs run by run_graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import _recursive_joint_graph_passes, partition_fn
    from torch._inductor.decomposition import select_decomp_table
    cache: dict = {}

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind] += 1
            if kind == "validation":  # inductor's inference path runs the joint-graph passes here
                gm = _recursive_joint_graph_passes(gm)

            def run(args):
                meter = meter_box[0]
                meter.in_graph = True
                try:
                    return run_graph(gm, args, meter, f"{kind} graph", cache)
                finally:
                    meter.in_graph = False
            run._boxed_call = True
            return run
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        inference_compiler=compiler("validation"), decompositions=select_decomp_table(),
                        partition_fn=partition_fn)  # inductor's: its joint-graph passes, then the min-cut


# ----------------------------------------------------------------------------- the trainer's pieces, fake

def fake_model(args: T.Hyperparameters, rt: T.Runtime) -> T.GPT:
    """build_model on the meta device (no memory, no init), then every parameter and buffer as an empty fake
    tensor of its shape and dtype (the ambient FakeTensorMode makes them)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily(), torch.device("meta"):
        model = T.build_model(args, dataclasses.replace(rt, device=torch.device("meta")))
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype),
                                                        requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype)
    return model


@contextlib.contextmanager
def flex_attention_on_cpu_tensors():
    """FlexAttention refuses CPU inputs that need grad (it has no CPU backward); nothing runs here."""
    import torch.nn.attention.flex_attention as flex
    check = flex._validate_device
    flex._validate_device = lambda *_: None
    try:
        yield
    finally:
        flex._validate_device = check


def fake_tokens(n: int) -> torch.Tensor:
    return torch.zeros(n + 1, dtype=torch.int64)  # to_device's int64 sequence (fake: made under the mode)


class Scenario:
    """One recipe's model, compiled once; train_step, warm-up and validation measured per world size."""

    def __init__(self, preset: str, recipe: str, extra: list[str], mode):
        self.recipe, self.mode = recipe, mode
        self.args = T.parse_args([f"--preset={preset}", f"--recipe={recipe}", *extra], cuda_available=True)
        kernels = T.choose_kernels(self.args, "cuda", fp8_capable=True)  # what setup_runtime picks on an H100
        self.rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16,
                            **kernels)
        self.meter_box: list = [None]
        self.graphs: Counter = Counter()
        self.model = fake_model(self.args, self.rt)
        backend = counting_backend(self.meter_box, self.graphs)
        self.compiled = torch.compile(self.model, dynamic=False, backend=backend) if self.rt.compile == "model" \
            else self.model

    def measure(self, world_size: int, phase: str) -> tuple[Tally, Tally]:
        fused, unfused = Tally(), Tally()
        meter = self.meter_box[0] = LiveMemory(fused, unfused)
        model, args = self.model, self.args
        model.zero_grad(set_to_none=True)
        with meter:
            with meter.phase("parameters + buffers"):
                for t in [*model.parameters(), *model.buffers()]:
                    fused.add(t, meter.label, "model"), unfused.add(t, meter.label, "model")
            with meter.phase("optimizer state"):
                opt = T.build_optimizers(model, args, rank=0, world_size=world_size, grad_sync_from_hooks=False,
                                         compile_newton_schulz=True)
                if opt.muon is not None:  # build_optimizers compiles it; the same math, run here as is
                    opt.muon.orthogonalize = T.polar_express if args.polar_express else T.newton_schulz
                state = T.training_state(model, opt, types.SimpleNamespace(state=dict), 0)  # AdamW's state made
            schedule = T.batch_schedule(args, world_size)
            if phase == "validation":
                self.validation(meter)
            elif phase == "train":  # the largest stage's micro-steps
                self.train_step(meter, opt, *heaviest(schedule, range(len(schedule.stage_tokens))))
            else:  # warm_up(): the whole training state cloned and held through its steps and one validation
                with meter.phase("warm-up state copy"), torch.no_grad():
                    held = {name: T.local_part(x).clone() for name, x in state.tensors.items()}
                self.train_step(meter, opt, *heaviest(schedule, warmed_stages(args, schedule)))
                self.validation(meter)
                held.clear()  # warm_up copies it back and lets it go
            del state, opt
        model.zero_grad(set_to_none=True)
        self.meter_box[0] = None
        gc.collect()
        return fused, unfused

    def final_windows(self) -> torch.Tensor:
        """The model's windows input at the schedule's last step (the largest pair)."""
        return torch.tensor(T.attention_windows(self.args.num_iterations, self.args), dtype=torch.int64)

    def train_step(self, meter: LiveMemory, opt: T.Optimizers, accum: int, seq_len: int) -> None:
        """train_step's micro-steps of seq_len tokens (at most 2 run: from the second on, the gradients of the
        earlier ones are alive, and every later one is the same) and its optimizer step."""
        args, model = self.args, self.model
        windows = self.final_windows()
        mtp = T.StepTensors(args, torch.device("cpu")).mtp_weights(0)  # MTP (and prefix-token) weights, as training
        model.train()
        for i in range(min(accum, 2)):
            with meter.phase("inputs"):
                seq = fake_tokens(seq_len).clone()
            x, y = seq[:-1], seq[1:]
            opt.sync.arm(i == min(accum, 2) - 1)
            with meter.phase("forward"):
                loss = self.compiled(x, y, windows, *mtp)
            with meter.phase("backward"):
                loss.backward()
            meter.fused.relabel([p.grad for p in model.parameters() if p.grad is not None], "gradients")
            meter.unfused.relabel([p.grad for p in model.parameters() if p.grad is not None], "gradients")
            del loss, x, y, seq
        with meter.phase("optimizer step"):
            opt.step(1.0, args.muon_momentum, accum)
        model.zero_grad(set_to_none=True)

    def validation(self, meter: LiveMemory) -> None:
        """evaluate(): eval mode, no grad, one val_seq_len sequence through the model's forward."""
        args, model = self.args, self.model
        windows = self.final_windows()
        with meter.phase("inputs"):
            seq = fake_tokens(args.val_seq_len).clone()
        model.eval()
        try:
            with torch.no_grad(), meter.phase("validation"):
                self.compiled(seq[:-1], seq[1:], windows).double()
        finally:
            model.train()


# ----------------------------------------------------------------------------- report

PHASES = {"train": "train step", "warm-up": "warm-up", "validation": "validation"}


def breakdown(tally: Tally) -> str:
    parts = [(label, n) for label, n in tally.peak_by_label.most_common() if n >= 0.005 * GIB]
    return ", ".join(f"{label} {n / GIB:.2f}" for label, n in parts)


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of world_size ranks (collectives return at once, on fake tensors), this being rank 0."""
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torch.distributed._tools.fake_collectives  # noqa: F401  (fake kernels for the c10d ops)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def warmed_stages(args: T.Hyperparameters, schedule: T.BatchSchedule) -> list[int]:
    """The stages warm_up() steps in (one step at least): with --batch_sequences, every sequence length."""
    return sorted({schedule.stage(step) for step in T.warm_up_steps(max(args.warmup_steps, 1), schedule)})


def heaviest(schedule: T.BatchSchedule, stages: typing.Iterable[int]) -> tuple[int, int]:
    """(micro-steps, sequence length) of the heaviest of these stages: the longest sequences, then the most
    micro-steps (which keep the earlier micro-steps' gradients alive)."""
    length, accum = max((schedule.stage_seq_len[i], schedule.stage_accum[i]) for i in stages)
    return accum, length


def micro_steps(args: T.Hyperparameters, world_size: int, phase: str) -> str:
    """The micro-steps per step of each stage the phase runs (each distinct count once, in stage order)."""
    schedule = T.batch_schedule(args, world_size)
    stages = {"train": range(len(schedule.stage_tokens)), "warm-up": warmed_stages(args, schedule)}.get(phase)
    if stages is None:
        return "-"
    return "/".join(dict.fromkeys(str(schedule.stage_accum[i]) for i in stages))


def sequences_line(args: T.Hyperparameters) -> str:
    """The training sequences' length: seq_len, or --batch_sequences' packed length per stage."""
    if not args.batch_sequences:
        return f"seq_len {args.seq_len:,}"
    lengths = dict.fromkeys(f"{n:,}" for n in T.batch_schedule(args, 1).stage_seq_len)
    return f"{args.batch_sequences} packed sequences per step of {' / '.join(lengths)} tokens by stage"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = OneLineArgumentParser(prog="memory_estimate.py", usage="%(prog)s [options] [-- train_gpt.py flags]",
                              description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="speedrun", choices=["speedrun", "medium"],
                   help="train_gpt.py's preset whose shapes are measured (default speedrun)")
    p.add_argument("--recipes", type=comma_list(choices=tuple(T.RECIPES)), default="reference,v2",
                   help="comma-separated train_gpt.py recipes (reference,v2)")
    p.add_argument("--gpus", type=comma_list(integer(1), items="world sizes"), default="1,8",
                   help="comma-separated world sizes; the peak of rank 0 is reported (rank 0 owns the most Muon "
                   "matrices)")
    p.add_argument("--phases", type=comma_list(choices=tuple(PHASES)), default="train,warm-up,validation",
                   help="train (train_step at the largest stage), warm-up (warm_up's steps and validation, with "
                   "its copy of the training state), validation (evaluate on one sequence)")
    p.add_argument("--device_gib", type=number(0, lo_open=True), default=H100_GIB,
                   help=f"device memory the headroom is taken from (default {H100_GIB:.1f} GiB: an H100 80GB)")
    p.add_argument("--breakdown", action="store_true", help="also print what is alive at each peak, by kind, "
                   "and the largest storages")
    a = p.parse_args(own)
    recipes, phases, gpus = a.recipes, a.phases, a.gpus
    try:  # the trainer's own refusals (a bad flag after --, a world size that cannot split the batch)
        for recipe in recipes:
            args = T.parse_args([f"--preset={a.preset}", f"--recipe={recipe}", *extra], cuda_available=True)
            for world_size in gpus:
                T.batch_schedule(args, world_size)
    except T.UsageError as e:
        p.error(str(e))
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.perf_counter()
    print(f"torch {torch.__version__}; fake tensors; train_gpt.py --preset={a.preset} --recipe=R "
          f"{' '.join(extra)}".rstrip())
    rows = []
    with flex_attention_on_cpu_tensors():
        for recipe in recipes:
            mode = FakeTensorMode(allow_non_fake_inputs=False)
            with mode:
                scenario = Scenario(a.preset, recipe, extra, mode)
                args, rt = scenario.args, scenario.rt
                print(f"{recipe}: {sum(p.numel() for p in scenario.model.parameters()) / 1e6:.1f}M parameters; "
                      f"{sequences_line(args)}, val_seq_len {args.val_seq_len:,}; attention={rt.attention} "
                      f"fp8_head={rt.fp8_head} compile={rt.compile} chunked_loss={rt.chunked_loss}")
                for world_size in gpus:
                    with fake_world(world_size):
                        for phase in phases:
                            t0 = time.perf_counter()
                            fused, unfused = scenario.measure(world_size, phase)
                            rows.append((recipe, PHASES[phase], world_size, micro_steps(args, world_size, phase),
                                         fused, unfused))
                            print(f"  {PHASES[phase]}, {world_size} GPU(s): {fused.peak / GIB:.1f} GiB "
                                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
                print(f"  graphs compiled: {dict(scenario.graphs)}")
            del scenario, mode
            torch._dynamo.reset()
            gc.collect()
    print()
    print(f"| recipe | phase | GPUs | micro-steps per step | predicted peak GiB | no fusion GiB | "
          f"headroom of {a.device_gib:.1f} GiB |")
    print("|---|---|---|---|---|---|---|")
    for recipe, phase, world_size, steps, fused, unfused in rows:
        print(f"| {recipe} | {phase} | {world_size} | {steps} | {fused.peak / GIB:.1f} | {unfused.peak / GIB:.1f} | "
              f"{a.device_gib - fused.peak / GIB:+.1f} |")
    if a.breakdown:
        print()
        for recipe, phase, world_size, _, fused, _ in rows:
            print(f"{recipe} {phase} {world_size} GPU(s): peak at {fused.peak_at}; {breakdown(fused)} (GiB)")
            for nbytes, made_by in fused.peak_largest:
                print(f"    {nbytes / GIB:6.2f} GiB  {made_by}")
    print(f"\nNot counted: CUDA context (~0.5-1 GiB), NCCL buffers, allocator fragmentation, kernel workspaces. "
          f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
