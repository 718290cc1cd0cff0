"""What torch.compile sees on a GPU, checked on CPU: the full speedrun model (12 layers, FlexAttention
backend, FP8 head) and every other compiled piece traced with fullgraph=True under the aot_eager
backend, so a graph break or an op without a fake kernel fails CI instead of the first GPU run; and
recompilations after warm-up are reported with dynamo's reason."""


import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode

import lifecycle
import train_gpt as T

EOT = T.EOT_TOKEN
SEQ = 512  # shorter than the speedrun's 48K: the graph is the same, only the sizes shrink
VAL_SEQ = 2048  # validation's longer sequence (the speedrun's is 256K)


def speedrun_args(*extra):
    return T.parse_args(["--preset=speedrun", "--recipe=reference", f"--seq_len={SEQ}", f"--val_seq_len={SEQ}", f"--val_tokens={SEQ}",
                         f"--batch_tokens={8 * SEQ}", *extra], cuda_available=True)


def documents(n, starts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (n,), generator=gen)
    tokens[list(starts)] = EOT
    return tokens


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False, **_):
    """torch._scaled_mm's math in fp32 (the e4m3 values are exact in fp32). Some CPUs run the real CPU kernel
    at ~0.03 GFLOP/s, an hour for this test's 1024 x 768 x 50304 head; the trace does not see this kernel
    (the custom op's fake kernel stands in for it), only the numbers compared with eager mode do."""
    return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)


@pytest.mark.parametrize("recipe", [pytest.param("reference", marks=pytest.mark.torch_range), "v2"])
def test_speedrun_model_traces_as_one_graph_with_flex_and_fp8(monkeypatch, recipe):
    """v2 adds every model technique (paired heads' doubled masks, key offset, gates, bigrams with their
    signs, backout, the rescaled softcap) and the three-token loss, whose weights are a tensor input."""
    monkeypatch.setattr(torch, "_scaled_mm", emulated_scaled_mm)
    # a non-zero head, so the FP8 logits matter to the loss; v2's batch stages are not the point here
    args = speedrun_args("--zero_init=false", f"--recipe={recipe}", "--batch_schedule=")
    mtp = [torch.tensor([1.0, 0.5, 0.25])] if recipe == "v2" else []
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16,
                   attention="flex", fp8_head=True, compile="off")
    torch.manual_seed(0)
    model = T.build_model(args, rt)
    assert args.n_layer == 12 and model.lm_head.fp8 == "eager" and isinstance(model.backend, T.FlexAttention)
    model.train()  # the FP8 head is used in training mode only
    tokens = documents(SEQ + 1, [0, 150, 151, 450])
    window = T.window_tensor(3)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():  # FlexAttention's backward has no CPU kernel; the forward graph is the test
        got = compiled(tokens[:-1], tokens[1:], window, *mtp)
        eager = model(tokens[:-1], tokens[1:], window, *mtp)
        # A new window value (or loss weights) is the same graph: tensors, never guarded Python numbers.
        watch = T.RecompileWatch().start()
        compiled(tokens[:-1], tokens[1:], T.window_tensor(7), *[w * 0.5 for w in mtp])
    assert torch.isfinite(got) and abs(got.item() - 10.83 * (1.75 if mtp else 1)) < 1.5, got
    torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-3)
    assert watch.count == 0, watch.drain()



HOST_SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.is_nonzero", "aten.equal")


def graph_ops(gm) -> set[str]:
    return {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}


def host_syncs(gm) -> list[str]:
    """The ops of a graph that read a device value on the host (each a full device sync on a GPU)."""
    return sorted(op for op in graph_ops(gm) if op.startswith(HOST_SYNC_OPS)) + \
        ([".item()"] if ".item(" in gm.code else [])


