"""The medium preset (track 2, GPT-2-medium-class to 2.92): its values pinned to the track's 2025-12-31 record
(modded-nanogpt PR #188, train_gpt_medium.py at d7011639, cited per value), the techniques only it uses
(five value-embedding tables, attention in every layer, staged windows with a capped short window, multi-token
prediction over the first quarter), its batch on 1 to 8 GPUs, the joint forward + backward and validation graphs
traced at its real model shape, a tiny run on CPU through every medium-only path, and its one-line refusals."""
import dataclasses
import json
from pathlib import Path


import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

import lifecycle
import train_gpt as T
from conftest import run_main, train_losses
from test_compile import as_fake, documents, graph_ops, graph_recorder

# The track-2 record's values, as literals (not the trainer's table): the code at d7011639 and its README.
RECORD_2025_12_31 = dict(
    n_layer=16, model_dim=1024, n_head=8, head_dim=128,  # L1688-1695
    value_embed_tables=5,  # L1056-1060, L1152: tables 0-4 at layers 0-4 and 11-15
    attention_free_layer=False,  # README: "use all 16 attn layers"
    batch_tokens=524288, batch_schedule="1/4,1/2,3/4,1,1,1,1,1,1,1,1,1",  # L1617-1620: 131K, 262K, 393K, then 524K
    batch_sequences=8, seq_len=65536,  # L1351, L1718: one packed buffer of batch/8 per GPU, the last stage's 64K
    num_iterations=4740, cooldown_frac=0.7, lr_final_frac=0.05,  # L1625-1628, get_lr: 2.0 -> 0.1
    val_every=250, val_tokens=10485760, val_seq_len=262144,  # L1632, L1615, L1623
    window_stages="3,7,11,13,15,17,19,21,23,23,23,23", short_window_cap=11,  # L1636-1638, get_ws
    extension_steps=40, muon_momentum_cooldown_steps=50,  # L1625-1627: 4700 scheduled + 40; get_muon_momentum
    stage_lr_shares="0.5,0.76,0.865,1,1,1,1,1,1,1,1,1",  # get_lr's lr_max 1.0/1.52/1.73/2.0, over its peak 2.0
    attn_scale=0.1, yarn_max_window=13, final_window_blocks=27,  # L889, L1552-1553, L1646
    token_exact_windows=True,  # L982-984: FA3 window_size=(128 * w, 0)
    bos_align=True, doc_len_cap=4096,  # L1622
    muon_lr=0.03, polar_express=True, normuon=True, normuon_beta2=0.95, cautious_wd=True,  # L1486: 0.015 x peak 2.0
    muon_cautious_wd=1.2, adam_cautious_wd=0.005, muon_momentum=0.95, muon_momentum_start=0.85,
    muon_momentum_warmup_steps=300,  # L1437-1449
    head_lr=0.008, embed_lr=0.6, scalar_lr=0.08, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-8,  # L1484-1485
    scalar_adam_beta1=0.9, scalar_adam_beta2=0.99,
    smear=True, attn_gate=True, ve_gates=True, skip_gates=True, backout=True, key_offset=True,
    logit_softcap=23.0, logit_offset=5.0, logit_temperature=7.5,  # L1203
    mtp_tokens=3, mtp_frac=0.25,  # L1505-1518: its three phases within the first 4700/4 steps
    fp8_head=False, coordinate_descent_tuning=False, bigram_vocab_size=0, paired_heads=False,  # L845, L28
    target_val_loss=2.92,
    pad_embed_tables=True, gate_dims=16, second_embed=True,  # M L1046, L1061, L1076, L1079; gates CastedLinear(16, .)
    skip_connections="6>9,4>10,2>11", skip_sigmoid=True,  # M L1127-1128 (skip_in, skip_out), L1096, L1179
    residual_lambda_init=1.05, attn_output_lambda=True, cross_document_shifts=True,  # M L1092, L988, L971-974
    qkv_init_gain=1.0, head_init_std=0.005, value_embed_zero_init=True,  # M L935-936, L1073, L1062-1063
    bf16_rotary=True, bf16_train_logits=True, loss_sum=True,  # M L881-886, L1204-1221
)


