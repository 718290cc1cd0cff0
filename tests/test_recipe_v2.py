"""Recipe v2: train_gpt.py's "Recipe v2" section and the math of its techniques. The TECHNIQUES declarations held
to docs/techniques.md's table and docs/v2-fidelity.md, each flag owned by one technique and every preset decided,
--recipe=v2 switching exactly its techniques on (and Technique.off each one off), the cpu v2's line on what it
leaves out, the gates' lrs and the techniques' refusals; each model and loss technique against a written-out
reference (key offset, paired heads, bigram hash embedding and its signs, smear, gates, backout, the rescaled
softcap, multi-token prediction) and the whole v2 model's causality and parameter count; and its schedules: the
batch-size stages per world size and the multi-token loss weights."""
import dataclasses
import math
import re

import pytest
import torch

import train_gpt as T
from conftest import REPO
from test_model import attention_inputs, reference_attention, small_args, tokens_with_docs
from test_schedules import speedrun

EOT = T.EOT_TOKEN
BLOCK = T.BLOCK_SIZE


# ----------------------------------------------------------------------------- the declarations

def test_the_v2_fidelity_table_states_the_recipes_values():
    """docs/v2-fidelity.md compares each v2 constant with its record's code; its `flag` column must be what
    --recipe=v2 --preset=speedrun resolves to, and every row names a record and says same / differs."""
    table = [line.split("|")[1:-1] for line in (REPO / "docs" / "v2-fidelity.md").read_text().splitlines()
             if line.startswith("| ") and line.count("|") == 8]
    header, rows = [c.strip() for c in table[0]], table[1:]
    assert header == ["technique", "constant", "record", "record's code", "ours", "flag", "note"]
    args = T.parse_args(["--preset=speedrun", "--recipe=v2"], cuda_available=True)
    types = T.field_types(T.Hyperparameters)
    checked = 0
    for cells in rows:
        technique, record, flag, note = (cells[i].strip() for i in (0, 2, 5, 6))
        assert re.match(r"(\d{4}-\d\d-\d\d_\w+|R\b|—)", record) and re.search(r"same|differ", note, re.I), cells
        for text in re.findall(r"`--(\w+)=([^`]*)`", flag):
            name, value = text
            assert getattr(args, name) == types[name].parse(value), (technique, name, value)
            checked += 1
    assert checked >= 40


def readme_recipes_rows():
    """(flags, record folders) of each row of the techniques table (docs/techniques.md)."""
    text = (REPO / "docs" / "techniques.md").read_text()
    table = text[text.index("| technique | flags (v2 value) | record folder"):].split("\n\n")[0].splitlines()[2:]
    rows = [line.split(" | ") for line in table]
    return [(set(re.findall(r"`(\w+)`", row[1])), set(re.findall(r"\d{4}-\d\d-\d\d[_-]\w+", row[2]))) for row in rows]


def test_the_readme_recipes_table_lists_every_technique_with_its_flags_and_records():
    """Each row of the table belongs to exactly one declared technique: the one whose records hold its record
    folders and whose flags the row names (one record folder may hold several techniques); each technique's records
    and flags all appear in its rows."""
    seen = {t.name: (set(), set()) for t in T.TECHNIQUES}
    for names, records in readme_recipes_rows():
        owners = [t for t in T.TECHNIQUES if records and records <= set(t.records) and names & set(t.flags)]
        assert len(owners) == 1, (names, records, [t.name for t in owners])
        seen[owners[0].name][0].update(names)
        seen[owners[0].name][1].update(records)
    for t in T.TECHNIQUES:
        assert set(t.flags) <= seen[t.name][0] and set(t.records) == seen[t.name][1], t.name


def test_each_flag_is_owned_by_at_most_one_technique_and_every_preset_is_decided():
    fields = {f.name for f in dataclasses.fields(T.Hyperparameters)}
    owned = [name for t in T.TECHNIQUES for name in t.flags]
    assert len(owned) == len(set(owned)) and set(owned) <= fields
    for t in T.TECHNIQUES:
        assert set(t.v2) | set(t.left_out) == set(T.PRESETS) and not set(t.v2) & set(t.left_out), t.name
        assert all(set(values) <= fields for values in t.v2.values()), t.name


