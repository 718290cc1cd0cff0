"""train_gpt.py's "Configuration" and "Validation" sections. The speedrun preset is the 2025-01-26 record: every
value the record sets, pinned to the record's value (records/track_1_short/2025-01-26_BatchSize of modded-nanogpt and its train_gpt.py;
../shared/SPEEDRUN_RECIPE.md). Then Hyperparameters and parse_args: every field settable from the command line,
--help, the presets, and the one-line refusal of each flag's out-of-range values (a table covering every field) and
of values that contradict each other (the batch schedule's stages among them)."""
import dataclasses
from dataclasses import fields
from pathlib import Path

import pytest

import flags
import train_gpt as T


RECORD_2025_01_26 = dict(
    val_tokens=10485760, batch_tokens=8 * 48 * 1024, seq_len=48 * 1024, val_seq_len=4 * 64 * 1024,
    num_iterations=1770, cooldown_frac=0.4, lr_final_frac=0.1, val_every=125, window_final_tokens=1728,
    sliding_window=True, vocab_size=50257, n_layer=12, model_dim=768, n_head=6, head_dim=128, attn_scale=0.12,
    logit_softcap=30.0, value_embeds=True, unet_skips=True, zero_init=True, qk_norm=True, mlp_act="relu2",
    muon=True, muon_lr=0.05, muon_momentum=0.95, muon_momentum_start=0.85, muon_momentum_warmup_steps=300,
    ns_steps=5, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-10, head_lr=0.008, embed_lr=0.6, scalar_lr=0.04,
    weight_decay=0.0, dtype="bf16", fp8_head=True, coordinate_descent_tuning=True)


def test_the_reference_recipe_is_the_2025_01_26_record():
    """The literals above, not the trainer's own table: --recipe=reference on a GPU machine's default preset and
    --preset=speedrun named on a machine without one both resolve to the record's values."""
    args = T.parse_args(["--recipe=reference"], cuda_available=True)
    assert args.preset == "speedrun"
    assert {k: getattr(args, k) for k in RECORD_2025_01_26} == RECORD_2025_01_26
    named = T.parse_args(["--preset=speedrun", "--recipe=reference"], cuda_available=False)
    assert {k: getattr(named, k) for k in RECORD_2025_01_26} == RECORD_2025_01_26
    assert T.FP8_SCALES == dict(x_scale=2.0, w_scale=2.0 ** 9, grad_scale=2.0 ** 19)
    assert args.val_tokens // args.val_seq_len == 40  # 5 val sequences per rank on 8 GPUs


def test_every_hyperparameter_has_a_command_line_type():
    types = T.field_types(T.Hyperparameters)
    assert set(types) == {f.name for f in dataclasses.fields(T.Hyperparameters)}
    assert types["seed"] == flags.FieldType(int) and types["muon"] == flags.FieldType(bool)


def test_help_lists_every_flag_in_its_group_with_its_default_and_exits_0(tmp_path):
    from conftest import run_main
    result = run_main(["--help"], tmp_path)
    assert result.returncode == 0 and result.stderr == "" and not list(tmp_path.iterdir())  # no run started
    text = result.stdout
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert [flag.split("=")[0] for flag in flags] == [f"--{f.name}" for f in dataclasses.fields(T.Hyperparameters)]
    # the default: the speedrun preset's recipe record, each of its values with its source
    assert "  --seq_len=49152 [cpu: 1024, medium: 65536] (from: T:1816, T:1821: one varlen sequence per GPU, " \
           "16K/32K/48K tokens)  R: cut from 64K to 48K per GPU" in text  # value, other presets, source, doc
    assert "  --value_embeds=true (from: T:1496" in text and "  --scalar_adam_beta1=0.9 [cpu: none] (from: T:2030" in text
    headers = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headers[:3] == ["general:", "data:", "batch: one flat sequence of seq_len tokens per rank per micro-step:"]
    assert "checkpoints:" in headers and "optimizers:" in headers