def medium(*extra, cuda=False):
    return T.parse_args(["--preset=medium", *extra], cuda_available=cuda)


def test_the_medium_preset_is_the_track_2_record_as_far_as_the_trainer_reaches():
    args = medium()
    assert {k: getattr(args, k) for k in RECORD_2025_12_31} == RECORD_2025_12_31
    assert medium("--recipe=v2") == dataclasses.replace(args, recipe="v2")  # the record is its recipe already
    speedrun = T.parse_args(["--preset=speedrun", "--recipe=reference"], False)
    assert speedrun == T.Hyperparameters(preset="speedrun", recipe="reference")  # the speedrun preset is untouched


def test_help_shows_the_medium_presets_values(tmp_path):
    result = run_main(["--preset=medium", "--help"], tmp_path)
    assert result.returncode == 0 and "Values shown: the medium preset, recipe reference" in result.stdout
    for line in ("  --n_layer=16 [speedrun: 11, cpu: 6]", "  --value_embed_tables=5 [speedrun: 3, cpu: 3]",
                 "  --window_stages=3,7,11,13,15,17,19,21,23,23,23,23 [speedrun: 3,7,11, cpu: ]",
                 "  --target_val_loss=2.92 [speedrun: 3.28, cpu: 5.7]", "  --fp8_head=false [speedrun: true, cpu: true]"):
        assert line in result.stdout, line


def test_the_medium_layout_has_five_value_tables_attention_everywhere_and_the_records_windows():
    roles = T.LayerRoles.for_depth(16, value_embeds=True, key_offset=True, backout=True, value_embed_tables=5,
                                   attention_free_layer=False)
    assert roles.value_embed == (0, 1, 2, 3, 4) + (None,) * 6 + (0, 1, 2, 3, 4)
    assert all(roles.attention) and [i for i, long in enumerate(roles.long_window) if long] == [0, 4, 11, 15]
    assert [i for i, k in enumerate(roles.key_offset) if k] == [0, 4, 11, 15] and roles.backout_layer == 12
    reference = T.LayerRoles.for_depth(16)  # the 2025-01-26 layout at this depth: 3 tables, layer 9 without attention
    assert reference.value_embed[:4] == (0, 1, 2, None) and not reference.attention[9]


def test_windows_step_through_the_records_stages_with_the_short_one_capped():
    args = medium()
    stage = T.scheduled_steps(args) / 12
    longs = [T.attention_windows(int(i * stage) + 1, args) for i in range(12)]
    assert longs == [(3, 1), (7, 3), (11, 5), (13, 6), (15, 7), (17, 8), (19, 9), (21, 10)] + [(23, 11)] * 4
    assert T.attention_windows(args.num_iterations - 1, args) == (23, 11)
    assert T.attention_windows(args.num_iterations, args) == (27, 11)  # the last validation: M L1646
    assert T.window_pair(40, short_cap=11) == (40, 11) and T.window_pair(40) == (40, 20)
    model = T.GPT(T.ModelConfig.of(medium("--n_layer=2", "--model_dim=64", "--n_head=2", "--head_dim=32",
                                          "--value_embed_tables=1", "--skip_connections=0>1")))
    assert model.window(T.attention_windows(args.num_iterations, args)).tolist() == [27, 11]  # the tools' too
    with pytest.raises(T.UsageError, match="--window_stages sets the sliding windows"):
        medium("--sliding_window=false")
    with pytest.raises(T.UsageError, match="bad value 'wide' for --window_stages"):
        medium("--window_stages=wide")