@pytest.mark.parametrize("preset", ["speedrun", "cpu"])
def test_recipe_v2_turns_on_exactly_the_techniques_declared_for_the_preset_and_off_turns_each_off(preset):
    reference = T.parse_args([f"--preset={preset}", "--recipe=reference"], False)
    v2 = T.parse_args([f"--preset={preset}", "--recipe=v2"], False)
    assert not [t.name for t in T.TECHNIQUES if t.is_on(reference)]
    assert [t.name for t in T.TECHNIQUES if t.is_on(v2)] == [t.name for t in T.TECHNIQUES if preset in t.v2]
    for t in T.TECHNIQUES:
        if preset in t.v2:
            off = T.parse_args([f"--preset={preset}", "--recipe=v2", *T.as_flags(t.off(preset))], False)
            assert [u.name for u in T.TECHNIQUES if u.is_on(off)] == [u.name for u in T.TECHNIQUES
                                                                     if preset in u.v2 and u is not t], t.name


def test_every_gate_parameter_has_its_techniques_lr_and_every_declared_gate_exists():
    import torch
    with torch.device("meta"):
        model = T.GPT(T.ModelConfig.of(T.parse_args(["--preset=speedrun", "--recipe=v2"], False)))
    gates = {name.rsplit(".", 1)[-1] for name, _ in model.named_parameters() if name.endswith("_gate")}
    declared = {name for t in T.TECHNIQUES for name in t.gate_lrs}
    assert gates == declared == {"smear_gate", "attn_gate", "ve_gate", "skip_gate"}


def test_the_cpu_v2_run_log_names_what_it_leaves_out_and_the_flags_that_add_it():
    line = T.left_out_line(T.parse_args(["--preset=cpu", "--recipe=v2"], False))
    assert line.startswith("recipe v2 on the cpu preset leaves out doc_align: ") and "\n" not in line
    assert "--logit_softcap=23.0 --logit_offset=5.0 adds it" in line and "--mtp_tokens=3 adds it" in line
    assert "mtp" not in T.left_out_line(T.parse_args(["--preset=cpu", "--recipe=v2", "--mtp_tokens=3"], False))
    assert T.left_out_line(T.parse_args(["--preset=speedrun", "--recipe=v2"], False)) is None
    assert T.left_out_line(T.parse_args(["--preset=cpu"], False)) is None


def test_recipe_v2_switches_every_technique_on_and_each_flag_switches_one_off():
    ref, v2 = speedrun(), speedrun("--recipe=v2")
    assert ref == T.Hyperparameters(preset="speedrun", recipe="reference")  # the reference stays the dataclass defaults
    on = {"polar_express": True, "normuon": True, "cautious_wd": True, "bos_align": True, "doc_len_cap": 2048,
          "batch_schedule": "1/3,2/3,1", "scalar_adam_beta1": 0.9, "scalar_adam_beta2": 0.99}
    assert {k: getattr(v2, k) for k in on} == on and all(getattr(ref, k) != v for k, v in on.items())
    off = speedrun("--recipe=v2", "--normuon=false")
    assert not off.normuon and off.polar_express and off.cautious_wd  # one technique off, the rest stay
    model_on = {"smear": True, "attn_gate": True, "ve_gates": True, "skip_gates": True, "backout": True,
                "key_offset": True, "paired_heads": True, "bigram_sign": True, "bigram_vocab_size": 15 * 50304,
                "bigram_dim": 192, "mtp_tokens": 3, "logit_softcap": 23.0, "logit_offset": 5.0}
    assert {k: getattr(v2, k) for k in model_on} == model_on and all(getattr(ref, k) != v for k, v in model_on.items())
    cpu = T.parse_args(["--recipe=v2"], False)
    assert (cpu.batch_tokens, cpu.seq_len, cpu.batch_schedule, cpu.bos_align) == (6144, 512, "1/3,2/3,1", False)
    assert (cpu.bigram_vocab_size, cpu.bigram_dim, cpu.smear, cpu.paired_heads) == (5 * 50304, 64, True, True)
    # the cpu v2 leaves the logit rescale and MTP out (their CPU ablation cost)
    assert (cpu.mtp_tokens, cpu.logit_softcap, cpu.logit_offset) == (1, 30.0, 0.0)
    with pytest.raises(T.UsageError, match="unknown recipe 'v3'; valid recipes: reference, v2"):
        T.parse_args(["--recipe=v3"], False)