# ----------------------------------------------------------------------------- presets, and values refused at start-up

def test_the_default_recipe_is_record_on_the_speedrun_preset_and_reference_elsewhere():
    """torchrun train_gpt.py on a GPU machine runs record #89 (DEFAULT_RECIPES); the cpu preset the reference,
    which the cpu ablation of the recipes keeps; the medium preset is its own record."""
    assert T.parse_args([], cuda_available=True) == T.parse_args(["--recipe=record"], cuda_available=True)
    assert T.parse_args([], cuda_available=False) == T.parse_args(["--recipe=reference"], cuda_available=False)
    assert T.parse_args(["--preset=medium"], True).recipe == "reference"
    assert T.Hyperparameters.recipe == "auto" and T.parse_args([], True).recipe == "record"  # logged resolved


def test_help_names_the_source_of_every_value_the_record_recipe_sets_or_shares():
    text = T.help_text({"recipe": "record"})
    args = T.parse_args(["--recipe=record"], True)
    for name in [*T.RECORD_VALUES["speedrun"], *(n for _, values in T.RECORD_SHARED_LINES for n in values)]:
        line = next(line for line in text.splitlines() if line.startswith(f"  --{name}="))
        assert f"={T.flag_text(getattr(args, name))}" in line and f"(from: {T.RECORD_SOURCES['speedrun'][name]})" \
            in line, name
    shared = {n: v for _, values in T.RECORD_SHARED_LINES for n, v in values.items()}
    assert {n: getattr(args, n) for n in shared} == shared  # the shared values are what the record runs


def test_presets_resolve():
    cpu = T.parse_args([], cuda_available=False)
    assert cpu.preset == "cpu" and cpu.n_layer == T.PRESETS["cpu"]["n_layer"] and cpu.model_dim == 256
    gpu = T.parse_args(["--recipe=reference"], cuda_available=True)
    assert gpu.preset == "speedrun" and gpu == T.Hyperparameters(preset="speedrun", recipe="reference")
    forced = T.parse_args(["--preset=speedrun", "--recipe=reference"], cuda_available=False)
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
                                        ("--n_layer=3", "even depth"), ("--num_iterations=0", r"in \[1, 1000000000\]")])
def test_other_invalid_settings_refused(arg, match):
    with pytest.raises(T.UsageError, match=match):
        T.parse_args(["--preset=cpu", arg], False)


# ----------------------------------------------------------------------------- validation: every flag's range

