"""The model against the recipe: shapes, initial loss, layer roles, attention masks, backends, FP8 head, training."""

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt as T
from conftest import needs_cuda

EOT = T.EOT_TOKEN
BLOCK = T.BLOCK_SIZE


def small_args(*extra):
    return T.parse_args(["--preset=cpu", "--n_layer=2", "--model_dim=64", "--n_head=2", "--head_dim=32",
                         "--seq_len=1024", "--val_seq_len=1024", "--val_tokens=1024", *extra], False)


def tokens_with_docs(n, eot_positions, seed=0, vocab=T.EOT_TOKEN):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n,), generator=gen)  # below EOT: no accidental document starts
    tokens[list(eot_positions)] = EOT
    return tokens


# ----------------------------------------------------------------------------- shape and initial loss

def test_speedrun_parameter_count():
    with torch.device("meta"):
        model = T.GPT(T.ModelConfig.of(T.parse_args(["--preset=speedrun", "--recipe=reference"], False)))
    d, vocab, padded, layers = 768, 50257, 50304, 12
    embeddings = 4 * vocab * d  # token embedding + 3 value embeddings
    head = padded * d
    mlp = layers * (2 * 4 * d * d + 2)  # c_fc + c_proj, plus the block's 2 mixing lambdas (x, x0)
    ve_layers = 6  # layers 0,1,2 and 9,10,11 use value embeddings: 2 lambdas each; the other 5 attention layers 1
    attention = 11 * (3 * d * d + d * d) + ve_layers * 2 + (11 - ve_layers) * 1
    skips = 6
    expected = embeddings + head + mlp + attention + skips
    assert expected == 275_598_383  # 154,389,504 + 38,633,472 + 56,623,128 + 25,952,273 + 6
    assert sum(p.numel() for p in model.parameters()) == expected
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["lm_head.weight"] == (50304, 768) and shapes["embed.weight"] == (50257, 768)
    assert shapes["blocks.0.attn.qkv_w"] == (3, 768, 768) and shapes["blocks.0.mlp.c_fc.weight"] == (3072, 768)
    assert "blocks.7.attn.qkv_w" not in shapes and shapes["skip_weights"] == (6,)


def test_fresh_model_loss_is_log_vocab():
    args = small_args("--seq_len=256")
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(args))
    tokens = torch.randint(0, args.vocab_size, (257,), generator=torch.Generator().manual_seed(1))
    tokens[[0, 40, 130]] = EOT
    with torch.no_grad():
        loss = model(tokens[:-1], tokens[1:], T.window_tensor(1))
    # zero-init head -> logits 0 -> softcap 30*sigmoid(0) = 15 for all 50304 -> uniform distribution
    assert loss.item() == pytest.approx(math.log(50304), abs=1e-4)
    assert model.lm_head.weight.shape[0] == 50304  # the vocabulary padded to a multiple of 128: log(50304) is the loss


def test_initialisation_follows_recipe():
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(small_args()))
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            assert torch.count_nonzero(p) == 0, name  # output projections and head are zero
    w = model.blocks[0].mlp.c_fc.weight  # uniform with std 0.5/sqrt(fan_in)
    assert w.std().item() == pytest.approx(0.5 / math.sqrt(64), rel=0.02)
    assert w.abs().max().item() <= math.sqrt(3) * 0.5 / math.sqrt(64) + 1e-7
    assert model.blocks[0].lambdas.tolist() == [1.0, 0.0] and model.blocks[0].attn.lambdas.tolist() == [0.5, 0.5]
    # 2025-12-29_VeSkipGates: a gated value embedding enters at the gate's weight alone (lambda 1), v at 0.5
    assert T.GPT(T.ModelConfig.of(small_args("--ve_gates=true"))).blocks[0].attn.lambdas.tolist() == [0.5, 1.0]


# ----------------------------------------------------------------------------- layer roles

def test_layer_roles_twelve_layers():
    r = T.LayerRoles.for_depth(12, True)
    assert r.value_embed == (0, 1, 2, None, None, None, None, None, None, 0, 1, 2)
    assert r.attention == tuple(i != 7 for i in range(12))
    assert "".join("L" if x else "S" for x in r.long_window) == "LSSSLSSLSSSL"
    assert (r.n_encoder, r.n_value_embeds) == (6, 3)
    assert T.LayerRoles.for_depth(12, False).value_embed == (None,) * 12


@pytest.mark.parametrize("depth", [2, 4, 6, 8, 16])
def test_layer_roles_other_depths_are_sensible(depth):
    r = T.LayerRoles.for_depth(depth, True)
    enc = depth // 2
    assert r.n_encoder == enc and len(r.value_embed) == len(r.attention) == len(r.long_window) == depth
    # value embeddings: the same tables, in the same order, at the start and at the end; none in the middle
    n = r.n_value_embeds
    assert n == min(3, enc)
    assert r.value_embed[:n] == tuple(range(n)) == r.value_embed[depth - n:]
    assert all(v is None for v in r.value_embed[n:depth - n])
    # windows mirror around the middle, and the first and last layers see the long window
    assert r.long_window == r.long_window[::-1] and r.long_window[0]
    # at most one layer without attention, never in the encoder
    off = [i for i, a in enumerate(r.attention) if not a]
    assert len(off) <= 1 and all(i >= enc for i in off)


def test_layer_roles_six_layers():
    r = T.LayerRoles.for_depth(6, True)
    assert r.value_embed == (0, 1, 2, 0, 1, 2)
    assert r.attention == (True, True, True, True, False, True)
    assert r.long_window == (True, False, False, False, False, True)


# ----------------------------------------------------------------------------- masks

