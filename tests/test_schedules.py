"""Schedules (lr, Muon momentum, attention window) and the command line, checked against the recipe's numbers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as T  # noqa: E402
from conftest import TINY, run_main  # noqa: E402

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


def speedrun(*extra):
    return T.parse_args(["--preset=speedrun", *extra], cuda_available=False)


# ----------------------------------------------------------------------------- lr schedule

@pytest.mark.parametrize("step, expected", [
    (0, 1.0),
    (1061, 1.0),  # 1061/1770 = 0.59944 < 0.6: still constant
    (1062, 1.0),  # 1062/1770 = 0.6 exactly: the decay starts here at w = 1
    (1416, 0.55),  # progress 0.8: w = 0.2/0.4 = 0.5 -> 0.5 + 0.5 * 0.1
    (1770, 0.1),  # the end: lr_final_frac
    (1239, 1 - 0.9 * (177 / 708)),  # 177 steps into the 708-step cooldown
])
def test_lr_multiplier_matches_recipe(step, expected):
    args = speedrun()
    got = T.lr_multiplier(step, args.num_iterations, args.cooldown_frac, args.lr_final_frac)
    assert got == pytest.approx(expected, abs=1e-12)


def test_lr_multiplier_is_monotone_and_linear_in_cooldown():
    args = speedrun()
    lrs = [T.lr_multiplier(s, 1770, args.cooldown_frac, args.lr_final_frac) for s in range(1771)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    slopes = {round(lrs[s] - lrs[s + 1], 12) for s in range(1062, 1770)}
    assert slopes == {round(0.9 / 708, 12)}  # one constant slope: linear decay over the last 708 steps


@pytest.mark.parametrize("step, expected", [(0, 0.85), (150, 0.90), (300, 0.95), (1000, 0.95)])
def test_muon_momentum_warmup(step, expected):
    args = speedrun()
    got = T.muon_momentum(step, args.muon_momentum_warmup_steps, args.muon_momentum_start, args.muon_momentum)
    assert got == pytest.approx(expected, abs=1e-12)


# ----------------------------------------------------------------------------- window schedule

def reference_window_blocks(step, n=1770, final=1728):
    tokens = max(128, math.ceil(final * step / n / 128) * 128)  # next_multiple_of(1728*step/1770, 128), >= 1 block
    return tokens // 128


@pytest.mark.parametrize("step, expected", [
    (0, 1), (1, 1), (131, 1), (132, 2),  # 1728*131/1770 = 127.9 -> 128; 1728*132/1770 = 128.9 -> 256
    (885, 7),  # halfway: 864 tokens -> 896 = 7 blocks
    (1180, 9),  # 1728*1180/1770 = 1152 = 9 blocks exactly (not rounded up to 10)
    (1770, 14),  # 1728 -> 1792 tokens = 14 blocks
])
def test_window_blocks_speedrun(step, expected):
    args = speedrun()
    assert T.attention_windows(step, args)[0] == expected == reference_window_blocks(step)


def test_window_blocks_every_step_matches_reference():
    args = speedrun()
    got = [T.attention_windows(s, args)[0] for s in range(1771)]
    assert got == [reference_window_blocks(s) for s in range(1771)]
    assert all(a <= b for a, b in zip(got, got[1:]))


def test_full_window_without_sliding_window_spans_the_longest_sequence_at_every_step():
    """The long window covers every block of the longest sequence the run attends over: validation's 256K tokens
    (2048 blocks) on the speedrun preset, 2048 tokens (16 blocks) on the cpu one. That a window as long as the
    sequence leaves only the causal and same-document rules is test_model.py's brute-force mask test."""
    assert [T.attention_windows(s, speedrun("--sliding_window=false")) for s in (0, 500, 1770)] == [(2048, 1024)] * 3
    cpu = T.parse_args(["--preset=cpu", "--sliding_window=false"], False)
    assert [T.attention_windows(s, cpu) for s in (0, 100, cpu.num_iterations)] == [(16, 8)] * 3