# Recipe v2's model switches that contradict each other or the shape: one line naming both sides.
@pytest.mark.parametrize("flags, message", [
    (["--ve_gates=true", "--value_embeds=false"], "--ve_gates=true gates the value embeddings, which --value_embeds=false"),
    (["--skip_gates=true", "--unet_skips=false"], "--skip_gates=true gates the U-net skips, which --unet_skips=false"),
    (["--bigram_sign=true"], "--bigram_sign=true signs the bigram embedding, which --bigram_vocab_size=0 turns off"),
    (["--bigram_vocab_size=100", "--bigram_dim=512"], "--bigram_dim=512 is wider than the stream"),
    (["--bigram_vocab_size=1"], "--bigram_vocab_size=1 leaves no row besides the one kept for document starts"),
    (["--paired_heads=true", "--n_head=3", "--value_embeds=false"], "--n_head=3 must be even"),
    (["--paired_heads=true", "--n_layer=2"], "--n_layer=2 has none"),
    (["--attn_gate=true", "--model_dim=8", "--value_embeds=false"], "first 12 dims, more than --model_dim=8"),
    (["--logit_offset=5", "--logit_softcap=0"], "--logit_offset=5.0 shifts the logits inside the softcap"),
    (["--recipe=v2", "--value_embeds=false"], "--ve_gates=true gates the value embeddings"),
])
def test_conflicting_model_switches_are_refused(flags, message):
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--preset=cpu", *flags], False)
    assert message in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the model techniques

def v2_args(*extra):
    """A small model with every v2 model switch on (4 layers, so that there are short-window layers to pair)."""
    return small_args("--recipe=v2", "--n_layer=4", "--batch_tokens=2048", "--batch_schedule=",
                      "--bigram_vocab_size=1000", "--bigram_dim=32", *extra)


