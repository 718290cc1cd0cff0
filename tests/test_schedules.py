"""Schedules (lr, Muon momentum, attention window, the step's device tensors), checked against the recipe's numbers."""

import dataclasses
import itertools
import math

import pytest
import torch

import train_gpt as T
from conftest import TINY, run_main


def speedrun(*extra):
    return T.parse_args(["--preset=speedrun", "--recipe=reference", *extra], cuda_available=False)


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
        "build_mask": staticmethod(lambda tokens, w, **kw: seen.append(int(w)) or T.banded_window_mask(tokens, w,
                                                                                                        **kw))}))
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


@pytest.mark.parametrize("argv", [["--preset=speedrun"], ["--preset=medium"], ["--preset=cpu", "--recipe=v2"],
                                  ["--preset=cpu", "--window_final_tokens=300", "--num_iterations=7"],
                                  ["--preset=cpu", "--sliding_window=false"],
                                  ["--preset=cpu", "--window_final_tokens=1000000", "--num_iterations=50"]])
def test_the_windows_made_at_start_up_cover_every_step_without_walking_them(argv):
    args = T.parse_args(argv, False)
    reached = {T.attention_windows(step, args) for step in range(args.num_iterations + 1)}
    assert reached <= T.window_pairs(args)


@pytest.mark.parametrize("argv", [["--preset=medium"], ["--preset=cpu", "--recipe=v2", "--num_iterations=61"],
                                  ["--preset=cpu"]])
def test_tokens_before_sums_the_stages_as_the_steps_would(argv):
    args = T.parse_args(argv, False)
    batches = T.batch_schedule(args, 1)
    total = 0
    for step in range(args.num_iterations + 3):  # past the end too: a warm-up longer than the run
        assert batches.tokens_before(step) == total, step
        total += batches.tokens(step)


def test_start_up_of_a_very_long_run_walks_no_step(monkeypatch):
    """--num_iterations=100000000 looped over every step in Python at start-up and never printed a line."""
    steps = 10**6
    args = speedrun("--mtp_tokens=3", f"--num_iterations={steps}")
    calls = {"windows": 0, "mtp": 0}
    windows, mtp = T.attention_windows, T.mtp_loss_weights

    def counted(name, function):
        def call(*a, **k):
            calls[name] += 1
            return function(*a, **k)
        return call

    monkeypatch.setattr(T, "attention_windows", counted("windows", windows))
    monkeypatch.setattr(T, "mtp_loss_weights", counted("mtp", mtp))
    schedules = T.StepTensors(args, torch.device("cpu"))
    assert calls["windows"] < 100 and calls["mtp"] <= T.MTP_TABLE_ROWS, calls
    for step in (0, 12345, T.MTP_TABLE_ROWS - 1, T.MTP_TABLE_ROWS, 700_001, steps, steps + 10):
        assert schedules.windows(step).tolist() == list(windows(min(step, steps), args))
        assert schedules.mtp_weights(step)[0].tolist() == torch.tensor(mtp(min(step, steps), steps, 3)).tolist()
    assert schedules.windows(5) is schedules.windows(6)


def test_a_step_count_beyond_any_run_is_refused_in_one_line():
    with pytest.raises(T.UsageError, match=r"^bad value 12345678901234567890 for --num_iterations; valid: an integer "
                                           r"in \[1, 1000000000\]$"):
        T.parse_args(["--preset=cpu", "--num_iterations=12345678901234567890"], False)


# ----------------------------------------------------------------------------- track 2: the record's schedules
# The medium preset against the record's own functions, transcribed here from its source ("M": the train_gpt.py
# embedded in the logs of records/track_2_medium/2025-12-31_BulkSmallTrackTransfer; docs/track2-record-fidelity.md,
# "Schedules at the record's boundary steps"): 4700 scheduled steps, 40 extension steps, 4740 in all.