# Every flag validated at start-up: a table that must cover every field of Hyperparameters.
BAD_VALUES = {  # field: (a value just inside the valid range, values outside it)
    "preset": ("cpu", ["fast"]), "seed": ("0", ["-1"]), "train_files": ("x", [""]), "val_files": ("x", [""]),
    "val_tokens": ("1024", ["0", "-1024"]), "train_cycle": ("true", ["maybe"]), "bos_align": ("false", ["2"]),
    "batch_tokens": ("1024", ["0"]), "seq_len": ("128", ["0", "-128"]), "val_seq_len": ("128", ["0"]),
    "num_iterations": ("1000000000", ["0", "1000000001", "12345678901234567890"]), "cooldown_frac": ("0", ["-0.1", "1.5", "nan"]),
    "lr_final_frac": ("1", ["inf", "-1"]), "val_every": ("0", ["-1"]), "window_final_tokens": ("1", ["0"]),
    "sliding_window": ("true", ["x"]), "vocab_size": ("1", ["0"]), "n_layer": ("2", ["0"]),
    "model_dim": ("1", ["0"]), "n_head": ("1", ["0"]), "head_dim": ("4", ["0"]),
    "attn_scale": ("0.01", ["0", "nan"]), "logit_softcap": ("0", ["-1", "inf"]), "value_embeds": ("1", ["x"]),
    "unet_skips": ("0", ["x"]), "zero_init": ("on", ["x"]), "qk_norm": ("off", ["x"]),
    "mlp_act": ("gelu", ["swish"]), "muon": ("yes", ["x"]), "muon_lr": ("0", ["nan", "-0.1", "inf"]),
    "muon_momentum": ("0", ["1", "1.5"]), "muon_momentum_start": ("0.99", ["1"]),
    "muon_momentum_warmup_steps": ("0", ["-1"]), "ns_steps": ("1", ["0"]), "adam_beta1": ("0", ["1", "-0.1"]),
    "adam_beta2": ("0.999", ["1.5", "1"]), "adam_eps": ("1e-30", ["0", "nan"]), "head_lr": ("0", ["nan"]),
    "embed_lr": ("0", ["-1"]), "scalar_lr": ("0", ["nan"]), "matrix_adam_lr": ("0", ["inf"]),
    "weight_decay": ("0", ["-0.1", "nan"]), "dtype": ("fp32", ["fp16"]), "fp8_head": ("false", ["x"]),
    "fp8_mlp": ("false", ["x"]), "fp8_head_scales": ("reference", ["x", "2"]),
    "attention": ("banded", ["xformers"]), "compile": ("off", ["always"]), "warmup_steps": ("0", ["-1"]),
    "coordinate_descent_tuning": ("false", ["maybe"]),
    "collective_timeout_s": ("1", ["0", "-5"]), "log_dir": ("logs", [""]),
    "run_id": ("a.b-c_1", ["../../x", "a/b", "..", ".hidden", "a\\b"]), "log_train_loss": ("true", ["x"]),
    "profile_steps": ("0", ["-1"]), "checkpoint_every": ("0", ["-1"]), "checkpoint_final": ("true", ["x"]),
    "target_val_loss": ("2.92", ["0", "-1", "nan"]), "stop_at_target": ("true", ["x"]), "tensorboard": ("on", ["x"]),
    "usd_per_gpu_hour": ("0", ["-1", "inf"]),
    "hellaswag_every": ("0", ["-1"]), "hellaswag_data": ("", []), "sample_at_end": ("0", ["-2"]),
    "checkpoint_keep": ("1", ["0"]), "resume": ("latest", []),  # any text; a bad folder fails at start-up
    "stop_after": ("0", ["-1"]),
    # recipe v2: the batch schedule, the optimizers and the data
    "recipe": ("v2", ["v3"]), "doc_len_cap": ("0", ["-1"]), "batch_schedule": ("1/2,1", ["0", "1/2,3/2", "half"]),
    "batch_lr_exponent": ("0", ["-0.5", "nan"]), "polar_express": ("true", ["x"]), "normuon": ("true", ["x"]),
    "normuon_beta2": ("0", ["1", "-0.1"]), "cautious_wd": ("true", ["x"]), "muon_cautious_wd": ("0", ["-1"]),
    "adam_cautious_wd": ("0", ["nan"]), "scalar_adam_beta1": ("none", ["1", "x"]),
    "scalar_adam_beta2": ("0.99", ["1.5"]),
    # recipe v2: the model techniques
    "bigram_vocab_size": ("0", ["-1"]), "bigram_dim": ("0", ["-1"]), "bigram_sign": ("false", ["x"]),
    "smear": ("true", ["x"]), "attn_gate": ("true", ["x"]), "ve_gates": ("true", ["x"]), "skip_gates": ("true", ["x"]),
    "backout": ("true", ["x"]), "key_offset": ("true", ["x"]), "paired_heads": ("true", ["x"]),
    "logit_offset": ("-5", ["nan", "inf"]), "logit_temperature": ("0.5", ["0", "nan"]), "mtp_tokens": ("1", ["0"]),
    "mtp_frac": ("1", ["0", "1.5", "nan"]),
    "prefix_loss_weight": ("0", ["-1", "nan", "inf"]), "loss_weights_by_stage": ("false", ["x"]),
    # track 2's techniques (the medium preset)
    "value_embed_tables": ("1", ["0", "-3"]), "attention_free_layer": ("false", ["x"]), "short_window_cap": ("0", ["-1"]),
    "window_stages": ("3,7", ["0", "3,x", "-1,2"]), "extension_steps": ("10", ["-1", "x"]),
    "stage_lr_shares": ("0.5,1", ["0", "x", "0.5,-1", "1,inf"]), "muon_momentum_cooldown_steps": ("10", ["-1"]),
    "yarn_max_window": ("13", ["-1"]), "final_window_blocks": ("4", ["-1"]), "token_exact_windows": ("true", ["x"]),
    "batch_sequences": ("0", ["-1", "x"]),
    "pad_embed_tables": ("true", ["x"]), "skip_connections": ("2>5,1>4", ["6", "2>x", "2>5,1>5", "-1>2"]),
    "skip_sigmoid": ("true", ["x"]), "gate_dims": ("16", ["0", "-1"]), "second_embed": ("true", ["x"]),
    "residual_lambda_init": ("1.05", ["nan", "inf"]), "attn_output_lambda": ("true", ["x"]),
    "cross_document_shifts": ("true", ["x"]), "qkv_init_gain": ("1", ["-1", "nan"]),
    "head_init_std": ("0.005", ["-0.1", "inf"]), "value_embed_zero_init": ("true", ["x"]),
    "bf16_rotary": ("true", ["x"]), "bf16_train_logits": ("true", ["x"]), "loss_sum": ("true", ["x"]),
    "record_muon_shapes": ("true", ["x"]), "muon_gates": ("true", ["x"]), "muon_gate_lr_mul": ("0.1", ["-1", "nan"]),
    "adam_every": ("2", ["0", "-1"]), "adam_master": ("false", ["x"]), "bf16_val_softcap": ("true", ["x"]), "adam_moments_fp32": ("false", ["x"]), "token_embed_lr": ("none", ["-1", "x"]),
    "head_embed_wd_mul": ("150", ["-1", "inf"]), "value_embed_wd_mul": ("5", ["-1", "nan"]),
    "x0_lambda_lr": ("0.04", ["-1", "x"]), "gate_adam_lr": ("8e-5", ["-1", "nan"]),
    "tied_embed_steps": ("0", ["-1"]),
    # record #89's schedules, optimizers and data
    "rounded_stages": ("true", ["x"]), "extension_window_blocks": ("4", ["-1", "x"]),
    "stage_share_cooldown": ("true", ["x"]), "stage_doc_len_caps": ("64,128", ["0", "x", "-1,2"]),
    "table_adam_beta1": ("0.75", ["1", "x"]), "bigram_wd_mul": ("5", ["-1", "nan"]),
    "gate_scalar_betas": ("true", ["x"]), "ve_gate_lr": ("0.008", ["-1", "x"]),
    # record #89's techniques (--recipe=record)
    "muon_qk_head_pairs": ("true", ["x"]),
    # record #89's layout and residual stream
    "long_window_blocks": ("3,5", ["x", "-1", "3,"]), "attention_free_blocks": ("", ["six"]),
    "paired_head_blocks": ("0", ["0.5"]), "value_embed_blocks": ("", ["1;2"]), "ve_gate_reads_value": ("true", ["x"]),
    "value_embed_init_std": ("0.01", ["-0.01", "nan"]), "attn_proj_uniform_init": ("true", ["x"]),
    "sublayer_lambdas": ("true", ["x"]), "attention_cache_block": ("0", ["-1"]), "mudd_gate_block": ("0", ["-1"]),
    "output_gate_blocks": ("", ["a"]), "xsa_blocks": ("", ["1,x"]), "dc_blocks": ("", ["-3"]), "mudd": ("false", ["x"]),
}


