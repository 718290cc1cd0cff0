"""flags.py alone: the dataclass-to-flags machinery under the trainer's command line. Each field's command-line
kind read from its annotation (FieldType, field_types, and the one line refusing a kind the command line cannot
set), and parse_overrides' --name=value overrides with their one-line refusals (an unknown or malformed argument, a
missing value, a value of the wrong kind) and a switch's spellings; where a test needs a real dataclass it parses
the trainer's Hyperparameters through parse_args."""
import pytest

import flags
import train_gpt as T


# ----------------------------------------------------------------------------- field kinds

def test_optional_fields_parse_none_and_their_kind():
    from dataclasses import dataclass

    @dataclass
    class Fields:
        lr: float | None = None
        name: str = "x"
        steps: "int | None" = 3

    types = flags.field_types(Fields)
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

    with pytest.raises(flags.UsageError, match=r"^hyperparameter sizes is annotated list\[int\], which the command line "
                                           r"cannot set: use bool, int, float, str, or one of them \| None$"):
        flags.field_types(Fields)


# ----------------------------------------------------------------------------- command-line overrides

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