M_SCHEDULED, M_STEPS, M_COOLDOWN = 4700, 4740, 0.70
M_BATCHES = (131072, 262144, 393216) + (524288,) * 9
M_WINDOWS = (3, 7, 11, 13, 15, 17, 19, 21, 23, 23, 23, 23)
# the audit's table: step -> (M get_lr, M batch, M momentum)
M_BOUNDARY_VALUES = {
    0: (1, 131072, 0.85), 1: (1, 131072, 0.850333), 299: (1, 131072, 0.949667), 300: (1, 131072, 0.95),
    391: (1, 131072, 0.95), 392: (1.52, 262144, 0.95), 783: (1.52, 262144, 0.95), 784: (1.73, 393216, 0.95),
    785: (1.73, 393216, 0.95), 786: (1.73, 393216, 0.95), 1174: (1.73, 393216, 0.95), 1175: (1.73, 524288, 0.95),
    1176: (2, 524288, 0.95), 1410: (2, 524288, 0.95), 1411: (1.99942, 524288, 0.95),
    1567: (1.90933, 524288, 0.95), 3134: (1.00438, 524288, 0.95), 4690: (0.105775, 524288, 0.95),
    4691: (0.105198, 524288, 0.948), 4699: (0.100578, 524288, 0.932), 4700: (0.1, 524288, 0.93),
    4701: (0.1, 524288, 0.928), 4739: (0.1, 524288, 0.852),
}


def m_get_lr(step):
    if step > M_SCHEDULED:
        return 0.1
    lr_max = 1.0
    x = step / M_SCHEDULED
    if x > 1/12:
        lr_max = 1.52
    if x > 2/12:
        lr_max = 1.73
    if x > 3/12:
        lr_max = 2.0
    if x >= 1 - M_COOLDOWN:
        w = (1 - x) / M_COOLDOWN
        return lr_max * w + (1 - w) * 0.1
    return lr_max


def m_get_bs(step):
    return 524288 if step >= M_SCHEDULED else M_BATCHES[int(len(M_BATCHES) * (step / M_SCHEDULED))]