def randomised(model, seed=0):
    """Every weight random (zero-init projections, gates and lambdas included): each path carries signal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.ndim < 2 else 0.1))
    return model


def test_speedrun_v2_parameter_count():
    with torch.device("meta"):
        model = T.GPT(T.ModelConfig.of(T.parse_args(["--preset=speedrun", "--recipe=v2"], False)))
    d, vocab, padded, layers, heads, gate = 768, 50257, 50304, 12, 6, 12
    embeddings = 4 * vocab * d + 15 * 50304 * 192  # token + 3 value embeddings + the bigram table (192 wide)
    head = padded * d
    mlp = layers * (2 * 4 * d * d + 2 + 1)  # c_fc + c_proj, the (x, x0) lambdas and the bigram lambda
    ve_layers = 6
    attention = 11 * (4 * d * d + heads * gate) + ve_layers * (2 + heads * gate) + (11 - ve_layers) * 1
    skips = 6 + 6 * gate  # skip weights and their gates
    extras = gate + 1 + 1  # smear gate and lambda, backout lambda
    expected = embeddings + head + mlp + attention + skips + extras
    assert expected == 275_598_383 + 15 * 50304 * 192 + 12 + 11 * 72 + 6 * 72 + 72 + 14
    assert sum(p.numel() for p in model.parameters()) == expected
    roles = model.roles
    # the record's rule (0, 2, 5, 9 of S S S L S S - S S S L): the first short-window layer and each one just
    # before a long-window or attention-free layer; on L S S S L S S - S S S L that is 1, 3, 6, 10
    assert roles.paired_heads == tuple(i in (1, 3, 6, 10) for i in range(12))
    assert roles.key_offset == tuple(i in (0, 4, 11) for i in range(12)) and roles.long_window[7]  # 7: no attention
    assert roles.backout_layer == 9
    assert [tuple(b.attn.lambdas.shape) for b in model.blocks if b.attn is not None][:4] == [(2,), (2,), (2,), (1,)]


def perturbed_logits(model, tokens, position, window):
    with torch.no_grad():
        before = model.logits(tokens, window)[0]
        changed = tokens.clone()
        changed[position] = (changed[position] + 1) % 50000
        after = model.logits(changed, window)[0]
    return (before != after).any(-1)


@pytest.mark.parametrize("backend", ["banded", "flex"])
def test_v2_model_never_looks_ahead_or_across_documents(backend):
    """Every v2 technique that reaches to other positions (smear, bigrams, key offset, paired heads, the attention
    itself): a token changed at p changes no output before p and none in another document, and does change
    later outputs of its own document. The wide window makes every layer see the whole document."""
    torch.manual_seed(0)
    model = randomised(T.GPT(T.ModelConfig.of(v2_args("--dtype=fp32")), attention=backend)).eval()
    tokens = tokens_with_docs(512, [0, 200, 201, 330])
    docs = T.document_ids(tokens)
    for p in (5, 199, 200, 201, 202, 329, 330, 331, 511):
        changed = perturbed_logits(model, tokens, p, T.window_tensor(4))
        assert not changed[:p].any(), (p, torch.nonzero(changed[:p]).flatten()[:5])
        assert not changed[docs != docs[p]].any(), p
        assert changed[p]
        same_doc_after = (docs == docs[p]) & (torch.arange(512) > p)
        if same_doc_after.any():
            assert changed[same_doc_after].any(), p


def test_v2_gradient_does_not_cross_documents_or_look_ahead():
    """The loss at one position, back to the token and bigram embeddings: zero gradient outside its document and
    after it; the previous token (smear, bigrams, key offset) gets some, except across a document start."""
    torch.manual_seed(0)
    model = randomised(T.GPT(T.ModelConfig.of(v2_args("--dtype=fp32"))))
    tokens = tokens_with_docs(513, [0, 300, 301, 302, 400])
    docs = T.document_ids(tokens[:-1])
    captured = {}

    def keep(name):
        def hook(module, inputs, out):
            out.retain_grad()
            captured[name] = out
        return hook
    model.embed.register_forward_hook(keep("embed"))
    model.bigram_embed.register_forward_hook(keep("bigram"))
    for pos in (299, 300, 301, 303, 450):
        targets = torch.full((512,), -100)
        targets[pos] = tokens[pos + 1]
        model(tokens[:-1], targets, T.window_tensor(4)).backward()
        for name, out in captured.items():
            touched = out.grad.abs().sum(-1) != 0
            allowed = (docs == docs[pos]) & (torch.arange(512) <= pos)
            assert not (touched & ~allowed).any(), (name, pos, torch.nonzero(touched & ~allowed).flatten()[:5])
            assert touched[pos], (name, pos)
        if docs[pos - 1] == docs[pos]:
            assert captured["embed"].grad[pos - 1].abs().sum() > 0, pos


def test_offset_stationary_keys_against_a_loop():
    k = torch.randn(1, 6, 2, 16)
    doc_start = torch.tensor([True, False, False, True, False, False])
    got = T.offset_stationary_keys(k, doc_start)
    for t in range(6):
        for d in range(16):
            stationary = 4 <= d < 8 or 12 <= d < 16  # D/4..D/2 and 3D/4..D: the dims rotary leaves alone
            want = (0.0 if doc_start[t] else k[0, t - 1, :, d]) if stationary else k[0, t, :, d]
            torch.testing.assert_close(got[0, t, :, d], torch.as_tensor(want).expand(2).float(), rtol=0, atol=0)
    rotary = T.Rotary(16, 6)
    assert torch.equal(rotary.cos[:, 4:8], torch.ones(6, 4)) and torch.equal(rotary.sin[:, 4:8], torch.zeros(6, 4))


def paired_reference(q, k, v, tokens, window, scale):
    """Paired-head attention written out: for heads (2p, 2p+1), positions 2i + j hold token i's head 2p + j;
    position a attends to b <= a in the same document within `window` 128-position blocks of a."""
    n, heads = q.size(1), q.size(2)
    docs = T.document_ids(tokens)
    a = torch.arange(2 * n)
    allowed = (a[None, :] <= a[:, None]) & (docs[a // 2][None, :] == docs[a // 2][:, None]) \
        & (a[:, None] // BLOCK - a[None, :] // BLOCK < window)
    out = torch.empty(1, n, heads, q.size(3), dtype=torch.float64)
    for p in range(heads // 2):
        seq = [torch.stack([t[0, :, 2 * p], t[0, :, 2 * p + 1]], dim=1).reshape(2 * n, -1)[None, :, None]
               for t in (q, k, v)]
        y = reference_attention(*seq, allowed, scale)[0, :, 0]
        out[0, :, 2 * p], out[0, :, 2 * p + 1] = y[0::2], y[1::2]
    return out


@pytest.mark.parametrize("backend", ["banded", "flex"])
def test_paired_head_attention_matches_the_written_out_reference(backend):
    n = 512
    tokens = tokens_with_docs(n, [0, 100, 301, 302])
    q, k, v = attention_inputs(n, heads=4, dim=16, seed=3)
    be = T.attention_backend(backend)
    for window in (1, 3):
        mask = be.build_mask(T.paired_tokens(tokens), torch.tensor(window))
        y = T.unpair_heads(be.attend(T.pair_heads(q), T.pair_heads(k), T.pair_heads(v), mask, 0.12))
        torch.testing.assert_close(y.double(), paired_reference(q, k, v, tokens, window, 0.12), atol=1e-5, rtol=1e-5)
    assert torch.equal(T.unpair_heads(T.pair_heads(q)), q)


def test_bigram_rows_and_signs_against_the_record_formula():
    tokens = torch.tensor([EOT, 11, 50255, 7, EOT, 7, 11])
    rows = 5 * 50304
    got = T.bigram_rows(tokens, rows).tolist()
    for t in range(7):
        if t == 0 or tokens[t] == EOT:
            assert got[t] == rows - 1  # a document's first token: the reserved row, no pair across documents
        else:
            assert got[t] == ((36313 * int(tokens[t])) ^ (27191 * int(tokens[t - 1]))) % (rows - 1)
    assert got[3] != got[5] and max(got) < rows
    signs = T.bigram_sign_rows(tokens).tolist()
    assert signs[0] == signs[4] == 0 and signs[2] == (11 ^ 50255) % 8192
    table = T.bigram_sign_table(64)
    assert table.shape == (8192, 64) and set(table.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(table, T.bigram_sign_table(64))  # fixed: every rank and every reload agrees


def test_record_89s_bigram_hashes_cross_document_starts():
    """T:1786-1793 and T:1535-1536 (with --cross_document_shifts): only the sequence's first token takes the reserved
    rows; a document's first token pairs with the previous document's last."""
    tokens = torch.tensor([EOT, 11, 50255, 7, EOT, 7, 11])
    rows = 377280
    got, signs = T.bigram_rows(tokens, rows, True).tolist(), T.bigram_sign_rows(tokens, True).tolist()
    assert got[0] == rows - 1 and signs[0] == 0
    for t in range(1, 7):
        assert got[t] == ((36313 * int(tokens[t])) ^ (27191 * int(tokens[t - 1]))) % (rows - 1)
        assert signs[t] == (int(tokens[t]) ^ int(tokens[t - 1])) % 8192
    args = T.parse_args(["--preset=cpu", "--recipe=record"], False)
    assert args.cross_document_shifts  # the record recipe hashes across documents


def test_bigram_embedding_enters_the_first_dims_with_its_sign():
    torch.manual_seed(0)
    model = randomised(T.GPT(T.ModelConfig.of(v2_args("--dtype=fp32"))))
    tokens = tokens_with_docs(256, [0, 100])
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: seen.append(a[6]))
    with torch.no_grad():
        model.logits(tokens, T.window_tensor(1))
    bigram = seen[0][0]
    table = model.bigram_embed.weight
    want = table[T.bigram_rows(tokens, 1000)] * model.bigram_signs[T.bigram_sign_rows(tokens)]
    torch.testing.assert_close(bigram[:, :32], want)
    assert not bigram[:, 32:].any()


def test_smear_takes_a_gated_share_of_the_previous_token_within_its_document():
    x = torch.randn(1, 6, 4)
    gate = torch.rand(1, 6, 1)
    doc_start = torch.tensor([True, False, False, True, False, False])
    got = T.smear(x, gate, doc_start)
    for t in range(6):
        want = x[0, t] if doc_start[t] else x[0, t] + gate[0, t] * x[0, t - 1]
        torch.testing.assert_close(got[0, t], want)


def test_gates_read_only_the_first_twelve_dims_and_start_neutral():
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(v2_args("--dtype=fp32")))
    attn = model.blocks[0].attn
    assert attn.attn_gate.shape == (2, T.GATE_DIMS) and attn.ve_gate.shape == (2, T.GATE_DIMS)
    assert model.skip_gate.shape == (2, T.GATE_DIMS) and model.smear_gate.shape == (1, T.GATE_DIMS)
    six = T.GPT(T.ModelConfig.of(v2_args("--n_layer=6")))
    assert [b.attn is not None and b.attn.ve_gate is not None for b in six.blocks] == \
        [ve is not None and has_attention for ve, has_attention in zip(six.roles.value_embed, six.roles.attention)]
    for gate in (attn.attn_gate, attn.ve_gate, model.skip_gate, model.smear_gate):
        assert not gate.any()  # sigmoid(0) = 0.5: the attention gate halves, the 2x gates pass as is
    x = torch.randn(1, 8, 64, requires_grad=True)
    T.sigmoid_gate(x, torch.randn(2, T.GATE_DIMS)).sum().backward()
    assert x.grad[..., :T.GATE_DIMS].abs().sum() > 0 and not x.grad[..., T.GATE_DIMS:].any()


def test_backout_subtracts_its_share_of_the_stream_entering_its_layer():
    """With backout_lambda = 0 the model is the model without backout; with lambda the stream the head reads
    loses lambda x the stream that layers 0-2 of 4 made (layer 3 then adds its U-net skip)."""
    torch.manual_seed(0)
    with_backout = randomised(T.GPT(T.ModelConfig.of(v2_args("--dtype=fp32"))))
    without = T.GPT(T.ModelConfig.of(v2_args("--dtype=fp32", "--backout=false")))
    without.load_state_dict({k: v for k, v in with_backout.state_dict().items() if k != "backout_lambda"})
    tokens = tokens_with_docs(256, [0, 100])
    attention = with_backout.layer_attention(tokens, T.window_tensor(2))
    entering = []
    with_backout.blocks[2].register_forward_hook(lambda m, a, out: entering.append(out))  # before 3's U-net skip
    with torch.no_grad():
        lam = with_backout.backout_lambda.item()
        torch.testing.assert_close(with_backout.trunk(tokens, attention), without.trunk(tokens, attention) - lam * entering[0])
        with_backout.backout_lambda.zero_()
        torch.testing.assert_close(with_backout.trunk(tokens, attention), without.trunk(tokens, attention), rtol=0, atol=0)
    assert with_backout.roles.backout_layer == 3


def test_v2_gates_and_bigram_table_go_to_their_optimizer_groups():
    torch.manual_seed(0)
    args = v2_args()
    model = T.GPT(T.ModelConfig.of(args))
    opt = T.build_optimizers(model, args, 0, 1)
    lr = {id(p): g["base_lr"] for p, g in zip(opt.adam.params, opt.adam.adam.param_groups)}
    muon = {id(p) for b in opt.muon.buckets for p in b.real}
    assert lr[id(model.bigram_embed.weight)] == args.embed_lr
    assert lr[id(model.smear_gate)] == pytest.approx(args.scalar_lr * 0.01 / 5)
    assert lr[id(model.skip_gate)] == pytest.approx(args.scalar_lr * 0.05 / 5)
    assert lr[id(model.blocks[0].attn.attn_gate)] == pytest.approx(args.scalar_lr / 5)
    assert lr[id(model.blocks[0].attn.ve_gate)] == pytest.approx(args.scalar_lr / 5)
    assert lr[id(model.backout_lambda)] == lr[id(model.blocks[0].bigram_lambda)] == args.scalar_lr
    assert id(model.blocks[0].attn.qkv_w) in muon and id(model.blocks[0].attn.attn_gate) not in muon


def test_v2_fresh_model_loss_is_log_vocab_through_the_rescaled_softcap():
    torch.manual_seed(0)
    model = T.GPT(T.ModelConfig.of(v2_args()))
    tokens = tokens_with_docs(257, [0, 40, 130])
    with torch.no_grad():  # zero head: every logit is 23 * sigmoid(5 / 7.5), the same for all 50304
        loss = model(tokens[:-1], tokens[1:], T.window_tensor(1))
    assert loss.item() == pytest.approx(math.log(50304), abs=1e-4)
    z = torch.linspace(-40, 40, 9)
    torch.testing.assert_close(T.apply_softcap(z, T.Softcap(23.0, 7.5, 5.0)), 23 * torch.sigmoid((z + 5) / 7.5))


def test_v2_stream_stays_in_the_activation_dtype():
    """Every v2 scale factor (bigram, smear, backout lambdas) multiplies the bf16 stream as a 0-dim tensor: a
    (1,)-shaped fp32 factor would promote the stream, and every matmul after it, to fp32 (2x slower on CPU)."""
    torch.manual_seed(0)
    model = randomised(T.GPT(T.ModelConfig.of(v2_args())))
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.to(torch.bfloat16)
    tokens = tokens_with_docs(256, [0, 100])
    dtypes = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    with torch.no_grad():
        assert model.final_hidden(tokens, T.window_tensor(2)).dtype == torch.bfloat16
    assert dtypes == [torch.bfloat16] * 4


def test_multi_token_targets_stop_at_the_sequence_end_and_after_a_document_ends():
    targets = torch.tensor([5, 6, EOT, 8, 9, -100, 11])
    got = T.multi_token_targets(targets, 3)
    for t in range(7):
        ended = False
        for k in range(3):
            if k:
                ended = ended or t + k - 1 >= 7 or int(targets[t + k - 1]) == EOT
            want = -100 if ended or t + k >= 7 else int(targets[t + k])
            assert got[t, k] == want, (t, k)
    assert torch.equal(got[:, 0], targets)  # column 0 is the plain next-token target


def test_multi_token_loss_is_the_weighted_sum_of_each_columns_mean_against_float64():
    """2025-12-22_MultiTokenPrediction: the same logits score every column; the weighted per-column means are
    summed, not averaged. Reference: float64 log-softmax by hand."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 96, generator=gen) * 4
    targets = T.multi_token_targets(torch.randint(0, 96, (40,), generator=gen), 3)
    targets[7, 0] = -100
    weights = torch.tensor([1.0, 0.5, 0.2])
    softcap = T.Softcap(23.0, 7.5, 5.0)
    got = T.multi_token_cross_entropy(logits, targets, weights, softcap)
    logp = torch.log_softmax(23 * torch.sigmoid((logits.double() + 5) / 7.5), -1)
    want = 0.0
    for k in range(3):
        rows = [t for t in range(40) if targets[t, k] != -100]
        want += float(weights[k]) * -sum(logp[t, targets[t, k]] for t in rows) / len(rows)
    assert got.item() == pytest.approx(float(want), rel=1e-5)
    one = T.multi_token_cross_entropy(logits, targets[:, :1], torch.ones(1), softcap)
    torch.testing.assert_close(one, T.softcapped_cross_entropy(logits, targets[:, 0], softcap))