def test_every_hyperparameter_has_a_rule_and_bad_values_here():
    names = {f.name for f in fields(T.Hyperparameters)}
    assert set(BAD_VALUES) == names and set(T.FLAG_RULES) == names


USED_ONLY_WITH = {"matrix_adam_lr": ["--muon=false"], "batch_lr_exponent": ["--batch_schedule=1/2,1"],
                  "normuon_beta2": ["--normuon=true"], "muon_cautious_wd": ["--cautious_wd=true"],
                  "adam_cautious_wd": ["--cautious_wd=true"], "stage_lr_shares": ["--batch_schedule=1/2,1"],
                  "yarn_max_window": ["--window_stages=1,2"], "muon_gate_lr_mul": ["--muon_gates=true"],
                  "rounded_stages": ["--window_stages=1,2"], "extension_window_blocks": ["--extension_steps=2"],
                  "stage_doc_len_caps": ["--batch_schedule=1/2,1", "--bos_align=true"],
                  "paired_head_blocks": ["--long_window_blocks=1"], "ve_gate_reads_value": ["--ve_gates=true"]}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_every_flag_refuses_a_bad_value_in_one_line_naming_it(name):
    good, bad = BAD_VALUES[name]
    base = ["--preset=cpu"] + (["--val_tokens=1024", "--val_seq_len=128"] if name in ("val_tokens", "val_seq_len")
                               else [])
    base += ["--value_embeds=false"] if name in ("model_dim", "n_head", "head_dim") else []  # frees the width
    base += USED_ONLY_WITH.get(name, [])  # the flags under which its good value does something
    T.parse_args(base + [f"--{name}={good}"], False)
    for value in bad:
        with pytest.raises(T.UsageError) as e:
            T.parse_args(base + [f"--{name}={value}"], False)
        message = str(e.value)
        assert name in message and "\n" not in message  # names the flag
        assert "valid" in message or "expected" in message  # says what is accepted