def test_multi_token_prediction_runs_over_the_first_quarter_then_the_next_token_alone():
    n = 4700  # the scheduled steps (M: s / (4700 / 4))
    assert T.mtp_loss_weights(0, n, 3, 0.25) == [1.0, 0.5, 0.25]
    quarter = n * 0.25
    assert T.mtp_loss_weights(int(quarter / 3) + 1, n, 3, 0.25)[2] == 0.0  # phase 2: two tokens
    assert T.mtp_loss_weights(int(quarter) + 1, n, 3, 0.25) == [1.0, 0.0, 0.0]
    assert T.mtp_loss_weights(2400, 4800, 3, 1.0) == T.mtp_loss_weights(600, 4800, 3, 0.25)  # the same phases, sooner


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_the_medium_step_is_the_records_eight_packed_buffers_on_1_2_4_and_8_gpus(world_size):
    """M L1351, L1718: one buffer of stage/8 tokens per GPU on 8 GPUs, grad_accum 8 / W on W; the sequence length
    changes with the stage (16,384 to 65,536), the number of sequences does not."""
    args = medium()
    assert (args.batch_sequences, args.seq_len) == (8, 65536)
    schedule = T.batch_schedule(args, world_size)
    assert schedule.stage_tokens == (131072, 262144, 393216) + (524288,) * 9
    assert schedule.stage_seq_len == (16384, 32768, 49152) + (65536,) * 9
    assert schedule.stage_accum == (8 // world_size,) * 12
    for stage in range(12):
        step = schedule.first_step(stage)
        assert schedule.accum(step) * world_size * schedule.seq_len(step) == schedule.tokens(step)


@pytest.mark.parametrize("world_size", [3, 5, 6, 16])
def test_a_world_size_that_cannot_split_the_medium_batch_is_refused_in_one_line(world_size):
    with pytest.raises(T.UsageError) as e:
        T.batch_schedule(medium(), world_size)
    assert f"world size {world_size} cannot split --batch_sequences=8 packed sequences" in str(e.value)
    assert "world sizes that work: [1, 2, 4, 8]" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--seq_len=16384"], "--seq_len=16384 is not the longest packed sequence of --batch_sequences=8 (65536 tokens: "
                          "--batch_tokens=524288 / 8); pass --seq_len=65536, or --batch_sequences=0"),
    (["--batch_sequences=3"], "--batch_sequences=3 cuts the batch stages into sequences of 43690.7/87381.3/131072/"
                              "174763 tokens, not whole 128-token blocks"),
    (["--batch_sequences=2048"], "--batch_sequences=2048 cuts the batch stages into sequences of 64/128/192/256 "
                                 "tokens, not whole 128-token blocks"),
])
def test_a_micro_batch_that_cannot_hold_the_records_buffer_is_refused_in_one_line(argv, message):
    with pytest.raises(T.UsageError) as e:
        medium(*argv)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_medium_warm_up_compiles_every_stages_sequence_length():
    """M warms up around its transitions (L1722): ours adds the first step of each stage with a new length."""
    args = medium()
    schedule = T.batch_schedule(args, 8)
    steps = T.warm_up_steps(args.warmup_steps, schedule)
    assert steps == list(range(args.warmup_steps)) + [schedule.first_step(i) for i in (1, 2, 3)]
    assert sorted({schedule.seq_len(s) for s in steps}) == [16384, 32768, 49152, 65536]
    speedrun = T.parse_args(["--preset=speedrun", "--recipe=v2"], False)  # one length: the warm-up as before
    assert T.warm_up_steps(10, T.batch_schedule(speedrun, 8)) == list(range(10))


def test_the_medium_warm_up_compiles_each_yarn_state_and_the_untied_lookup():
    """A compiled model recompiled at step 786 (the lookup's switch after the split, in the third YaRN state): the
    warm-up visits it, as each YaRN change, and nothing else."""
    assert T.graph_changes(medium()) == [392, 784, 786, 1175]
    assert T.graph_changes(medium("--tied_embed_steps=0")) == [392, 784, 1175]
    assert T.graph_changes(T.parse_args(["--preset=speedrun", "--recipe=v2"], False)) == []


