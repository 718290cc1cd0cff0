"""Record #89's two additions to attention, checked against slow direct implementations (loops over tokens and
heads, fp64) forward and gradient: gated XSA (exclusive_self_attention, T:1151-1157) and DC head composition
(dc_composition, T:1142-1149, T:1072-1080, DC:253-440)."""

import pytest
import torch

import train_gpt as T

EOT = T.EOT_TOKEN
KEYS = 112  # the record's DC window (T:1147)
DOC_STARTS = (0, 5, 60, 130, 131, 300, 301, 302)  # lengths 1..169: windows cross starts and chunks; 112 bites


def tokens_with_documents(n: int, starts=DOC_STARTS, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (n,), generator=gen)
    tokens[[s for s in starts if s < n]] = EOT
    return tokens


def dc_inputs(n_tokens: int, heads: int, head_dim: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n_tokens, heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k = T.rms_norm(q), T.rms_norm(k)  # as attention sees them: unit rms, so the softmax is not one-hot
    w1 = torch.randn(1, n_tokens, heads, generator=gen, dtype=torch.float64)
    w2 = torch.randn(1, n_tokens, heads, generator=gen, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, w1, w2)]


def slow_dc(q, k, v, w1, w2, docs, keys, scale):
    """§4.6 term by term: W(t) = {s : t - keys < s <= t, same document}; P_h(t, .) the softmax of
    scale * q_h(t).k_h(s) over W(t); A(t, s) = sum_h w1n_h(t) P_h(t, s); out_h(t) = w2_h(t) sum_s A(t, s) v_h(s)."""
    n_tokens, heads = q.size(1), q.size(2)
    w1n = w1[0] / torch.sqrt(w1[0].square().mean(-1, keepdim=True) + 1e-6)
    rows = []
    for t in range(n_tokens):
        window = [s for s in range(max(0, t - keys + 1), t + 1) if docs[s] == docs[t]]
        mix = 0
        for h in range(heads):
            scores = torch.stack([scale * (q[0, t, h] * k[0, s, h]).sum() for s in window])
            mix = mix + w1n[t, h] * torch.softmax(scores, 0)
        rows.append(torch.stack([w2[0, t, h] * (mix[:, None] * v[0, window, h]).sum(0) for h in range(heads)]))
    return torch.stack(rows)[None]


def slow_xsa(y, v, alpha):
    """§4.7 token by token and head by head."""
    out = torch.empty_like(y)
    for t in range(y.size(1)):
        for h in range(y.size(2)):
            yv, vv = y[0, t, h], v[0, t, h]
            projection = (yv * vv).sum() / torch.clamp_min((vv * vv).sum(), 1e-8)
            out[0, t, h] = yv - torch.tanh(alpha[0, t, h]) * projection * vv
    return out


def weighted_grads(out, inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * weights).sum(), inputs)


def test_dc_window_stops_at_document_starts_and_keys():
    """The mask itself, against the window's definition, for every query and every key slot of its band."""
    docs = T.document_ids(tokens_with_documents(512))
    mask = T.dc_window_mask(docs, KEYS, 128)
    for t in range(512):
        c, i = divmod(t, 128)
        allowed = {(c - 1) * 128 + j for j in range(256) if mask[c, 0, i, j]}
        assert allowed == {s for s in range(max(0, t - KEYS + 1), t + 1) if docs[s] == docs[t]}, t