# ----------------------------------------------------------------------------- validation: the batch schedule's stages

@pytest.mark.parametrize("flags, match", [
    (["--batch_tokens=4096", "--batch_schedule=1/3,1"], "stage 1/3 of --batch_tokens=4096 is 1365.33 tokens"),
    (["--batch_tokens=4096", "--batch_schedule=1/8,1"], "stage 1/8 of --batch_tokens=4096 is 512 tokens, not whole "
                                                       "sequences of --seq_len=1024"),
    (["--batch_schedule=1/2,0"], "bad value '1/2,0' for --batch_schedule"),
])
def test_a_stage_that_is_not_whole_sequences_is_refused_at_start_up(flags, match):
    with pytest.raises(T.UsageError, match=match):
        T.parse_args(["--preset=cpu"] + flags, False)


@pytest.mark.parametrize("schedule, message", [
    ("1/2,1/3", "--batch_schedule=1/2,1/3 shrinks the batch; the stages must grow"),
    ("1,1/2", "--batch_schedule=1,1/2 shrinks the batch"),
    ("1/4,1/2", "--batch_schedule=1/4,1/2 never reaches --batch_tokens=2048: its last stage must be 1"),
    ("1/3,2/3,1", "stage 1/3 of --batch_tokens=2048 is 682.667 tokens, not whole sequences of --seq_len=1024; use "
                  "multiples of 1/2 (one sequence) for every stage"),
])
def test_a_batch_schedule_that_shrinks_stops_short_or_splits_sequences_is_refused(schedule, message):
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--preset=cpu", f"--batch_schedule={schedule}"], False)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_batch_schedule_with_more_stages_than_steps_is_refused():
    """The probe: 10 stages over 3 steps trained 2,048 + 6,144 + 6,144 tokens and never the 4,096-token stage."""
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--recipe=v2", "--batch_schedule=1/3,2/3,1,1,1,1,1,1,1,1", "--num_iterations=3"], False)
    assert "has 10 stages but --num_iterations=3 has fewer steps; every stage needs at least one step" in str(e.value)
    T.parse_args(["--recipe=v2", "--num_iterations=3"], False)  # one step per stage is enough


# ----------------------------------------------------------------------------- validation: flags that would do nothing