def m_get_ws(step):
    """(long, short), with the last validation's ws_validate_post_yarn_ext."""
    if step == M_STEPS:
        return 27, 11
    if step >= M_SCHEDULED:
        return 23, 23 // 2
    long = M_WINDOWS[int(len(M_WINDOWS) * (step / M_SCHEDULED))]
    return long, min(11, long // 2)


def m_get_muon_momentum(step, warmup=300, cooldown=50, low=0.85, high=0.95):
    cooldown_start = M_STEPS - cooldown
    if step < warmup:
        return low + step / warmup * (high - low)
    if step > cooldown_start:
        return high - (step - cooldown_start) / cooldown * (high - low)
    return high


def m_mtp_weights(step):
    x = step / (M_SCHEDULED / 4)
    if x < 1/3:
        return [1.0, 0.5, 0.25 * (1 - 3*x)]
    if x < 2/3:
        return [1.0, 0.5 * (1 - (3*x - 1))]
    return [1.0]


def m_yarn_states():
    """M's Yarn object stepped by advance_schedule through the run: {step: (angular_freq, attn_scale)} after each
    step's schedule (float32 frequencies, as M's buffer)."""
    freq = (1 / 1024) ** torch.linspace(0, 1, steps=32, dtype=torch.float32)
    freq = torch.cat([freq, freq.new_zeros(32)])
    scale, long, states = 0.1, m_get_ws(0)[0], {}
    for step in range(M_STEPS):
        new = m_get_ws(step)[0]
        if new != long and new <= 13:
            rotations = 128 * long * freq / (2 * torch.pi)
            scaling_factor = long / new
            interpolation_weight = torch.clamp((rotations - 1) / (32 - 1), 0, 1)
            freq = freq * (scaling_factor + interpolation_weight * (1 - scaling_factor))
            scale *= 0.2 * math.log(new / long) + 1
        long = new
        states[step] = (freq.clone(), scale)
    states[M_STEPS] = states[M_STEPS - 1]  # the last validation: 27 blocks, no YaRN
    return states


def medium_schedules():
    args = T.parse_args(["--preset=medium"], False)
    batches = T.batch_schedule(args, 8)
    return args, batches, type("RunStub", (), {"args": args, "batches": batches})


def test_the_medium_lr_is_the_records_get_lr_over_2_at_every_step():
    """Cooldown multiplier x stage share == M get_lr / 2 bit for bit at all 4740 steps: the stages from x > k/12
    (392, 784, 1176: one step after the batch's 1175), the cooldown from 1411 on the 4700-step clock, the floor
    0.05 from 4700 through the extension."""
    args, batches, run = medium_schedules()
    ours = [T.lr_multiplier_at(run, step) for step in range(M_STEPS)]
    assert ours == [m_get_lr(step) / 2 for step in range(M_STEPS)]
    for step, (lr, _, _) in M_BOUNDARY_VALUES.items():
        assert ours[step] == pytest.approx(lr / 2, rel=1e-5), step
    assert [batches.lr_stage(s) for s in (391, 392, 783, 784, 1175, 1176)] == [0, 1, 1, 2, 2, 3]


def test_the_medium_batch_is_the_records_get_bs_and_the_run_trains_its_tokens():
    args, batches, _ = medium_schedules()
    assert [batches.tokens(step) for step in range(M_STEPS + 3)] == [m_get_bs(step) for step in range(M_STEPS + 3)]
    assert [batches.first_step(i) for i in range(4)] == [0, 392, 784, 1175]
    for step, (_, batch, _) in M_BOUNDARY_VALUES.items():
        assert batches.tokens(step) == batch, step
    assert batches.tokens_before(M_STEPS) == sum(map(m_get_bs, range(M_STEPS))) == 2_176_974_848
    assert batches.stage_accum[:4] == (1, 1, 1, 1)  # one packed buffer per GPU on 8 (M L1351)
    assert batches.stage_seq_len[:4] == (16384, 32768, 49152, 65536)


def test_the_medium_muon_momentum_warms_up_and_cools_down_as_the_records():
    args, _, _ = medium_schedules()
    ours = [T.muon_momentum_at(step, args) for step in range(M_STEPS)]
    assert ours[300:] == [m_get_muon_momentum(step) for step in range(300, M_STEPS)]  # the cooldown in M's form
    assert ours[:300] == pytest.approx([m_get_muon_momentum(step) for step in range(300)], abs=1e-15)
    for step, (_, _, momentum) in M_BOUNDARY_VALUES.items():
        assert ours[step] == pytest.approx(momentum, abs=5e-7), step


def test_the_medium_windows_and_mtp_weights_are_the_records_at_every_step():
    args, _, _ = medium_schedules()
    assert [T.attention_windows(step, args) for step in range(M_STEPS + 1)] == \
        [m_get_ws(step) for step in range(M_STEPS + 1)]
    for step in range(M_STEPS + 1):
        ours = T.mtp_loss_weights(step, T.scheduled_steps(args), args.mtp_tokens, args.mtp_frac)
        want = m_mtp_weights(step)
        assert ours == want + [0.0] * (3 - len(want)), step
    schedules = T.StepTensors(args, torch.device("cpu"))
    assert schedules.mtp_last == 1175 and schedules.windows(M_STEPS).tolist() == [27, 11]
    assert schedules.mtp_weights(392)[0].tolist() == pytest.approx([1, 0.499574, 0], abs=1e-6)


def test_yarn_is_the_records_at_every_window_change_and_a_pure_function_of_the_step():
    """yarn_state against M's Yarn stepped through the run: the same float32 frequencies and the same attention
    scale at every step around each change; the audit's values: 0.1 -> 0.116946 -> 0.127518 -> 0.131778, then
    fixed through the 27-block last validation (no YaRN above 13 blocks)."""
    args, _, _ = medium_schedules()
    m = m_yarn_states()
    for step in (0, 391, 392, 393, 783, 784, 785, 1174, 1175, 1176, 1566, 1567, 3134, 4700, 4739, 4740):
        freqs, scale = T.yarn_state(step, args)
        assert torch.equal(freqs, m[step][0]) and scale == m[step][1], step
    scales = [T.yarn_state(step, args)[1] for step in (391, 392, 784, 1175, 4740)]
    assert scales == pytest.approx([0.1, 0.1169460, 0.1275175, 0.1317780, 0.1317780], abs=5e-8)
    final = [1, 0.799638, 0.639421, 0.504225, 0.356011, 0.254507, 0.17184, 0.111207, 0.0736302, 0.0508033,
             0.0361749, 0.0263929, 0.0196245, 0.0148107, 0.0113099, 0.00871741, 0.00676914, 0.00528742,
             0.00414952, 0.00329728, 0.00263663, 0.00210835, 0.00168592, 0.00134812, 0.00107801, 0.000862019,
             0.000689303, 0.000551193, 0.000440755, 0.000352445, 0.000281828, 0.000225361]
    freqs = T.yarn_state(4740, args)[0]
    assert freqs[:32].tolist() == pytest.approx(final, rel=2e-5) and not freqs[32:].any()
    first = T.yarn_state(392, args)[0] / T.rotary_frequencies(128)
    assert first[:3].tolist() == [1, 1, 1] and first[3].item() == pytest.approx(0.98615, abs=1e-5)
    assert first[19:32].tolist() == pytest.approx([3 / 7] * 13, rel=1e-6)
    off = T.parse_args(["--preset=medium", "--yarn_max_window=0"], False)
    assert T.yarn_state(4740, off)[1] == 0.1 and torch.equal(T.yarn_state(4740, off)[0], T.rotary_frequencies(128))


def test_the_model_follows_yarn_in_place_and_a_fresh_model_at_a_step_rebuilds_the_same_state():
    """follow_yarn rebuilds every layer's rotary tables (same buffers) and scales once per change; a model built
    afresh and brought to a later step (a resumed run, a tool) holds exactly the same tables and scales."""
    args = T.parse_args(["--preset=medium", "--compile=off", "--n_layer=2", "--model_dim=64", "--n_head=2",
                         "--head_dim=32", "--value_embed_tables=1", "--seq_len=256", "--val_seq_len=256",
                         "--val_tokens=256", "--batch_tokens=1024", "--batch_sequences=0", "--skip_connections=0>1"], False)
    model = T.GPT(T.ModelConfig.of(args))
    table = model.blocks[0].attn.rotary.cos
    assert T.follow_yarn(model, 0, args) is None and T.follow_yarn(model, 391, args) is None
    changes = [T.follow_yarn(model, step, args) for step in range(392, 1200)]
    assert [c for c in changes if c is not None] == [(1, T.yarn_state(392, args)[1]), (2, T.yarn_state(784, args)[1]),
                                                     (3, T.yarn_state(1175, args)[1])]
    freqs, scale = T.yarn_state(1175, args)
    positions = torch.arange(table.size(0), dtype=torch.float32)
    assert model.blocks[0].attn.rotary.cos is table and torch.equal(table, torch.outer(positions, freqs).cos().to(table.dtype))
    assert all(block.attn.scale == scale for block in model.blocks)
    fresh = T.GPT(T.ModelConfig.of(args))
    assert T.follow_yarn(fresh, 3000, args) == (3, scale)
    assert all(torch.equal(a.attn.rotary.sin, b.attn.rotary.sin) for a, b in zip(model.blocks, fresh.blocks))


def test_the_tools_run_a_checkpoint_at_its_steps_yarn_state_and_windows():
    from pathlib import Path

    from tools import loading
    args = T.parse_args(["--preset=medium", "--compile=off", "--n_layer=2", "--model_dim=64", "--n_head=2",
                         "--head_dim=32", "--value_embed_tables=1", "--seq_len=256", "--val_seq_len=256",
                         "--val_tokens=256", "--batch_tokens=1024", "--batch_sequences=0", "--skip_connections=0>1", "--dtype=fp32"], False)
    state = T.GPT(T.ModelConfig.of(args)).state_dict()
    for step, window, at in ((800, "step", 800), (300, "step", 300), (300, "final", 4740)):
        loaded = loading.build(args, state, step, torch.device("cpu"), window, Path("ckpt"))
        assert loaded.windows == T.attention_windows(at, args)
        assert all(block.attn.scale == T.yarn_state(at, args)[1] for block in loaded.model.blocks), (step, window)
    assert loaded.windows == (27, 11)


# ----------------------------------------------------------------------------- record #89 (--recipe=record)
# Its schedules transcribed from its source (KellerJordan/modded-nanogpt at f411b3d3, "T:n" = a line of its
# train_gpt.py; docs/track1-record-fidelity.md section 2): TrainingSchedule, get_lr, get_muon_momentum, the stages'
# windows and Yarn.apply. 1270 scheduled steps and 15 extension steps, 1285 in all.

R_SCHEDULED, R_EXTENSION = 1270, 15
R_STEPS = R_SCHEDULED + R_EXTENSION
# TRAINING_STAGES (T:1979-1989): duration, batch_size, window_sizes (short, long), lr_mul, train_max_seq_len
R_STAGES = [(1 / 3, 8 * 2048 * 8, (1, 3), 1.0, 896), (1 / 3, 16 * 2048 * 8, (3, 7), 1.52, 2048),
            (1 / 3, 24 * 2048 * 8, (5, 11), 1.73, 2048), (None, 24 * 2048 * 8, (6, 13), 1.0, 2048)]


def r_boundaries():
    """TrainingSchedule.__init__ (T:1940-1945): [start, end) of each stage, the extension last."""
    durations = [stage[0] for stage in R_STAGES[:-1]]
    ends = [0, *[round(c * R_SCHEDULED) for c in itertools.accumulate(durations)], R_STEPS]
    return list(itertools.pairwise(ends))


def r_lookup(step):
    """TrainingSchedule.lookup (T:1959-1966): (stage index, fraction of the way through it)."""
    for i, (start, end) in enumerate(r_boundaries()):
        if step < end:
            return i, (step - start) / (end - start)
    return len(R_STAGES) - 1, 1.0


def r_get_lr(step):
    """TrainingSchedule.get_lr (T:1968-1976) with cooldown_frac=0.60 (T:1992)."""
    lr = R_STAGES[r_lookup(step)[0]][3]
    cd_start = int(R_SCHEDULED * (1 - 0.60))
    if step >= cd_start:
        t = min(1.0, (step - cd_start) / (R_SCHEDULED - cd_start))
        lr = lr * (1 - t) + 0.15 * t
    return lr


def r_get_ws(step):
    """(long, short) in blocks: the stage's window_sizes (T:2112-2113); the last validation's 20 (T:2092-2093)."""
    if step == R_STEPS:
        return 20, 6
    short, long = R_STAGES[r_lookup(step)[0]][2]
    return long, short


def r_get_muon_momentum(step, muon_warmup_steps=300, muon_cooldown_steps=50, momentum_min=0.85, momentum_max=0.95):
    """get_muon_momentum (T:1995-2006)."""
    momentum_cd_start = R_STEPS - muon_cooldown_steps
    if step < muon_warmup_steps:
        frac = step / muon_warmup_steps
        return momentum_min + frac * (momentum_max - momentum_min)
    if step > momentum_cd_start:
        frac = (step - momentum_cd_start) / muon_cooldown_steps
        return momentum_max - frac * (momentum_max - momentum_min)
    return momentum_max


def r_yarn_states():
    """The record's Yarn (T:1000-1056) stepped by advance_schedule (T:2111-2116) through the run: {step:
    (angular_freq, attn_scale)}; the last validation's 20 blocks apply no YaRN."""
    freq = (1 / 1024) ** torch.linspace(0, 1, steps=32, dtype=torch.float32)
    freq = torch.cat([freq, freq.new_zeros(32)])
    scale, long, states = 0.1, r_get_ws(0)[0], {}
    for step in range(R_STEPS):
        new = r_get_ws(step)[0]
        if new != long:
            old_window, new_window = long * 128, new * 128
            rotations = old_window * freq / (2 * torch.pi)
            scaling_factor = old_window / new_window
            interpolation_weight = torch.clamp((rotations - 1) / (32 - 1), 0, 1)
            freq = freq * (scaling_factor + interpolation_weight * (1 - scaling_factor))
            scale *= 0.2 * math.log(new_window / old_window) + 1
        long = new
        states[step] = (freq.clone(), scale)
    states[R_STEPS] = states[R_STEPS - 1]
    return states


def record_schedules(preset="speedrun", world_size=8):
    args = T.parse_args([f"--preset={preset}", "--recipe=record"], False)
    return args, T.batch_schedule(args, world_size)


# The audit's boundary table (section 2): step -> (stage, lr multiplier, Muon lr, Adam head/embed lr, value/bigram
# table lr, Muon momentum, (short, long) window tokens, attention scale, Adam step, tied)
R_BOUNDARY_TABLE = {
    0: (0, 1.000, 0.02300, 0.00800, 0.600, 0.850, (128, 384), 0.1, False, True),
    1: (0, 1.000, 0.02300, 0.00800, 0.600, 0.8503, (128, 384), 0.1, True, True),
    300: (0, 1.000, 0.02300, 0.00800, 0.600, 0.950, (128, 384), 0.1, False, True),
    422: (0, 1.000, 0.02300, 0.00800, 0.600, 0.950, (128, 384), 0.1, False, True),
    423: (1, 1.520, 0.03496, 0.01216, 0.912, 0.950, (384, 896), 0.116946, True, True),
    508: (1, 1.520, 0.03496, 0.01216, 0.912, 0.950, (384, 896), 0.116946, False, True),
    509: (1, 1.5182, 0.03492, 0.01215, 0.911, 0.950, (384, 896), 0.116946, True, True),
    846: (1, 0.91231, 0.02098, 0.00730, 0.547, 0.950, (384, 896), 0.116946, False, True),
    847: (2, 1.02709, 0.02362, 0.00822, 0.616, 0.950, (640, 1408), 0.127518, True, True),
    849: (2, 1.02294, 0.02353, 0.00818, 0.614, 0.950, (640, 1408), 0.127518, True, False),
    1000: (2, 0.70984, 0.01633, 0.00568, 0.426, 0.950, (640, 1408), 0.127518, False, False),
    1235: (2, 0.22257, 0.00512, 0.00178, 0.134, 0.950, (640, 1408), 0.127518, True, False),
    1236: (2, 0.22050, 0.00507, 0.00176, 0.132, 0.948, (640, 1408), 0.127518, False, False),
    1269: (2, 0.15207, 0.00350, 0.00122, 0.091, 0.882, (640, 1408), 0.127518, True, False),
    1270: (3, 0.15, 0.00345, 0.00120, 0.090, 0.880, (768, 1664), 0.131778, False, False),
    1284: (3, 0.15, 0.00345, 0.00120, 0.090, 0.852, (768, 1664), 0.131778, False, False),
}


@pytest.mark.parametrize("step", sorted(R_BOUNDARY_TABLE))
def test_the_record_recipe_has_the_audits_values_at_every_boundary_step(step):
    stage, lr, muon_lr, head_lr, table_lr, momentum, windows, scale, adam_step, tied = R_BOUNDARY_TABLE[step]
    args, batches = record_schedules()
    ell = T.step_lr_multiplier(step, args, batches)
    assert min(batches.stage(step), 2) == min(stage, 2) and (step >= args.num_iterations - 15) == (stage == 3)
    assert ell == pytest.approx(lr, abs=5e-6)
    assert args.muon_lr * ell == pytest.approx(muon_lr, abs=5e-6)
    assert args.head_lr * ell == pytest.approx(head_lr, abs=5e-6)
    assert args.token_embed_lr * ell == pytest.approx(head_lr, abs=5e-6)
    assert args.embed_lr * ell == pytest.approx(table_lr, abs=5e-4)
    assert T.muon_momentum_at(step, args) == pytest.approx(momentum, abs=5e-5)
    long, short = T.attention_windows(step, args)
    assert (short * T.BLOCK_SIZE, long * T.BLOCK_SIZE) == windows
    assert T.yarn_state(step, args)[1] == pytest.approx(scale, abs=5e-7)
    assert ((step + 1) % args.adam_every == 0) == adam_step
    assert (step <= args.tied_embed_steps) == tied


def test_the_record_recipe_stages_start_at_423_and_847_for_the_batch_lr_windows_and_yarn():
    args, batches = record_schedules()
    assert [start for start, _ in r_boundaries()] == [0, 423, 847, 1270]
    assert [batches.first_step(k) for k in range(3)] == [0, 423, 847]
    assert [batches.stage(s) for s in range(R_STEPS + 3)] == [min(r_lookup(s)[0], 2) for s in range(R_STEPS + 3)]
    assert [batches.lr_stage(s) for s in range(R_STEPS + 3)] == [batches.stage(s) for s in range(R_STEPS + 3)]
    assert [batches.tokens(s) for s in range(R_STEPS + 3)] == [R_STAGES[r_lookup(s)[0]][1] for s in range(R_STEPS + 3)]
    assert [c for c, _, _ in T.long_window_changes(args)] == [423, 847, 1270]
    assert [c for c, _, _ in T.yarn_changes(R_STEPS, args)] == [423, 847, 1270]
    assert args.tied_embed_steps == r_boundaries()[2][0] | 1 == 847  # T:1948: the split on an odd step
    assert batches.stage_accum == (1, 1, 1) and batches.stage_seq_len == (16384, 32768, 49152)


def test_the_record_recipe_trains_the_records_tokens():
    """The tokens seen before each stage and in all (section 2): 55,443,456; 166,592,512; 332,922,880; 338,821,120."""
    _, batches = record_schedules()
    expected = {423: 55_443_456, 847: 166_592_512, 1270: 332_922_880, 1285: 338_821_120}
    for step, tokens in expected.items():
        assert batches.tokens_before(step) == tokens == sum(R_STAGES[r_lookup(s)[0]][1] for s in range(step))


def test_the_record_recipe_lr_is_the_records_get_lr_at_every_step():
    """Bit for bit at all 1285 steps and past them: the stage's lr_mul until 508, then lr_mul (1 - t) + 0.15 t."""
    args, batches = record_schedules()
    ours = [T.step_lr_multiplier(step, args, batches) for step in range(R_STEPS + 3)]
    assert ours == [r_get_lr(step) for step in range(R_STEPS + 3)]
    assert ours[507:510] == [1.52, 1.52, 1.52 * (1 - 1 / 762) + 0.15 / 762] and ours[1270:] == [0.15] * 18


def test_the_record_recipe_muon_momentum_is_the_records_at_every_step():
    args, _ = record_schedules()
    ours = [T.muon_momentum_at(step, args) for step in range(R_STEPS + 1)]
    assert ours[300:] == [r_get_muon_momentum(step) for step in range(300, R_STEPS + 1)]  # the cooldown in its form
    assert ours[:300] == pytest.approx([r_get_muon_momentum(step) for step in range(300)], abs=1e-15)
    assert ours[1235] == 0.95 and ours[1236] < 0.95 and ours[1284] == pytest.approx(0.852, abs=1e-12)


def test_the_record_recipe_windows_are_the_records_at_every_step():
    """(1, 3), (3, 7), (5, 11), the extension's (6, 13), and (6, 20) at the last validation, token-exact."""
    args, _ = record_schedules()
    assert [T.attention_windows(step, args) for step in range(R_STEPS + 1)] == \
        [r_get_ws(step) for step in range(R_STEPS + 1)]
    assert args.token_exact_windows
    schedules = T.StepTensors(args, torch.device("cpu"))
    assert schedules.windows(1270).tolist() == [13, 6] and schedules.windows(R_STEPS).tolist() == [20, 6]


def test_the_record_recipe_yarn_is_the_records_and_none_for_the_last_validation():
    args, _ = record_schedules()
    m = r_yarn_states()
    for step in (0, 422, 423, 424, 846, 847, 848, 1269, 1270, 1271, 1284, 1285):
        freqs, scale = T.yarn_state(step, args)
        assert torch.equal(freqs, m[step][0]) and scale == m[step][1], step
    scales = [T.yarn_state(step, args)[1] for step in (422, 423, 847, 1270, 1285)]
    assert scales == pytest.approx([0.1, 0.116946, 0.127518, 0.131778, 0.131778], abs=5e-7)
    freqs = T.yarn_state(R_STEPS, args)[0]
    assert freqs[0] == 1 and freqs[8].item() == pytest.approx(0.07363, abs=5e-6)
    assert freqs[16].item() == pytest.approx(0.006769, abs=5e-7)
    start = T.rotary_frequencies(128)
    assert (freqs[19:32] / start[19:32]).tolist() == pytest.approx([384 / 1664] * 13, rel=1e-6)


def test_the_record_recipe_on_the_cpu_preset_is_its_forms_at_60_steps():
    args, batches = record_schedules("cpu", world_size=1)
    assert T.scheduled_steps(args) == 59 and [batches.first_step(k) for k in range(3)] == [0, 20, 39]
    assert args.tied_embed_steps == 39 and [c for c, _, _ in T.yarn_changes(60, args)] == [20, 39, 59]
    assert batches.stage_seq_len == (512, 1024, 1536) and not args.bos_align  # the sample's long documents
    lrs = [T.step_lr_multiplier(step, args, batches) for step in range(61)]
    assert lrs[:24] == [1.0] * 20 + [1.52] * 4 and lrs[59:] == [0.15, 0.15]  # the cooldown from int(0.4 x 59) = 23
    for world_size in (1, 2, 4):
        assert T.batch_schedule(args, world_size).stage_accum == (4 // world_size,) * 3
    with pytest.raises(T.UsageError, match="world size 3 cannot split --batch_sequences=4"):
        T.batch_schedule(args, 3)


def test_the_record_recipe_is_refused_on_the_medium_preset_in_one_line():
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--preset=medium", "--recipe=record"], False)
    assert "--recipe=record" in str(e.value) and "\n" not in str(e.value)
    assert "[medium:" not in T.help_text({"preset": "cpu", "recipe": "record"})  # --help leaves that preset out


def test_the_record_flags_off_keep_todays_stage_starts_and_lr():
    """Without --rounded_stages a stage starts at ceil(k S / n) (424 of 1270); get_lr's form alone."""
    args, batches = record_schedules()
    plain = T.batch_schedule(dataclasses.replace(args, rounded_stages=False), 8)
    assert [plain.first_step(k) for k in range(3)] == [0, 424, 847] and plain.stage(423) == plain.lr_stage(423) == 0
    assert T.stage_share_cooldown_lr(600, 1270, 0.6, 0.15, 1.52) == r_get_lr(600)


# ----------------------------------------------------------------------------- record #89's loss weights by stage

# the record recipe's own batch schedule: stages from round(k * S / 3) (T:1943: 0, 423, 847 of S = 1270)
RECORD_STAGES = T.batch_schedule(T.parse_args(["--preset=speedrun", "--recipe=record"], True), 8)


def record_loss_weights(step):
    """T:1950-1958 with T:1980-1988's stages: w = start + (end - start) * t per stage, t = 1 past the last."""
    ends = [0, 423, 847, 1270, 1285]
    stages = [([1.0, 0.5, 0.25], [1.0, 0.5, 0.0], 0.25, 0.25), ([1.0, 0.5], [1.0, 0.0], 0.25, 0.0),
              ([1.0], [1.0], 0.0, 0.0), ([1.0], [1.0], 0.0, 0.0)]
    k = next((i for i in range(4) if step < ends[i + 1]), 3)
    t = (step - ends[k]) / (ends[k + 1] - ends[k]) if step < 1285 else 1.0
    start, end, p0, p1 = stages[k]
    mtp = [a + (b - a) * t for a, b in zip(start, end)]
    return mtp + [0.0] * (3 - len(mtp)) + [p0 + (p1 - p0) * t]


@pytest.mark.parametrize("step, mtp, prefix", [  # docs/track1-record-fidelity.md §2, values at the boundary steps
    (0, (1, 0.5, 0.25), 0.25), (1, (1, 0.5, 0.24941), 0.25), (300, (1, 0.5, 0.07270), 0.25),
    (422, (1, 0.5, 0.00059), 0.25), (423, (1, 0.5, 0), 0.25), (508, (1, 0.39976, 0), 0.19988),
    (509, (1, 0.39858, 0), 0.19929), (846, (1, 0.00118, 0), 0.00059), (847, (1, 0, 0), 0), (849, (1, 0, 0), 0),
    (1000, (1, 0, 0), 0), (1269, (1, 0, 0), 0), (1270, (1, 0, 0), 0), (1284, (1, 0, 0), 0), (1285, (1, 0, 0), 0),
])
def test_the_loss_weights_by_stage_are_the_records_at_its_boundary_steps(step, mtp, prefix):
    got = T.stage_loss_weights(step, RECORD_STAGES, 3, 0.25)
    assert got == pytest.approx([*mtp, prefix], abs=6e-6)
    assert got == pytest.approx(record_loss_weights(step), abs=1e-12)
    assert T.stage_loss_weights(step, RECORD_STAGES, 3) == got[:3]  # no prefix weight: MTP's alone
    assert T.stage_loss_weights(step, RECORD_STAGES, 1, 0.25) == [1.0, got[3]]  # no MTP: the next token, the prefix


def test_the_step_tensors_follow_the_stages_and_end_their_table_where_the_weights_settle():
    args = speedrun("--mtp_tokens=3", "--prefix_loss_weight=0.25", "--loss_weights_by_stage=true",
                    "--num_iterations=1285", "--extension_steps=15")
    schedules = T.StepTensors(args, torch.device("cpu"), RECORD_STAGES)
    assert schedules.mtp_last == 847 and len(schedules.mtp_table) == 848
    for step in (0, 300, 423, 508, 846, 847, 1284, 1285, 5000):
        [row] = schedules.mtp_weights(step)
        assert row.tolist() == torch.tensor(record_loss_weights(min(step, 1285))).tolist(), step
    assert T.StepTensors(speedrun("--prefix_loss_weight=0.25", "--loss_weights_by_stage=true"),
                         torch.device("cpu")).mtp_weights(0)[0].tolist() == [1.0, 0.25]