@pytest.mark.parametrize("n_tokens", [256, 384])
def test_dc_matches_the_slow_direct_form_forward_and_gradient(n_tokens):
    """fp64 at 2 and 3 chunks, documents of lengths 1..198 (windows that cross a start stop there)."""
    docs = T.document_ids(tokens_with_documents(n_tokens))
    inputs = dc_inputs(n_tokens, heads=3, head_dim=8)
    scale = 0.12
    fast = T.dc_composition(*inputs, docs, KEYS, scale)
    slow = slow_dc(*inputs, docs, KEYS, scale)
    assert fast.dtype == torch.float64 and fast.shape == (1, n_tokens, 3, 8)
    torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-12)
    for got, want in zip(weighted_grads(fast, inputs), weighted_grads(slow, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dc_runs_forward_and_backward_in_training_dtypes(dtype):
    """bf16 as the record trains (scores and the mix in fp32, w2 * mix cast to bf16 before v), and fp32."""
    docs = T.document_ids(tokens_with_documents(256))
    inputs = dc_inputs(256, heads=2, head_dim=16, dtype=dtype)
    out = T.dc_composition(*inputs, docs, KEYS, 0.12)
    assert out.dtype == dtype
    want = slow_dc(*[t.detach().double() for t in inputs], docs, KEYS, 0.12)
    tolerance = dict(rtol=0.03, atol=0.03) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.double(), want, **tolerance)
    grads = weighted_grads(out, inputs)
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)


def test_dc_is_a_no_op_at_init():
    """w2 = 0 (the record's init) adds exactly zero, whatever w1 and the scores are."""
    docs = T.document_ids(tokens_with_documents(256))
    q, k, v, w1, w2 = dc_inputs(256, heads=3, head_dim=8, dtype=torch.bfloat16)
    out = T.dc_composition(q, k, v, w1, torch.zeros_like(w2), docs, KEYS, 0.12)
    assert torch.equal(out, torch.zeros_like(out))


def test_dc_refuses_a_window_wider_than_its_chunk():
    docs = T.document_ids(tokens_with_documents(256))
    with pytest.raises(ValueError, match="at most 128 keys"):
        T.dc_composition(*dc_inputs(256, 2, 4), docs, 129, 0.1)


def test_xsa_matches_the_slow_direct_form_forward_and_gradient():
    gen = torch.Generator().manual_seed(0)
    y, v = (torch.randn(1, 6, 3, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v[0, 2, 1] = 0  # a zero value vector: the clamp keeps the projection finite (and zero)
    v[0, 3, 2] *= 1e-6  # |v|^2 ~ 1e-11, below the clamp: the projection divides by the record's 1e-8
    alpha = torch.randn(1, 6, 3, generator=gen, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (y, v, alpha)]
    fast, slow = T.exclusive_self_attention(*inputs), slow_xsa(*inputs)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    for got, want in zip(weighted_grads(fast, inputs), weighted_grads(slow, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_xsa_is_a_no_op_at_init_and_keeps_y_dtype():
    gen = torch.Generator().manual_seed(0)
    y, v = (torch.randn(1, 16, 4, 8, generator=gen).bfloat16() for _ in range(2))
    assert torch.equal(T.exclusive_self_attention(y, v, torch.zeros(1, 16, 4)), y)
    out = T.exclusive_self_attention(y, v, torch.ones(1, 16, 4))
    assert out.dtype == torch.bfloat16 and not torch.equal(out, y)


def test_both_trace_as_one_graph_and_match_eager():
    """torch.compile(fullgraph=True) on CPU: no data-dependent Python control flow; forward and backward."""
    torch._dynamo.reset()
    docs = T.document_ids(tokens_with_documents(256))
    inputs = dc_inputs(256, heads=2, head_dim=8, dtype=torch.float32)
    alpha = torch.randn(1, 256, 2, requires_grad=True)

    def both(q, k, v, w1, w2, alpha):
        y = T.dc_composition(q, k, v, w1, w2, docs, KEYS, 0.12)
        return T.exclusive_self_attention(y, v, alpha)

    compiled = torch.compile(both, fullgraph=True, backend="aot_eager", dynamic=False)
    args = [*inputs, alpha]
    got, want = compiled(*args), both(*args)
    torch.testing.assert_close(got, want)
    for g, w in zip(weighted_grads(got, args), weighted_grads(want, args), strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()
