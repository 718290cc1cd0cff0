"""What torch.compile sees on a GPU, checked on CPU: the full speedrun model (12 layers, FlexAttention
backend, FP8 head) and every other compiled piece traced with fullgraph=True under the aot_eager
backend, so a graph break or an op without a fake kernel fails CI instead of the first GPU run; and
recompilations after warm-up are reported with dynamo's reason."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as T  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

EOT = T.EOT_TOKEN
SEQ = 1024  # shorter than the speedrun's 48K: the graph is the same, only the sizes shrink


def speedrun_args(*extra):
    return T.parse_args(["--preset=speedrun", f"--seq_len={SEQ}", f"--val_seq_len={SEQ}", f"--val_tokens={SEQ}",
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


@pytest.mark.parametrize("recipe", ["reference", "v2"])
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
    assert args.n_layer == 12 and model.lm_head.fp8 and model.backend is T.FlexAttention
    model.train()  # the FP8 head is used in training mode only
    tokens = documents(SEQ + 1, [0, 300, 301, 900])
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


def test_newton_schulz_traces_as_one_graph():
    gen = torch.Generator().manual_seed(1)
    compiled = torch.compile(T.newton_schulz, fullgraph=True, backend="aot_eager", dynamic=False)
    for shape in [(3, 64, 64), (256, 64), (64, 256)]:  # Q/K/V batched, a tall and a wide matrix
        G = torch.randn(*shape, generator=gen)
        assert torch.equal(compiled(G, 5), T.newton_schulz(G, 5))


def test_fp8_kernels_trace_as_one_graph():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(256, 64, generator=gen).bfloat16()
    w = torch.randn(512, 64, generator=gen) * 0.05
    grad = torch.randn(256, 512, generator=gen).bfloat16() * 1e-4

    def run():
        x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = T.fp8_matmul(x_, w_, T.FP8_SCALES["x_scale"], T.FP8_SCALES["w_scale"])[0]
        out.backward(grad)
        return out, x_.grad, w_.grad

    eager = run()
    saved = dict(T.FP8_KERNELS)
    try:
        T.compile_fp8_kernels(backend="aot_eager")
        assert T.FP8_KERNELS["forward"] is not T.fp8_forward_math
        compiled = run()
    finally:
        T.FP8_KERNELS.update(saved)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


def test_loss_traces_as_one_graph():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(128, 50304, generator=gen).bfloat16()
    targets = torch.randint(0, 50257, (128,), generator=gen)
    compiled = torch.compile(T.softcapped_cross_entropy, fullgraph=True, backend="aot_eager", dynamic=False)
    torch.testing.assert_close(compiled(logits, targets, T.Softcap(30.0)), T.softcapped_cross_entropy(logits, targets, T.Softcap(30.0)))


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
