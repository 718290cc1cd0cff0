"""The speedrun preset is the 2025-01-26 record: every value the record sets, pinned to the record's value
(records/012625_BatchSize of modded-nanogpt and its train_gpt.py; ../shared/SPEEDRUN_RECIPE.md)."""
import dataclasses
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flags  # noqa: E402
import train_gpt as T  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

RECORD_2025_01_26 = dict(
    val_tokens=10485760, batch_tokens=8 * 48 * 1024, seq_len=48 * 1024, val_seq_len=4 * 64 * 1024,
    num_iterations=1770, cooldown_frac=0.4, lr_final_frac=0.1, val_every=125, window_final_tokens=1728,
    sliding_window=True, vocab_size=50257, n_layer=12, model_dim=768, n_head=6, head_dim=128, attn_scale=0.12,
    logit_softcap=30.0, value_embeds=True, unet_skips=True, zero_init=True, qk_norm=True, mlp_act="relu2",
    muon=True, muon_lr=0.05, muon_momentum=0.95, muon_momentum_start=0.85, muon_momentum_warmup_steps=300,
    ns_steps=5, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-10, head_lr=0.008, embed_lr=0.6, scalar_lr=0.04,
    weight_decay=0.0, dtype="bf16", fp8_head=True, coordinate_descent_tuning=True)


def test_speedrun_preset_is_the_record():
    """The literals above, not the trainer's own table: the default on a GPU machine and --preset=speedrun named
    on a machine without one both resolve to the record's values."""
    args = T.parse_args([], cuda_available=True)
    assert args.preset == "speedrun"
    assert {k: getattr(args, k) for k in RECORD_2025_01_26} == RECORD_2025_01_26
    named = T.parse_args(["--preset=speedrun"], cuda_available=False)
    assert {k: getattr(named, k) for k in RECORD_2025_01_26} == RECORD_2025_01_26
    assert T.FP8_SCALES == dict(x_scale=2.0, w_scale=2.0 ** 9, grad_scale=2.0 ** 19)
    assert args.val_tokens // args.val_seq_len == 40  # 5 val sequences per rank on 8 GPUs


def test_optional_fields_parse_none_and_their_kind():
    from dataclasses import dataclass

    @dataclass
    class Fields:
        lr: float | None = None
        name: str = "x"
        steps: "int | None" = 3

    types = T.field_types(Fields)
    assert types["lr"] == flags.FieldType(float, optional=True) and types["name"] == flags.FieldType(str)
    assert types["steps"] == flags.FieldType(int, optional=True)
    assert types["lr"].parse("none") is None and types["lr"].parse("0.5") == 0.5
    assert types["name"].parse("none") == "none"  # only optional fields take none
    with pytest.raises(ValueError):
        types["steps"].parse("1.5")


def test_a_field_the_command_line_cannot_set_is_refused_in_one_line():
    from dataclasses import dataclass, field

    @dataclass
    class Fields:
        sizes: list[int] = field(default_factory=list)

    with pytest.raises(T.UsageError, match=r"^hyperparameter sizes is annotated list\[int\], which the command line "
                                           r"cannot set: use bool, int, float, str, or one of them \| None$"):
        T.field_types(Fields)


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
    assert "  --seq_len=49152 [cpu: 1024]  R: cut from 64K to 48K per GPU" in text  # default, cpu preset, comment
    assert "  --value_embeds=true  R: three value-embedding tables" in text and "  --scalar_adam_beta1=none" in text
    headers = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headers[:3] == ["general:", "data:", "batch: one flat sequence of seq_len tokens per rank per micro-step:"]
    assert "checkpoints:" in headers and "optimizers:" in headers


def test_the_v2_fidelity_table_states_the_recipes_values():
    """bench/v2_fidelity.md compares each v2 constant with its record's code; its `flag` column must be what
    --recipe=v2 --preset=speedrun resolves to, and every row names a record and says same / differs."""
    table = [line.split("|")[1:-1] for line in (REPO / "bench" / "v2_fidelity.md").read_text().splitlines()
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


# ----------------------------------------------------------------------------- recipe v2's techniques

def readme_recipes_rows():
    """(flags, record folders) of each row of the README's Recipes table."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("| technique | flags (v2 value) | record folder"):].split("\n\n")[0].splitlines()[2:]
    rows = [line.split(" | ") for line in table]
    return [(set(re.findall(r"`(\w+)`", row[1])), set(re.findall(r"\d{4}-\d\d-\d\d_\w+", row[2]))) for row in rows]


def test_the_readme_recipes_table_lists_every_technique_with_its_flags_and_records():
    """Each README row belongs to one declared technique (by its record folders); each technique's records and
    flags all appear in its rows."""
    owners = {record: t for t in T.TECHNIQUES for record in t.records}
    seen = {t.name: (set(), set()) for t in T.TECHNIQUES}
    for names, records in readme_recipes_rows():
        techniques = {owners[r].name for r in records if r in owners}
        assert len(techniques) == 1 and records <= set(owners), (names, records)
        seen[techniques.pop()][0].update(names)
        seen[owners[next(iter(records))].name][1].update(records)
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
    reference = T.parse_args([f"--preset={preset}"], False)
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