def as_fake(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """The model with every parameter and buffer replaced by a fake tensor of its shape, dtype and device:
    torch.compile traces it as it would the real one, and no kernel runs (FlexAttention's backward has no
    CPU kernel, and the FP8 head's matmuls take minutes on some CPUs)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(mode.from_tensor(p), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = mode.from_tensor(b)
    return model


def graph_recorder(graphs: dict, kind: str):
    """An AOTAutograd compiler that keeps the graph and runs it as is (here on fake tensors). A host sync fails
    here, by name: run on fake tensors it would fail anyway, with DataDependentOutputException."""
    def compile_graph(gm, example_inputs):
        graphs.setdefault(kind, []).append(gm)
        assert not host_syncs(gm), f"the {kind} graph reads device values on the host: {host_syncs(gm)}"
        return make_boxed_func(gm)
    return compile_graph


@pytest.mark.skipif(lifecycle.torch_release(torch.__version__) < (2, 11), reason="torch 2.10's AOTAutograd refuses fake inputs "
                    "from a FakeTensorMode other than dynamo's (2.11 made dynamo's authoritative); these graphs trace "
                    "under 2.10 from real tensors (docs/supported-torch.md)")
@pytest.mark.parametrize("recipe", [pytest.param("reference", marks=pytest.mark.torch_range), "v2"])
def test_speedrun_forward_backward_and_validation_graphs_have_no_host_sync(monkeypatch, recipe):
    """What AOTAutograd hands the compiler for the full-depth speedrun model: the training forward and
    backward traced jointly, and the validation graph (eval, no grad, the longer sequence), each one graph
    (fullgraph=True). The backward must hold the FP8 head's backward op and FlexAttention's backward, and no
    graph may read a device value on the host. Traced on fake tensors: no kernel runs."""
    import torch.nn.attention.flex_attention as flex_module
    # flex_attention refuses CPU inputs that need grad up front (it has no CPU backward); nothing runs here
    monkeypatch.setattr(flex_module, "_validate_device", lambda *_: None)
    v2_shape = ["--bigram_vocab_size=4096", "--bigram_dim=64"] if recipe == "v2" else []  # fit the narrow stream
    args = speedrun_args(f"--recipe={recipe}", "--batch_schedule=", "--model_dim=128", "--n_head=2", "--head_dim=64",
                         f"--val_seq_len={VAL_SEQ}", f"--val_tokens={VAL_SEQ}", *v2_shape)
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16,
                   attention="flex", fp8_head=True, compile="model")
    mode = FakeTensorMode()
    torch.manual_seed(0)
    model = as_fake(T.build_model(args, rt), mode)
    assert args.n_layer == 12 and model.lm_head.fp8 == "inductor" and isinstance(model.backend, T.FlexAttention)
    graphs: dict[str, list] = {}
    backend = aot_autograd(fw_compiler=graph_recorder(graphs, "forward"),
                           bw_compiler=graph_recorder(graphs, "backward"),
                           inference_compiler=graph_recorder(graphs, "validation"))
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    train_tokens = mode.from_tensor(documents(SEQ + 1, [0, 150, 151, 450]))
    val_tokens = mode.from_tensor(documents(VAL_SEQ + 1, [0, 700, 1500], seed=1))
    mtp = [mode.from_tensor(torch.tensor([1.0, 0.5, 0.25]))] if recipe == "v2" else []
    with mode:
        model.train()
        loss = compiled(train_tokens[:-1], train_tokens[1:], mode.from_tensor(T.window_tensor(3)), *mtp)
        loss.backward()  # AOTAutograd compiles the backward graph on its first call
        assert model.lm_head.weight.grad is not None and model.blocks[0].attn.qkv_w.grad is not None
        model.eval()  # as evaluate() calls it
        with torch.no_grad():
            compiled(val_tokens[:-1], val_tokens[1:], mode.from_tensor(T.window_tensor(7)))
    assert {kind: len(g) for kind, g in graphs.items()} == {"forward": 1, "backward": 1, "validation": 1}, graphs
    forward, backward = graph_ops(graphs["forward"][0]), graph_ops(graphs["backward"][0])
    assert "speedrun.fp8_matmul.default" in forward and "flex_attention" in forward, sorted(forward)
    assert "speedrun.fp8_matmul_backward.default" in backward, sorted(backward)
    assert "flex_attention_backward" in backward, sorted(backward)
    for kind, (gm,) in graphs.items():
        assert not host_syncs(gm), f"{kind} graph reads device values on the host: {host_syncs(gm)}"


@pytest.mark.torch_range
def test_newton_schulz_traces_as_one_graph():
    gen = torch.Generator().manual_seed(1)
    compiled = torch.compile(T.newton_schulz, fullgraph=True, backend="aot_eager", dynamic=False)
    for shape in [(3, 64, 64), (256, 64), (64, 256)]:  # Q/K/V batched, a tall and a wide matrix
        G = torch.randn(*shape, generator=gen)
        assert torch.equal(compiled(G, 5), T.newton_schulz(G, 5))


@pytest.mark.torch_range
def test_fp8_kernels_trace_as_one_graph():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 64, generator=gen).bfloat16()
    w = torch.randn(512, 64, generator=gen) * 0.05
    grad = torch.randn(256, 512, generator=gen).bfloat16() * 1e-4

    def run(backend):
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = T.fp8_matmul(x_, w_, T.FP8_SCALES["x_scale"], T.FP8_SCALES["w_scale"], backend)[0]
        out.backward(grad)
        return out, x_.grad, w_.grad

    assert T.fp8_kernel(T.fp8_forward_math, "eager") is T.fp8_forward_math
    assert T.fp8_kernel(T.fp8_forward_math, "aot_eager") is not T.fp8_forward_math  # the op's insides, compiled
    eager, compiled = run("eager"), run("aot_eager")
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


@pytest.mark.torch_range
def test_loss_traces_as_one_graph():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(128, 50304, generator=gen).bfloat16()
    targets = torch.randint(0, 50257, (128,), generator=gen)
    compiled = torch.compile(T.softcapped_cross_entropy, fullgraph=True, backend="aot_eager", dynamic=False)
    torch.testing.assert_close(compiled(logits, targets, T.Softcap(30.0)), T.softcapped_cross_entropy(logits, targets, T.Softcap(30.0)))


@pytest.mark.torch_range
def test_recompile_after_warmup_is_reported_with_its_reason():
    def scaled(x, factor):
        return x * factor
    compiled = torch.compile(scaled, backend="eager", dynamic=False)
    compiled(torch.ones(4), 2)  # warm-up
    watch = T.RecompileWatch().start()
    compiled(torch.ones(4), 2)
    assert watch.count == 0
    compiled(torch.ones(4), 3)  # a changed Python int is a guard failure
    assert watch.count == 1
    (reason,) = watch.drain()
    assert "scaled" in reason and "factor" in reason, reason
    assert watch.drain() == []


def test_the_fp8_mlp_compiles_as_one_graph_and_matches_eager_bit_for_bit(monkeypatch):
    """Record #89's FP8 MLP under inductor with fullgraph: the autograd.Function and the in-place update of P's
    scale trace; with inductor emulating eager's bf16 roundings (emulate_precision_casts) forward, scale and
    gradients equal eager's exactly, so the remaining difference on a GPU is only inductor's fp32 intermediates
    (which the record, compiling the same math, has as well)."""
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config, "emulate_precision_casts", True)
    args = T.parse_args(["--preset=cpu", "--model_dim=64", "--n_head=2", "--head_dim=32", "--fp8_mlp=true",
                         "--zero_init=false"], False)
    mlps = []
    for _ in range(2):
        torch.manual_seed(0)
        mlps.append(T.MLP(T.ModelConfig.of(args)).train())
        mlps[-1].fp8 = True
        T.quantize_mlp_fp8(mlps[-1], bootstrap=True)
    eager, compiled_mlp = mlps
    compiled = torch.compile(compiled_mlp, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(64, 64, generator=gen).bfloat16()
        g = torch.randn(64, 64, generator=gen).bfloat16()
        xs = [x.clone().requires_grad_() for _ in range(2)]
        outs = [module(xi) for module, xi in zip((eager, compiled), xs)]
        for out in outs:
            out.backward(g)
        assert torch.equal(outs[0], outs[1]) and torch.equal(xs[0].grad, xs[1].grad)
        assert torch.equal(eager.fp8_act_scale, compiled_mlp.fp8_act_scale) and eager.fp8_act_scale.item() != 1.0
        for a, b in zip(eager.parameters(), compiled_mlp.parameters()):
            assert torch.equal(a.grad, b.grad)