@pytest.mark.parametrize("long, short", [(1, 1), (2, 1), (3, 1), (7, 3), (14, 7)])
def test_short_window_is_half_the_long_one_at_least_one_block(long, short, monkeypatch):
    """The schedule gives the short-window layers max(1, long // 2) blocks (the record's long // 2, which
    we keep at least one block), and the model builds its two masks from exactly the pair it is given."""
    assert T.window_pair(long) == (long, short)
    assert torch.equal(T.window_tensor(long), torch.tensor([long, short]))
    args = T.parse_args(["--preset=cpu", "--n_layer=4", "--model_dim=32", "--n_head=1", "--head_dim=32",
                         "--vocab_size=64", "--seq_len=2048", "--val_seq_len=2048", "--val_tokens=2048"], False)
    model = T.GPT(T.ModelConfig.of(args))
    seen = []
    monkeypatch.setattr(model, "backend", type("Spy", (T.BandedAttention,), {
        "build_mask": staticmethod(lambda tokens, w: seen.append(int(w)) or T.banded_window_mask(tokens, w))}))
    tokens = torch.randint(0, 64, (2048,))
    model(tokens, tokens, T.window_tensor(long))
    assert sorted(seen) == sorted([long, short])


def test_every_step_has_its_window_pair_and_mtp_weights_as_device_tensors():
    args = speedrun("--mtp_tokens=3")
    schedules = T.StepTensors(args, torch.device("cpu"))
    for step in (0, 1, 600, 1770):
        assert schedules.windows(step).tolist() == list(T.window_pair(reference_window_blocks(step)))
        [weights] = schedules.mtp_weights(step)
        assert weights.tolist() == torch.tensor(T.mtp_loss_weights(step, 1770, 3)).tolist()
        assert weights.untyped_storage().data_ptr() == schedules.mtp_table.untyped_storage().data_ptr()  # a view
    assert schedules.windows(5) is schedules.windows(6)  # made once: the same tensor object while the window stays put
    assert T.StepTensors(speedrun(), torch.device("cpu")).mtp_weights(3) == []  # one-token loss: no input
    # a warm-up longer than the run (--warmup_steps > --num_iterations) trains on the last step's inputs
    assert schedules.windows(5000).tolist() == list(T.window_pair(reference_window_blocks(1770)))
    assert schedules.mtp_weights(5000)[0].tolist() == [1.0, 0.0, 0.0]