def reference_mask(tokens, window):
    """The rule from the recipe, by brute force: causal, same document, q_block - k_block < window."""
    toks = tokens.numpy()
    n = len(toks)
    doc = np.zeros(n, dtype=np.int64)
    current = 0
    for i in range(n):
        if toks[i] == EOT:
            current += 1
        doc[i] = current
    mask = np.zeros((n, n), dtype=bool)
    for q in range(n):
        k = np.arange(q + 1)  # causal: keys up to and including q
        mask[q, :q + 1] = (doc[k] == doc[q]) & (q // BLOCK - k // BLOCK < window)
    return torch.from_numpy(mask)


def mask_from_block_mask(bm, n):
    """Element-wise mask a BlockMask stands for: full blocks true, partial blocks by mask_mod, others false."""
    nb = n // BLOCK
    q_idx = torch.arange(n)[:, None]
    kv_idx = torch.arange(n)[None, :]
    mod = bm.mask_mod(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
    out = torch.zeros(n, n, dtype=torch.bool)
    kinds = torch.zeros(nb, nb, dtype=torch.int64)  # 0 absent, 1 partial, 2 full
    assert bm.kv_num_blocks.shape == (1, 1, nb) and bm.kv_indices.shape[-2] == nb
    for qb in range(nb):
        for kind, counts, indices in ((1, bm.kv_num_blocks, bm.kv_indices), (2, bm.full_kv_num_blocks,
                                                                               bm.full_kv_indices)):
            listed = indices[0, 0, qb, :int(counts[0, 0, qb])].tolist()
            assert len(set(listed)) == len(listed)
            for kb in listed:
                assert kinds[qb, kb] == 0, "a block is listed twice (partial and full)"
                kinds[qb, kb] = kind
                rows, cols = slice(qb * BLOCK, (qb + 1) * BLOCK), slice(kb * BLOCK, (kb + 1) * BLOCK)
                out[rows, cols] = True if kind == 2 else mod[rows, cols]
    return out, kinds


def layouts(n, seed):
    rng = np.random.default_rng(seed)
    yield "one document", [0]
    yield "no EOT at all", []
    yield "boundary inside a block and at a block edge", [0, 200, 256, 257] if n > 257 else [0, 77]
    yield "long document then short ones", [0, n // 2 + 5, n // 2 + 9] if n > 128 else [0, 100]
    yield "random", sorted(set(rng.choice(n, size=max(1, n // 150), replace=False).tolist()))


@pytest.mark.torch_range
@pytest.mark.parametrize("n", [128, 384, 1024])
def test_block_mask_and_dense_mask_match_brute_force(n):
    for name, eots in layouts(n, seed=n):
        tokens = tokens_with_docs(n, eots, seed=n)
        for window in (1, 2, 3, n // BLOCK + 2):
            w = torch.tensor(window)
            ref = reference_mask(tokens, window)
            dense = T.sliding_window_mask(tokens, w)
            assert dense.dtype == torch.bool and torch.equal(dense, ref), (name, window)
            bm = T.sliding_window_block_mask(tokens, w)
            from_blocks, kinds = mask_from_block_mask(bm, n)
            assert torch.equal(from_blocks, ref), (name, window)
            # sparsity: a full block really is all-true, a listed block has something allowed, an absent one none
            ref_blocks = ref.view(n // BLOCK, BLOCK, n // BLOCK, BLOCK)
            any_true, all_true = ref_blocks.any(dim=(1, 3)), ref_blocks.all(dim=(1, 3))
            assert torch.equal(kinds > 0, any_true), (name, window)
            assert torch.equal(kinds == 2, all_true), (name, window)  # every all-true block skips mask_mod


def test_window_limits_reach_and_documents_split():
    n = 1024
    tokens = tokens_with_docs(n, [0, 600])
    mask = T.sliding_window_mask(tokens, torch.tensor(2))
    assert mask[599, 384] and not mask[599, 383] and mask[599, 599]  # q block 4 sees blocks 3-4 only
    assert not mask[700, 599] and mask[700, 600]  # the new document starts at its EOT
    assert not mask[10, 11]


# ----------------------------------------------------------------------------- attention backends

def attention_inputs(n, heads=2, dim=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, heads, dim, generator=gen).to(dtype) for _ in range(3)]


def reference_attention(q, k, v, mask, scale):
    """Softmax attention in float64 with -inf outside the mask."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backends_agree(dtype, tol):
    n = 1024
    tokens = tokens_with_docs(n, [0, 130, 500, 501, 777])
    q, k, v = attention_inputs(n, dtype=dtype)
    for window in (1, 3, 9):
        w = torch.tensor(window)
        banded = T.BandedAttention.attend(q, k, v, T.BandedAttention.build_mask(tokens, w), 0.12)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            flex = T.FlexAttention().attend(q, k, v, T.FlexAttention.build_mask(tokens, w), 0.12)
        ref = reference_attention(q, k, v, reference_mask(tokens, window), 0.12)
        assert banded.shape == flex.shape == q.shape and banded.dtype == flex.dtype == dtype
        torch.testing.assert_close(banded.double(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(flex.double(), ref, atol=tol, rtol=tol)
        torch.testing.assert_close(flex, banded, atol=tol, rtol=tol)


def test_attention_gradient_does_not_leak():
    n = 512
    tokens = tokens_with_docs(n, [0, 100, 300, 301])
    for window in (1, 2):
        mask = T.BandedAttention.build_mask(tokens, torch.tensor(window))
        allowed = reference_mask(tokens, window)
        q, k, v = (t.requires_grad_() for t in attention_inputs(n, seed=window))
        y = T.BandedAttention.attend(q, k, v, mask, 0.12)
        for pos in (99, 100, 299, 300, 301, 383, 384, 511):
            q.grad = k.grad = v.grad = None
            y[0, pos].sum().backward(retain_graph=True)
            touched_v = v.grad[0].abs().sum(dim=(-2, -1)) != 0
            touched_k = k.grad[0].abs().sum(dim=(-2, -1)) != 0
            assert torch.equal(touched_v, allowed[pos]), (window, pos)  # zero exactly where not allowed
            assert not (touched_k & ~allowed[pos]).any(), (window, pos)
            if allowed[pos].sum() > 1:  # with a single key the softmax is constant: no gradient to k at all
                assert torch.equal(touched_k, allowed[pos]), (window, pos)
            touched_q = q.grad[0].abs().sum(dim=(-2, -1)) != 0
            assert not touched_q[torch.arange(n) != pos].any()


def dense_from_banded(bm, n):
    """Element-wise (n, n) mask a BandedMask stands for: query block i's band is keys (i-W+1)*128 ..."""
    out = torch.zeros(n, n, dtype=torch.bool)
    width = bm.band_blocks * BLOCK
    for lo, hi, allowed in bm.chunks:
        assert allowed.shape == (hi - lo, 1, BLOCK, width)
        for qb in range(lo, hi):
            first = (qb - bm.band_blocks + 1) * BLOCK
            keep = slice(max(0, -first), width)  # keys left of the sequence are padding
            out[qb * BLOCK:(qb + 1) * BLOCK, max(first, 0):first + width] = allowed[qb - lo, 0][:, keep]
            assert not allowed[qb - lo, 0][:, :max(0, -first)].any(), "a padding key is allowed"
    return out


def banded_cases(seed=0):
    """(n, EOT positions, window): windows shorter than a document, documents longer than the window,
    one-block windows, windows wider than the sequence, and documents that start inside the band."""
    rng = np.random.default_rng(seed)
    yield 1024, [0, 130, 500, 501, 777], 1
    yield 1024, [0], 3  # one 1024-token document, a 384-token window
    yield 512, [0, 100, 300, 301], 2
    yield 384, [0, 200], 9  # window wider than the sequence
    yield 256, list(range(128, 256)), 1  # every token of block 1 starts a document: each sees only itself
    for _ in range(6):
        n = int(rng.choice([256, 640, 1024]))
        eots = sorted(set(rng.choice(n, size=int(rng.integers(1, 12)), replace=False).tolist()))
        yield n, eots, int(rng.integers(1, n // BLOCK + 3))


@pytest.mark.parametrize("chunk_keys", [T.BAND_CHUNK_KEYS, 384, 1])
def test_banded_mask_matches_brute_force(chunk_keys):
    for n, eots, window in banded_cases():
        tokens = tokens_with_docs(n, eots, seed=n)
        bm = T.banded_window_mask(tokens, torch.tensor(window), chunk_keys)
        assert bm.band_blocks == min(window, n // BLOCK)
        assert torch.equal(dense_from_banded(bm, n), reference_mask(tokens, window)), (n, eots, window)
        # O(T * W): the masks hold exactly one band per query block, never a (T, T) square
        assert sum(m.numel() for _, _, m in bm.chunks) == n * bm.band_blocks * BLOCK


@pytest.mark.parametrize("chunk_keys", [T.BAND_CHUNK_KEYS, 256])
def test_banded_attention_and_gradients_match_dense(chunk_keys):
    """float64 banded attention vs float64 dense softmax attention over the brute-force mask: outputs and
    the gradients to q, k and v agree to rounding, and nothing is NaN (every query sees itself)."""
    for n, eots, window in banded_cases(seed=1):
        tokens = tokens_with_docs(n, eots, seed=n)
        q, k, v = (t.double().requires_grad_() for t in attention_inputs(n, seed=window))
        y = T.banded_attention(q, k, v, T.banded_window_mask(tokens, torch.tensor(window), chunk_keys), 0.12)
        ref = reference_attention(q, k, v, reference_mask(tokens, window), 0.12)
        torch.testing.assert_close(y, ref, atol=1e-12, rtol=1e-10)
        grad = torch.randn_like(y)
        got = torch.autograd.grad(y, (q, k, v), grad)
        want = torch.autograd.grad(ref, (q, k, v), grad)
        for a, b in zip(got, want):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def reachable(tokens, long_window, roles):
    """Which inputs can influence each output through every attention layer (product of boolean masks)."""
    n = tokens.numel()
    reach = torch.eye(n, dtype=torch.bool)
    for has_attention, is_long in zip(roles.attention, roles.long_window):
        if has_attention:
            window = long_window if is_long else max(1, long_window // 2)
            m = reference_mask(tokens, window).double()
            reach = (m @ reach.double()) > 0
    return reach


@pytest.mark.parametrize("n_layer, window, far", [(2, 1, 384), (4, 2, 256)])
def test_model_gradient_does_not_cross_documents_or_windows(n_layer, window, far):
    """The loss at one position, back to the token embeddings: exactly zero gradient outside what the
    attention layers can reach (every layer's mask composed), nonzero inside. Zero-init output projections
    would make every cross-position gradient zero, so they are initialised randomly here."""
    args = small_args(f"--n_layer={n_layer}", "--seq_len=512", "--zero_init=false", "--dtype=fp32")
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(args))
    tokens = tokens_with_docs(513, [0, 450, 451, 470])  # one 450-token document over 4 blocks, then short ones
    reach = reachable(tokens[:-1], window, model.roles)
    # what the layout puts in play: 2 layers x window 1 reach back to 384 (same block), 4 layers with
    # long 2 / short 1 / short 1 / no attention reach one block back, to 256; documents cut everything else
    assert reach[440, far] and not reach[440, far - 1] and reach[449, 449 - 449 % BLOCK]
    assert not reach[460, :451].any() and reach[460, 451] and not reach[450, :450].any()
    captured = []

    def keep_embedding_output(module, inputs, out):  # returns None: the output itself is unchanged
        out.retain_grad()
        captured.append(out)
    model.embed.register_forward_hook(keep_embedding_output)
    for pos in (440, 460, 511):
        captured.clear()
        targets = torch.full((512,), -100)
        targets[pos] = tokens[pos + 1]  # the loss of this one position (cross_entropy ignores -100)
        model(tokens[:-1], targets, T.window_tensor(window)).backward()
        touched = captured[0].grad.abs().sum(-1) != 0
        assert not (touched & ~reach[pos]).any(), (pos, torch.nonzero(touched & ~reach[pos]).flatten()[:10])
        assert touched[pos] and touched.sum() >= 0.95 * reach[pos].sum(), pos


# ----------------------------------------------------------------------------- chunked head + loss (CPU)

@pytest.mark.parametrize("softcap, n, ignored, weights", [
    (T.Softcap(30.0), 1280, (), None), (T.Softcap(0.0), 512, (), None), (T.Softcap(30.0), 640, (3, 600, 601), None),
    (T.Softcap(23.0, 7.5, 5.0), 640, (3,), None),  # 2025-12-26_LogitRescale
    (T.Softcap(23.0, 7.5, 5.0), 1280, (3, 700), [1.0, 0.5, 0.125]),  # three-token prediction
    (T.Softcap(30.0), 640, (), [1.0, 0.0])])  # a weight that has decayed to zero
def test_chunked_head_loss_matches_plain_loss(softcap, n, ignored, weights):
    """ChunkedHeadLoss (several chunks, a ragged last one, ignored targets, one or several target columns)
    against the plain softcapped_cross_entropy / multi_token_cross_entropy of F.linear(h, w.type_as(h)) with
    autograd: loss and both gradients."""
    gen = torch.Generator().manual_seed(n)
    h0 = T.rms_norm(torch.randn(n, 64, generator=gen)).bfloat16()
    w0 = torch.randn(1024, 64, generator=gen) * 0.3  # logits of a few units: the softcap matters
    targets = torch.randint(0, 1024, (n,), generator=gen)
    targets[list(ignored)] = -100
    if weights is not None:
        targets[[10, 500]] = EOT % 1024  # not an EOT id here: the columns are built by hand below
        weights = torch.tensor(weights)
        targets = torch.stack([F_pad(targets, k) for k in range(len(weights))], dim=1)
    results = []
    for chunked in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if chunked:
            loss = T.chunked_head_loss(h, w, targets, softcap, T.softcapped_cross_entropy_chunk, weights)
        elif weights is None:
            loss = T.softcapped_cross_entropy(torch.nn.functional.linear(h, w.type_as(h)), targets, softcap)
        else:
            loss = T.multi_token_cross_entropy(torch.nn.functional.linear(h, w.type_as(h)), targets, weights, softcap)
        (2.5 * loss).backward()  # a non-unit upstream gradient must scale both gradients
        results.append((loss.detach(), h.grad.float(), w.grad))
    (plain, plain_gh, plain_gw), (chunk, chunk_gh, chunk_gw) = results
    assert chunk.dtype == torch.float32
    torch.testing.assert_close(chunk, plain, atol=1e-5, rtol=1e-6)
    assert rel_err(chunk_gh, plain_gh) < 1e-2 and rel_err(chunk_gw, plain_gw) < 1e-2  # bf16 rounding
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(T.chunked_head_loss(h0, w0, targets, softcap, T.softcapped_cross_entropy_chunk,
                                                       weights), plain, atol=1e-5, rtol=1e-6)


def F_pad(targets, k):
    """targets shifted k places left, -100 past the end."""
    return torch.cat([targets[k:], torch.full((k,), -100)])


@pytest.mark.torch_range
def test_validation_scores_the_head_a_chunk_at_a_time_on_every_path(monkeypatch):
    """GPU path (chunked_loss off): in eval mode without grad the head + loss still goes a chunk of rows at a
    time, so a 262K-token validation sequence never holds its 26 GB of logits; the loss is the plain one."""
    assert [s.stop - s.start for s in T.head_chunks(262144)] == [8192] * 32  # bigger chunks, never more than 32
    assert [s.stop - s.start for s in T.head_chunks(2048)] == [512] * 4  # the CPU's validation: unchanged
    args = small_args("--seq_len=256", "--zero_init=false")
    tokens = tokens_with_docs(1025, [0, 90, 700])
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(args), loss=T.LossPath(chunked=False)).eval()
    with torch.no_grad():
        plain = T.softcapped_cross_entropy(model.logits(tokens[:-1], T.window_tensor(4)), tokens[1:], model.softcap)
        chunks = []
        monkeypatch.setattr(T, "head_chunks", lambda n: chunks.append(n) or [slice(lo, lo + 256) for lo in range(0, n, 256)])
        monkeypatch.setattr(model, "logits", None)  # the whole-sequence logits must not be made
        got = model(tokens[:-1], tokens[1:], T.window_tensor(4))
    assert chunks == [1024]
    assert got.item() == pytest.approx(plain.item(), abs=1e-5)


# ----------------------------------------------------------------------------- bad input

def test_bad_model_input_refused():
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(small_args("--seq_len=256")))
    ok = torch.randint(0, 50257, (256,))
    with pytest.raises(T.UsageError, match="sequence length 200 is not a multiple of the 128-token block"):
        model(ok[:200], ok[:200], T.window_tensor(1))
    bad = ok.clone()
    bad[17] = 50257
    with pytest.raises(T.UsageError, match=r"token id 50257 is outside the vocabulary \[0, 50257\)"):
        model(bad, ok, T.window_tensor(1))
    bad[17] = -3
    with pytest.raises(T.UsageError, match="token id -3"):
        model(bad, ok, T.window_tensor(1))
    with pytest.raises(T.UsageError, match="window of 0 blocks is below one 128-token block"):
        model(ok, ok, T.window_tensor(0))


def test_target_outside_vocab_refused():
    """Targets are token ids too. An id in [50257, 50304) silently trains a padding logit; one >= 50304 is a
    device-side assert on CUDA. (-100, cross_entropy's ignore_index, stays usable: the leak test uses it.)"""
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(small_args("--seq_len=256")))
    ok = torch.randint(0, 50257, (256,))
    targets = ok.clone()
    targets[5] = 50300
    with pytest.raises(T.UsageError, match="50300"):
        model(ok, targets, T.window_tensor(1))


# ----------------------------------------------------------------------------- FP8 head (CPU numerics)

def fp8_case(n=256, d=128, vocab=512, seed=0):
    """Realistic magnitudes: rms-normed activations, 0.02-std weights, gradients of a mean loss (~1/n)."""
    gen = torch.Generator().manual_seed(seed)
    x = T.rms_norm(torch.randn(n, d, generator=gen)).bfloat16()
    w = torch.randn(vocab, d, generator=gen) * 0.02
    grad = torch.randn(n, vocab, generator=gen) / n
    return x, w, grad


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.torch_range
def test_fp8_matmul_matches_fp32_within_fp8_rounding():
    """Bounds from the formats: round-to-nearest with m mantissa bits has relative error uniform in
    +-2^-(m+1) of the binade, ~2^-m/sqrt(12) * 0.72 rms (the 0.72 averages over the position in the binade):
    2.6% for e4m3 (m=3), 5.2% for e5m2 (m=2). A dot product of independent terms keeps that relative
    size in norm: forward (x and w both e4m3) ~3.7%, backward (e5m2 gradient times an e4m3 operand) ~5.8%.
    Measured 3.8% forward, 5.9% for both gradients. Bounds: 0.1 forward, 0.15 backward (2.5x), far below
    what a wrong scale does (a factor of 2 anywhere is a 50-100% error)."""
    x, w, grad = fp8_case()
    s = T.FP8_SCALES
    assert s == dict(x_scale=2.0, w_scale=2.0 ** 9, grad_scale=2.0 ** 19)
    x_ = x.clone().requires_grad_()
    w_ = w.clone().requires_grad_()
    out, x_f8, w_f8 = T.fp8_matmul(x_, w_, s["x_scale"], s["w_scale"], "eager")
    assert out.dtype == torch.bfloat16 and out.shape == (256, 512)
    assert x_f8.dtype == w_f8.dtype == torch.float8_e4m3fn
    assert torch.equal(x_f8.float(), (x.float() * 2).to(torch.float8_e4m3fn).float())  # scaled before the cast
    out.backward(grad)
    x_ref = x.float().requires_grad_()
    w_ref = w.clone().requires_grad_()
    ref = x_ref @ w_ref.T
    ref.backward(grad)
    assert w_.grad.dtype == torch.float32 and x_.grad.shape == x.shape
    e_out, e_gx, e_gw = rel_err(out, ref), rel_err(x_.grad, x_ref.grad), rel_err(w_.grad, w_ref.grad)
    assert e_out < 0.1 and e_gx < 0.15 and e_gw < 0.15, (e_out, e_gx, e_gw)
    assert e_out > 1e-3  # and it really went through 8-bit floats


@pytest.mark.torch_range
def test_fp8_matmul_opcheck():
    x, w, grad = fp8_case(n=32, d=64, vocab=128)
    torch.library.opcheck(T.fp8_matmul, (x, w, 2.0, 2.0 ** 9, "eager"))
    x_f8, w_f8 = (x * 2).to(torch.float8_e4m3fn), (w * 2 ** 9).to(torch.float8_e4m3fn)
    # test_schema is left out for the backward op: its mutation check compares the float8 inputs with
    # torch.allclose, which is not implemented for float8 on CPU (a limitation of opcheck, not of the op)
    torch.library.opcheck(T.fp8_matmul_backward, (grad.bfloat16(), x_f8, w_f8, 2.0, 2.0 ** 9, 2.0 ** 19, "eager"),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


class TinyHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = T.CastedLinear(64, 256, fp8="eager")

    def forward(self, x):
        return torch.nn.functional.cross_entropy(self.head(T.rms_norm(x)).float(), torch.arange(x.size(0)) % 256)


def test_fp8_head_compiles_forward_and_backward():
    """Inductor on CPU compiles the custom ops' fake impls and the registered autograd (about 18 s cold on
    two cores, ~2 s with a warm inductor cache); the result matches eager."""
    torch.manual_seed(0)
    module = TinyHead().train()
    with torch.no_grad():
        module.head.weight.normal_(std=0.02)
    x = torch.randn(128, 64).bfloat16()
    eager_x = x.clone().requires_grad_()
    eager = module(eager_x)
    eager.backward()
    eager_grad_w = module.head.weight.grad.clone()
    module.head.weight.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    comp_x = x.clone().requires_grad_()
    loss = compiled(comp_x)
    loss.backward()
    torch.testing.assert_close(loss, eager, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(comp_x.grad, eager_x.grad, atol=1e-3, rtol=2e-2)
    torch.testing.assert_close(module.head.weight.grad, eager_grad_w, atol=1e-4, rtol=2e-2)
    module.eval()  # evaluation uses the plain matmul: exact against F.linear
    with torch.no_grad():
        plain = torch.nn.functional.linear(T.rms_norm(x), module.head.weight.bfloat16())
        assert torch.equal(module.head(T.rms_norm(x)), plain)


# ----------------------------------------------------------------------------- training

def test_small_model_learns_synthetic_documents():
    args = small_args("--seq_len=256", "--dtype=fp32", "--num_iterations=10")
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32,
                   attention="banded", fp8_head=False, compile="off")
    torch.manual_seed(0)
    model = T.build_model(args, rt)
    opt = T.build_optimizers(model, args, rank=0, world_size=1)
    document = [EOT] + [(37 * i) % 1000 + 5 for i in range(1, 16)]  # a fixed 16-token document, repeated
    stream = torch.tensor(document * 40)
    losses = []
    for step in range(args.num_iterations):
        seq = stream[(step * 48) % 160:][:257]  # a different offset each step
        opt.sync.arm(True)
        loss = model(seq[:-1], seq[1:], torch.tensor(T.attention_windows(step, args)))
        loss.backward()
        opt.step(T.lr_multiplier(step, args.num_iterations, args.cooldown_frac, args.lr_final_frac),
                 T.muon_momentum(step, args.muon_momentum_warmup_steps, args.muon_momentum_start,
                                 args.muon_momentum), 1)
        model.zero_grad(set_to_none=False)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(50304), abs=1e-3)
    assert losses[-1] < 6.0, losses  # measured 3.73 after 9 updates
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


# ----------------------------------------------------------------------------- GPU only

@pytest.mark.torch_range
@needs_cuda("FlexAttention's compiled backward runs only on GPU")
def test_flex_attention_compiled_matches_banded_on_cuda():
    device = torch.device("cuda")
    n = 4096
    tokens = tokens_with_docs(n, [0, 700, 701, 2000, 2100, 3333]).to(device)
    attend = torch.compile(T.FlexAttention().attend)
    for window in (1, 3, 14):
        w = torch.tensor(window, device=device)
        inputs = [t.to(device).requires_grad_() for t in attention_inputs(n, heads=6, dim=128,
                                                                           dtype=torch.bfloat16, seed=window)]
        flex = attend(*inputs, T.FlexAttention.build_mask(tokens, w), 0.12)
        flex.float().square().sum().backward()
        flex_grads = [t.grad.clone() for t in inputs]
        for t in inputs:
            t.grad = None
        banded = T.BandedAttention.attend(*inputs, T.BandedAttention.build_mask(tokens, w), 0.12)
        banded.float().square().sum().backward()
        torch.testing.assert_close(flex, banded, atol=2e-2, rtol=2e-2)
        for a, b in zip(flex_grads, (t.grad for t in inputs)):
            assert rel_err(a, b) < 2e-2


@pytest.mark.torch_range
@needs_cuda("compute capability >= 8.9 for torch._scaled_mm FP8 kernels",
            torch.cuda.is_available() and T.fp8_supported(torch.device("cuda")))
def test_fp8_head_matches_bf16_on_cuda():
    x, w, grad = (t.cuda() for t in fp8_case(n=1024, d=768, vocab=50304))
    x_ = x.clone().requires_grad_()
    w_ = w.clone().requires_grad_()
    out = T.fp8_matmul(x_, w_, 2.0, 2.0 ** 9, "eager")[0]
    out.backward(grad)
    x_ref = x.clone().requires_grad_()
    w_ref = w.clone().requires_grad_()
    ref = x_ref @ w_ref.bfloat16().T
    ref.backward(grad.bfloat16())
    assert rel_err(out, ref) < 0.1 and rel_err(x_.grad, x_ref.grad) < 0.15 and rel_err(w_.grad, w_ref.grad) < 0.15


@pytest.mark.torch_range
@needs_cuda("a 48K-token speedrun-shape step compiled with FlexAttention")
def test_speedrun_model_compiled_step_on_cuda(monkeypatch):
    args = T.parse_args(["--preset=speedrun", "--recipe=reference"], cuda_available=True)
    device = torch.device("cuda")
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=device, dtype=torch.bfloat16, attention="flex",
                   fp8_head=T.fp8_supported(device), compile="model")
    torch.manual_seed(0)
    model = T.build_model(args, rt)
    compiled = torch.compile(model, dynamic=False)
    tokens = tokens_with_docs(args.seq_len + 1, range(0, args.seq_len, 3000)).to(device)
    loss = compiled(tokens[:-1], tokens[1:], torch.tensor(T.attention_windows(900, args), device=device))
    loss.backward()
    assert loss.item() == pytest.approx(math.log(50304), abs=1e-2)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.lm_head.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- track 2's model (the medium preset)

def tiny_medium(*extra):
    """The medium preset's model flags at a tiny shape (4 layers, two nested skips as the record's)."""
    return T.parse_args(["--preset=medium", "--compile=off", "--n_layer=4", "--model_dim=64", "--n_head=2",
                         "--head_dim=32", "--value_embed_tables=2", "--skip_connections=1>2,0>3", "--batch_sequences=0",
                         "--seq_len=256",
                         "--val_seq_len=256", "--val_tokens=256", *extra], False)


def test_the_medium_model_has_the_records_tables_matrices_and_small_parameters():
    """M's GPT at world size 8 has 613,420,440 parameters: 8 tables of 50,304 x 1,024, 48 hidden matrices and
    3,480 gates and scalars, 3 of them the padding of its `scalars` vector (never read). Ours: the same less those 3."""
    with torch.device("meta"):
        model = T.GPT(T.ModelConfig.of(T.parse_args(["--preset=medium"], False)))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tables = [n for n, s in shapes.items() if s == (50304, 1024)]
    assert sorted(tables) == sorted(["embed.weight", "embed2.weight", "lm_head.weight",
                                     *(f"value_embeds.{k}.weight" for k in range(5))])
    hidden = [n for n in shapes if n.endswith(("qkv_w", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"))]
    assert sum(math.prod(shapes[n]) for n in hidden) == 48 * 4 * 1024 * 1024  # M: 16 x (qkvo_w, c_fc, c_proj)
    small = {n: s for n, s in shapes.items() if n not in tables and n not in hidden}
    per_layer = {"attn.attn_gate": (8, 16), "attn.lambdas": (2,), "lambdas": (1,), "x0_lambda": (1,),
                 "x02_lambda": (1,)}
    want = {"skip_lambdas": (3,), "skip_gate": (3, 16), "smear_gate": (1, 16), "smear_lambda": (1,),
            "backout_lambda": (1,), **{f"blocks.{i}.{n}": s for i in range(16) for n, s in per_layer.items()},
            **{f"blocks.{i}.attn.ve_gate": (8, 16) for i in (0, 1, 2, 3, 4, 11, 12, 13, 14, 15)}}
    assert small == want
    assert sum(math.prod(s) for s in small.values()) == 3480 - 3
    assert sum(p.numel() for p in model.parameters()) == 613_420_440 - 3
    assert model.skips == ((6, 9), (4, 10), (2, 11))


def test_the_medium_initialisation_is_the_records():
    """M L935-936 (Q, K, V uniform, bound sqrt(3/dim)), L1073 (head N(0, 0.005)), L1062-1063 (value tables zero),
    L1079 (embed2 N(0, 1)), L1092-1096 (lambdas: stream 1.05, v 0.5, output 1.0, skips -1.5), gates 16 wide."""
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(tiny_medium("--model_dim=256", "--n_head=2", "--head_dim=128")))
    qkv = model.blocks[0].attn.qkv_w
    assert qkv.abs().max().item() <= math.sqrt(3) / math.sqrt(256) + 1e-7
    assert qkv.std().item() == pytest.approx(1 / math.sqrt(256), rel=0.02)
    assert model.lm_head.weight.std().item() == pytest.approx(0.005, rel=0.01)
    assert all(torch.count_nonzero(t.weight) == 0 for t in model.value_embeds)
    assert model.embed2.weight.std().item() == pytest.approx(1.0, rel=0.01)
    assert model.embed.weight.shape[0] == model.embed2.weight.shape[0] == model.value_embeds[0].weight.shape[0] == 50304
    for block in model.blocks:
        assert block.lambdas.tolist() == pytest.approx([1.05]) and block.x0_lambda.tolist() == [0.0]
        assert block.x02_lambda.tolist() == [0.0]
        assert block.attn.lambdas.tolist() == [0.5, 1.0] and block.attn.attn_gate.shape == (2, 16)
    assert model.skip_lambdas.tolist() == [-1.5, -1.5] and model.skip_weights is None
    assert model.skip_gate.shape == (2, 16) and model.smear_gate.shape == (1, 16)
    assert torch.count_nonzero(model.blocks[0].attn.c_proj.weight) == 0  # M L946: O starts at zero


def randomize_small_parameters(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() < 5000 or "c_proj" in name or "value_embeds" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.numel() < 5000 else 0.05))


def reference_trunk(model, tokens, attention):
    """M L1148-1191 written out for a fp32 model: smear across documents on the raw embedding (position 0 alone
    left out), x0 and x02 normed, skips popped last-in-first-out at skip_out with weight
    sigmoid(lambda) * 2 * sigmoid(W x0[:16]), each layer's mix resid * x + l0 * x0 + l1 * x02, then the block."""
    g = model.config.gate_dims
    e = model.embed.weight[tokens]
    gate = model.smear_lambda * torch.sigmoid(e[1:, :g] @ model.smear_gate.T)
    x = x0 = T.rms_norm(torch.cat([e[:1], e[1:] + gate * e[:-1]])[None])
    x02 = T.rms_norm(model.embed2.weight[tokens][None])
    skip_in = sorted(a for a, _ in model.skips)
    skip_out = sorted(b for _, b in model.skips)
    stack, idx = [], 0
    for i, block in enumerate(model.blocks):
        if i in skip_out:
            w = torch.sigmoid(model.skip_lambdas[idx]) * 2 * torch.sigmoid(x0[..., :g] @ model.skip_gate[idx:idx + 1].T)
            idx += 1
            x = x + w * stack.pop()
        x = block.lambdas[0] * x + block.x0_lambda * x0 + block.x02_lambda * x02
        ve_i = model.roles.value_embed[i]
        ve = None if ve_i is None else model.value_embeds[ve_i].weight[tokens][None]
        x = x + block.attn(T.rms_norm(x), ve, attention[i], 0, None)
        x = x + block.mlp(T.rms_norm(x))
        if i in skip_in:
            stack.append(x)
        if i == model.roles.backout_layer - 1:
            backout = x
    return x - model.backout_lambda * backout


def test_the_medium_trunk_matches_the_records_forward_and_gradient():
    """Skips (sigmoid lambda x gate), embed2's x02 mixed in every layer, smear across documents: GPT.trunk against
    reference_trunk, value and the gradients of every small parameter and of embed2."""
    args = tiny_medium("--dtype=fp32", "--bf16_rotary=false")
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(args))
    randomize_small_parameters(model)
    tokens = tokens_with_docs(256, [0, 50, 51, 130])
    attention = model.layer_attention(tokens, T.window_tensor(2))
    results = []
    for trunk in (lambda: model.trunk(tokens, attention), lambda: reference_trunk(model, tokens, attention)):
        model.zero_grad()
        out = trunk()
        (out * torch.linspace(-1, 1, out.size(-1))).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (got, got_grads), (want, want_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys() and "embed2.weight" in got_grads and "skip_lambdas" in got_grads
    for name in got_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert got_grads["blocks.2.x02_lambda"].abs() > 0 and got_grads["skip_gate"].abs().sum() > 0


def test_the_attention_output_lambda_scales_the_projection_and_the_value_embedding_enters_unscaled():
    """M L968-988: v = lambda0 * v + 2 sigmoid(W_v x[:16]) * ve, y gated per head, out = y @ (lambda1 * W_o).T."""
    args = tiny_medium("--dtype=fp32", "--bf16_rotary=false")
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(args))
    randomize_small_parameters(model)
    attn = model.blocks[0].attn
    x = T.rms_norm(torch.randn(1, 128, 64))
    ve = torch.randn(1, 128, 64)

    def attend(q, k, v, scale):
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           scale=scale)
        return y.transpose(1, 2)

    def reference():
        q, k, v = (F.linear(x, attn.qkv_w[i]).view(1, 128, 2, 32) for i in range(3))
        v = attn.lambdas[0] * v + 2 * torch.sigmoid(x[..., :16] @ attn.ve_gate.T)[..., None] * ve.view(1, 128, 2, 32)
        q, k = attn.rotary(T.rms_norm(q)), attn.rotary(T.rms_norm(k))
        k = T.offset_stationary_keys(k, None)  # layer 0 is a long-window layer
        y = attend(q, k, v, attn.scale) * torch.sigmoid(x[..., :16] @ attn.attn_gate.T)[..., None]
        return F.linear(y.reshape(1, 128, 64), attn.lambdas[1] * attn.c_proj.weight)

    grads = []
    for run in (lambda: attn(x, ve, attend), reference):
        attn.zero_grad()
        out = run()
        out.square().sum().backward()
        grads.append((out.detach(), attn.lambdas.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    assert grads[0][1][1].abs() > 0


def test_cross_document_shifts_cross_every_document_start_but_not_the_sequence_start():
    """M L971-974: every key but the sequence's first takes the previous position's stationary dims; M L1161:
    smear skips position 0 alone; M L1213-1218: target k of row t is t+k's, -100 only past the sequence end."""
    k = torch.randn(1, 6, 2, 16)
    got = T.offset_stationary_keys(k, None)
    for t in range(6):
        for d in range(16):
            stationary = 4 <= d < 8 or 12 <= d < 16
            want = k[0, max(t - 1, 0), :, d] if stationary else k[0, t, :, d]
            assert torch.equal(got[0, t, :, d], want), (t, d)
    x, gate = torch.randn(1, 6, 4), torch.rand(1, 6, 1)
    smeared = T.smear(x, gate, None)
    assert torch.equal(smeared[0, 0], x[0, 0])
    torch.testing.assert_close(smeared[0, 1:], x[0, 1:] + gate[0, 1:] * x[0, :-1])
    targets = torch.tensor([5, EOT, 7, 8, EOT, 9])
    columns = T.multi_token_targets(targets, 3, across_documents=True)
    for t in range(6):
        for c in range(3):
            assert columns[t, c] == (targets[t + c] if t + c < 6 else -100), (t, c)
    assert T.multi_token_targets(targets, 3)[0, 2] == -100  # the default stops at the document's end


def test_bf16_rotary_tables_and_rotation_are_the_records():
    """M L881-886: fp32 angles, tables cast to bf16; L902-911: y1 = x1 cos + x2 sin, y2 = x1 (-sin) + x2 cos in
    bf16. The fp32 rotary (the default) is untouched."""
    fp32, bf16 = T.Rotary(32, 300), T.Rotary(32, 300, bf16=True)
    assert bf16.cos.dtype == torch.bfloat16 and torch.equal(bf16.cos, fp32.cos.bfloat16())
    assert torch.equal(bf16.sin, fp32.sin.bfloat16()) and fp32.cos.dtype == torch.float32
    x = torch.randn(1, 300, 2, 32).bfloat16()
    cos, sin = bf16.cos[None, :, None, :], bf16.sin[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], dim=-1)
    assert torch.equal(bf16(x), want) and bf16(x).dtype == torch.bfloat16
    halved = T.rotary_frequencies(32) * 0.5
    bf16.set_frequencies(halved)  # YaRN's rebuild: the same buffers, the same table dtype
    assert torch.equal(bf16.cos, torch.outer(torch.arange(300.0), halved).cos().bfloat16())


def records_training_loss(logits, targets, weights):
    """M L1204-1221 on bf16 head outputs: softcap, logsumexp and per-token cross-entropy in bf16; column k (the
    token k after the next) zero past the sequence end; sum of w_k * CE."""
    capped = 23 * torch.sigmoid((logits + 5) / 7.5)
    n = weights.numel()
    idx = F.pad(targets, (0, n - 1)).unfold(0, n, 1)
    ce = torch.logsumexp(capped, dim=-1).unsqueeze(1) - capped.gather(1, idx)
    for k in range(1, n):
        ce[-k:, k] = 0
    return (ce * weights).sum()


@pytest.mark.parametrize("weights", [[1.0], [1.0, 0.5, 0.25]])
def test_the_bf16_summed_training_loss_is_the_records_on_both_head_paths(weights):
    """The plain path (multi_token_cross_entropy / softcapped_cross_entropy with LossForm(bf16, summed)) against
    records_training_loss, value and logits gradient; the chunked head (ChunkedHeadLoss) against the plain path."""
    gen = torch.Generator().manual_seed(len(weights))
    n, vocab = 640, 512
    h0 = T.rms_norm(torch.randn(n, 64, generator=gen)).bfloat16()
    w0 = torch.randn(vocab, 64, generator=gen) * 0.4
    targets = torch.randint(0, vocab, (n,), generator=gen)
    weights = torch.tensor(weights)
    columns = T.multi_token_targets(targets, len(weights), across_documents=True)
    softcap, form = T.Softcap(23.0, 7.5, 5.0), T.LossForm(bf16_logits=True, summed=True)
    logits = F.linear(h0, w0.bfloat16()).requires_grad_()
    want = records_training_loss(logits, targets, weights)
    want.backward()
    want_grad, logits.grad = logits.grad.clone(), None
    got = (T.softcapped_cross_entropy(logits, targets, softcap, form) if len(weights) == 1 else
           T.multi_token_cross_entropy(logits, columns, weights, softcap, form))
    got.backward()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-2)
    torch.testing.assert_close(logits.grad, want_grad)
    results = []
    for chunked in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = (T.chunked_head_loss(h, w, columns, softcap, T.softcapped_cross_entropy_chunk, weights, form) if chunked
                else T.multi_token_cross_entropy(F.linear(h, w.type_as(h)), columns, weights, softcap, form))
        loss.backward()
        results.append((loss.detach(), h.grad.float(), w.grad))
    (plain, plain_gh, plain_gw), (chunk, chunk_gh, chunk_gw) = results
    torch.testing.assert_close(chunk, plain, rtol=1e-5, atol=1e-2)
    assert rel_err(chunk_gh, plain_gh) < 2e-2 and rel_err(chunk_gw, plain_gw) < 2e-2  # bf16 rounding
    assert plain.item() > 100 * len(weights)  # a sum over 640 tokens, not a mean


def test_the_summed_loss_is_the_mean_times_the_tokens_and_validation_keeps_the_mean():
    """--loss_sum: training mode returns the sum over the sequence (M L1221), eval mode the mean (M L1202); on
    both head paths."""
    tokens = tokens_with_docs(257, [0, 90, 200])
    for chunked in (False, True):
        args = tiny_medium("--dtype=fp32", "--bf16_train_logits=false")
        torch.manual_seed(0)
        model = T.GPT(T.ModelConfig.of(args), loss=T.LossPath(chunked=chunked))
        summed = model(tokens[:-1], tokens[1:], T.window_tensor(2))
        with torch.no_grad():
            mean = model.eval()(tokens[:-1], tokens[1:], T.window_tensor(2))
        assert summed.item() == pytest.approx(256 * mean.item(), rel=1e-5)


def test_skips_that_point_backwards_or_past_the_last_layer_are_refused_in_one_line():
    for flags, message in [(["--skip_connections=9>3"], "9>3 points backwards"),
                           (["--skip_connections=6>9,4>10,2>16"], "2>16 goes past the last layer (15 of --n_layer=16)"),
                           (["--n_layer=10"], "4>10 goes past the last layer (9 of --n_layer=10)")]:
        with pytest.raises(T.UsageError) as e:
            T.parse_args(["--preset=medium", *flags], False)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert T.skip_pairs("2>11,6>9,4>10") == ((6, 9), (4, 10), (2, 11))  # ordered by target: M's skip_idx
    assert T.skip_pairs("2>9,3>9") is None and T.skip_pairs("2-9") is None


def test_the_default_skips_are_the_mirrored_u_net_with_linear_weights():
    model = T.GPT(T.ModelConfig.of(small_args("--n_layer=6")))
    assert model.skips == ((2, 3), (1, 4), (0, 5)) and model.skip_weights.tolist() == [1.0] * 3
    assert model.skip_lambdas is None and model.embed2 is None and model.embed.weight.shape[0] == 50257


# ----------------------------------------------------------------------------- record #89's prefix-token loss

def prefix_loss_reference(h, weight, targets, weights, prefix_weight, table, cap=23.0, offset=5.0, temp=7.5):
    """K:1066-1090 and §4.4, token by token in fp64: sum_t [sum_{k: t+k < T} w_k (lse_t - z[y_{t+k}]) +
    [pi(y_t) >= 0] w_p (lse_t - z[pi(y_t)])], z = cap * sigmoid((logits + offset) / temp) over every head column,
    the MTP targets read across documents (K:1073-1079)."""
    total = 0.0
    for t in range(len(targets)):
        z = cap * torch.sigmoid((weight @ h[t] + offset) / temp)
        lse = torch.logsumexp(z, 0)
        for k, w in enumerate(weights):
            if t + k < len(targets):
                total = total + w * (lse - z[targets[t + k]])
        prefix = int(table[targets[t]])
        if prefix >= 0:
            total = total + prefix_weight * (lse - z[prefix])
    return total


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("mtp", [[1.0, 0.5, 0.2], [1.0]], ids=["mtp", "next-token"])
def test_the_prefix_token_loss_and_its_gradient_match_a_token_by_token_reference(mtp, chunked):
    """--prefix_loss_weight (record #89): the summed training loss of the model's head and its gradient to the
    head's weight and the final hidden state, against prefix_loss_reference in fp64, with MTP on and off; one
    target's next token is its own prefix token (two terms on one column). Validation stays the plain mean."""
    args = small_args("--loss_sum=true", "--logit_softcap=23", "--logit_offset=5", "--cross_document_shifts=true")
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(args), loss=T.LossPath(chunked=chunked, prefix_tokens=True))
    head = torch.nn.init.normal_(model.lm_head.weight, std=0.05)
    tokens = tokens_with_docs(BLOCK + 1, [0, 60])
    tokens[20] = 65  # "b", a single byte: no prefix token (nor EOT, an input at 60)
    gazed, gaze = 50255, 17841  # " gazed", " gaze"
    assert model.prefix_table[gazed] == gaze
    tokens[[30, 31]] = torch.tensor([gazed, gaze])  # target 29 is " gazed", target 30 its prefix token
    x, y = tokens[:-1], tokens[1:]
    row = torch.tensor([*mtp, 0.25])
    loss = model(x, y, T.window_tensor(1), row)
    loss.backward()
    h = model.final_hidden(x, T.window_tensor(1))[0].detach().double().requires_grad_()
    w = head.detach().double().requires_grad_()
    want = prefix_loss_reference(h, w, y.tolist(), mtp, 0.25, model.prefix_table)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=0)
    assert rel_err(model.lm_head.weight.grad, w.grad) < 1e-4
    h2 = model.final_hidden(x, T.window_tensor(1))[0].detach().requires_grad_()
    head_loss = (T.chunked_head_loss(h2, model.lm_head.weight, model.loss_targets(y, len(row)), model.softcap,
                                     model.loss.chunk, row, T.LossForm(False, True)) if chunked else
                 T.multi_token_cross_entropy(F.linear(h2, model.lm_head.weight), model.loss_targets(y, len(row)), row,
                                             model.softcap, T.LossForm(False, True)))
    head_loss.backward()
    assert rel_err(h2.grad, h.grad) < 1e-4
    off = model(x, y, T.window_tensor(1), torch.tensor([*mtp, 0.0]))  # the term's weight at 0: the MTP loss alone
    assert off.item() == pytest.approx(prefix_loss_reference(h, w, y.tolist(), mtp, 0.0, model.prefix_table).item(),
                                       rel=1e-5)
    with torch.no_grad():
        mean = model.eval()(x, y, T.window_tensor(1))
    plain = T.GPT(T.ModelConfig.of(args))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert mean.item() == plain.eval()(x, y, T.window_tensor(1)).item()


# ----------------------------------------------------------------------------- FP8 MLP (record #89, §4.5)

def e4m3(x):
    return x.to(torch.float8_e4m3fn).float()


class RecordFP8MLP:
    """A slow direct reading of the fidelity audit's §4.5: explicit e4m3 casts, fp32 matmuls, the record's state
    (W1's current scale, W2's used and next scales, P's scale a) updated as quantize_mlp_fp8 and the forward do."""

    def __init__(self, w1, w2):
        self.a = torch.tensor(1.0)
        self.s_next = torch.tensor(1.0)
        self.after_step(w1, w2, bootstrap=True)

    def after_step(self, w1, w2, bootstrap):
        self.s1 = (w1.abs().max().clamp(min=1e-12) / 448).float()
        self.w1_f8 = e4m3(w1 / self.s1.to(w1.dtype))
        if bootstrap:  # no headroom: the current amax
            self.s_next = (w2.abs().max().clamp(min=1e-12) / 448).float()
        self.w2_f8 = e4m3((w2.float() / self.s_next).clamp(-448, 448))
        self.s_used = self.s_next
        self.s_next = w2.float().abs().max().clamp(min=1e-12) * (1.12 / 448)

    def forward(self, x):
        n = x.bfloat16()
        m = n.abs().max().clamp(min=1e-12)
        n_f8 = e4m3(n * (448 / m))
        pre = ((n_f8 @ self.w1_f8.T) * (self.s1 * m.float() / 448)).bfloat16()
        post = F.relu(pre).square()
        post_f8 = e4m3(torch.clamp(post.float() / self.a, max=448))
        y = ((post_f8 @ self.w2_f8.T) * (self.a * self.s_used)).bfloat16()
        self.a = post.float().max().clamp(min=1e-12) * (1.80 / 448)  # training forwards only (K:519)
        return y, post


def fp8_mlp(seed=0):
    torch.manual_seed(seed)
    mlp = T.MLP(T.ModelConfig.of(small_args("--fp8_mlp=true", "--zero_init=false"))).train()
    mlp.fp8 = True
    with torch.no_grad():
        mlp.c_proj.weight.normal_(std=0.02)
    T.quantize_mlp_fp8(mlp, bootstrap=True)
    return mlp


def mlp_input(seed, rows=64, d=64):
    return torch.randn(rows, d, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_fp8_mlp_follows_the_record_through_bootstrap_delayed_scales_and_clipping():
    """Steps 0-15 bootstrap W2's scale, then it lags a step with 1.12x headroom; W2 growing 1.5x in one step clips.
    P's scale a is 1 at first, then 1.8x the previous training forward's amax; eval forwards are bf16 and leave it."""
    mlp = fp8_mlp()
    ref = RecordFP8MLP(mlp.c_fc.weight.detach(), mlp.c_proj.weight.detach())
    assert mlp.fp8_act_scale.item() == 1.0
    clipped = False
    for step in range(20):
        for micro in range(2):
            x = mlp_input(100 * step + micro)
            y = mlp(x)
            y_ref, post = ref.forward(x)
            # the same e4m3 operands; fp32 sums in another order may flip a bf16 rounding or a P element's e4m3
            torch.testing.assert_close(y.float(), y_ref.float(), rtol=1e-2, atol=5e-3 * y_ref.abs().max().item())
            assert torch.equal(mlp.fp8_act_scale, ref.a), (step, micro)  # per micro-step
        with torch.no_grad():
            before = mlp.fp8_act_scale.clone()
            plain = mlp.c_proj(F.relu(mlp.c_fc(x)).square())
            assert torch.equal(mlp.eval()(x), plain) and torch.equal(mlp.fp8_act_scale, before)
            mlp.train()
            gen = torch.Generator().manual_seed(step)
            mlp.c_fc.weight.add_(torch.randn(mlp.c_fc.weight.shape, generator=gen) * 0.01)
            mlp.c_proj.weight.mul_(1.5 if step == 17 else 1.0).add_(
                torch.randn(mlp.c_proj.weight.shape, generator=gen) * 0.002)
        T.quantize_mlp_fp8(mlp, bootstrap=step < T.FP8_MLP_BOOTSTRAP_STEPS)
        ref.after_step(mlp.c_fc.weight.detach(), mlp.c_proj.weight.detach(), bootstrap=step < 16)
        for mine, theirs in [(mlp.fp8_up_scale, ref.s1), (mlp.fp8_down_scale, ref.s_used),
                             (mlp.fp8_down_next_scale, ref.s_next)]:
            assert torch.equal(mine, theirs), step
        amax = mlp.c_proj.weight.abs().max()
        headroom = (amax / (mlp.fp8_down_scale * 448)).item()
        assert headroom == pytest.approx(1.0, rel=1e-6) if step < 16 else headroom < 1.0 or step == 17
        clipped |= bool((ref.w2_f8.abs() == 448).sum() > 1)
    assert clipped  # step 17's weights outgrew the 12% headroom


def test_fp8_mlp_backward_is_bf16_from_the_saved_operands():
    """dW2 = P^T g, dpre = 2 (g W2^T) sqrt(P), dW1 = dpre^T n, dx = dpre W1: autograd of relu(pre)^2 W2^T in fp32
    with pre's value replaced by sqrt(P) (the FP8 forward's P) and its gradient through n W1^T."""
    mlp = fp8_mlp(seed=1)
    x = mlp_input(7).requires_grad_()
    g = mlp_input(8)
    (mlp(x) * g).sum().backward()
    ref = RecordFP8MLP(mlp.c_fc.weight.detach(), mlp.c_proj.weight.detach())
    _, post = ref.forward(x.detach())
    n = x.detach().float().requires_grad_()
    w1 = mlp.c_fc.weight.detach().bfloat16().float().requires_grad_()
    w2 = mlp.c_proj.weight.detach().bfloat16().float().requires_grad_()
    h = n @ w1.T
    pre = h - h.detach() + post.float().sqrt()
    ((F.relu(pre).square() @ w2.T) * g.float()).sum().backward()
    for got, want in [(x.grad, n.grad), (mlp.c_fc.weight.grad, w1.grad), (mlp.c_proj.weight.grad, w2.grad)]:
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
        assert ((got.float() - want).norm() / want.norm()).item() < 4e-3  # bf16 roundings, no bias
    assert mlp.c_fc.weight.grad.dtype == mlp.c_fc.weight.dtype and x.grad.dtype == torch.bfloat16


def test_fp8_mlp_state_round_trips_and_exists_only_with_the_flag():
    """The scales (P's included) are model buffers: a state_dict round trip (what checkpoints and the warm-up's
    restore copy) gives the same next forward, bit for bit; without --fp8_mlp there is no such state."""
    args = small_args("--fp8_mlp=true", "--zero_init=false")
    tokens = tokens_with_docs(1025, [0, 300])
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16,
                   attention="banded", fp8_head=False, compile="off", fp8_mlp=True)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(T.build_model(args, rt))
    trained, fresh = models
    mlp = fresh.blocks[1].mlp  # build_model's bootstrap (T:2258): current amax, no headroom; a at 1
    assert mlp.fp8 and mlp.fp8_act_scale.item() == 1.0
    assert mlp.fp8_up_scale == mlp.c_fc.weight.abs().max() / 448
    assert mlp.fp8_down_scale == mlp.c_proj.weight.abs().max() / 448
    for step in range(3):
        trained(tokens[:-1], tokens[1:], T.window_tensor(2)).backward()
        with torch.no_grad():
            for p in trained.parameters():
                p.sub_(0.01 * p.grad.sign()) if p.grad is not None else None
        T.quantize_mlp_fp8(trained, bootstrap=False)
    state = trained.state_dict()
    names = {k for k in state if ".fp8_" in k}
    assert len(names) == 4 * args.n_layer and state["blocks.1.mlp.fp8_act_scale"].item() != 1.0
    fresh.load_state_dict(state)
    for model in (trained, fresh):
        model.zero_grad(set_to_none=True)
    a, b = (m(tokens[:-1], tokens[1:], T.window_tensor(2)) for m in (trained, fresh))
    assert torch.equal(a, b)
    assert torch.equal(trained.blocks[0].mlp.fp8_act_scale, fresh.blocks[0].mlp.fp8_act_scale)
    plain = T.GPT(T.ModelConfig.of(small_args()))
    assert not any(".fp8_" in k for k in plain.state_dict()) and not plain.blocks[0].mlp.fp8


def test_a_run_refreshes_the_fp8_mlp_scales_after_each_step_and_restarts_them_after_the_warm_up(
        monkeypatch, tmp_path):
    """T:2258-2365's calls: the initial bootstrap, one after each warm-up step, one after the restore (P's scale
    back at 1), one after each training step (bootstrap through step 15). FP8 on this CPU through _scaled_mm."""
    from conftest import TINY, run_main
    calls, quantize = [], T.quantize_mlp_fp8

    def spy(model, bootstrap):
        calls.append((bootstrap, sorted({m.fp8_act_scale.item() for m in model.modules() if isinstance(m, T.MLP)})))
        quantize(model, bootstrap)

    monkeypatch.setattr(T, "fp8_supported", lambda device: True)
    monkeypatch.setattr(T, "quantize_mlp_fp8", spy)
    flags = ["--fp8_mlp=true", "--fp8_head=false", "--warmup_steps=2", "--num_iterations=18", "--val_every=0"]
    result = run_main([*TINY, *flags], tmp_path)
    assert result.returncode == 0, result.stderr
    assert [bootstrap for bootstrap, _ in calls] == [True] * 4 + [True] * 16 + [False] * 2
    assert calls[0][1] == [1.0] and calls[3][1] == [1.0] and 1.0 not in calls[2][1] and 1.0 not in calls[4][1]


@pytest.mark.parametrize("name", ["fp8_mlp", "fp8_head"])
def test_fp8_asked_on_the_command_line_without_fp8_matmuls_is_refused_in_one_line(name):
    """A recipe's FP8 runs in bf16 where the device has none (fp8_head's default); the command line's is refused."""
    args = small_args(f"--{name}=true")
    with pytest.raises(T.UsageError) as e:
        T.choose_kernels(args, "cpu", False, explicit={name: True})
    assert str(e.value).startswith(f"--{name}=true needs FP8 matmuls") and "\n" not in str(e.value)
    assert f"pass --{name}=false" in str(e.value)
    quiet = T.choose_kernels(args, "cpu", False)
    assert not quiet["fp8_head"] and not quiet["fp8_mlp"]
    assert T.choose_kernels(args, "cuda", True, explicit={name: True})[name]


def test_only_a_value_the_preset_and_recipe_do_not_give_counts_as_asked_for():
    """A rebuilt run's command line (records/rebuild_run.py) repeats every value, --fp8_head=true (the default)
    included: that asks for nothing, so a CPU reruns it; --fp8_mlp=true on the cpu preset does ask."""
    overrides = {"preset": "cpu", "fp8_head": True, "fp8_mlp": True, "n_layer": 6, "seed": 0}
    args = T.resolve_hyperparameters(overrides, False)
    assert T.changed_from_recipe(overrides, args) == {"fp8_mlp"}
    record = {"preset": "speedrun", "recipe": "record", "fp8_mlp": True, "n_layer": 11}
    assert T.changed_from_recipe(record, T.resolve_hyperparameters(record, False)) == set()


def test_the_record_recipe_runs_the_fp8_mlp_on_the_speedrun_preset_only_and_the_head_at_its_scales():
    """(--loss_sum=true: the loss section's record value, which the record head's g scale needs.)"""
    speedrun, cpu = (T.parse_args([f"--preset={p}", "--recipe=record", "--loss_sum=true"], False)
                     for p in ("speedrun", "cpu"))
    assert speedrun.fp8_mlp and not cpu.fp8_mlp and speedrun.fp8_head_scales == cpu.fp8_head_scales == "record"
    plain = T.parse_args(["--preset=speedrun", "--recipe=reference"], False)
    assert not plain.fp8_mlp and plain.fp8_head_scales == "reference"
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--preset=speedrun", "--recipe=reference", "--fp8_head_scales=record"], False)
    assert "--loss_sum=false; pass --loss_sum=true" in str(e.value) and "\n" not in str(e.value)


def test_the_record_head_scales_reach_the_fp8_matmul_forward_and_backward(monkeypatch):
    """T:1225: x/(100/448) and W/(1.6/448) in e4m3, g/(0.75/448) in e5m2; the reference's 2, 2^9, 2^19 otherwise."""
    seen = []
    forward, backward = T.fp8_forward_math, T.fp8_backward_math
    monkeypatch.setattr(T, "fp8_forward_math", lambda x, w, xs, ws: seen.append((xs, ws)) or forward(x, w, xs, ws))
    monkeypatch.setattr(T, "fp8_backward_math",
                        lambda g, x8, w8, xs, ws, gs: seen.append(gs) or backward(g, x8, w8, xs, ws, gs))
    for scales, expected in [("record", [(4.48, 280.0), 448 / 0.75]), ("reference", [(2.0, 512.0), 2.0 ** 19])]:
        args = small_args(f"--fp8_head_scales={scales}", "--loss_sum=true", "--zero_init=false")
        model = T.GPT(T.ModelConfig.of(args), fp8_kernels="eager")
        assert model.lm_head.fp8_scales == T.FP8_HEAD_SCALES[scales]
        x = T.rms_norm(torch.randn(8, 64)).bfloat16().requires_grad_()
        model.lm_head(x).float().sum().backward()
        assert seen == [(pytest.approx(expected[0][0]), pytest.approx(expected[0][1])), pytest.approx(expected[1])]
        seen.clear()


# ----------------------------------------------------------------------------- record #89's layout and stream

# The record's layout and stream flags (RECORD_VALUES' "layout and residual stream" section), on a tiny width; the
# shifts cross documents as the record's code does, so the slow reference below can follow T: line by line.
RECORD_STREAM = ["--n_layer=11", "--long_window_blocks=3,10", "--attention_free_blocks=6",
                 "--paired_head_blocks=0,2,5,9", "--value_embed_blocks=1,2,8,9,10", "--key_offset=true",
                 "--pad_embed_tables=true", "--unet_skips=true", "--skip_connections=3>6", "--skip_sigmoid=true",
                 "--sublayer_lambdas=true", "--attention_cache_block=7", "--mudd=true", "--mudd_gate_block=4",
                 "--output_gate_blocks=3,10", "--xsa_blocks=1,3,4,7", "--dc_blocks=10", "--smear=true",
                 "--ve_gates=true", "--ve_gate_reads_value=true", "--attn_output_lambda=true",
                 "--attn_proj_uniform_init=true", "--value_embed_init_std=0.01", "--bigram_vocab_size=1000",
                 "--bigram_dim=0", "--bigram_sign=true", "--head_init_std=0.005", "--cross_document_shifts=true"]


def record_stream_args(*extra):
    return T.parse_args(["--preset=cpu", "--model_dim=64", "--n_head=2", "--head_dim=32", "--seq_len=256",
                         "--val_seq_len=256", "--val_tokens=256", "--dtype=fp32", *RECORD_STREAM, *extra], False)


def record_stream_model(randomised=True, seed=0):
    args = record_stream_args()
    torch.manual_seed(seed)
    model = T.GPT(T.ModelConfig.of(args))
    if randomised:  # every gate and coefficient away from its init, so every path carries signal
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                # the attention lambdas stay near (0.5, 1): a v near zero would make XSA's projection ill-conditioned
                scale = 0.05 if p.ndim >= 2 or name.endswith("attn.lambdas") else 0.3
                p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def record_block_attention(model, i, a, aux_v, tokens, gates):
    """Block i's attention as T:1090-1161 writes it, over whole documents (the windows cover the sequence): q, k, v
    from lambda0 W_qkv, QK rms, rotary, the key offset on 3 and 10 (across documents), paired blocks on
    interleaved positions, then DC (10), XSA, the output gate and lambda1 W_O."""
    attn, n = model.blocks[i].attn, a.size(1)
    H, d = attn.n_head, attn.head_dim
    q, k, v = ((a @ (attn.lambdas[0] * attn.qkv_w[j]).T).view(1, n, H, d) for j in range(3))
    q, k = F.rms_norm(q, (d,)), F.rms_norm(k, (d,))
    if aux_v is not None:
        v = v + aux_v
    paired = i in (0, 2, 5, 9)
    if paired:
        q, k, v = T.pair_heads(q), T.pair_heads(k), T.pair_heads(v)
    q, k = attn.rotary(q), attn.rotary(k)
    if i in (3, 10):
        stationary = torch.arange(d) % (d // 2) >= d // 4
        k = torch.where(stationary, torch.cat([k[:, :1], k[:, :-1]], dim=1), k)
    docs = T.document_ids(T.paired_tokens(tokens) if paired else tokens)
    pos = torch.arange(q.size(1))
    allowed = (pos[None] <= pos[:, None]) & (docs[None] == docs[:, None])
    scores = torch.einsum("bthd,bshd->bhts", q, k) * attn.scale
    y = torch.einsum("bhts,bshd->bthd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
    if paired:
        y = T.unpair_heads(y)
    if i == 10:  # DC over 112 keys, w1 rms-normed over heads (section 4.6)
        w1, w2 = gates["dc1"], gates["dc2"]
        near = allowed & (pos[None] > pos[:, None] - 112)
        probs = (scores.masked_fill(~near, -math.inf)).softmax(-1)
        w1n = w1 / torch.sqrt(w1.square().mean(-1, keepdim=True) + 1e-6)
        mixed = (w1n.permute(0, 2, 1)[..., None] * probs).sum(1)  # (1, T, S)
        y = y + w2[..., None] * torch.einsum("bts,bshd->bthd", mixed, v)
    if i in gates["xsa"]:
        along = (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(1e-8)
        y = y - torch.tanh(gates["xsa"][i])[..., None] * along * v
    if i in gates["output"]:
        y = y * gates["output"][i][..., None]
    return y.reshape(1, n, -1) @ (attn.lambdas[1] * attn.c_proj.weight).T


def reference_record_stream(model, tokens):
    """Record #89's stream, T:1530-1680 with the record's own gate offsets (section 4.1-4.3), for any even n_head."""
    H = model.config.n_head
    x0 = model.embedded(tokens, None)
    bigram = model.bigram_vector(tokens, x0.size(-1))
    ve = [emb(tokens)[None] for emb in model.value_embeds]
    ve_of = {1: ve[0], 2: ve[1], 8: ve[2], 9: ve[3], 10: ve[4]}

    def gate(x, j, n):
        hidden = F.gelu(x @ model.mudd_gate_w1[j].T)
        return model.mudd_gate_scale * (hidden @ model.mudd_gate_w2[j, :n].T + model.mudd_gate_b2[j, :n])

    def mudd(x, j, n):
        hidden = F.gelu(x @ model.mudd_w1[j].T)
        return (0.1 * (hidden @ model.mudd_w2[j, :n].T + model.mudd_b2[j, :n])).split(1, dim=-1)

    pre = gate(x0, 0, 3 * H + 8)  # T:1443: xsa[1], xsa[3], attn[3], then x0 and bigram for blocks 0-3
    gates = {"xsa": {1: pre[..., :H], 3: pre[..., H:2 * H]}, "output": {3: pre[..., 2 * H:3 * H]}}
    x0_gate = {b: pre[..., 3 * H + 2 * b:3 * H + 2 * b + 1] for b in range(4)}
    bigram_gate = {b: pre[..., 3 * H + 2 * b + 1:3 * H + 2 * b + 2] for b in range(4)}
    x = c0 = x0 + bigram_gate[0] * bigram
    cache, skip_gate = {}, None
    for i, block in enumerate(model.blocks):
        r = model.resid_lambdas[i]
        p = model.post_lambdas[i]
        if i == 4:  # T:1580-1589: xsa[4], xsa[7], attn[10], x0/bigram for 4, 5, 7, 8, 9, skip, dc w1, dc w2
            post = gate(x, 1, 5 * H + 11)
            gates["xsa"].update({4: post[..., :H], 7: post[..., H:2 * H]})
            gates["output"][10] = post[..., 2 * H:3 * H]
            for m, b in enumerate((4, 5, 7, 8, 9)):
                x0_gate[b] = post[..., 3 * H + 2 * m:3 * H + 2 * m + 1]
                bigram_gate[b] = post[..., 3 * H + 2 * m + 1:3 * H + 2 * m + 2]
            skip_gate = post[..., 3 * H + 10:3 * H + 11]
            gates["dc1"], gates["dc2"] = post[..., 3 * H + 11:4 * H + 11], post[..., 4 * H + 11:5 * H + 11]
        if i == 6:
            x = x + torch.sigmoid(model.skip_lambdas[0]) * skip_gate * cache[3]
            x = r[1] * x + p[1] * block.mlp(F.rms_norm(x, (x.size(-1),)))
            continue
        a = F.rms_norm(cache.get(7, x), (x.size(-1),))
        if i == 10:
            cache[9] = x
            mu = mudd(x, 0, 14)
            aux_v = (mu[0] * c0 + mu[1] * cache[7] + mu[2] * x).view(1, -1, H, x.size(-1) // H)
            x = (1 + mu[5]) * x + mu[3] * c0 + mu[4] * cache[7]
            ve_gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(H // 2, dim=-1)[..., None]
            aux_v = ve_gate * ve_of[i].view_as(aux_v) + aux_v
            o = record_block_attention(model, i, a, aux_v, tokens, gates)
            x = mu[8] * x + mu[9] * o + mu[10] * c0 + mu[11] * bigram
            x = mu[12] * x + mu[13] * block.mlp(F.rms_norm(x, (x.size(-1),)))
            continue
        aux_v = None
        if i in ve_of:
            gate_in = torch.cat([a[..., :6], ve_of[i][..., :6]], dim=-1)
            aux_v = (2 * torch.sigmoid(gate_in @ block.attn.ve_gate.T))[..., None] * ve_of[i].view(1, -1, H,
                                                                                                x.size(-1) // H)
        o = record_block_attention(model, i, a, aux_v, tokens, gates)
        x = r[0] * x + p[0] * o + x0 * x0_gate[i]
        if i != 0:
            x = x + bigram * bigram_gate[i]
        x = r[1] * x + p[1] * block.mlp(F.rms_norm(x, (x.size(-1),)))
        if i in (3, 7):
            cache[i] = x
    nu = mudd(x, 1, 5)
    return x + nu[0] * c0 + nu[1] * cache[7] + nu[2] * cache[9] + nu[3] * ve[0] + nu[4] * cache[3]


def test_record_stream_matches_a_slow_reference_forward_and_gradient():
    """The whole record-layout trunk (gates, XSA, DC, output gates, injections, r/p, h7, MUDD) against the record's
    code written out with its literal gate offsets: the same stream, and the same gradient for every parameter."""
    model = record_stream_model()
    tokens = tokens_with_docs(256, [0, 90, 200])
    probe = torch.randn(1, 256, 64, generator=torch.Generator().manual_seed(3))
    got = model.trunk(tokens, model.layer_attention(tokens, T.window_tensor(8)))
    (got * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    expected = reference_record_stream(model, tokens)
    (expected * probe).sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-3)  # fp32, two attention orders of summation
    assert set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_record_gates_and_mudd_at_init_make_block_10_a_static_block():
    """Section 4.2/4.3: at init every gate is its bias (XSA and x0 0, output gates 0.25, bigrams 0.05, the skip 0.5,
    DC w1 1 and w2 0); block 10's MUDD is (0, 0, 0, 0, 0, 0, 2, 2, sqrt(1.1), 1, 0, 0.05, sqrt(1.1), 1), i.e.
    x <- sqrt(1.1) x + o + 0.05 bigram, then sqrt(1.1) x + MLP, VE gate 2 and no x0; the exit subtracts 0.5 h7."""
    model = record_stream_model(randomised=False)
    x = torch.randn(1, 128, 64)
    mu = torch.cat(model.mudd_coefficients(x, 0, 14), dim=-1)
    want = torch.tensor([0, 0, 0, 0, 0, 0, 2, 2, 1.1 ** 0.5, 1, 0, 0.05, 1.1 ** 0.5, 1]).expand_as(mu)
    torch.testing.assert_close(mu, want, atol=1e-6, rtol=1e-6)
    nu = torch.cat(model.mudd_coefficients(x, 1, 5), dim=-1)
    torch.testing.assert_close(nu, torch.tensor([0, -0.5, 0, 0, 0]).expand_as(nu), atol=1e-6, rtol=1e-6)
    inits = {"output_gate": 0.25, "bigram": 0.05, "skip": 0.5, "dc1": 1.0}
    for j in (0, 1):
        for (kind, _), value in model.gates_from(x, j).items():
            torch.testing.assert_close(value, torch.full_like(value, inits.get(kind, 0.0)), atol=1e-6, rtol=1e-6)
    assert len(model.gate_columns[0]) == 2 + 1 + 8 and len(model.gate_columns[1]) == 2 + 1 + 10 + 1 + 2
    assert torch.equal(model.resid_lambdas, torch.full((11, 2), 1.1 ** 0.5)) and torch.equal(
        model.post_lambdas, torch.ones(11, 2))
    std = model.value_embeds[0].weight.std().item()
    assert 0.009 < std < 0.011  # T:1261: 0.01 N(0, 1)
    o = model.blocks[0].attn.c_proj.weight
    assert o.abs().max() <= 0.5 * 3 ** 0.5 / 8 and o.std() > 0.01  # T:1293: uniform like V, not zero
    assert model.blocks[0].mlp.c_proj.weight.abs().max() == 0  # T:1308: the MLP's out projection stays zero


def test_record_layout_roles():
    """Section 4.1's roles from the block lists (T:1238-1252, T:1494-1496, T:1543)."""
    roles = record_stream_model(randomised=False).roles
    assert [i for i, on in enumerate(roles.attention) if not on] == [6]
    assert [i for i, on in enumerate(roles.long_window) if on] == [3, 10] == \
        [i for i, on in enumerate(roles.key_offset) if on]
    assert [i for i, on in enumerate(roles.paired_heads) if on] == [0, 2, 5, 9]
    assert roles.value_embed == (None, 0, 1, None, None, None, None, None, 2, 3, 4)
    assert [i for i, on in enumerate(roles.xsa) if on] == [1, 3, 4, 7] and roles.dc[10] and sum(roles.dc) == 1
    assert [i for i, on in enumerate(roles.output_gate) if on] == [3, 10]
    assert T.LayerRoles.of(T.ModelConfig.of(small_args())) == T.LayerRoles.for_depth(2, True)


def test_record_parameter_shapes_at_the_speedrun_shape():
    """Section 6 on the meta device: the record's shapes, and its stored count 643,751,335 less the padding slots
    (7,864,320: Q/K, V/O and MLP bank rows) and 74 unused slots (the 5th VE gate's 72, two pad scalars)."""
    args = T.parse_args(["--preset=speedrun", "--recipe=record"], True)
    with torch.device("meta"):
        model = T.GPT(T.ModelConfig.of(args))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["lm_head.weight"] == shapes["embed.weight"] == (50304, 768)
    assert [shapes[f"value_embeds.{j}.weight"] for j in range(5)] == [(50304, 768)] * 5
    assert shapes["bigram_embed.weight"] == (377280, 768)
    assert shapes["resid_lambdas"] == shapes["post_lambdas"] == (11, 2)
    assert shapes["mudd_w1"] == shapes["mudd_gate_w1"] == (2, 64, 768)
    assert shapes["mudd_w2"] == (2, 14, 64) and shapes["mudd_b2"] == (2, 14)
    assert shapes["mudd_gate_w2"] == (2, 41, 64) and shapes["mudd_gate_b2"] == (2, 41)
    assert shapes["mudd_gate_scale"] == ()
    assert sum(p.numel() for p in model.parameters()) == 643_751_335 - 7_864_320 - 74


def test_record_stream_parameters_take_the_records_adam_groups_and_stay_out_of_muon():
    """Rows 102, 103, 106, 107 (T:2035-2049, base lr 0.008 = the head's): r at 0.04 and p at 0.008 with betas
    (0.9, 0.95); MUDD's W1/W2 at 0.002 and the gate generators' G1/G2 at 0.0008 with (0.9, 0.99) and the cautious
    decay, their biases and s_g without it. None of them is a Muon matrix."""
    args = record_stream_args("--head_lr=0.008", "--cautious_wd=true", "--adam_cautious_wd=0.005")
    model = T.GPT(T.ModelConfig.of(args))
    opt = T.build_optimizers(model, args, rank=0, world_size=1)
    names = {p: n for n, p in model.named_parameters()}
    muon = {names[p] for b in opt.muon.buckets for p in b.real}
    assert not any(n.startswith(("mudd", "resid_lambdas", "post_lambdas")) for n in muon)
    groups = {names[g.param]: g for g in T.adam_groups(model, args, [p for b in opt.muon.buckets for p in b.real])}
    want = {"resid_lambdas": (0.04, (0.9, 0.95), 0.0), "post_lambdas": (0.008, (0.9, 0.95), 0.0),
            "mudd_w1": (0.002, (0.9, 0.99), 0.005), "mudd_w2": (0.002, (0.9, 0.99), 0.005),
            "mudd_b2": (0.002, (0.9, 0.99), 0.0), "mudd_gate_w1": (0.0008, (0.9, 0.99), 0.005),
            "mudd_gate_w2": (0.0008, (0.9, 0.99), 0.005), "mudd_gate_b2": (0.0008, (0.9, 0.99), 0.0),
            "mudd_gate_scale": (0.0008, (0.9, 0.99), 0.0)}
    for name, (lr, betas, wd) in want.items():
        g = groups[name]
        assert g.betas == betas and (g.lr, g.cautious_wd, g.weight_decay) == pytest.approx((lr, wd, 0.0)), name


def test_record_stream_traces_as_one_graph():
    """torch.compile traces the whole record trunk without a graph break (a break would compile each block's helpers
    as frames of their own, recompiling per block past dynamo's limit)."""
    model = record_stream_model()
    tokens = tokens_with_docs(256, [0, 90, 200])
    attention = model.layer_attention(tokens, T.window_tensor(8))
    compiled = torch.compile(model.trunk, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens, attention), model.trunk(tokens, attention))


def test_record_89s_validation_squashes_bf16_logits_in_bf16_then_takes_the_fp32_cross_entropy():
    """T:1689-1692: logits = lm_head(x) (bf16); 23 * sigmoid((logits + 5) / 7.5) in bf16; F.cross_entropy of its
    float copy. --bf16_val_softcap=false keeps the fp32 softcap."""
    torch.manual_seed(0)
    h, w = torch.randn(256, 32).bfloat16(), (0.3 * torch.randn(96, 32)).bfloat16()
    targets = torch.randint(0, 96, (256,))
    softcap = T.Softcap(23.0, 7.5, 5.0)
    logits = h @ w.T
    want = F.cross_entropy((23 * torch.sigmoid((logits + 5) / 7.5)).float(), targets)
    fp32 = F.cross_entropy(23 * torch.sigmoid((logits.float() + 5) / 7.5), targets)
    with torch.no_grad():
        got = T.chunked_head_loss(h, w, targets, softcap, T.softcapped_cross_entropy_chunk,
                                  form=T.LossForm(bf16_softcap=True))
        plain = T.chunked_head_loss(h, w, targets, softcap, T.softcapped_cross_entropy_chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain, fp32, rtol=1e-6, atol=1e-6)
    assert abs(want - fp32) > 1e-5  # the two are told apart
    assert T.parse_args(["--preset=cpu", "--recipe=record"], False).bf16_val_softcap