def test_a_checkpoint_of_the_old_medium_preset_is_refused_in_one_line():
    """A checkpoint.json written before --batch_sequences existed records none: it ran at the default (0, fixed
    16K sequences), so the run cannot go on under today's preset; refused before anything is read further."""
    fresh = medium()
    old = {k: v for k, v in dataclasses.asdict(fresh).items() if k != "batch_sequences"}
    old["seq_len"] = 16384  # the old preset's micro-batch
    with pytest.raises(T.UsageError) as e:
        T.resumed_hyperparameters(old, {}, fresh, Path("ckpt"))
    assert str(e.value) == ("checkpoint ckpt is from an older train_gpt.py, whose medium preset ran with "
                            "batch_sequences=0 (now 8): resume it with the train_gpt.py that wrote it (its sha256 is "
                            "in checkpoint.json), or start a fresh run")
    args, _ = T.resumed_hyperparameters({**old, "batch_sequences": 0}, {}, fresh, Path("ckpt"))
    assert (args.batch_sequences, args.seq_len) == (0, 16384)  # one that records it continues as it began
    speedrun = T.parse_args(["--preset=speedrun", "--recipe=reference"], False)  # a flag at its default on its preset: no change
    T.resumed_hyperparameters({k: v for k, v in dataclasses.asdict(speedrun).items() if k != "batch_sequences"}, {},
                              speedrun, Path("ckpt"))
    meta = {"hyperparameters": {k: v for k, v in dataclasses.asdict(fresh).items() if k != "vocab_size"}, "step": 1}
    T.check_compatible(Path("ckpt"), meta, fresh)  # an unrecorded field compares as its default, not as a mismatch


@pytest.mark.skipif(lifecycle.torch_release(torch.__version__) < (2, 11), reason="torch 2.10's AOTAutograd refuses fake "
                    "inputs from a FakeTensorMode other than dynamo's (docs/supported-torch.md)")
def test_the_medium_model_traces_forward_backward_and_validation_at_its_real_shape(monkeypatch):
    """The 16 x 1024 model with every medium technique, compiled whole as on a GPU (FlexAttention, the bf16
    head: the record has no FP8 head), traced on fake tensors (no kernel runs): one forward, one backward and one
    validation graph, FlexAttention's backward in the backward graph, and no graph reads a device value on the
    host. The sequences are short (the graph is the same at 16K and 256K tokens)."""
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_validate_device", lambda *_: None)  # no CPU backward needed: nothing runs
    seq = 1024
    args = medium(f"--seq_len={seq}", f"--batch_tokens={8 * seq}", f"--val_seq_len={2 * seq}",
                  f"--val_tokens={2 * seq}", cuda=True)
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16,
                   **T.choose_kernels(args, "cuda", fp8_capable=True))
    assert rt.attention == "flex" and not rt.fp8_head and rt.compile == "model"
    mode = FakeTensorMode()
    model = as_fake(T.build_model(args, rt), mode)
    assert len(model.value_embeds) == 5 and all(block.attn is not None for block in model.blocks)
    graphs: dict = {}
    backend = aot_autograd(fw_compiler=graph_recorder(graphs, "forward"), bw_compiler=graph_recorder(graphs, "backward"),
                           inference_compiler=graph_recorder(graphs, "validation"))
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    train_tokens = mode.from_tensor(documents(seq + 1, [0, 300, 301, 900]))
    val_tokens = mode.from_tensor(documents(2 * seq + 1, [0, 700, 1500], seed=1))
    step = StepTensorsAt(args, 1)
    with mode:
        loss = compiled(train_tokens[:-1], train_tokens[1:], mode.from_tensor(step.windows),
                        mode.from_tensor(step.mtp))
        loss.backward()
        assert model.blocks[9].attn.qkv_w.grad is not None  # layer 9 attends (the reference layout's does not)
        model.eval()
        with torch.no_grad():
            compiled(val_tokens[:-1], val_tokens[1:], mode.from_tensor(T.window_tensor(23, short_cap=11)))
    assert {kind: len(g) for kind, g in graphs.items()} == {"forward": 1, "backward": 1, "validation": 1}, graphs
    assert "flex_attention" in graph_ops(graphs["forward"][0])
    assert "flex_attention_backward" in graph_ops(graphs["backward"][0])


@dataclasses.dataclass
class StepTensorsAt:
    """The schedules' model inputs at one step, on the host."""
    args: T.Hyperparameters
    step: int

    @property
    def windows(self):
        return torch.tensor(T.attention_windows(self.step, self.args))

    @property
    def mtp(self):
        args = self.args
        return torch.tensor(T.mtp_loss_weights(self.step, T.scheduled_steps(args), args.mtp_tokens, args.mtp_frac))