def test_validation_loss_is_next_token_loss_whatever_the_training_weights():
    """The model's loss without mtp_weights (validation, evaluate()) is plain next-token cross-entropy."""
    torch.manual_seed(0)
    model = randomised(T.GPT(T.ModelConfig.of(v2_args("--dtype=fp32")))).eval()
    tokens = tokens_with_docs(257, [0, 100])
    with torch.no_grad():
        plain = model(tokens[:-1], tokens[1:], T.window_tensor(2))
        logits = model.logits(tokens[:-1], T.window_tensor(2))[0]
        with_weights = model(tokens[:-1], tokens[1:], T.window_tensor(2), torch.tensor([1.0, 0.5, 0.25]))
    torch.testing.assert_close(plain, T.softcapped_cross_entropy(logits, tokens[1:], model.softcap))
    assert with_weights > plain  # the other columns add their (positive) losses


def test_skip_gates_read_the_embedding_stream_x0(monkeypatch):
    """2025-12-29_VeSkipGates: the skip gate reads x0 (the normed embedding), not the stream at the skip; the
    skip enters as skip_weight * 2 * sigmoid(gate . x0[:12]) * (the encoder layer's output)."""
    torch.manual_seed(0)
    model = randomised(T.GPT(T.ModelConfig.of(v2_args("--dtype=fp32"))))
    x0, gate_inputs = [], []
    model.blocks[0].register_forward_pre_hook(lambda m, a: x0.append(a[1]))
    gate = T.sigmoid_gate
    monkeypatch.setattr(T, "sigmoid_gate", lambda x, w: gate_inputs.append((x, w)) or gate(x, w))
    with torch.no_grad():
        model.logits(tokens_with_docs(256, [0, 100]), T.window_tensor(2))
    skip_calls = [x for x, w in gate_inputs if w.shape == (1, T.GATE_DIMS) and w.data_ptr() != model.smear_gate.data_ptr()]
    assert len(skip_calls) == model.roles.n_encoder and all(x is x0[0] for x in skip_calls)