# A command line for every flag of ONLY_WHEN that sets it where it does nothing (a test below holds the table to it).
UNUSED = {
    "muon_lr": ["--muon=false", "--muon_lr=0.1"], "muon_momentum": ["--muon=false", "--muon_momentum=0.9"],
    "muon_momentum_start": ["--muon=false", "--muon_momentum_start=0.9"],
    "muon_momentum_warmup_steps": ["--muon=false", "--muon_momentum_warmup_steps=10"],
    "ns_steps": ["--muon=false", "--ns_steps=3"], "matrix_adam_lr": ["--matrix_adam_lr=0.01"],
    "logit_temperature": ["--logit_softcap=0", "--logit_temperature=5"],
    "window_final_tokens": ["--sliding_window=false", "--window_final_tokens=512"],
    "hellaswag_data": ["--hellaswag_data=h.jsonl"], "coordinate_descent_tuning": ["--coordinate_descent_tuning=false",
                                                                                 "--compile=off"],
    "stop_after": ["--num_iterations=10", "--stop_after=10"],
    "batch_lr_exponent": ["--batch_lr_exponent=0.5"], "normuon_beta2": ["--normuon_beta2=0.9"],
    "muon_cautious_wd": ["--cautious_wd=false", "--muon_cautious_wd=5"],
    "adam_cautious_wd": ["--adam_cautious_wd=0.1"], "bigram_dim": ["--bigram_dim=32"],
    "mtp_frac": ["--mtp_frac=0.5"], "loss_weights_by_stage": ["--loss_weights_by_stage=true"], "value_embed_tables": ["--value_embeds=false", "--value_embed_tables=5"],
    "short_window_cap": ["--sliding_window=false", "--short_window_cap=4"],
    "stage_lr_shares": ["--stage_lr_shares=0.5,1"], "yarn_max_window": ["--yarn_max_window=13"],
    "muon_momentum_cooldown_steps": ["--muon=false", "--muon_momentum_cooldown_steps=5"],
    "final_window_blocks": ["--sliding_window=false", "--final_window_blocks=27"],
    "token_exact_windows": ["--sliding_window=false", "--token_exact_windows=true"],
    "skip_connections": ["--unet_skips=false", "--skip_connections=2>5"],
    "skip_sigmoid": ["--unet_skips=false", "--skip_sigmoid=true"],
    "muon_gate_lr_mul": ["--muon_gate_lr_mul=0.2"], "adam_moments_fp32": ["--adam_moments_fp32=true"],
    "rounded_stages": ["--rounded_stages=true"], "extension_window_blocks": ["--extension_window_blocks=13"],
    "stage_doc_len_caps": ["--bos_align=true", "--stage_doc_len_caps=896"],
    "fp8_head_scales": ["--fp8_head=false", "--loss_sum=true", "--fp8_head_scales=record"],
    "attention_free_blocks": ["--attention_free_blocks=1"], "paired_head_blocks": ["--paired_head_blocks=0"],
    "value_embed_blocks": ["--value_embed_blocks=1"], "ve_gate_reads_value": ["--ve_gate_reads_value=true"],
    "output_gate_blocks": ["--output_gate_blocks=1"], "xsa_blocks": ["--xsa_blocks=1"], "dc_blocks": ["--dc_blocks=1"],
    "attention_free_layer": ["--long_window_blocks=1", "--attention_free_layer=false"],
}


def test_every_flag_that_only_matters_under_another_has_a_refused_case_here():
    assert {name for rule in T.ONLY_WHEN for name in rule.flags} == set(UNUSED)


@pytest.mark.parametrize("name", sorted(UNUSED))
def test_a_flag_set_where_it_does_nothing_is_refused_in_one_line(name):
    """--value_embeds=false --value_embed_tables=5 or --cautious_wd=false --muon_cautious_wd=5 ran, and logged a
    value the run never used, while --muon=false --normuon=true was refused: every such pair is refused now."""
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--preset=cpu", *UNUSED[name]], False)
    message = str(e.value)
    assert message.startswith(f"--{name}=") and "\n" not in message and ("pass" in message or "drop" in message)


