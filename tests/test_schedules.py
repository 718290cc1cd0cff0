"""Schedules (lr, Muon momentum, attention window, the step's device tensors), checked against the recipe's numbers."""

import math

import pytest
import torch

import train_gpt as T
from conftest import TINY, run_main


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
    batches = T.batch_schedule(T.parse_args(argv, False), 1)
    total = 0
    for step in range(batches.num_iterations + 3):  # past the end too: a warm-up longer than the run
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