def test_a_training_step_makes_no_tensor_from_host_values(tmp_path, monkeypatch):
    """On a GPU, torch.tensor(python values, device=cuda) is a copy from pageable memory that waits for the
    device: a training step must only index what start-up put on the device (v2: windows and MTP weights)."""
    train_step, calls = T.train_step, []

    def guarded(*a, **k):
        def host_tensor(*args, **kwargs):
            raise AssertionError(f"torch.tensor{args!r:.60} inside a training step")
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(torch, "tensor", host_tensor)
            calls.append(1)
            return train_step(*a, **k)

    monkeypatch.setattr(T, "train_step", guarded)
    result = run_main(TINY + ["--recipe=v2", "--n_layer=4", "--mtp_tokens=3", "--batch_schedule=", "--bigram_vocab_size=512",
                              "--bigram_dim=32", "--run_id=nocopy"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(calls) == 4


# ----------------------------------------------------------------------------- command line

def test_unknown_flag_lists_valid_names():
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--learning_rate=0.1"], False)
    msg = str(e.value)
    assert "--learning_rate=0.1" in msg
    for name in ("--muon_lr=", "--seq_len=", "--preset=", "--sliding_window="):
        assert name in msg


def test_not_a_flag_refused():
    with pytest.raises(T.UsageError, match="unknown argument 'seed=3'"):
        T.parse_args(["seed=3"], False)


@pytest.mark.parametrize("arg, kind", [("--seed=abc", "int"), ("--muon_lr=fast", "float"),
                                       ("--muon=maybe", "bool"), ("--seq_len=1.5", "int")])
def test_bad_value_names_flag_and_type(arg, kind):
    with pytest.raises(T.UsageError) as e:
        T.parse_args([arg], False)
    name, value = arg[2:].split("=")
    assert f"--{name}" in str(e.value) and value in str(e.value) and kind in str(e.value)


def test_flag_without_value():
    assert T.parse_args(["--checkpoint_final"], False).checkpoint_final is True
    with pytest.raises(T.UsageError, match="--seed needs a value"):
        T.parse_args(["--seed"], False)


@pytest.mark.parametrize("text, value", [("true", True), ("1", True), ("yes", True), ("ON", True),
                                         ("false", False), ("0", False), ("no", False), ("Off", False)])
def test_bool_parsing(text, value):
    assert T.parse_args([f"--value_embeds={text}"], False).value_embeds is value


def test_presets_resolve():
    cpu = T.parse_args([], cuda_available=False)
    assert cpu.preset == "cpu" and cpu.n_layer == T.PRESETS["cpu"]["n_layer"] and cpu.model_dim == 256
    gpu = T.parse_args([], cuda_available=True)
    assert gpu.preset == "speedrun" and gpu == T.Hyperparameters(preset="speedrun")
    forced = T.parse_args(["--preset=speedrun"], cuda_available=False)
    assert (forced.preset, forced.n_layer, forced.model_dim, forced.seq_len) == ("speedrun", 12, 768, 48 * 1024)
    over = T.parse_args(["--preset=cpu", "--n_layer=4"], False)
    assert over.n_layer == 4 and over.model_dim == 256  # an override wins over the preset, the rest stays
    with pytest.raises(T.UsageError, match="unknown preset 'tiny'.*speedrun, cpu"):
        T.parse_args(["--preset=tiny"], False)


@pytest.mark.parametrize("arg", ["--seq_len=1000", "--val_seq_len=129"])
def test_seq_len_not_multiple_of_block_refused(arg):
    name, value = arg[2:].split("=")
    with pytest.raises(T.UsageError, match=f"--{name}={value} is not a multiple of the 128-token block"):
        T.parse_args(["--preset=cpu", arg], False)


@pytest.mark.parametrize("arg, match", [("--dtype=fp16", "bf16, fp32"), ("--attention=xformers", "flex, banded"),
                                        ("--n_layer=3", "even depth"), ("--num_iterations=0", "at least 1")])
def test_other_invalid_settings_refused(arg, match):
    with pytest.raises(T.UsageError, match=match):
        T.parse_args(["--preset=cpu", arg], False)


@pytest.mark.parametrize("world_size, accum", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_gradient_accumulation_keeps_global_batch(world_size, accum):
    args = speedrun()
    batches = T.batch_schedule(args, world_size)
    assert batches.stage_accum == (accum,) and batches.stage_tokens == (args.batch_tokens,)
    assert all(batches.accum(s) * world_size * args.seq_len == args.batch_tokens for s in (0, 885, 1770))
    assert batches.lr_scale(0) == 1.0 == batches.lr_scale(1770)


@pytest.mark.parametrize("world_size", [3, 5, 16])
def test_gradient_accumulation_refuses_impossible_world_size(world_size):
    with pytest.raises(T.UsageError) as e:
        T.batch_schedule(speedrun(), world_size)
    assert f"world size {world_size}" in str(e.value) and "[1, 2, 4, 8]" in str(e.value)


# ----------------------------------------------------------------------------- batch-size schedule (recipe v2)

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


@pytest.mark.parametrize("flags, match", [
    (["--batch_tokens=4096", "--batch_schedule=1/3,1"], "stage 1/3 of --batch_tokens=4096 is 1365.33 tokens"),
    (["--batch_tokens=4096", "--batch_schedule=1/8,1"], "stage 1/8 of --batch_tokens=4096 is 512 tokens, not whole "
                                                       "sequences of --seq_len=1024"),
    (["--batch_schedule=1/2,0"], "bad value '1/2,0' for --batch_schedule"),
])
def test_a_stage_that_is_not_whole_sequences_is_refused_at_start_up(flags, match):
    with pytest.raises(T.UsageError, match=match):
        T.parse_args(["--preset=cpu"] + flags, False)


def test_recipe_v2_switches_every_technique_on_and_each_flag_switches_one_off():
    ref, v2 = speedrun(), speedrun("--recipe=v2")
    assert ref == T.Hyperparameters(preset="speedrun")  # the reference stays the dataclass defaults
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