def test_the_muon_weight_decay_needs_muon_too():
    with pytest.raises(T.UsageError, match="^--muon_cautious_wd=5.0 only matters with --muon=true, and this run has "
                                           "--muon=false: drop --muon_cautious_wd or pass --muon=true$"):
        T.parse_args(["--preset=cpu", "--muon=false", "--cautious_wd=true", "--muon_cautious_wd=5"], False)
    T.parse_args(["--preset=cpu", "--muon=false", "--cautious_wd=true", "--adam_cautious_wd=0.1"], False)


def test_more_value_embedding_tables_than_encoder_layers_is_refused():
    """--value_embed_tables=100 on 2 layers trained with one table and logged 100."""
    with pytest.raises(T.UsageError, match=r"^--value_embed_tables=100 is more tables than --n_layer=2 uses \(one per "
                                           r"encoder layer: 1\); pass --value_embed_tables=1 or fewer, or "
                                           r"--n_layer=200$"):
        T.parse_args(["--preset=cpu", "--n_layer=2", "--value_embed_tables=100"], False)
    # the default, "three tables, one per encoder layer on a shallower model" (its help), set or not: what a command
    # rebuilt from a run log passes
    assert T.parse_args(["--preset=cpu", "--n_layer=4", "--value_embed_tables=3"], False).value_embed_tables == 3
    assert T.parse_args(["--preset=cpu", "--n_layer=2"], False).value_embed_tables == 3


def test_values_the_preset_or_recipe_sets_are_not_the_command_line_s_to_drop():
    """Only what the command line sets is refused: switching a technique off leaves its preset values unused."""
    assert not T.parse_args(["--preset=medium", "--value_embeds=false", "--ve_gates=false"], False).value_embeds
    assert not T.parse_args(["--preset=medium", "--cautious_wd=false"], False).cautious_wd
    # a flag set to its default (how bench/ablation.py switches a technique off) is no unused value either
    T.parse_args(["--preset=cpu", "--recipe=v2", "--bigram_vocab_size=0", "--bigram_dim=0", "--bigram_sign=false"],
                 False)


def test_a_resumed_run_judges_unused_flags_on_its_checkpoint_s_values():
    fresh = T.parse_args(["--preset=cpu"], False)
    recorded = {**dataclasses.asdict(fresh), "normuon": True}
    args, _ = T.resumed_hyperparameters(recorded, {"normuon_beta2": 0.9}, fresh, Path("ckpt"))
    assert args.normuon and args.normuon_beta2 == 0.9
    with pytest.raises(T.UsageError, match="^--normuon_beta2=0.9 only matters with --normuon=true"):
        T.resumed_hyperparameters({**recorded, "normuon": False}, {"normuon_beta2": 0.9}, fresh, Path("ckpt"))


@pytest.mark.parametrize("argv, message", [
    (["--mtp_tokens=300", "--seq_len=256", "--batch_tokens=512"],
     "--mtp_tokens=300 predicts more tokens than a --seq_len=256 sequence holds; pass at most 256"),
    (["--prefix_loss_weight=0.25"],
     "--prefix_loss_weight=0.25 decays by the batch stages (record #89, T:1981-1983); pass "
     "--loss_weights_by_stage=true"),
    (["--mtp_tokens=3", "--mtp_frac=0.5", "--loss_weights_by_stage=true"],
     "--mtp_frac=0.5 sets equal MTP phases, which --loss_weights_by_stage=true replaces by the batch stages"),
    (["--preset=medium", "--num_iterations=11", "--batch_schedule=", "--extension_steps=0",
      "--tied_embed_steps=0"],
     "--window_stages has 12 stages but --num_iterations=11 has fewer steps"),
    (["--preset=medium", "--num_iterations=50", "--batch_schedule=", "--muon_momentum_cooldown_steps=0",
      "--tied_embed_steps=0"],  # 50 steps less the record's 40 of extension: 10 scheduled, for 12 window stages
     "--window_stages has 12 stages but --num_iterations=50 less --extension_steps=40 (10 scheduled steps) has "
     "fewer steps"),
    (["--preset=medium", "--extension_steps=4740"],
     "--extension_steps=4740 leaves no scheduled step of --num_iterations=4740; pass fewer extension steps"),
    (["--preset=medium", "--stage_lr_shares=0.5,1"],
     "--stage_lr_shares has 2 shares but --batch_schedule has 12 stages; pass one share per stage"),
    (["--preset=medium", "--muon_momentum_cooldown_steps=5000"],
     "--muon_momentum_cooldown_steps=5000 is longer than --num_iterations=4740; pass at most 4740"),
])
def test_ranges_that_depend_on_another_flag_are_refused(argv, message):
    """--mtp_tokens beyond the sequence was accepted and failed at the first step with a shape error."""
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--preset=cpu", *argv] if "--preset=medium" not in argv else argv, False)
    assert message in str(e.value)