# ----------------------------------------------------------------------------- batch stages, multi-token weights

def record_stage(step, num_iterations):
    """2025-11-29_BatchSizeSchedule: three equal thirds of training, the last step in the last third."""
    return min(int(3 * step / num_iterations), 2)


@pytest.mark.parametrize("world_size, accums", [(8, (1, 2, 3)), (4, (2, 4, 6)), (1, (8, 16, 24))])
def test_v2_speedrun_batch_stages_are_the_records_131k_262k_393k(world_size, accums):
    args = speedrun("--recipe=v2")
    assert args.seq_len == 16 * 1024 and args.batch_schedule == "1/3,2/3,1"
    batches = T.batch_schedule(args, world_size)
    assert batches.stage_tokens == (131072, 262144, 393216)
    assert batches.stage_accum == accums
    n = args.num_iterations
    for step in range(n + 1):
        stage = record_stage(step, n)
        assert batches.tokens(step) == (131072, 262144, 393216)[stage], step
        assert batches.accum(step) * world_size * args.seq_len == batches.tokens(step)
    assert [batches.first_step(i) for i in range(3)] == [0, 590, 1180]  # 1770 / 3 = 590 steps per stage
    assert (batches.tokens(589), batches.tokens(590), batches.tokens(1179), batches.tokens(1180)) == \
        (131072, 262144, 262144, 393216)
    # the record scales every lr by (batch / final batch) ** 0.6
    assert batches.lr_scale(0) == pytest.approx((1 / 3) ** 0.6) and batches.lr_scale(600) == pytest.approx((2 / 3) ** 0.6)
    assert batches.lr_scale(1770) == 1.0
    assert batches.tokens_before(591) == 590 * 131072 + 262144
    assert batches.tokens_before(n) == 590 * (131072 + 262144 + 393216)