# A tiny medium: 10 layers (five encoder layers read the five tables), the record's 12 batch stages as two packed
# sequences of 128 to 512 tokens, its window stages, capped short window and early MTP, on the bundled sample.
TINY_MEDIUM = ["--preset=medium", "--train_files=data/sample/sotu_train_*.bin", "--val_files=data/sample/sotu_val_*.bin",
               "--n_layer=10", "--model_dim=64", "--n_head=2", "--head_dim=32", "--batch_sequences=2", "--seq_len=512",
               "--batch_tokens=1024", "--val_seq_len=256", "--val_tokens=512", "--num_iterations=14",
               "--extension_steps=2", "--muon_momentum_cooldown_steps=2", "--val_every=6", "--warmup_steps=0",
               "--log_train_loss=true", "--compile=off", "--attention=banded", "--dtype=fp32",
               "--skip_connections=4>6,2>7,1>8",  # the record's 6>9,4>10,2>11 needs 12 layers
               "--tied_embed_steps=5"]  # M's split (785) at an odd step inside the 12 scheduled


def test_a_tiny_medium_trains_on_cpu_through_every_medium_only_path(tmp_path):
    """Falling losses through the value tables, every layer's attention, the window stages with their cap, the
    early MTP phases and the 12 batch stages (two packed sequences of 128 to 512 tokens per step), YaRN at the first
    three window changes and an extension step; its checkpoint is refused under the small preset in one line, and as
    the old medium preset's (no batch_sequences recorded) too, with nothing written."""
    one = run_main(TINY_MEDIUM + ["--run_id=m1", "--checkpoint_final=true"], tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    summary = json.loads((tmp_path / "m1.json").read_text())
    assert [s[1:] for s in summary["runtime"]["batch_stages"][:4]] == [[256, 2], [512, 2], [768, 2], [1024, 2]]
    log = (tmp_path / "m1.txt").read_text()
    assert "(derived) batch_stage_seq_len = 128/256/384/512/512/512" in log
    losses = train_losses(log)
    assert sorted(losses) == list(range(1, 15)) and losses[14] < losses[1]
    assert [line.split(",")[0] for line in log.splitlines() if line.startswith("yarn:")] == [
        f"yarn: from step {step}" for step in (1, 2, 3)]  # 3 -> 7 -> 11 -> 13 blocks; none from 15 on
    assert summary["final_val_loss"] < summary["val_curve"][0][1]
    small = run_main(["--preset=speedrun", f"--resume={tmp_path / 'm1' / 'step_000014'}", "--run_id=small"], tmp_path)
    assert small.returncode == 2 and small.stderr.count("\n") == 1
    assert "--preset=speedrun differs from checkpoint" in small.stderr and "a resumed run keeps its preset" in \
        small.stderr
    meta_path = tmp_path / "m1" / "step_000014" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    del meta["hyperparameters"]["batch_sequences"]  # as the train_gpt.py before it wrote it
    meta_path.write_text(json.dumps(meta))
    before = sorted(p for p in tmp_path.rglob("*"))
    old = run_main(["--preset=medium", f"--resume={meta_path.parent}", "--run_id=old"], tmp_path)
    assert old.returncode == 2 and old.stderr.count("\n") == 1, old.stderr
    assert "is from an older train_gpt.py, whose medium preset ran with batch_sequences=0 (now 8): resume it with " \
           "the train_gpt.py that wrote it" in old.stderr
    assert sorted(p for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_device_too_small_for_the_micro_batch_is_one_line_saying_what_to_pass(tmp_path, monkeypatch):
    """The warm-up is the first step: running out of memory there is a start-up error (exit 2) naming the
    micro-batch that halves it, not a traceback from inside a compiled graph."""
    def out_of_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.29 GiB")
    monkeypatch.setattr(T, "train_step", out_of_memory)
    result = run_main(TINY_MEDIUM + ["--run_id=oom", "--warmup_steps=1", "--batch_tokens=2048", "--seq_len=1024"],
                      tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "the medium preset's 10-layer model does not fit this device's memory at --seq_len=1024 (CUDA out of " \
           "memory. Tried to allocate 12.29 GiB); pass --batch_sequences=4 --seq_len=512 (the same batch in twice " \
           "the micro-steps)" in result.stderr
    plain = run_main(TINY_MEDIUM + ["--run_id=oom2", "--warmup_steps=1", "--batch_sequences=0", "--seq_len=256"],
                     tmp_path)  # fixed-length sequences: a shorter --seq_len alone
    assert "at --seq_len=256 (CUDA out of memory. Tried to allocate 12.29 GiB); pass --seq_len=128 (the same batch " \
           "in twice the micro-steps)" in plain.stderr


def test_the_medium_memory_estimate_runs_on_fake_tensors(capsys):
    """bench/memory_estimate.py --preset=medium from the trainer's own model: its validation on one GPU (the
    table in docs/presets.md has every phase on 1 and 8 GPUs; this test keeps the suite short)."""
    from bench import memory_estimate as M
    assert M.main(["--preset=medium", "--recipes=reference", "--gpus=1", "--phases=validation"]) == 0
    done = capsys.readouterr()
    assert "train_gpt.py --preset=medium" in done.out and "613.4M parameters" in done.out
    (row,) = [line for line in done.out.splitlines() if line.startswith("| reference | validation | 1 |")]
    assert 5 < float(row.split("|")[5]) < 79.6  # docs/presets.md: 8.5 GiB


def test_the_memory_estimate_measures_the_longest_packed_sequence_in_training_and_warm_up(capsys, monkeypatch):
    """--batch_sequences: the train step and the warm-up (which compiles every length) at the last stage's length,
    the same micro-steps in every stage."""
    from bench import memory_estimate as M
    lengths = []
    monkeypatch.setattr(M, "fake_tokens", lambda n, real=M.fake_tokens: lengths.append(n) or real(n))
    tiny = ["--n_layer=2", "--model_dim=64", "--n_head=2", "--head_dim=32", "--value_embed_tables=1",
            "--batch_tokens=1024", "--batch_sequences=2", "--seq_len=512", "--val_seq_len=512", "--val_tokens=512",
            "--skip_connections=0>1"]
    assert M.main(["--preset=medium", "--recipes=reference", "--gpus=1,2", "--phases=train,warm-up", "--", *tiny]) == 0
    out = capsys.readouterr().out
    assert "2 packed sequences per step of 128 / 256 / 384 / 512 tokens by stage" in out
    rows = [line.split(" | ")[1:4] for line in out.splitlines() if line.startswith("| reference |")]
    assert rows == [["train step", "1", "2"], ["warm-up", "1", "2"], ["train step", "2", "1"], ["warm-up", "2", "1"]]
    assert set(lengths) == {512}


def test_a_tiny_medium_resumes_on_either_side_of_the_split_as_if_never_stopped(tmp_path):
    """The tie (split after step 5), the odd-step Adam and the bf16 record Adam survive a checkpoint taken before
    the split (step 4) and one after it (step 6): the run stopped at both ends on the uninterrupted one's losses."""
    whole = run_main(TINY_MEDIUM + ["--run_id=whole"], tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    for launch in (["--stop_after=4"], ["--resume=auto", "--stop_after=6"], ["--resume=auto"]):
        part = run_main(TINY_MEDIUM + ["--run_id=part", *launch], tmp_path)
        assert part.returncode == 0, part.stderr[-2000:]
    log = (tmp_path / "part.txt").read_text()
    assert " resumes:2" in log.splitlines()[-1]  # stopped at 4 and at 6
    want, got = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("whole", "part"))
    assert got["final_val_loss"] == want["final_val_loss"]
    assert train_losses(log) == train_losses((tmp_path / "whole.txt").read_text())


def test_a_checkpoint_of_the_medium_preset_before_its_record_optimizers_is_refused_in_one_line(tmp_path):
    """Its checkpoint.json records none of the optimizer-structure flags (gates in Muon, no Adam master, the x0
    lambdas apart): its tensors are not this run's, and check_compatible says which flag in one line."""
    args = T.parse_args(["--preset=medium"], False)
    old = {k: v for k, v in dataclasses.asdict(args).items()
           if k not in ("muon_gates", "adam_master", "x0_lambda_lr")}
    with pytest.raises(T.UsageError) as e:
        T.check_compatible(tmp_path, {"hyperparameters": old, "step": 10}, args)
    assert "muon_gates" in str(e.value) and "\n" not in str(e.value)
    assert {"muon_gates", "adam_master", "x0_lambda_lr"} <= set(T.OPTIMIZER_STRUCTURE_FIELDS)