# ----------------------------------------------------------------------------- record #89's layout: refusals

@pytest.mark.parametrize("flags, match", [
    (["--long_window_blocks=3,6"], "names block 6, past the last layer (5 of --n_layer=6)"),
    (["--long_window_blocks=3", "--attention_free_blocks=3"], "gives block 3 an attention role"),
    (["--long_window_blocks=3", "--attention_free_blocks=2", "--mudd_gate_block=1", "--dc_blocks=2"],
     "gives block 2 an attention role"),
    (["--long_window_blocks=3", "--paired_head_blocks=1", "--mudd_gate_block=2", "--xsa_blocks=1"],
     "XSA needs unpaired heads"),
    (["--long_window_blocks=1", "--paired_heads=true"], "pass --paired_head_blocks instead"),
    (["--attention_cache_block=5"], "leaves no later block to attend over its stream"),
    (["--ve_gates=true", "--ve_gate_reads_value=true", "--gate_dims=11"], "pass an even --gate_dims"),
    (["--value_embed_init_std=0.01", "--value_embed_zero_init=true"], "both set the value tables' init; pass one"),
    (["--mudd_gate_block=6"], "--mudd_gate_block=6 is past the last layer"),
    (["--mudd_gate_block=3", "--skip_gates=true"], "pass --skip_gates=false"),
    (["--mudd_gate_block=4", "--skip_connections=1>3"], "adds a skip before --mudd_gate_block=4"),
    (["--mudd=true"], "--mudd=true needs an --attention_cache_block"),
    (["--mudd=true", "--attention_cache_block=2", "--skip_connections=1>3,0>4"], "exactly one --skip_connections"),
    (["--mudd=true", "--attention_cache_block=2", "--skip_connections=1>3", "--long_window_blocks=1",
      "--value_embed_blocks=1"], "a value table read by the last block"),
    (["--mudd=true", "--attention_cache_block=2", "--skip_connections=1>3", "--long_window_blocks=1",
      "--value_embed_blocks=5", "--backout=true"], "pass --backout=false"),
])
def test_record_layout_refuses_what_it_cannot_run_in_one_line(flags, match):
    with pytest.raises(T.UsageError) as e:
        T.parse_args(["--preset=cpu", *flags], False)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_for_depths_layout_flags_are_refused_with_the_layout_by_lists():
    with pytest.raises(T.UsageError, match="only matters with for_depth's layout"):
        T.parse_args(["--preset=cpu", "--long_window_blocks=1", "--value_embed_tables=2"], False)


def test_record_recipe_resolves_and_keeps_the_reference_layout_elsewhere():
    speedrun = T.parse_args(["--preset=speedrun", "--recipe=record"], True)
    got = (speedrun.n_layer, speedrun.mudd, speedrun.mudd_gate_block, speedrun.attention_cache_block)
    assert got == (11, True, 4, 7)
    assert T.parse_args(["--preset=cpu", "--recipe=record"], False).model_dim == 256
    assert not T.GPT(T.ModelConfig.of(T.parse_args(["--preset=cpu"], False))).streamed