def test_batch_stages_of_uneven_length_follow_the_same_rule():
    args = T.parse_args(["--preset=cpu", "--batch_tokens=4096", "--batch_schedule=1/4,1/2,3/4,1",
                         "--num_iterations=10"], False)
    batches = T.batch_schedule(args, 1)
    got = [batches.tokens(s) for s in range(11)]
    expect = [(1024, 2048, 3072, 4096)[min(4 * s // 10, 3)] for s in range(11)]  # floor(4 s / 10)
    assert got == expect == [1024] * 3 + [2048] * 2 + [3072] * 3 + [4096] * 3
    assert [batches.first_step(i) for i in range(4)] == [0, 3, 5, 8]
    assert sum(got[:10]) == batches.tokens_before(10) == 3 * 1024 + 2 * 2048 + 3 * 3072 + 2 * 4096


@pytest.mark.parametrize("world_size, valid", [(3, "[1, 2, 4, 8]"), (16, "[1, 2, 4, 8]")])
def test_a_batch_schedule_the_world_size_cannot_split_is_refused_with_the_sizes_that_work(world_size, valid):
    with pytest.raises(T.UsageError) as e:
        T.batch_schedule(speedrun("--recipe=v2"), world_size)
    message = str(e.value)
    assert f"world size {world_size} cannot split the --batch_schedule stages 131072/262144/393216 tokens" in message
    assert f"world sizes that work: {valid}" in message and "\n" not in message
    cpu = T.parse_args(["--recipe=v2"], False)  # 4, 8, 12 sequences of 512: 1, 2 and 4 ranks divide all three
    with pytest.raises(T.UsageError, match=r"world size 3 cannot split .* 2048/4096/6144 .* work: \[1, 2, 4\]"):
        T.batch_schedule(cpu, 3)


def test_the_cpu_v2_splits_over_one_two_and_four_ranks():
    """Its ramp must run as `torchrun --nproc_per_node=N train_gpt.py --recipe=v2` for N = 1, 2, 4 (the earlier
    2048 -> 3072 -> 4096 ramp of 1024-token sequences was refused on 2 ranks); 3 ranks are refused by name."""
    args = T.parse_args(["--preset=cpu", "--recipe=v2"], False)
    for ranks in (1, 2, 4):
        assert T.batch_schedule(args, ranks).stage_accum == tuple(n // ranks for n in (4, 8, 12))
    with pytest.raises(T.UsageError, match=r"world size 3 cannot split .* world sizes that work: \[1, 2, 4\]"):
        T.batch_schedule(args, 3)


def test_mtp_weights_follow_the_records_three_phases():
    """2025-12-22_MultiTokenPrediction: [1, .5, .25 -> 0] -> [1, .5 -> 0] -> [1] over thirds of training, linear
    within each; always three weights, so a compiled model sees one shape."""
    N = 90
    for step in range(N + 1):
        w = T.mtp_loss_weights(step, N, 3)
        x = step / N
        if x < 1 / 3:
            want = [1.0, 0.5, 0.25 * (1 - 3 * x)]
        elif x < 2 / 3:
            want = [1.0, 0.5 * (1 - (3 * x - 1)), 0.0]
        else:
            want = [1.0, 0.0, 0.0]
        assert w == pytest.approx(want, abs=1e-12), step
    assert T.mtp_loss_weights(0, N, 1) == [1.0] and T.mtp_loss_weights(45, N, 2) == [1.0, 0.0]
