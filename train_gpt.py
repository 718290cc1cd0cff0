"""GPT-2 speedrun trainer: one file, any number of ranks, CUDA or CPU.

Trains a GPT-2-small-class model on pre-tokenized FineWeb shards to <= 3.28
validation loss, following the 2025-01-26 NanoGPT speedrun recipe: Muon for
hidden matrices, Adam for the rest, value embeddings, U-net skips, long/short
sliding-window attention over documents, an FP8 LM head and a reduce-scatter
gradient loop.

    torchrun --standalone --nproc_per_node=8 train_gpt.py          # speedrun preset on GPUs
    python train_gpt.py                                            # cpu preset, bundled sample
    python train_gpt.py --preset=cpu --num_iterations=20 --seed=1  # any hyperparameter as --name=value
    torchrun --standalone --nproc_per_node=8 train_gpt.py --recipe=v2  # the later records' techniques

--recipe=reference (the default) keeps the 2025-01-26 math bit for bit; --recipe=v2 switches on later
records' techniques, each declared once in TECHNIQUES and each its own hyperparameter, so that any one can be
switched off.

Sections, in order: configuration, recipe v2's techniques, validation, distributed setup, data, model, optimizers,
schedules, run log and accounting, checkpoints, samples and HellaSwag, training loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import glob
import hashlib
import inspect
import json
import logging
import math
import os
import pickle
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
import typing
import uuid
import warnings
from dataclasses import dataclass, fields
from datetime import timedelta
from fractions import Fraction
from pathlib import Path



def stopped_before_training(signum: int) -> str:
    """The one line a signal ends a run with before its first training step."""
    return (f"error: stopped by signal {signal.Signals(signum).name} before the first training step; nothing was "
            "trained or saved: run again (or resume from the last checkpoint)")


def exit_on_signal_while_importing(signum: int, frame) -> None:
    """Ctrl-C or SIGTERM while numpy and torch import (seconds, before train() installs StopSignal)."""
    print(stopped_before_training(signum), file=sys.stderr, flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":  # a signal during the imports below ends in one line, not a 40-line traceback
    signal.signal(signal.SIGINT, exit_on_signal_while_importing)
    signal.signal(signal.SIGTERM, exit_on_signal_while_importing)

import numpy as np  # noqa: E402

# The 2025-01 record's allocator setting, before torch starts CUDA (a user's own setting wins): training
# (48K tokens) and validation (262K) graphs alternate, and fixed-size segments would fragment between them.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

REPO_DIR = Path(__file__).resolve().parent
EOT_TOKEN = 50256  # <|endoftext|>: every document starts with it
BLOCK_SIZE = 128  # attention mask granularity and window unit, in tokens


# Exit statuses, the same for every program here (README, "Errors and exit statuses"; tools/cli.py has the rest).
EXIT_OK = 0
EXIT_USAGE = 2  # a UsageError: the one-line message says what to fix
EXIT_PEER_LOST = 3  # a collective failed: another rank died or stopped answering
EXIT_RUN_FAILED = 4  # a RunFailed: the run itself failed (diverged, out of data, disk full), not its input


class UsageError(Exception):
    """An expected bad condition (flag, data, checkpoint, file, environment): reported as one line that
    says what to do, no traceback. tools/cli.py has the torch-free twin that data/ and records/ raise."""
    exit_status = EXIT_USAGE


class RunFailed(UsageError):
    """A run that started well and failed on its own (diverged, ran out of data, a full disk, a full KV cache):
    one line that says what to do, like a UsageError, but its own exit status, since no flag was wrong."""
    exit_status = EXIT_RUN_FAILED


# -----------------------------------------------------------------------------
# Configuration

@dataclass
class Hyperparameters:
    """Every knob of a run. The defaults are the `speedrun` preset: the 2025-01-26 record of the NanoGPT
    speedrun ("R" below: records/012625_BatchSize of modded-nanogpt), whose values tests/test_config.py pins."""
    preset: str = "auto"  # speedrun | cpu; auto picks speedrun when CUDA is present, cpu otherwise
    recipe: str = "reference"  # reference (R, bit for bit) | v2: the later records' techniques (TECHNIQUES)
    seed: int = 0  # model initialisation (data order is fixed by the shards)
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760  # R: the fixed validation budget every speedrun record is scored on
    train_cycle: bool = False  # allow more than one pass over the training shards
    bos_align: bool = False  # start every training sequence at a document start
    doc_len_cap: int = 0  # 2025-09-03_FA3: pack documents cut to this many tokens (the rest dropped); 0: off
    # batch: one flat sequence of seq_len tokens per rank per micro-step
    batch_tokens: int = 8 * 48 * 1024  # R: 8 GPUs x 48K tokens per optimizer step, fixed for any world size
    seq_len: int = 48 * 1024  # R: cut from 64K to 48K per GPU (critical batch size, arXiv 2410.21676)
    batch_schedule: str = ""  # 2025-11-29_BatchSizeSchedule: equal-length stages, fractions of batch_tokens ("1/3,2/3,1": the record's 131K -> 262K -> 393K); empty: batch_tokens throughout
    batch_lr_exponent: float = 0.6  # same record: a stage's lrs are scaled by (its tokens / batch_tokens) ** 0.6
    val_seq_len: int = 4 * 64 * 1024  # R: 256K-token val sequences cut fewer documents (~0.0015 lower val loss)
    # schedule
    num_iterations: int = 1770  # R
    cooldown_frac: float = 0.4  # R: lr decays linearly over this last fraction of training ...
    lr_final_frac: float = 0.1  # R: ... down to this fraction of the base lr
    val_every: int = 125  # R
    window_final_tokens: int = 1728  # R: window grows linearly to next_multiple(1728 * step / 1770, 128) tokens
    sliding_window: bool = True  # False: full causal attention within documents (ablation)
    # model (R: 12 x 768, 6 heads of 128; GPT-2 vocabulary, head padded to 50304)
    vocab_size: int = 50257  # GPT-2's BPE vocabulary (the head pads it to 50304, a multiple of 128)
    n_layer: int = 12  # R: GPT-2 small's depth
    model_dim: int = 768  # R: GPT-2 small's width
    n_head: int = 6  # R: 6 heads of 128 (GPT-2 small has 12 of 64)
    head_dim: int = 128  # R: wide heads, half of each rotated by rotary
    attn_scale: float = 0.12  # R: fixed attention temperature instead of 1/sqrt(128)
    logit_softcap: float = 30.0  # R: 30 * sigmoid(logits / 7.5); 0 turns the softcap (and the rescale below) off
    value_embeds: bool = True  # R: three value-embedding tables (value residual, arXiv 2410.17897)
    unet_skips: bool = True  # R: encoder layers feed the mirrored decoder layers with learned weights
    zero_init: bool = True  # R: zero-init output projections and the head (initial loss ln(50304))
    qk_norm: bool = True  # R: rms_norm of queries and keys before rotary
    mlp_act: str = "relu2"  # R: relu(x)^2 (Primer, arXiv 2109.08668) | gelu
    # model, recipe v2 (each off by default, which is the reference's math)
    bigram_vocab_size: int = 0  # 2026-01-19_BigramHashEmbedding: rows of a hashed (previous, current) token table added to every layer's input; 0: off
    bigram_dim: int = 0  # 2026-05-20_BigramsSignTrick: the table's width, added to the stream's first dims; 0: model_dim
    bigram_sign: bool = False  # same record: a second hash picks a fixed random +-1 vector per bigram, so rows shared by several bigrams interfere less
    smear: bool = False  # 2025-09-18_Smear: a gated share of the previous token's embedding, within the document
    attn_gate: bool = False  # 2025-08-23_SparseAttnGate: a sigmoid gate per head on the attention output
    ve_gates: bool = False  # 2025-12-29_VeSkipGates: a sigmoid gate per head on the value embeddings
    skip_gates: bool = False  # same record: a 2 * sigmoid gate on each U-net skip, read from the embedding x0
    backout: bool = False  # 2025-10-04_Backout: subtract a learned share of the stream after 3/4 of the layers before the head
    key_offset: bool = False  # 2025-12-14_PartialKeyOffset: long-window keys' stationary rotary dims come from the previous token
    paired_heads: bool = False  # 2026-01-07_PairedHeadAttention: head pairs attend as one head over interleaved positions
    logit_offset: float = 0.0  # 2025-12-26_LogitRescale: softcap * sigmoid((logits + offset) / logit_temperature)
    logit_temperature: float = 7.5  # R: 30 * sigmoid(logits / 7.5)
    mtp_tokens: int = 1  # 2025-12-22_MultiTokenPrediction: the training loss also predicts the next N-1 tokens after the next; 1: off
    # optimizers
    muon: bool = True  # R: Muon for hidden matrices; False: Adam for them too (ablation)
    muon_lr: float = 0.05  # R
    muon_momentum: float = 0.95  # R: Nesterov momentum, warmed up from muon_momentum_start ...
    muon_momentum_start: float = 0.85  # R
    muon_momentum_warmup_steps: int = 300  # R: ... over these steps
    ns_steps: int = 5  # R: quintic Newton-Schulz iterations
    polar_express: bool = False  # 2025-09-29_PolarExpress: a minimax-optimal quintic per iteration (at most 5)
    normuon: bool = False  # 2025-10-24_NorMuon: normalise the orthogonalised update per neuron by its 2nd moment
    normuon_beta2: float = 0.95  # same record
    cautious_wd: bool = False  # 2025-11-10_CautiousWD: decay only where the update and the weight agree in sign
    muon_cautious_wd: float = 1.2  # same record; applied as lr * wd, so it follows the lr schedule
    adam_cautious_wd: float = 0.005  # 2025-12-18_CautiousWDAdam: head and embeddings (not the scalars)
    scalar_adam_beta1: float | None = None  # 2025-12-21_SmoothedScalars: 0.9 for the scalars; none: adam_beta1
    scalar_adam_beta2: float | None = None  # same record: 0.99; none: adam_beta2
    adam_beta1: float = 0.8  # R
    adam_beta2: float = 0.95  # R
    adam_eps: float = 1e-10  # R
    head_lr: float = 0.008  # R
    embed_lr: float = 0.6  # R: token and value embeddings
    scalar_lr: float = 0.04  # R: lambdas and skip weights
    matrix_adam_lr: float = 0.001  # hidden matrices' lr when muon is off (best of a sweep on the cpu preset)
    weight_decay: float = 0.0  # R: none; decoupled, on matrices updated by Adam
    # systems
    dtype: str = "bf16"  # activations and embeddings: bf16 | fp32
    fp8_head: bool = True  # R: FP8 LM head; used only where the GPU supports FP8 (compute capability >= 8.9)
    attention: str = "auto"  # flex | banded; auto: flex on CUDA, banded (SDPA over key chunks) on CPU
    compile: str = "auto"  # model | loss (softcap + cross-entropy only) | off; auto: model on CUDA, loss on CPU
    coordinate_descent_tuning: bool = True  # R's inductor setting with --compile=model: faster kernels, longer compile
    warmup_steps: int = 10  # untimed steps to compile kernels; state is restored afterwards
    collective_timeout_s: int = 600  # a dead rank stops the others after this long
    # logging and accounting
    log_dir: str = "logs"
    run_id: str = ""  # default: time, preset and a random suffix
    log_train_loss: bool = False  # a host sync per step; off for the timed speedrun
    profile_steps: int = 0  # record this many steps with torch.profiler (Chrome trace per rank)
    # downstream checks (tools/): off by default, outside the timed region
    hellaswag_every: int = 0  # HellaSwag acc/acc_norm every N steps and at the end, all ranks' shares summed
    hellaswag_data: str = ""  # a local HellaSwag JSONL; empty: the pinned validation file, downloaded once
    sample_at_end: int = 0  # log this many short samples from the final model
    # checkpoints
    checkpoint_every: int = 0  # 0: only with checkpoint_final
    checkpoint_final: bool = False
    checkpoint_keep: int = 2
    resume: str = ""  # a checkpoint folder; "latest" (newest under log_dir); "auto" (this run_id's newest, else fresh)
    stop_after: int = 0  # stop (with a checkpoint) after this step; for preemption tests and resume drills


PRESETS = {
    "speedrun": dict(),  # the dataclass defaults are the 8xH100 reference recipe
    "cpu": dict(
        train_files="data/sample/sotu_train_*.bin",
        val_files="data/sample/sotu_val_*.bin",
        val_tokens=16384,
        batch_tokens=2048,
        seq_len=1024,
        val_seq_len=2048,
        num_iterations=60,
        val_every=20,
        window_final_tokens=1024,
        n_layer=6,
        model_dim=256,
        n_head=4,
        head_dim=64,
        warmup_steps=1,
        log_train_loss=True,
    ),
}

@dataclass(frozen=True)
class FieldType:
    """How the command line sets a hyperparameter: its kind, and whether 'none' sets it to None."""
    kind: type  # bool | int | float | str
    optional: bool = False  # annotated `kind | None`

    def __str__(self) -> str:
        return self.kind.__name__ + (" or none" if self.optional else "")

    def holds(self, value: object) -> bool:
        """Whether a JSON value (a checkpoint's record) is of this kind: an int passes for a float, a bool for
        nothing but a bool."""
        if value is None or isinstance(value, bool):
            return value is None and self.optional or isinstance(value, bool) and self.kind is bool
        return isinstance(value, (int, float) if self.kind is float else self.kind)


def field_types(cls: type = Hyperparameters) -> dict[str, FieldType]:
    """Every field's FieldType, read from its annotation: bool, int, float, str, or one of them | None.
    Any other annotation is refused in one line (the command line could not set it)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        hint = hints[f.name]
        parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        kinds = [k for k in parts if k is not type(None)]
        if len(kinds) != 1 or kinds[0] not in (bool, int, float, str):
            raise UsageError(f"hyperparameter {f.name} is annotated {hint}, which the command line cannot set: "
                             "use bool, int, float, str, or one of them | None")
        out[f.name] = FieldType(kinds[0], optional=len(parts) > len(kinds))
    return out


def parse_value(ftype: FieldType, text: str):
    if ftype.optional and text.lower() == "none":
        return None
    if ftype.kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true/false")
    return ftype.kind(text)


def help_text() -> str:
    """What --help prints: every flag in the dataclass's groups, with its default (the speedrun preset's), the cpu
    preset's value where it differs, and its comment, all read from the Hyperparameters source itself."""
    lines = ["usage: torchrun --nproc_per_node=N train_gpt.py [--name=value ...]   (one process: python train_gpt.py)",
             "Every flag is --name=value (a bare --name sets a switch true). Defaults are the speedrun preset's; "
             "[cpu: x] is --preset=cpu's value.", "", "general:"]
    for line in inspect.getsource(Hyperparameters).splitlines()[3:]:
        text = line.strip()
        if text.startswith("# "):
            lines += ["", text[2:] + ":"]
            continue
        name, comment = text.partition(":")[0], text.partition("#")[2].strip()
        if hasattr(Hyperparameters, name):
            cpu = PRESETS["cpu"].get(name)
            lines.append(f"  --{name}={flag_text(getattr(Hyperparameters, name))}"
                         + (f" [cpu: {flag_text(cpu)}]" if cpu is not None else "") + (f"  {comment}" if comment else ""))
    return "\n".join(lines)


def flag_text(value: object) -> str:
    """A value as the command line writes it: true/false, none, the rest as is."""
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def parse_overrides(argv: list[str]) -> dict[str, object]:
    """The values the command line sets, `--name=value` each (a bare --name sets a switch true); unknown names
    and values of the wrong kind are refused."""
    types = field_types()
    overrides: dict[str, object] = {}
    for arg in argv:
        name, sep, text = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or name not in types:
            raise UsageError(f"unknown argument {arg!r}; valid: " + " ".join(f"--{n}=" for n in types))
        if not sep:
            if types[name].kind is not bool:
                raise UsageError(f"--{name} needs a value: --{name}=<{types[name]}>")
            text = "true"
        try:
            overrides[name] = parse_value(types[name], text)
        except ValueError:
            raise UsageError(f"bad value {text!r} for --{name}: expected {types[name]}") from None
    return overrides


def resolve_hyperparameters(overrides: dict[str, object], cuda_available: bool) -> Hyperparameters:
    """The command line's values on top of its recipe's, on top of its preset's; validated."""
    preset = overrides.get("preset", "auto")
    if preset == "auto":
        preset = "speedrun" if cuda_available else "cpu"
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    recipe = overrides.get("recipe", Hyperparameters.recipe)
    if recipe not in RECIPES:
        raise UsageError(f"unknown recipe {recipe!r}; valid recipes: {', '.join(RECIPES)}")
    args = Hyperparameters(**{**PRESETS[preset], **RECIPES[recipe][preset], **overrides, "preset": preset})
    validate_args(args)
    return args


def parse_args(argv: list[str], cuda_available: bool) -> Hyperparameters:
    """`--name=value` overrides applied on top of a preset; unknown names and bad values are refused."""
    return resolve_hyperparameters(parse_overrides(argv), cuda_available)


# What a resumed run does not take from its checkpoint: where to find it and how to name this launch, the
# one-shot flags of a launch (stop after a step, profile a few steps), and the collective timeout, which the
# process group is made with before the checkpoint is read.
PER_LAUNCH_FIELDS = ("resume", "log_dir", "run_id", "stop_after", "profile_steps", "collective_timeout_s")


def resumed_hyperparameters(recorded: dict, overrides: dict[str, object], fresh: Hyperparameters,
                            path: Path) -> tuple[Hyperparameters, list[str]]:
    """A resumed run continues the run it resumes: every hyperparameter the checkpoint recorded, except the
    per-launch ones and those the command line sets. Returns them with the run-log lines that say which values
    came from where (where the checkpoint and this command line alone would disagree)."""
    types = field_types()
    for name in ("preset", "recipe"):
        if name in overrides and name in recorded and overrides[name] != recorded[name]:
            raise UsageError(f"--{name}={overrides[name]} differs from checkpoint {path}'s {name} {recorded[name]}: "
                             f"a resumed run keeps its {name}; drop --{name}, or start a new run")
    carried = {}
    for name, value in recorded.items():
        if name not in types or name in PER_LAUNCH_FIELDS or name in overrides:
            continue  # a field this train_gpt.py no longer has, or one this launch sets itself
        if not types[name].holds(value):
            raise UsageError(f"checkpoint {path} records {name}={value!r}, not a {types[name]}: its checkpoint.json "
                             "is edited or corrupt; resume from an earlier checkpoint")
        carried[name] = float(value) if types[name].kind is float and value is not None else value
    args = Hyperparameters(**{**dataclasses.asdict(fresh), **carried, **overrides})
    validate_args(args)
    kept = [f"{n}={flag_text(v)}" for n, v in carried.items() if v != getattr(fresh, n)]
    changed = [f"{n}={flag_text(v)} (checkpoint: {flag_text(recorded[n])})" for n, v in overrides.items()
               if n in recorded and n not in PER_LAUNCH_FIELDS and v != recorded[n]]
    lines = [f"resume: the hyperparameters of checkpoint {path}" + (f", which differ from this command line's "
                                                                   f"defaults in {', '.join(kept)}" if kept else "")]
    if changed:
        lines.append(f"resume: changed on the command line: {', '.join(changed)}")
    return args, lines


@dataclass(frozen=True)
class Rule:
    """What one flag accepts: a predicate and the valid range as the error message states it."""
    ok: object  # value -> bool
    valid: str


def integer(lo: int, hi: int | None = None) -> Rule:
    return Rule(lambda v: lo <= v and (hi is None or v <= hi),
                f"an integer at least {lo}" if hi is None else f"an integer in [{lo}, {hi}]")


def number(lo: float, hi: float = math.inf, hi_open: bool = False, lo_open: bool = False) -> Rule:
    """A finite float in the interval (NaN and inf are refused everywhere: they only ever mean a typo)."""
    def ok(v):
        return math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    left, right = "(" if lo_open else "[", ")" if hi_open or hi == math.inf else "]"
    return Rule(ok, f"a finite number in {left}{lo:g}, {'inf' if hi == math.inf else f'{hi:g}'}{right}")


def one_of(*allowed: str) -> Rule:
    return Rule(lambda v: v in allowed, "one of " + ", ".join(allowed))


ANY_BOOL = Rule(lambda v: isinstance(v, bool), "true or false")  # a checkpoint's JSON could hold anything
ANY_TEXT = Rule(lambda v: True, "any text")
NON_EMPTY = Rule(lambda v: v != "", "a non-empty path or glob")
# A run id names a log file and a folder directly under --log_dir, so it must not be a path.
PLAIN_NAME = Rule(lambda v: v == "" or (v not in (".", "..") and v[0] != "." and
                                        all(c.isascii() and (c.isalnum() or c in "._+=-") for c in v)),
                  "a plain name of letters, digits and ._+=- (no path separators, no leading dot), "
                  "or empty for a fresh name")
UNIT = number(0.0, 1.0)


def stage_fractions(text: str) -> list[Fraction] | None:
    """--batch_schedule's stages as exact fractions of batch_tokens; None if the text is not such a list."""
    try:
        out = [Fraction(part.strip()) for part in text.split(",")]
    except (ValueError, ZeroDivisionError):
        return None
    return out if all(0 < f <= 1 for f in out) else None


BETA = number(0.0, 1.0, hi_open=True)  # a decay of 1 never forgets; above 1 it diverges
OPTIONAL_BETA = Rule(lambda v: v is None or BETA.ok(v), BETA.valid + ", or none")
LR = number(0.0)


# -----------------------------------------------------------------------------
# Recipe v2: the later records' techniques, each declared once

@dataclass(frozen=True)
class Refusal:
    """A combination of flags a technique cannot run with, and the one line that says what to pass instead."""
    when: typing.Callable[[Hyperparameters], bool]
    why: typing.Callable[[Hyperparameters], str]


@dataclass(frozen=True)
class Technique:
    """One technique of recipe v2: validation, the recipes, checkpoints, decoding, the optimizer's gate groups,
    bench/ablation.py's variants and the README's Recipes table (a test holds it to this) all read it from here.
    Its flags are Hyperparameters fields (with their comments and defaults, which are the technique off); its
    math lives where the model or the optimizer uses it."""
    name: str  # bench/ablation.py calls its variants v2_without_<name> / v2_with_<name>
    records: tuple[str, ...]  # its modded-nanogpt records/track_1_short/ folders
    part: str  # model (ModelConfig carries its flags) | loss | optimizer | schedule | data
    flags: dict[str, Rule]  # the hyperparameters it owns, and what each accepts
    v2: dict[str, dict]  # preset -> the values recipe v2 sets there (its own flags or others) ...
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)  # ... or why v2 leaves it out there
    refusals: tuple[Refusal, ...] = ()
    reads_previous_token: bool = False  # the KV cache cannot extend it: decoding reruns the history
    gate_lrs: dict[str, float] = dataclasses.field(default_factory=dict)  # its gates' lr, a fraction of scalar_lr
    optimizer_state: bool = False  # it changes what the optimizer keeps, so a checkpoint must agree on it

    @property
    def switch(self) -> str:
        """The flag that turns it on: its first."""
        return next(iter(self.flags))

    def is_on(self, values) -> bool:
        """Whether a run (Hyperparameters or ModelConfig) uses it: its switch is off its default."""
        return getattr(values, self.switch) != getattr(Hyperparameters, self.switch)

    def off(self, preset: str) -> dict[str, object]:
        """The values that leave it out on preset: what the reference recipe has for every flag v2 sets."""
        reference = {**{f.name: getattr(Hyperparameters, f.name) for f in fields(Hyperparameters)}, **PRESETS[preset]}
        return {name: reference[name] for name in self.v2.get(preset, {})}


def everywhere(**values) -> dict[str, dict]:
    return {preset: values for preset in PRESETS}


def gates_need_width(flag: str) -> Refusal:
    return Refusal(lambda a: getattr(a, flag) and a.model_dim < GATE_DIMS,
                   lambda a: f"--{flag}=true reads the stream's first {GATE_DIMS} dims, more than --model_dim="
                             f"{a.model_dim}; switch the gate off or widen the model")


def needs_muon(flag: str) -> Refusal:
    return Refusal(lambda a: getattr(a, flag) and not a.muon,
                   lambda a: f"--{flag}=true changes Muon's update, and --muon=false turns Muon off; pass "
                             f"--muon=true or --{flag}=false")


# Gate lrs are fractions of scalar_lr (0.04 = 5 x the record's Adam lr 0.008): 2025-12-29_VeSkipGates has the
# smear gate at 0.01 x and the skip gate at 0.05 x that Adam lr, 2026-05-20_BigramsSignTrick the others at 1 x.
TECHNIQUES: tuple[Technique, ...] = (
    Technique(
        "batch_schedule", ("2025-11-29_BatchSizeSchedule",), "schedule",
        {"batch_schedule": Rule(lambda v: v == "" or stage_fractions(v) is not None,
                                "empty, or comma-separated fractions in (0, 1] such as 1/3,2/3,1"),
         "batch_lr_exponent": number(0.0)},
        # Its lrs are set for its first batch and scaled up by (batch / 131072) ** 0.6: Muon 0.023 -> 0.0444 at
        # the final batch, ours' base; its cooldown floor is 0.1 of the first stage's lr.
        {"speedrun": dict(batch_schedule="1/3,2/3,1", cooldown_frac=0.55, muon_lr=0.0444, lr_final_frac=0.0518),
         "cpu": dict(batch_schedule="1/3,2/3,1", cooldown_frac=0.55)}),
    Technique(  # sequences start at a document; documents are cut at the record's max_seq_len
        "doc_align", ("2025-07-12_BosAlign", "2025-09-03_FA3"), "data",
        {"bos_align": ANY_BOOL, "doc_len_cap": integer(0)},
        {"speedrun": dict(bos_align=True, doc_len_cap=2048)},
        left_out={"cpu": "the bundled sample's documents are ~7.8K tokens long (median), so aligned sequences "
                         "would drop most of its text"},
        refusals=(Refusal(lambda a: a.doc_len_cap and not a.bos_align,
                          lambda a: f"--doc_len_cap={a.doc_len_cap} packs whole documents from their start, so it "
                                    "needs --bos_align=true (or pass --doc_len_cap=0)"),)),
    Technique(
        "polar_express", ("2025-09-29_PolarExpress",), "optimizer", {"polar_express": ANY_BOOL},
        everywhere(polar_express=True),
        refusals=(needs_muon("polar_express"),
                  Refusal(lambda a: a.polar_express and a.ns_steps > len(POLAR_EXPRESS_COEFFICIENTS),
                          lambda a: f"--polar_express=true has {len(POLAR_EXPRESS_COEFFICIENTS)} iterations' "
                                    f"coefficients, not --ns_steps={a.ns_steps}; pass --ns_steps=5 or fewer"))),
    Technique(
        "normuon", ("2025-10-24_NorMuon", "2025-10-27_FixMuonLR"), "optimizer",
        {"normuon": ANY_BOOL, "normuon_beta2": BETA}, everywhere(normuon=True),
        refusals=(needs_muon("normuon"),), optimizer_state=True),
    Technique(
        "cautious_wd", ("2025-11-10_CautiousWD", "2025-12-18_CautiousWDAdam"), "optimizer",
        {"cautious_wd": ANY_BOOL, "muon_cautious_wd": number(0.0), "adam_cautious_wd": number(0.0)},
        everywhere(cautious_wd=True),
        refusals=(Refusal(lambda a: a.cautious_wd and a.weight_decay,
                          lambda a: f"--cautious_wd=true replaces the plain decay --weight_decay={a.weight_decay}; "
                                    "pass one of them"),)),
    Technique(
        "smoothed_scalars", ("2025-12-21_SmoothedScalars",), "optimizer",
        {"scalar_adam_beta1": OPTIONAL_BETA, "scalar_adam_beta2": OPTIONAL_BETA},
        everywhere(scalar_adam_beta1=0.9, scalar_adam_beta2=0.99)),
    # 15 x 50304 rows of 192 dims (a quarter of the stream); the bundled sample has about 10^5 distinct
    # bigrams, so the cpu preset takes 5 x 50304 rows of a quarter of its stream.
    Technique(
        "bigram", ("2026-01-19_BigramHashEmbedding", "2026-05-20_BigramsSignTrick"), "model",
        {"bigram_vocab_size": integer(0), "bigram_dim": integer(0), "bigram_sign": ANY_BOOL},
        {"speedrun": dict(bigram_vocab_size=15 * 50304, bigram_dim=192, bigram_sign=True),
         "cpu": dict(bigram_vocab_size=5 * 50304, bigram_dim=64, bigram_sign=True)},
        refusals=(
            Refusal(lambda a: a.bigram_sign and not a.bigram_vocab_size,
                    lambda a: "--bigram_sign=true signs the bigram embedding, which --bigram_vocab_size=0 turns "
                              "off; pass --bigram_sign=false or a table size"),
            Refusal(lambda a: a.bigram_vocab_size == 1,
                    lambda a: "--bigram_vocab_size=1 leaves no row besides the one kept for document starts; "
                              "pass 0 (off) or at least 2"),
            Refusal(lambda a: a.bigram_dim > a.model_dim,
                    lambda a: f"--bigram_dim={a.bigram_dim} is wider than the stream it is added to (--model_dim="
                              f"{a.model_dim}); pass at most that, or 0 for the full width")),
        reads_previous_token=True),
    Technique(
        "smear", ("2025-09-18_Smear",), "model", {"smear": ANY_BOOL}, everywhere(smear=True),
        refusals=(gates_need_width("smear"),), reads_previous_token=True, gate_lrs={"smear_gate": 0.01 / 5}),
    Technique(
        "attn_gate", ("2025-08-23_SparseAttnGate",), "model", {"attn_gate": ANY_BOOL}, everywhere(attn_gate=True),
        refusals=(gates_need_width("attn_gate"),), gate_lrs={"attn_gate": 1 / 5}),
    Technique(
        "ve_skip_gates", ("2025-12-29_VeSkipGates",), "model", {"ve_gates": ANY_BOOL, "skip_gates": ANY_BOOL},
        everywhere(ve_gates=True, skip_gates=True),
        refusals=(
            gates_need_width("ve_gates"), gates_need_width("skip_gates"),
            Refusal(lambda a: a.ve_gates and not a.value_embeds,
                    lambda a: "--ve_gates=true gates the value embeddings, which --value_embeds=false removes; pass "
                              "--ve_gates=false or --value_embeds=true"),
            Refusal(lambda a: a.skip_gates and not a.unet_skips,
                    lambda a: "--skip_gates=true gates the U-net skips, which --unet_skips=false removes; pass "
                              "--skip_gates=false or --unet_skips=true")),
        gate_lrs={"ve_gate": 1 / 5, "skip_gate": 0.05 / 5}),
    Technique("backout", ("2025-10-04_Backout",), "model", {"backout": ANY_BOOL}, everywhere(backout=True)),
    Technique(
        "key_offset", ("2025-12-14_PartialKeyOffset",), "model", {"key_offset": ANY_BOOL},
        everywhere(key_offset=True), reads_previous_token=True),
    Technique(
        "paired_heads", ("2026-01-07_PairedHeadAttention",), "model", {"paired_heads": ANY_BOOL},
        everywhere(paired_heads=True),
        refusals=(
            Refusal(lambda a: a.paired_heads and a.n_head % 2,
                    lambda a: f"--paired_heads=true pairs heads, so --n_head={a.n_head} must be even; pass "
                              "--paired_heads=false or an even --n_head"),
            Refusal(lambda a: a.paired_heads and
                    not any(LayerRoles.for_depth(a.n_layer, paired_heads=True).paired_heads),
                    lambda a: f"--paired_heads=true pairs the short-window layers, and --n_layer={a.n_layer} has "
                              "none; pass --paired_heads=false or --n_layer=4 or more")),
        reads_previous_token=True),  # its interleaved positions do not extend token by token
    # The logit rescale and multi-token prediction pay only at scale: on the cpu preset they are one flag away.
    Technique(
        "logit_rescale", ("2025-12-26_LogitRescale",), "model",
        {"logit_offset": number(-math.inf, lo_open=True, hi_open=True)},
        {"speedrun": dict(logit_softcap=23.0, logit_offset=5.0)},
        left_out={"cpu": "it costs 0.10 of validation loss at this scale, beyond the seed noise (bench/results/v2)"},
        refusals=(Refusal(lambda a: a.logit_offset != 0 and a.logit_softcap == 0,
                          lambda a: f"--logit_offset={a.logit_offset} shifts the logits inside the softcap, which "
                                    "--logit_softcap=0 turns off; pass --logit_offset=0 or a softcap"),)),
    Technique(
        "mtp", ("2025-12-22_MultiTokenPrediction",), "loss", {"mtp_tokens": integer(1)},
        {"speedrun": dict(mtp_tokens=3)},
        left_out={"cpu": "it does not pay at this scale: +0.015 of validation loss, inside the seed noise, for 9.5% "
                         "more time per step (bench/results/v2)"}),
)

# Recipe v2's batch geometry per preset, which the batch schedule's stages must split into whole sequences:
# on speedrun 16K-token sequences (1, 2, 3 per GPU on 8 GPUs); on cpu the record's ramp in 512-token
# sequences, 4 -> 8 -> 12, which 1, 2 and 4 ranks split (windows grow to the sequence).
V2_SHAPE = {"speedrun": dict(seq_len=16 * 1024),
            "cpu": dict(batch_tokens=6144, seq_len=512, window_final_tokens=512)}


def v2_values(preset: str) -> dict[str, object]:
    """What --recipe=v2 sets on preset: its shape, then every technique's values there."""
    out = dict(V2_SHAPE[preset])
    for technique in TECHNIQUES:
        for name, value in technique.v2.get(preset, {}).items():
            assert name not in out, f"{name} is set by two techniques of recipe v2"
            out[name] = value
    return out


# A recipe's values per preset, applied on top of the preset (command-line flags win over both).
RECIPES: dict[str, dict[str, dict]] = {
    "reference": {preset: {} for preset in PRESETS},
    "v2": {preset: v2_values(preset) for preset in PRESETS},
}


def left_out_line(args: Hyperparameters) -> str | None:
    """The run-log line of a recipe-v2 run on a preset that leaves techniques out: why, and the flags that add them."""
    missing = [t for t in TECHNIQUES if args.preset in t.left_out and not t.is_on(args)]
    if args.recipe != "v2" or not missing:
        return None
    return f"recipe v2 on the {args.preset} preset leaves out " + "; ".join(
        f"{t.name}: {t.left_out[args.preset]} ({' '.join(as_flags(t.v2['speedrun']))} adds it)" for t in missing)


def as_flags(values: dict[str, object]) -> list[str]:
    """Hyperparameter values as the command-line arguments that set them."""
    return [f"--{name}={flag_text(value)}" for name, value in values.items()]


def check_techniques(args: Hyperparameters) -> None:
    """Refuses, in one line, a technique's flags that conflict with each other or with the shape."""
    for technique in TECHNIQUES:
        for refusal in technique.refusals:
            if refusal.when(args):
                raise UsageError(refusal.why(args))


# -----------------------------------------------------------------------------
# Validation: each flag's range, and the relations between flags

# Every Hyperparameters field and what it accepts (a technique's own flags: its declaration); validate_args
# refuses a field missing here.
FLAG_RULES: dict[str, Rule] = {
    "preset": one_of(*PRESETS), "recipe": one_of(*RECIPES), "seed": integer(0, 2**63 - 1),
    "train_files": NON_EMPTY, "val_files": NON_EMPTY, "val_tokens": integer(1), "train_cycle": ANY_BOOL,
    "batch_tokens": integer(1), "seq_len": integer(BLOCK_SIZE),
    "val_seq_len": integer(BLOCK_SIZE), "num_iterations": integer(1), "cooldown_frac": UNIT, "lr_final_frac": UNIT,
    "val_every": integer(0), "window_final_tokens": integer(1), "sliding_window": ANY_BOOL,
    "vocab_size": integer(1), "n_layer": integer(2), "model_dim": integer(1), "n_head": integer(1),
    "head_dim": integer(4), "attn_scale": number(0.0, lo_open=True), "logit_softcap": number(0.0),
    "value_embeds": ANY_BOOL, "unet_skips": ANY_BOOL, "zero_init": ANY_BOOL, "qk_norm": ANY_BOOL,
    "mlp_act": one_of("relu2", "gelu"), "logit_temperature": number(0.0, lo_open=True),
    "muon": ANY_BOOL, "muon_lr": LR, "muon_momentum": BETA,
    "muon_momentum_start": BETA, "muon_momentum_warmup_steps": integer(0), "ns_steps": integer(1),
    "adam_beta1": BETA, "adam_beta2": BETA, "adam_eps": number(0.0, lo_open=True), "head_lr": LR, "embed_lr": LR,
    "scalar_lr": LR, "matrix_adam_lr": LR, "weight_decay": number(0.0), "dtype": one_of("bf16", "fp32"),
    "fp8_head": ANY_BOOL, "attention": one_of("auto", "flex", "banded"),
    "compile": one_of("auto", "model", "loss", "off"), "coordinate_descent_tuning": ANY_BOOL,
    "warmup_steps": integer(0),
    "collective_timeout_s": integer(1), "log_dir": NON_EMPTY, "run_id": PLAIN_NAME, "log_train_loss": ANY_BOOL,
    "profile_steps": integer(0), "checkpoint_every": integer(0), "checkpoint_final": ANY_BOOL,
    "checkpoint_keep": integer(1), "resume": ANY_TEXT, "stop_after": integer(0),
    "hellaswag_every": integer(0), "hellaswag_data": ANY_TEXT, "sample_at_end": integer(0),
    **{name: rule for technique in TECHNIQUES for name, rule in technique.flags.items()},
}


def check_flag_ranges(args: Hyperparameters) -> None:
    """Refuses, with one line naming the flag and its valid range, any value outside its FLAG_RULES range."""
    missing = [f.name for f in fields(Hyperparameters) if f.name not in FLAG_RULES]
    assert not missing, f"no validation rule for {missing}"  # a new field needs its entry in FLAG_RULES
    for name, rule in FLAG_RULES.items():
        value = getattr(args, name)
        if not rule.ok(value):
            raise UsageError(f"bad value {value!r} for --{name}; valid: {rule.valid}")


def check_batch_schedule(args: Hyperparameters) -> None:
    """The stages grow to batch_tokens, each whole sequences of seq_len tokens."""
    fracs = stage_fractions(args.batch_schedule) or []
    flag = f"--batch_schedule={args.batch_schedule}"
    if any(later < earlier for earlier, later in zip(fracs, fracs[1:])):
        raise UsageError(f"{flag} shrinks the batch; the stages must grow, each at least the one before (the "
                         "record's is 1/3,2/3,1)")
    if fracs and fracs[-1] != 1:
        raise UsageError(f"{flag} never reaches --batch_tokens={args.batch_tokens}: its last stage must be 1, the "
                         "batch the learning rates are set for (pass --batch_tokens for a smaller batch)")
    if len(fracs) > args.num_iterations:  # equal-length stages: some would get no step and silently never train
        raise UsageError(f"{flag} has {len(fracs)} stages but --num_iterations={args.num_iterations} has fewer steps; "
                         "every stage needs at least one step: pass fewer stages or more steps")
    unit = Fraction(args.seq_len, args.batch_tokens)  # the smallest stage: one sequence
    for frac in fracs:
        if frac % unit:
            raise UsageError(f"{flag}: stage {frac} of --batch_tokens={args.batch_tokens} is "
                             f"{float(args.batch_tokens * frac):g} tokens, not whole sequences of --seq_len="
                             f"{args.seq_len}; use multiples of {unit} (one sequence) for every stage")


def validate_args(args: Hyperparameters) -> None:
    """Refuses, in one line, any value or combination of values the run would trip over later."""
    check_flag_ranges(args)
    # Relations between flags, once every flag is in range.
    for name in ("seq_len", "val_seq_len"):
        if getattr(args, name) % BLOCK_SIZE:
            raise UsageError(f"--{name}={getattr(args, name)} is not a multiple of the {BLOCK_SIZE}-token block")
    if args.val_tokens % args.val_seq_len:
        raise UsageError(f"--val_tokens={args.val_tokens} is not a multiple of --val_seq_len={args.val_seq_len}")
    if args.n_layer % 2:
        raise UsageError(f"--n_layer={args.n_layer}: the U-net layout needs an even depth >= 2")
    if args.head_dim % 4:
        raise UsageError(f"--head_dim={args.head_dim} must be a positive multiple of 4 (half-truncated rotary)")
    if args.value_embeds and args.model_dim != args.n_head * args.head_dim:
        raise UsageError(f"--value_embeds=true adds model_dim-wide tables to the values, so --model_dim="
                         f"{args.model_dim} must equal --n_head x --head_dim = {args.n_head * args.head_dim}; "
                         "change one of them or pass --value_embeds=false")
    check_batch_schedule(args)
    check_techniques(args)
    if args.resume == "auto" and not args.run_id:
        raise UsageError("--resume=auto needs --run_id=NAME: a restarted run finds its checkpoints under "
                         "log_dir/NAME (and never another run's)")


# -----------------------------------------------------------------------------
# Distributed setup and device choices (decided once, here)

@dataclass
class Place:
    """Where this process runs: its rank among world_size processes, and its device."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()


@dataclass
class Runtime(Place):
    """The Place and what start-up decided for its device: dtype and kernels."""
    dtype: torch.dtype
    attention: str  # flex | banded
    fp8_head: bool
    compile: str  # model | loss | off
    chunked_loss: bool = False  # head + loss a chunk of rows at a time (ChunkedHeadLoss): the CPU path
    compile_attention: bool = False  # flex_attention compiled on its own: the model around it is not compiled
    host_malloc: str = "default"  # glibc's settings on a CPU run (keep_freed_host_memory)

    def resolved(self) -> dict:
        """What start-up decided (not what was asked for): the summary and checkpoints record this."""
        return {"attention": self.attention, "fp8_head": self.fp8_head, "compile": self.compile,
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                "chunked_loss": self.chunked_loss, "compile_attention": self.compile_attention,
                "host_malloc": self.host_malloc, "world_size": self.world_size}


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def join_process_group(args: Hyperparameters) -> Place:
    """This process's rank and device; joins the process group when launched by torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UsageError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                             "set --nproc_per_node to at most the GPU count")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=args.collective_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return Place(rank, local_rank, world_size, device)


def choose_runtime(place: Place, args: Hyperparameters) -> Runtime:
    """The device's dtype and kernels for this run's hyperparameters."""
    kernels = choose_kernels(args, place.device.type, fp8_supported(place.device))
    if kernels["compile"] == "model":
        configure_inductor(args)
    return Runtime(**vars(place), dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32, **kernels,
                   host_malloc=keep_freed_host_memory() if place.device.type == "cpu" else "default")


def setup_runtime(args: Hyperparameters) -> Runtime:
    return choose_runtime(join_process_group(args), args)


# glibc's mallopt parameters and what a CPU run sets them to, unless its MALLOC_<name>_ variable is set: blocks
# up to 256 MiB (a 512-row chunk of fp32 logits is 103 MB) from the heap, not mmap; freed heap kept up to 1 GiB;
# the heap grown 256 MiB at a time.
HOST_MALLOC = {"MMAP_THRESHOLD": (-3, 256 << 20), "TRIM_THRESHOLD": (-1, 1 << 30), "TOP_PAD": (-2, 256 << 20)}


def keep_freed_host_memory() -> str:
    """Keeps freed memory in glibc's heap for reuse. Every micro-step frees and allocates the same activation
    buffers, and by default glibc hands blocks over 128 KiB back to the kernel, which zero-fills their pages
    again on the next touch: a third of a cpu-preset step (bench/README.md). Math unchanged. Returns what
    was set, for the run log; "default" where there is no glibc."""
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "default"
    done = [f"{name.lower()}={value}" for name, (param, value) in HOST_MALLOC.items()
            if f"MALLOC_{name}_" not in os.environ and mallopt(param, value) == 1]
    return "glibc " + ",".join(done) if done else "default"


def choose_kernels(args: Hyperparameters, device_type: str, fp8_capable: bool) -> dict:
    """Runtime's kernel choices for a device: attention, FP8 head, what is compiled, the head + loss path."""
    attention = args.attention if args.attention != "auto" else ("flex" if device_type == "cuda" else "banded")
    # Inductor's CPU codegen is not reliable for the whole model; the loss alone is the big CPU win.
    compile_mode = args.compile if args.compile != "auto" else ("model" if device_type == "cuda" else "loss")
    fp8_head = args.fp8_head and fp8_capable
    # On CPU the full fp32 logits cost more than the head matmuls; GPUs and whole-model compiles keep the plain loss.
    # Uncompiled flex_attention materializes the whole score matrix (58 GB per layer at 48K tokens): outside a
    # compiled model it is compiled on its own, as PyTorch's documentation prescribes.
    return dict(attention=attention, fp8_head=fp8_head, compile=compile_mode,
                chunked_loss=device_type == "cpu" and not fp8_head and compile_mode != "model",
                compile_attention=attention == "flex" and compile_mode != "model")


def configure_inductor(args: Hyperparameters) -> None:
    """The record's compiler settings for a compiled model."""
    import torch._inductor.config as inductor_config
    inductor_config.coordinate_descent_tuning = args.coordinate_descent_tuning  # R: tunes each kernel's tiling


@dataclass(frozen=True)
class BatchSchedule:
    """Global tokens per optimizer step at every step: batch_tokens throughout, or --batch_schedule's stages,
    equal in length (2025-11-29_BatchSizeSchedule: stage int(3 * step / num_iterations)). Every stage is
    whole micro-steps of seq_len tokens on every rank, so the shapes (and compiled kernels) never change."""
    stage_tokens: tuple[int, ...]
    stage_accum: tuple[int, ...]  # micro-steps per rank in each stage
    num_iterations: int
    batch_tokens: int
    lr_exponent: float

    def stage(self, step: int) -> int:
        return min(len(self.stage_tokens) * step // self.num_iterations, len(self.stage_tokens) - 1)

    def tokens(self, step: int) -> int:
        return self.stage_tokens[self.stage(step)]

    def accum(self, step: int) -> int:
        return self.stage_accum[self.stage(step)]

    def lr_scale(self, step: int) -> float:
        """The record scales every lr as batch ** 0.6; batch_tokens' lrs are the base."""
        return (self.tokens(step) / self.batch_tokens) ** self.lr_exponent

    def first_step(self, stage: int) -> int:
        return -(-stage * self.num_iterations // len(self.stage_tokens))

    def tokens_before(self, step: int) -> int:
        """Training tokens of steps 0 .. step-1 (what a validation at `step` has seen)."""
        return sum(self.tokens(s) for s in range(step))


def batch_schedule(args: Hyperparameters, world_size: int) -> BatchSchedule:
    """Every stage's tokens and micro-steps; refuses a world size that cannot split every stage into whole
    sequences per rank, naming the world sizes that can."""
    fracs = stage_fractions(args.batch_schedule) if args.batch_schedule else [Fraction(1)]
    tokens = tuple(int(args.batch_tokens * f) for f in fracs)
    sequences = [n // args.seq_len if n % args.seq_len == 0 else 0 for n in tokens]
    if any(n == 0 or n % world_size for n in sequences):
        valid = [w for w in range(1, min(sequences) + 1) if all(n % w == 0 for n in sequences)]
        batch = f"--batch_tokens={args.batch_tokens}" if len(tokens) == 1 else \
            f"the --batch_schedule stages {'/'.join(map(str, tokens))} tokens"
        raise UsageError(f"world size {world_size} cannot split {batch} into sequences of --seq_len={args.seq_len} "
                         f"for every rank; world sizes that work: {valid or 'none (fix the batch size)'}")
    return BatchSchedule(tokens, tuple(n // world_size for n in sequences), args.num_iterations,
                         args.batch_tokens, args.batch_lr_exponent)


# -----------------------------------------------------------------------------
# Data: shards of uint16 tokens behind a 256-int32 header

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_BYTES = 256 * 4


def shard_token_count(path: Path) -> int:
    """Validates a shard's header against its file size and returns its token count."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    except OSError as e:
        raise UsageError(f"cannot read shard {path}: {e.strerror}") from None
    if header.size < 256:
        raise UsageError(f"shard {path} is truncated: {size} bytes is less than its 1024-byte header")
    if header[0] != SHARD_MAGIC:
        raise UsageError(f"shard {path} has magic {header[0]}, expected {SHARD_MAGIC}: not a token shard")
    if header[1] != SHARD_VERSION:
        raise UsageError(f"shard {path} has version {header[1]}, expected {SHARD_VERSION}")
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        raise UsageError(f"shard {path} is truncated or padded: header says {count} tokens "
                         f"({HEADER_BYTES + 2 * count} bytes), file has {size} bytes; download it again")
    return count


def load_shard(path: Path, vocab_size: int) -> np.ndarray:
    """Memory-maps a shard's tokens after checking every id fits the vocabulary."""
    count = shard_token_count(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))
    if count and int(tokens.max()) >= vocab_size:
        raise UsageError(f"shard {path} holds token id {int(tokens.max())} >= vocab size {vocab_size}")
    return tokens


def document_starts(tokens: np.ndarray) -> np.ndarray:
    """Positions of every <|endoftext|> in a shard: where documents begin."""
    return np.flatnonzero(np.asarray(tokens) == EOT_TOKEN)


class ShardReader:
    """One shard read and checked (load_shard: every id in the vocabulary; its document starts) in a
    background thread, so that the ~100M-token scans run while the device trains on the shard before."""

    def __init__(self, index: int, path: Path, vocab_size: int):
        self.index, self.result, self.error = index, None, None
        self.thread = threading.Thread(target=self._read, args=(path, vocab_size), name="shard-reader", daemon=True)
        self.thread.start()

    def _read(self, path: Path, vocab_size: int) -> None:
        try:
            tokens = load_shard(path, vocab_size)
            self.result = (tokens, document_starts(tokens))
        except BaseException as e:  # handed to the training thread, which raises it where the shard is used
            self.error = e

    def get(self) -> tuple[np.ndarray, np.ndarray]:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def find_shards(pattern: str, what: str) -> list[Path]:
    """Sorted shards matching a glob (relative to the working directory, else to this script's folder)."""
    matches = sorted(glob.glob(pattern))
    if not matches and not os.path.isabs(pattern):
        matches = sorted(glob.glob(str(REPO_DIR / pattern)))
    if not matches:
        hint = ("run `python data/cached_fineweb10B.py 9` to download them" if "fineweb" in pattern
                else "make shards with `python data/fineweb.py --input ...` or pass --train_files/--val_files")
        raise UsageError(f"no {what} shards match {pattern!r}; {hint}")
    return [Path(m) for m in matches]


class TokenStream:
    """The shards read in order as one stream. At the end it cycles only when asked to."""

    def __init__(self, files: list[Path], vocab_size: int, cycle: bool, read_ahead: bool = False):
        self.files, self.vocab_size, self.cycle = files, vocab_size, cycle
        self.epoch, self.shard, self.pos = 0, 0, 0
        self._tokens: np.ndarray | None = None
        self._bos: np.ndarray | None = None
        self.read_ahead = read_ahead  # the next shard read in the background (training; ShardReader)
        self._reader: ShardReader | None = None

    def state(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "pos": self.pos}

    def load_state(self, state: dict) -> None:
        self.epoch, self.shard, self.pos = state["epoch"], state["shard"], state["pos"]
        self._forget_shard()

    def _forget_shard(self) -> None:
        """Drops the loaded shard and its document starts together (stale starts would misplace documents)."""
        self._tokens, self._bos = None, None

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            if self._reader is not None and self._reader.index == self.shard:
                self._tokens, self._bos = self._reader.get()
            else:
                self._tokens = load_shard(self.files[self.shard], self.vocab_size)
            self._read_next_shard_ahead()
        return self._tokens

    def _read_next_shard_ahead(self) -> None:
        self.close()
        following = self.shard + 1 if self.shard + 1 < len(self.files) else (0 if self.cycle else None)
        if self.read_ahead and following is not None and following != self.shard:
            self._reader = ShardReader(following, self.files[following], self.vocab_size)

    def close(self) -> None:
        """Waits for a shard being read ahead and drops it (it may not be the one needed next)."""
        if self._reader is not None:
            self._reader.thread.join()
            self._reader = None

    def _next_shard(self) -> None:
        self.shard, self.pos = self.shard + 1, 0
        self._forget_shard()
        if self.shard == len(self.files):
            if not self.cycle:
                raise RunFailed(f"ran out of training data after {self.epoch + 1} pass(es) over {len(self.files)} "
                                 "shard(s); download more shards or pass --train_cycle=true to repeat them")
            self.shard, self.epoch = 0, self.epoch + 1

    def _next_bos(self, start: int) -> int:
        if self._bos is None:
            self._bos = document_starts(self.tokens)
        i = np.searchsorted(self._bos, start)
        return int(self._bos[i]) if i < len(self._bos) else len(self.tokens)

    def take(self, n: int, bos_align: bool = False, doc_cap: int = 0) -> np.ndarray:
        """The next n tokens plus the one after (the last target); the cursor moves by n. With doc_cap,
        documents are packed from their starts, each cut to doc_cap tokens (the cursor moves past the last)."""
        for _ in range(2 * len(self.files) + 1):
            start = self._next_bos(self.pos) if bos_align else self.pos
            if doc_cap:
                pieces = self._capped_documents(start, n + 1, doc_cap)
                if pieces is not None:
                    self.pos = int(pieces[-1][1])
                    return np.concatenate([self.tokens[a:b] for a, b in pieces])
            elif start + n + 1 <= len(self.tokens):
                self.pos = start + n
                return self.tokens[start:start + n + 1]
            try:
                self._next_shard()
            except RunFailed as e:
                if not bos_align:
                    raise
                raise RunFailed(f"{e}; with --bos_align=true every sequence starts at a document start, so a shard's "
                                f"text after its last start with {n + 1} tokens to go is skipped (one document longer "
                                "than the shard yields one sequence): pass --bos_align=false or add shards") from None
        raise UsageError(f"no shard of {[str(f) for f in self.files]} holds a sequence of {n + 1} tokens")

    def _capped_documents(self, start: int, need: int, cap: int) -> list[tuple[int, int]] | None:
        """[begin, end) of the documents from the one at `start` on, each cut to cap tokens and the last one
        to what fills `need` tokens (2025-09-03_FA3's packing); None if this shard runs out first."""
        self._next_bos(start)  # loads the document starts
        i = int(np.searchsorted(self._bos, start))
        bounds = np.append(self._bos[i:i + need + 1], len(self.tokens))[:need + 1]  # need pieces at most
        begins, ends = bounds[:-1], np.minimum(bounds[1:], bounds[:-1] + cap)
        filled = np.cumsum(ends - begins)
        k = int(np.searchsorted(filled, need))
        if k == len(begins):
            return None
        ends[k] -= filled[k] - need
        return list(zip(begins[:k + 1].tolist(), ends[:k + 1].tolist()))


def to_device(chunk: np.ndarray, device: torch.device) -> tuple[Tensor, Tensor]:
    """Inputs and next-token targets; pinned and asynchronous on CUDA."""
    host = torch.from_numpy(chunk.astype(np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    seq = host.to(device, non_blocking=True)
    return seq[:-1], seq[1:]


class DistributedTokenLoader:
    """Cuts each global batch into world_size * accum sequences; rank r takes sequences r, r + W, ...

    Every rank walks the same global layout, so the batch does not depend on the world size.
    """

    def __init__(self, stream: TokenStream, seq_len: int, rank: int, world_size: int, bos_align: bool,
                 doc_cap: int, device: torch.device):
        self.stream, self.seq_len, self.rank, self.world_size = stream, seq_len, rank, world_size
        self.bos_align, self.doc_cap, self.device = bos_align, doc_cap, device

    def next_batch(self, accum: int) -> list[tuple[Tensor, Tensor]]:
        """The step's accum micro-batches of this rank."""
        chunks = [self.stream.take(self.seq_len, self.bos_align, self.doc_cap) for _ in range(self.world_size * accum)]
        return [to_device(chunks[i], self.device) for i in range(self.rank, len(chunks), self.world_size)]


def validation_sequences(files: list[Path], args: Hyperparameters, rank: int, world_size: int) -> list[np.ndarray]:
    """This rank's share of the fixed validation budget (sequence i goes to rank i % world_size)."""
    total = sum(shard_token_count(f) for f in files)
    if total < args.val_tokens + 1:
        raise UsageError(f"--val_tokens={args.val_tokens} but the validation shards hold only {total} tokens; "
                         "lower --val_tokens")
    stream = TokenStream(files, args.vocab_size, cycle=False)
    seqs = [np.array(stream.take(args.val_seq_len)) for _ in range(args.val_tokens // args.val_seq_len)]
    return seqs[rank::world_size]


# -----------------------------------------------------------------------------
# Model

def rms_norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


@dataclass(frozen=True)
class LayerRoles:
    """Every depth-dependent role of the U-net layout, derived in one place.

    For 12 layers: value embeddings 0,1,2 at layers 0-2 and again at 9-11, no attention
    in layer 7, windows L S S S L S | S L S S S L, layers 0-5 feed skips into 11-6.
    """
    value_embed: tuple[int | None, ...]  # table index used by each layer
    attention: tuple[bool, ...]
    long_window: tuple[bool, ...]
    n_encoder: int
    n_value_embeds: int
    paired_heads: tuple[bool, ...]  # attention layers whose head pairs attend as one
    key_offset: tuple[bool, ...]  # attention layers whose keys take the previous token's stationary dims
    backout_layer: int | None  # the stream entering this layer is backed out before the head

    VALUE_EMBED_TABLES = 3  # R: three value-embedding tables, read by the first three and the last three layers
    LONG_WINDOW_EVERY = 4  # R: encoder layers 0, 4, ... have the long window; the decoder mirrors the encoder
    NO_ATTENTION_OFFSET = 1  # R: the layer just after the middle (7 of 12) has no attention, only its MLP
    BACKOUT_FRACTION = Fraction(3, 4)  # 2025-10-04_Backout: the stream after block 8 of 12 (0-based), entering 9

    @staticmethod
    def for_depth(n_layer: int, value_embeds: bool = True, paired_heads: bool = False, key_offset: bool = False,
                  backout: bool = False) -> "LayerRoles":
        n_enc = n_layer // 2
        n_ve = min(LayerRoles.VALUE_EMBED_TABLES, n_enc) if value_embeds else 0
        ve: list[int | None] = [None] * n_layer
        for i in range(n_ve):
            ve[i] = ve[n_layer - n_ve + i] = i
        encoder_long = [i % LayerRoles.LONG_WINDOW_EVERY == 0 for i in range(n_enc)]
        attention = [i != n_enc + LayerRoles.NO_ATTENTION_OFFSET for i in range(n_layer)]
        long_window = encoder_long + encoder_long[::-1]
        # 2026-01-07_PairedHeadAttention pairs layers 0, 2, 5, 9 of its 11: the first short-window layer and each
        # short-window layer just before a long-window or attention-free one (1, 3, 6, 10 of our 12)
        short = [i for i in range(n_layer) if attention[i] and not long_window[i]]
        paired = {i for i in short if i == short[0] or i + 1 < n_layer and (long_window[i + 1] or not attention[i + 1])}
        return LayerRoles(value_embed=tuple(ve), attention=tuple(attention), long_window=tuple(long_window),
                          n_encoder=n_enc, n_value_embeds=n_ve,
                          paired_heads=tuple(paired_heads and i in paired for i in range(n_layer)),
                          key_offset=tuple(key_offset and attention[i] and long_window[i] for i in range(n_layer)),
                          backout_layer=int(n_layer * LayerRoles.BACKOUT_FRACTION) if backout else None)


def document_ids(tokens: Tensor) -> Tensor:
    """Document index of every token: a new document starts at each EOT token."""
    return (tokens == EOT_TOKEN).cumsum(0)


def attention_allowed(docs: Tensor, q_idx: Tensor, kv_idx: Tensor, window_blocks: Tensor) -> Tensor:
    """The one mask rule: causal, same document, and within window_blocks 128-token blocks."""
    in_window = q_idx // BLOCK_SIZE - kv_idx // BLOCK_SIZE < window_blocks
    return (kv_idx <= q_idx) & (docs[q_idx] == docs[kv_idx]) & in_window


def sliding_window_mask(tokens: Tensor, window_blocks: Tensor) -> Tensor:
    """Dense (T, T) boolean mask of attention_allowed: O(T^2), kept as the tests' oracle only."""
    idx = torch.arange(tokens.numel(), device=tokens.device)
    return attention_allowed(document_ids(tokens), idx[:, None], idx[None, :], window_blocks)


BAND_CHUNK_KEYS = 64 * 1024  # key slots per SDPA call: bounds the per-call mask and gradient buffers


@dataclass
class BandedMask:
    """attention_allowed over each query block's band: key blocks i-W+1..i of query block i.

    Query blocks are split into chunks; chunk (lo, hi) has a boolean mask (hi-lo, 1, 128, W*128).
    Keys left of the sequence start (block index < 0) are padding and never allowed.
    """
    band_blocks: int  # W
    chunks: list[tuple[int, int, Tensor]]


@torch.compiler.disable  # the band's width is read from a tensor: a compiled model calls this eagerly
def banded_window_mask(tokens: Tensor, window_blocks: Tensor, chunk_keys: int = BAND_CHUNK_KEYS) -> BandedMask:
    """The band of each query block, masked by the same rule as the dense and Flex masks.

    The window is read as an int here (a host sync), once per mask: the band's width is a shape.
    """
    docs = document_ids(tokens)
    n_blocks = tokens.numel() // BLOCK_SIZE
    band = max(1, min(int(window_blocks), n_blocks))  # a wider window sees the whole sequence anyway
    per_chunk = max(1, chunk_keys // (band * BLOCK_SIZE))
    offsets = torch.arange(band * BLOCK_SIZE, device=tokens.device)
    chunks = []
    for lo in range(0, n_blocks, per_chunk):
        hi = min(lo + per_chunk, n_blocks)
        q_idx = torch.arange(lo * BLOCK_SIZE, hi * BLOCK_SIZE, device=tokens.device).view(hi - lo, BLOCK_SIZE, 1)
        first_key = (torch.arange(lo, hi, device=tokens.device) - (band - 1)) * BLOCK_SIZE
        kv_idx = (first_key.view(-1, 1) + offsets).view(hi - lo, 1, -1)
        allowed = attention_allowed(docs, q_idx, kv_idx.clamp_min(0), window_blocks) & (kv_idx >= 0)
        chunks.append((lo, hi, allowed[:, None]))
    return BandedMask(band_blocks=band, chunks=chunks)


def banded_attention(q: Tensor, k: Tensor, v: Tensor, mask: BandedMask, scale: float) -> Tensor:
    """Exact attention over (1, T, H, D) inputs that scores only each query block's band: O(T*W).

    The keys are padded with W-1 blocks in front; query block i's band is then a window of the
    padded keys, taken as an overlapping view (no copy). Every query may attend to itself, so no
    row of a mask is empty and no softmax sees only -inf.
    """
    if q.size(0) != 1:
        raise ValueError("banded attention takes one flat sequence (batch size 1)")
    band, n_heads, head_dim = mask.band_blocks, q.size(2), q.size(3)
    pad = (band - 1) * BLOCK_SIZE
    k, v = (F.pad(t[0], (0, 0, 0, 0, pad, 0)) for t in (k, v))  # (pad + T, H, D)

    def bands(t: Tensor, lo: int, hi: int) -> Tensor:  # (hi - lo, H, W*128, D), a view of t
        return t[lo * BLOCK_SIZE:(hi + band - 1) * BLOCK_SIZE].unfold(0, band * BLOCK_SIZE, BLOCK_SIZE) \
            .permute(0, 1, 3, 2)

    out = []
    for lo, hi, allowed in mask.chunks:
        q_blocks = q[0, lo * BLOCK_SIZE:hi * BLOCK_SIZE].view(hi - lo, BLOCK_SIZE, n_heads, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q_blocks, bands(k, lo, hi), bands(v, lo, hi), attn_mask=allowed,
                                           scale=scale)
        out.append(y.transpose(1, 2).reshape(1, (hi - lo) * BLOCK_SIZE, n_heads, head_dim))
    return torch.cat(out, dim=1) if len(out) > 1 else out[0]


def sliding_window_block_mask(tokens: Tensor, window_blocks: Tensor):
    """FlexAttention BlockMask of attention_allowed, built from per-block document ranges.

    A block pair is full when every pair in it is allowed, partial (mask_mod decides) when some are.
    """
    from torch.nn.attention.flex_attention import BlockMask

    docs = document_ids(tokens)
    n_blocks = tokens.numel() // BLOCK_SIZE
    doc_lo, doc_hi = docs.view(n_blocks, BLOCK_SIZE)[:, 0], docs.view(n_blocks, BLOCK_SIZE)[:, -1]
    q_blk = torch.arange(n_blocks, device=tokens.device)[:, None]
    kv_blk = q_blk.T
    in_window = q_blk - kv_blk < window_blocks
    any_allowed = (kv_blk <= q_blk) & (doc_lo[:, None] <= doc_hi[None, :]) & (doc_lo[None, :] <= doc_hi[:, None])
    all_allowed = (kv_blk < q_blk) & (doc_lo[:, None] == doc_hi[:, None]) & (doc_lo[None, :] == doc_hi[None, :]) \
        & (doc_lo[:, None] == doc_lo[None, :])
    full = all_allowed & in_window
    partial = any_allowed & in_window & ~full

    def kv_order(blocks: Tensor) -> tuple[Tensor, Tensor]:
        counts = blocks.sum(dim=-1, dtype=torch.int32)
        order = blocks.to(torch.int8).argsort(dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), order[None, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return attention_allowed(docs, q_idx, kv_idx, window_blocks)

    partial_counts, partial_idx = kv_order(partial)
    full_counts, full_idx = kv_order(full)
    return BlockMask.from_kv_blocks(partial_counts, partial_idx, full_counts, full_idx,
                                    BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA over (1, T, H, D) inputs with an explicit boolean mask: the KV-cache decode path."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale)
    return y.transpose(1, 2)


class BandedAttention:
    """Banded masks and scaled_dot_product_attention: CPU, and wherever FlexAttention is off."""
    build_mask = staticmethod(banded_window_mask)
    attend = staticmethod(banded_attention)


def flex_attention(*args, **kwargs) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention as kernel
    return FLEX_KERNEL.get("attend", kernel)(*args, **kwargs)


FLEX_KERNEL: dict = {}  # "attend": flex_attention compiled on its own (compile_flex_attention), when set


def compile_flex_attention() -> None:
    from torch.nn.attention.flex_attention import flex_attention as kernel
    FLEX_KERNEL["attend"] = torch.compile(kernel, dynamic=False)


class FlexAttention:
    """Block-sparse FlexAttention: CUDA (its backward does not run on CPU)."""
    build_mask = staticmethod(sliding_window_block_mask)

    @staticmethod
    def attend(q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> Tensor:
        y = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, scale=scale)
        return y.transpose(1, 2)


ATTENTION_BACKENDS = {"banded": BandedAttention, "flex": FlexAttention}


def attention_with(backend, mask):
    """One layer's attention, attend(q, k, v, scale): the backend with this layer's mask (KVCache.layer is the
    other kind, for decoding)."""
    return lambda q, k, v, scale: backend.attend(q, k, v, mask, scale)


# FP8 head: e4m3 operands forward, e5m2 gradients backward, scales fixed by the recipe.

def inverse_scale(scale: float, device: torch.device) -> Tensor:
    """torch._scaled_mm's fp32 scale operand, filled on the device (new_tensor would copy from the host and wait)."""
    return torch.full((), 1 / scale, dtype=torch.float32, device=device)


def fp8_forward_math(x: Tensor, w: Tensor, x_scale: float, w_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    x_f8 = (x * x_scale).to(torch.float8_e4m3fn)
    w_f8 = (w * w_scale).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.bfloat16, use_fast_accum=True,
                           scale_a=inverse_scale(x_scale, x.device), scale_b=inverse_scale(w_scale, x.device))
    return out, x_f8, w_f8


def fp8_backward_math(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_scale: float, w_scale: float,
                      grad_scale: float) -> tuple[Tensor, Tensor]:
    grad_f8 = (grad * grad_scale).to(torch.float8_e5m2)
    inv = lambda s: inverse_scale(s, grad.device)
    grad_x = torch._scaled_mm(grad_f8, w_f8.T.contiguous().T, out_dtype=torch.bfloat16, use_fast_accum=False,
                              scale_a=inv(grad_scale), scale_b=inv(w_scale))
    grad_w = torch._scaled_mm(grad_f8.T.contiguous(), x_f8.T.contiguous().T, out_dtype=torch.float32,
                              use_fast_accum=False, scale_a=inv(grad_scale), scale_b=inv(x_scale))
    return grad_x, grad_w


# A custom op is opaque to the model's torch.compile, so its scaling, casts and transposes would run as
# separate eager kernels (about 10 GB of extra memory traffic per step on a 49152x50304 gradient); the
# record compiles the op's insides. compile_fp8_kernels() switches to that, once, at start-up.
FP8_KERNELS = {"forward": fp8_forward_math, "backward": fp8_backward_math}


def compile_fp8_kernels(backend: str = "inductor") -> None:
    FP8_KERNELS["forward"] = torch.compile(fp8_forward_math, dynamic=False, fullgraph=True, backend=backend)
    FP8_KERNELS["backward"] = torch.compile(fp8_backward_math, dynamic=False, fullgraph=True, backend=backend)


@torch.library.custom_op("speedrun::fp8_matmul", mutates_args=())
def fp8_matmul(x: Tensor, w: Tensor, x_scale: float, w_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """x @ w.T in FP8; also returns the FP8 operands for the backward pass."""
    return FP8_KERNELS["forward"](x, w, x_scale, w_scale)


@fp8_matmul.register_fake
def _(x: Tensor, w: Tensor, x_scale: float, w_scale: float):
    return (x.new_empty(x.shape[0], w.shape[0], dtype=torch.bfloat16),
            torch.empty_like(x, dtype=torch.float8_e4m3fn), torch.empty_like(w, dtype=torch.float8_e4m3fn))


@torch.library.custom_op("speedrun::fp8_matmul_backward", mutates_args=())
def fp8_matmul_backward(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_scale: float, w_scale: float,
                        grad_scale: float) -> tuple[Tensor, Tensor]:
    """grad_x = grad @ w and grad_w = grad.T @ x from two scaled matmuls; grad_w accumulates in fp32."""
    return FP8_KERNELS["backward"](grad, x_f8, w_f8, x_scale, w_scale, grad_scale)


@fp8_matmul_backward.register_fake
def _(grad: Tensor, x_f8: Tensor, w_f8: Tensor, x_scale: float, w_scale: float, grad_scale: float):
    return (x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16), w_f8.new_empty(w_f8.shape, dtype=torch.float32))


FP8_SCALES = dict(x_scale=2.0, w_scale=2.0 ** 9, grad_scale=2.0 ** 19)  # R (w from 2**5, grad from 2**29)


def _fp8_setup_context(ctx, inputs, output):
    _, _, x_scale, w_scale = inputs
    ctx.save_for_backward(output[1], output[2])
    ctx.scales = (x_scale, w_scale)


def _fp8_backward(ctx, grad_out, *_):
    x_f8, w_f8 = ctx.saved_tensors
    grad_x, grad_w = fp8_matmul_backward(grad_out, x_f8, w_f8, *ctx.scales, FP8_SCALES["grad_scale"])
    return grad_x, grad_w, None, None


fp8_matmul.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)


class CastedLinear(nn.Linear):
    """fp32 master weight, used in the activation dtype; optionally FP8 in training (the head)."""

    def __init__(self, in_features: int, out_features: int, zero_init: bool = False, fp8: bool = False):
        super().__init__(in_features, out_features, bias=False)
        self.fp8 = fp8
        bound = math.sqrt(3) * 0.5 / math.sqrt(in_features)  # uniform with std 0.5/sqrt(fan_in)
        with torch.no_grad():
            self.weight.zero_() if zero_init else self.weight.uniform_(-bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 and self.training:
            out = fp8_matmul(x.flatten(0, -2), self.weight, FP8_SCALES["x_scale"], FP8_SCALES["w_scale"])[0]
            return out.view(*x.shape[:-1], -1)
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    """Rotary embedding on half the head dimension; the other half's frequencies are zero (not rotated)."""

    def __init__(self, head_dim: int, max_seq_len: int):
        super().__init__()
        n = head_dim // 4
        freqs = torch.cat([(1 / 1024) ** torch.linspace(0, 1, n), torch.zeros(n)])
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:  # (B, T, H, D) at positions offset, offset + 1, ...
        positions = slice(offset, offset + x.size(1))
        cos, sin = self.cos[None, positions, None, :], self.sin[None, positions, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


GATE_DIMS = 12  # 2025-08-23_SparseAttnGate, 2025-09-18_Smear, 2025-12-29_VeSkipGates: gates read 12 dims
NEUTRAL_GATE_SCALE = 2.0  # 2025-12-29_VeSkipGates: 2 * sigmoid, so a zero-initialised gate passes its input as is
BIGRAM_HASH = (36313, 27191)  # 2026-01-19_BigramHashEmbedding: multipliers of the current and previous token
BIGRAM_SIGN_ROWS = 8192  # 2026-05-20_BigramsSignTrick: random +-1 vectors, picked by (previous xor current) % 8192
BIGRAM_LAMBDA_INIT = 0.05  # same record: every layer adds 0.05 x the bigram embedding at first
BACKOUT_LAMBDA_INIT = 0.5  # 2025-10-04_Backout


# The model's share of the hyperparameters: the reference's shape and math, and every model technique's flags.
REFERENCE_MODEL_FIELDS = ("vocab_size", "n_layer", "model_dim", "n_head", "head_dim", "attn_scale", "qk_norm",
                          "zero_init", "mlp_act", "value_embeds", "unet_skips", "logit_softcap", "logit_temperature")


def model_config_class() -> type:
    """ModelConfig: a frozen dataclass of those Hyperparameters fields (same names and kinds), plus max_seq_len,
    the positions the rotary tables cover (the longer of training and validation sequences)."""
    kinds = field_types()
    names = REFERENCE_MODEL_FIELDS + tuple(name for t in TECHNIQUES if t.part == "model" for name in t.flags)
    cls = dataclasses.make_dataclass("ModelConfig", [(name, kinds[name].kind) for name in names]
                                     + [("max_seq_len", int)], frozen=True)
    cls.of = staticmethod(lambda args: cls(max_seq_len=max(args.seq_len, args.val_seq_len),
                                           **{name: getattr(args, name) for name in names}))
    return cls


ModelConfig = model_config_class()


def sigmoid_gate(x: Tensor, weight: Tensor) -> Tensor:
    """sigmoid(x[..., :GATE_DIMS] @ weight.T): one gate per row of weight, read from the stream's first dims."""
    return torch.sigmoid(F.linear(x[..., :GATE_DIMS], weight.type_as(x)))


def previous_in_document(x: Tensor, doc_start: Tensor) -> Tensor:
    """x (1, T, ...) shifted one position later along T: each position gets the previous token's value, and a
    document's first token gets zeros, so nothing crosses a document start (smear, key offset)."""
    previous = F.pad(x[:, :-1], (0, 0) * (x.dim() - 2) + (1, 0))
    return previous * ~doc_start.view(1, -1, *[1] * (x.dim() - 2))


def offset_stationary_keys(k: Tensor, doc_start: Tensor) -> Tensor:
    """2025-12-14_PartialKeyOffset: each key's stationary rotary dims (D/4..D/2 and 3D/4..D, which rotary
    leaves unrotated) are replaced by the previous token's, so one key can answer for two positions (1-layer
    induction). A document's first token gets zeros there: nothing crosses a document start."""
    dim = torch.arange(k.size(-1), device=k.device)
    stationary = dim % (k.size(-1) // 2) >= k.size(-1) // 4
    return torch.where(stationary, previous_in_document(k, doc_start), k)


def pair_heads(t: Tensor) -> Tensor:
    """(B, T, H, D) -> (B, 2T, H/2, D): heads 2p and 2p+1 become one head over interleaved positions
    (2026-01-07_PairedHeadAttention): position 2i holds token i's head 2p, position 2i+1 its head 2p+1."""
    B, T, H, D = t.shape
    return t.view(B, T, H // 2, 2, D).transpose(2, 3).reshape(B, 2 * T, H // 2, D)


def unpair_heads(t: Tensor) -> Tensor:
    """The inverse of pair_heads."""
    B, T2, H2, D = t.shape
    return t.view(B, T2 // 2, 2, H2, D).transpose(2, 3).reshape(B, T2 // 2, 2 * H2, D)


def paired_tokens(tokens: Tensor) -> Tensor:
    """A token sequence whose masks (document ids, causality, windows) are those of pair_heads' positions:
    token i at 2i and a non-document-start token at 2i+1, so both copies of i share i's document."""
    second = torch.where(tokens == EOT_TOKEN, 0, tokens)
    return torch.stack([tokens, second], dim=1).flatten()


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, uses_value_embed: bool, paired: bool = False, key_offset: bool = False):
        super().__init__()
        dim, hdim = cfg.model_dim, cfg.n_head * cfg.head_dim
        self.n_head, self.head_dim, self.scale, self.qk_norm = cfg.n_head, cfg.head_dim, cfg.attn_scale, cfg.qk_norm
        self.paired, self.key_offset = paired, key_offset
        bound = math.sqrt(3) * 0.5 / math.sqrt(dim)
        self.qkv_w = nn.Parameter(torch.empty(3, hdim, dim).uniform_(-bound, bound))  # Q, K, V kept apart for Muon
        # 2025-12-29_VeSkipGates: with the gate, the value embedding enters at the gate's weight alone (lambda 1)
        self.lambdas = nn.Parameter(torch.tensor([0.5, 1.0 if cfg.ve_gates else 0.5] if uses_value_embed else [0.5]))
        # paired heads rotate at their interleaved positions, so a pair's two heads sit half a token apart
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len * (2 if paired else 1))
        self.c_proj = CastedLinear(hdim, dim, zero_init=cfg.zero_init)
        self.attn_gate = nn.Parameter(torch.zeros(cfg.n_head, GATE_DIMS)) if cfg.attn_gate else None
        self.ve_gate = nn.Parameter(torch.zeros(cfg.n_head, GATE_DIMS)) if cfg.ve_gates and uses_value_embed else None

    def forward(self, x: Tensor, ve: Tensor | None, attend, offset: int = 0, doc_start: Tensor | None = None) -> Tensor:
        """attend(q, k, v, scale): this layer's attention (attention_with, or KVCache.layer when decoding)."""
        B, T = x.shape[:2]
        qkv = F.linear(x, self.qkv_w.flatten(end_dim=1).type_as(x)).view(B, T, 3 * self.n_head, self.head_dim)
        q, k, v = qkv.chunk(3, dim=-2)
        if self.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
        if self.ve_gate is not None:
            ve = ve.view_as(v) * (NEUTRAL_GATE_SCALE * sigmoid_gate(x, self.ve_gate))[..., None]
        v = self.lambdas[0] * v if ve is None else self.lambdas[0] * v + self.lambdas[1] * ve.view_as(v)
        if self.paired:
            q, k, v = pair_heads(q), pair_heads(k), pair_heads(v)
            offset = 2 * offset
        q, k = self.rotary(q, offset), self.rotary(k, offset)
        if self.key_offset:
            k = offset_stationary_keys(k, doc_start)
        y = attend(q, k, v, self.scale)
        if self.paired:
            y = unpair_heads(y)
        if self.attn_gate is not None:
            y = y * sigmoid_gate(x, self.attn_gate)[..., None]
        return self.c_proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = CastedLinear(cfg.model_dim, 4 * cfg.model_dim)
        self.c_proj = CastedLinear(4 * cfg.model_dim, cfg.model_dim, zero_init=cfg.zero_init)
        self.act = (lambda h: F.relu(h).square()) if cfg.mlp_act == "relu2" else F.gelu

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, roles: LayerRoles):
        super().__init__()
        self.attn = CausalSelfAttention(cfg, roles.value_embed[layer] is not None,
                                        paired=roles.paired_heads[layer], key_offset=roles.key_offset[layer]) \
            if roles.attention[layer] else None
        self.mlp = MLP(cfg)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # mix of the stream and the embedding x0
        self.bigram_lambda = nn.Parameter(torch.tensor([BIGRAM_LAMBDA_INIT])) if cfg.bigram_vocab_size else None

    def forward(self, x: Tensor, x0: Tensor, ve: Tensor | None, attend, offset: int = 0,
                doc_start: Tensor | None = None, bigram: Tensor | None = None) -> Tensor:
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if bigram is not None:
            x = x + self.bigram_lambda[0] * bigram  # [0]: a 0-dim factor keeps x in bf16
        if self.attn is not None:
            x = x + self.attn(rms_norm(x), ve, attend, offset, doc_start)
        return x + self.mlp(rms_norm(x))


def next_multiple(n: float, k: int) -> int:
    return int(math.ceil(n / k) * k)


def token_pairs(tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(current, previous, first) for the bigram hashes: int64 ids, the ids shifted one later, and where a pair
    must not be formed (the sequence's first token and every document start)."""
    current = tokens.to(torch.int64)
    first = tokens == EOT_TOKEN
    first[0] = True
    return current, F.pad(current[:-1], (1, 0)), first


def bigram_rows(tokens: Tensor, rows: int) -> Tensor:
    """2026-01-19_BigramHashEmbedding: the table row of each (previous, current) token pair,
    (36313 * current) xor (27191 * previous) mod (rows - 1). Row rows - 1 is kept for a document's first token
    (the record keeps it for the sequence's first only): a pair never spans two documents."""
    current, previous, first = token_pairs(tokens)
    row = torch.bitwise_xor(BIGRAM_HASH[0] * current, BIGRAM_HASH[1] * previous) % (rows - 1)
    return torch.where(first, rows - 1, row)


def bigram_sign_table(dim: int) -> Tensor:
    """2026-05-20_BigramsSignTrick: BIGRAM_SIGN_ROWS fixed random +-1 vectors. Drawn from a fixed seed, so every
    rank and every reload has the same table without storing it."""
    return torch.randn(BIGRAM_SIGN_ROWS, dim, generator=torch.Generator().manual_seed(0), device="cpu").sign()


def bigram_sign_rows(tokens: Tensor) -> Tensor:
    """Same record: the sign vector of each (previous, current) pair, (previous xor current) % BIGRAM_SIGN_ROWS
    (a different hash from bigram_rows'), row 0 at a document's first token. Two pairs sharing a table row
    then mostly add their embeddings with different signs, and interfere less."""
    current, previous, first = token_pairs(tokens)
    return torch.where(first, 0, torch.bitwise_xor(previous, current) % BIGRAM_SIGN_ROWS)


def smear(x: Tensor, gate: Tensor, doc_start: Tensor) -> Tensor:
    """2025-09-18_Smear: x[i] + gate[i] * x[i - 1] over (1, T, D) embeddings, where gate is (1, T, 1);
    a document's first token takes nothing from the token before it."""
    return x + gate * previous_in_document(x, doc_start)


class GPT(nn.Module):
    """The model of a ModelConfig. What the machine decides comes in from build_model: the attention backend
    (ATTENTION_BACKENDS), the FP8 head, and the loss path (LossPath); the tools' KV cache comes with decode()."""

    def __init__(self, cfg: ModelConfig, attention: str = "banded", fp8_head: bool = False,
                 loss: "LossPath | None" = None):
        super().__init__()
        self.loss = loss = LossPath() if loss is None else loss
        if loss.chunked and fp8_head:
            raise ValueError("the chunked head + loss computes the head in the activation dtype, not FP8")
        self.config = cfg
        self.roles = LayerRoles.for_depth(cfg.n_layer, cfg.value_embeds, cfg.paired_heads, cfg.key_offset,
                                          cfg.backout)
        self.backend = ATTENTION_BACKENDS[attention]
        self.vocab_size, self.unet = cfg.vocab_size, cfg.unet_skips
        self.softcap = Softcap(cfg.logit_softcap, cfg.logit_temperature, cfg.logit_offset)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, cfg.model_dim)
                                          for _ in range(self.roles.n_value_embeds))
        bigram_dim = cfg.bigram_dim or cfg.model_dim
        self.bigram_embed = nn.Embedding(cfg.bigram_vocab_size, bigram_dim) if cfg.bigram_vocab_size else None
        if self.bigram_embed is not None:
            nn.init.zeros_(self.bigram_embed.weight)  # the record: the table starts empty
        self.register_buffer("bigram_signs", bigram_sign_table(bigram_dim) if cfg.bigram_sign else None,
                             persistent=False)
        self.blocks = nn.ModuleList(Block(cfg, i, self.roles) for i in range(cfg.n_layer))
        self.skip_weights = nn.Parameter(torch.ones(self.roles.n_encoder)) if cfg.unet_skips else None
        self.skip_gate = nn.Parameter(torch.zeros(self.roles.n_encoder, GATE_DIMS)) if cfg.skip_gates else None
        self.smear_gate = nn.Parameter(torch.zeros(1, GATE_DIMS)) if cfg.smear else None
        self.smear_lambda = nn.Parameter(torch.zeros(1)) if cfg.smear else None  # the record: no smear at first
        self.backout_lambda = nn.Parameter(torch.tensor([BACKOUT_LAMBDA_INIT])) if cfg.backout else None
        self.lm_head = CastedLinear(cfg.model_dim, next_multiple(cfg.vocab_size, 128), zero_init=cfg.zero_init,
                                    fp8=fp8_head)

    def forward(self, tokens: Tensor, targets: Tensor, windows: Tensor, mtp_weights: Tensor | None = None) -> Tensor:
        """Mean cross-entropy of one flat sequence (T,) of documents. windows: the (long, short) window
        sizes in blocks, a (2,) tensor from the schedule (attention_windows). mtp_weights (training only):
        the weights of the next 1, 2, ... tokens' losses (mtp_loss_weights); none: the next token's alone."""
        if tokens.numel() % BLOCK_SIZE:
            raise UsageError(f"sequence length {tokens.numel()} is not a multiple of the {BLOCK_SIZE}-token block")
        if not torch.compiler.is_compiling():
            check_model_inputs(tokens, targets, windows, self.vocab_size)
        if mtp_weights is not None:
            targets = multi_token_targets(targets, mtp_weights.numel())
        # Validation (eval, no grad) too: its 262K-token sequence would otherwise hold 26 GB of bf16 logits.
        if self.loss.chunked or not (self.training or torch.is_grad_enabled()):
            return chunked_head_loss(self.final_hidden(tokens, windows)[0], self.lm_head.weight, targets,
                                     self.softcap, self.loss.chunk, mtp_weights)
        if mtp_weights is not None:
            return multi_token_cross_entropy(self.logits(tokens, windows), targets, mtp_weights, self.softcap)
        return self.loss.full(self.logits(tokens, windows), targets, self.softcap)

    def logits(self, tokens: Tensor, windows: Tensor) -> Tensor:
        """Head outputs (1, T, padded vocab) before the softcap: the forward pass without the loss."""
        return self.lm_head(self.final_hidden(tokens, windows))

    def final_hidden(self, tokens: Tensor, windows: Tensor) -> Tensor:
        """The normed residual stream (1, T, model_dim) the head reads."""
        return rms_norm(self.trunk(tokens, self.layer_attention(tokens, windows)))

    def layer_attention(self, tokens: Tensor, windows: Tensor) -> list:
        """Each layer's attention: the backend with the layer's window mask, over paired positions for
        paired-head layers (each kind of mask built once)."""
        kinds = list(zip(self.roles.long_window, self.roles.paired_heads))
        masks = {(is_long, paired): self.backend.build_mask(paired_tokens(tokens) if paired else tokens,
                                                            windows[0] if is_long else windows[1])
                 for is_long, paired in dict.fromkeys(kinds)}
        return [attention_with(self.backend, masks[kind]) for kind in kinds]

    def trunk(self, tokens: Tensor, layer_attention: list, offset: int = 0) -> Tensor:
        """Embeddings through every block (value embeddings, x0 mixing, U-net skips): the residual stream."""
        doc_start = tokens == EOT_TOKEN
        ve = [emb(tokens)[None] for emb in self.value_embeds]
        x = self.embed(tokens)[None]
        if self.smear_gate is not None:
            x = smear(x, self.smear_lambda[0] * sigmoid_gate(x, self.smear_gate), doc_start)
        x = x0 = rms_norm(x)
        bigram = None
        if self.bigram_embed is not None:
            bigram = self.bigram_embed(bigram_rows(tokens, self.bigram_embed.num_embeddings))[None]
            if self.bigram_signs is not None:
                bigram = bigram * self.bigram_signs[bigram_sign_rows(tokens)].type_as(bigram)
            bigram = F.pad(bigram, (0, x.size(-1) - bigram.size(-1)))  # into the stream's first bigram_dim dims
        skips, backout = [], None
        for i, block in enumerate(self.blocks):
            if i == self.roles.backout_layer:
                backout = x
            if self.unet and i >= self.roles.n_encoder:
                j = i - self.roles.n_encoder
                weight = self.skip_weights[j] if self.skip_gate is None \
                    else self.skip_weights[j] * NEUTRAL_GATE_SCALE * sigmoid_gate(x0, self.skip_gate[j:j + 1])
                x = x + weight * skips.pop()
            ve_i = self.roles.value_embed[i]
            x = block(x, x0, None if ve_i is None else ve[ve_i], layer_attention[i], offset, doc_start, bigram)
            if self.unet and i < self.roles.n_encoder:
                skips.append(x)
        if backout is not None:
            x = x - self.backout_lambda[0] * backout
        return x

    @property
    def decodes_from_history(self) -> bool:
        """Whether a technique reads the token before or interleaves positions (Technique.reads_previous_token):
        the KV cache cannot extend those, so decode() runs the whole history instead."""
        return any(t.is_on(self.config) for t in TECHNIQUES if t.reads_previous_token)

    @torch.no_grad()
    def decode(self, tokens: Tensor, cache: "KVCache") -> Tensor:
        """Head outputs (padded vocab) after the last of tokens (n,), which continue the cached sequence.

        The same modules and weights as logits(); each attention layer reads its keys and values
        from the cache, so a new token costs O(window) instead of a pass over the whole prefix.
        """
        start = cache.extend(tokens)
        if self.decodes_from_history:
            history = cache.tokens[:cache.length]
            padded = F.pad(history, (0, -cache.length % BLOCK_SIZE), value=EOT_TOKEN)  # later tokens: no effect
            return self.logits(padded, cache.window_pair)[0, cache.length - 1]
        x = self.trunk(tokens, [cache.layer(i) for i in range(len(self.blocks))], offset=start)
        return self.lm_head(rms_norm(x[0, -1]))

    @property
    def context_len(self) -> int:
        """Positions the rotary tables cover: the longest sequence the model can take."""
        return self.config.max_seq_len


class KVCache:
    """Keys and values of every attention layer for one growing sequence: GPT.decode's attention.

    Each layer's attention (layer()) stores its new keys and values at their absolute positions, and the new
    queries attend to the cached ones that attention_allowed admits (causal, same document, within the
    layer's long or short window), exactly as in the full forward.
    """

    def __init__(self, model: GPT, windows: Tensor, max_len: int | None = None):
        self.max_len = model.context_len if max_len is None else max_len
        if self.max_len > model.context_len:
            raise UsageError(f"a cache of {self.max_len} positions exceeds the model's {model.context_len}-token "
                             "context")
        device = model.embed.weight.device
        windows = self.window_pair = windows.to(device)
        self.windows = [windows[0] if is_long else windows[1] for is_long in model.roles.long_window]
        self.window_sizes = [int(w) for w in self.windows]  # host copies: no device sync per token
        self.keys: list[Tensor | None] = [None] * len(model.blocks)
        self.values: list[Tensor | None] = [None] * len(model.blocks)
        self.docs = torch.zeros(self.max_len, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(self.max_len, dtype=torch.int64, device=device)  # GPT.decodes_from_history
        self.start, self.length = 0, 0

    def extend(self, tokens: Tensor) -> int:
        """Appends tokens' document ids; returns the position of the first one."""
        n = tokens.numel()
        if self.length + n > self.max_len:
            raise RunFailed(f"sequence of {self.length + n} tokens exceeds the cache's {self.max_len} positions")
        previous = self.docs[self.length - 1] if self.length else 0
        self.docs[self.length:self.length + n] = previous + document_ids(tokens)
        self.tokens[self.length:self.length + n] = tokens
        self.start, self.length = self.length, self.length + n
        return self.start

    def layer(self, layer: int):
        """Layer's attention, attend(q, k, v, scale), reading and extending this cache."""
        return lambda q, k, v, scale: self.attend(q, k, v, layer, scale)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float) -> Tensor:
        if self.keys[layer] is None:
            self.keys[layer] = k.new_zeros(1, self.max_len, *k.shape[2:])
            self.values[layer] = v.new_zeros(1, self.max_len, *v.shape[2:])
        self.keys[layer][:, self.start:self.length] = k
        self.values[layer][:, self.start:self.length] = v
        window = self.windows[layer]
        first = max(0, (self.start // BLOCK_SIZE - self.window_sizes[layer] + 1) * BLOCK_SIZE)  # oldest key in any window
        q_idx = torch.arange(self.start, self.length, device=q.device)[:, None]
        kv_idx = torch.arange(first, self.length, device=q.device)[None, :]
        mask = attention_allowed(self.docs, q_idx, kv_idx, window)
        return dense_attention(q, self.keys[layer][:, first:self.length], self.values[layer][:, first:self.length],
                                    mask, scale)


class Softcap(typing.NamedTuple):
    """The head's logit squash, cap * sigmoid((z + offset) / temperature); a cap of 0 leaves logits as they are.
    R: 30 * sigmoid(z / 7.5). 2025-12-26_LogitRescale: 23 * sigmoid((z + 5) / 7.5), asymmetric about 0."""
    cap: float
    temperature: float = 7.5
    offset: float = 0.0


def apply_softcap(logits: Tensor, softcap: Softcap) -> Tensor:
    """fp32 logits squashed into (0, cap)."""
    logits = logits.float()
    if softcap.cap > 0:
        shifted = logits + softcap.offset if softcap.offset else logits
        logits = softcap.cap * torch.sigmoid(shifted / softcap.temperature)
    return logits


def softcapped_cross_entropy(logits: Tensor, targets: Tensor, softcap: Softcap) -> Tensor:
    """Mean cross-entropy of the softcapped fp32 logits."""
    logits = apply_softcap(logits, softcap)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def multi_token_targets(targets: Tensor, n: int) -> Tensor:
    """(T,) next-token targets -> (T, n): column k is the token k+1 places after the next, ignored (-100)
    past the sequence's end and once a document has ended (an EOT target) before it."""
    columns, ended = [targets], torch.zeros_like(targets, dtype=torch.bool)
    for k in range(1, n):
        ended = ended | (columns[-1] == EOT_TOKEN)
        later = F.pad(targets[k:], (0, k), value=-100)
        columns.append(torch.where(ended, -100, later))
    return torch.stack(columns, dim=1)


def multi_token_cross_entropy(logits: Tensor, targets: Tensor, weights: Tensor, softcap: Softcap) -> Tensor:
    """2025-12-22_MultiTokenPrediction: sum_k weights[k] * (mean cross-entropy of column k of targets), every
    column scored by the same softcapped logits (the record sums the weighted losses, it does not average them)."""
    capped = apply_softcap(logits, softcap).view(-1, logits.size(-1))
    counts = (targets != -100).sum(0).clamp_min(1)
    sums = torch.stack([F.cross_entropy(capped, targets[:, k], reduction="sum") for k in range(targets.size(1))])
    return (sums / counts * weights).sum()


HEAD_CHUNK_ROWS = 512  # rows of fp32 logits alive at once in the chunked head + loss (at least)
MAX_HEAD_CHUNKS = 32  # longer sequences (GPU validation: 262K tokens) take bigger chunks, not more of them


def head_chunks(n_rows: int) -> list[slice]:
    """The row ranges the chunked head + loss takes one at a time."""
    size = max(HEAD_CHUNK_ROWS, -(-n_rows // MAX_HEAD_CHUNKS))
    return [slice(lo, lo + size) for lo in range(0, n_rows, size)]


def softcapped_cross_entropy_chunk(logits: Tensor, targets: Tensor, softcap: Softcap, scales: Tensor,
                                   with_grad: bool) -> tuple[Tensor, Tensor | None]:
    """softcapped_cross_entropy of some rows against each column of targets (rows, K), summed per column
    (not averaged), and in closed form the gradient of sum_k scales[k] * (column k's sum) to the logits.

    The gradient is cast to the logits' dtype as autograd would. With one column and scales = 1 / count it is
    d(mean loss)/d(logits) = (softmax - onehot) / count, times cap * s' / temperature.
    """
    z = logits.float()
    sig = torch.sigmoid((z + softcap.offset if softcap.offset else z) / softcap.temperature) \
        if softcap.cap > 0 else None
    capped = softcap.cap * sig if softcap.cap > 0 else z
    lse = torch.logsumexp(capped, dim=-1, keepdim=True)
    valid = targets != -100  # cross_entropy's ignore_index
    picked = capped.gather(1, torch.where(valid, targets, 0))
    loss_sums = torch.stack([torch.where(valid[:, k], (lse - picked)[:, k], 0.0).sum() for k in range(targets.size(1))])
    if not with_grad:
        return loss_sums, None
    if targets.size(1) == 1:  # the reference's expression, bit for bit
        onehot = torch.arange(capped.size(-1), device=capped.device)[None, :] == targets
        grad = (torch.exp(capped - lse) - onehot.float()) * (valid.float() * scales)
    else:  # softmax * sum_k c_k - sum_k c_k * onehot_k, with c_k = scales[k] where the target counts
        coef = valid.float() * scales
        grad = torch.exp(capped - lse) * coef.sum(1, keepdim=True)
        grad = grad.scatter_add(1, torch.where(valid, targets, 0), -coef)
    if softcap.cap > 0:
        grad = grad * (softcap.cap * sig * (1 - sig) / softcap.temperature)
    return loss_sums, grad.to(logits.dtype)


class ChunkedHeadLoss(torch.autograd.Function):
    """lm_head matmul + softcapped cross-entropy, a chunk of rows at a time (the CPU path).

    Same math as softcapped_cross_entropy(F.linear(h, weight.type_as(h))) (multi_token_cross_entropy for
    several target columns), but only one chunk of fp32 logits exists at a time: each chunk's gradient is
    computed in the forward (closed form) and kept in h's dtype, as the plain path's bf16 logits would be;
    backward is then two matmuls.
    """

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, softcap: Softcap, kernel, weights: Tensor) -> Tensor:
        w = weight.type_as(h)
        counts = (targets != -100).sum(0).clamp_min(1)
        scales = weights / counts.float()
        grad_logits = h.new_empty(h.size(0), w.size(0))
        totals = torch.zeros(targets.size(1), dtype=torch.float32, device=h.device)
        for rows in head_chunks(h.size(0)):
            loss_sums, grad_logits[rows] = kernel(F.linear(h[rows], w), targets[rows], softcap, scales, True)
            totals += loss_sums
        ctx.save_for_backward(h, w, grad_logits)
        ctx.weight_dtype = weight.dtype
        return (totals / counts * weights).sum()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        h, w, grad_logits = ctx.saved_tensors
        scale = grad_loss.to(h.dtype)
        grad_h = (grad_logits @ w) * scale if ctx.needs_input_grad[0] else None
        grad_w = (grad_logits.T @ h).to(ctx.weight_dtype) * grad_loss if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None


def chunked_head_loss(h: Tensor, weight: Tensor, targets: Tensor, softcap: Softcap, kernel,
                      weights: Tensor | None = None) -> Tensor:
    """Mean softcapped cross-entropy of F.linear(h, weight) against targets (T,) or (T, K) (each column
    weighted by weights, as multi_token_cross_entropy) without ever holding all fp32 logits."""
    targets = targets[:, None] if targets.dim() == 1 else targets
    weights = torch.ones(1, device=h.device) if weights is None else weights
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return ChunkedHeadLoss.apply(h, weight, targets, softcap, kernel, weights)
    w = weight.type_as(h)
    counts = (targets != -100).sum(0).clamp_min(1)
    totals = torch.zeros(targets.size(1), dtype=torch.float32, device=h.device)
    for rows in head_chunks(h.size(0)):
        totals += kernel(F.linear(h[rows], w), targets[rows], softcap, counts, False)[0]
    return (totals / counts * weights).sum()


@dataclass(frozen=True)
class LossPath:
    """How GPT turns the head's output into the loss: the softcapped cross-entropy kernels (compiled or not),
    and whether training too goes through the chunked head, which never holds all fp32 logits (the CPU's
    choice: Runtime.chunked_loss). Validation always does."""
    full: typing.Callable = softcapped_cross_entropy
    chunk: typing.Callable = softcapped_cross_entropy_chunk
    chunked: bool = False

    @staticmethod
    def compiled(chunked: bool) -> "LossPath":
        return LossPath(torch.compile(softcapped_cross_entropy, dynamic=False),
                        torch.compile(softcapped_cross_entropy_chunk, dynamic=False), chunked)


def check_model_inputs(tokens: Tensor, targets: Tensor, windows: Tensor, vocab_size: int) -> None:
    """Eager-mode guards that would otherwise surface as a wrong mask, a trained padding logit or a
    device-side assert. Targets may hold -100, cross_entropy's ignore index. The value checks run on CPU
    tensors only: on a GPU each would wait for the device, and the trainer's inputs were checked on the
    host already (load_shard's vocabulary check, StepTensors' windows)."""
    if windows.shape != (2,):
        raise ValueError(f"windows must be the (long, short) pair of window sizes, got shape {tuple(windows.shape)}")
    if tokens.device.type != "cpu":
        return
    if int(windows.min()) < 1:
        raise UsageError(f"attention window of {int(windows.min())} blocks is below one {BLOCK_SIZE}-token block")
    top = int(tokens.max())
    if top >= vocab_size or int(tokens.min()) < 0:
        raise UsageError(f"token id {top if top >= vocab_size else int(tokens.min())} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if int(targets.max()) >= vocab_size:
        raise UsageError(f"target id {int(targets.max())} is outside the vocabulary [0, {vocab_size})")


def build_model(args: Hyperparameters, rt: Runtime) -> GPT:
    """The model on its device: embeddings in the activation dtype, matrices and scalars in fp32."""
    loss = LossPath.compiled(rt.chunked_loss) if rt.compile == "loss" else LossPath(chunked=rt.chunked_loss)
    model = GPT(ModelConfig.of(args), attention=rt.attention, fp8_head=rt.fp8_head, loss=loss).to(rt.device)
    if rt.fp8_head and rt.compile == "model":
        compile_fp8_kernels()
    if rt.compile_attention:
        compile_flex_attention()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.to(rt.dtype)
    return model


# -----------------------------------------------------------------------------
# Optimizers: a reduce-scatter gradient loop feeding sharded Muon and Adam

def quintic_iterations(G: Tensor, coefficients: list[tuple[float, float, float]], norm_scale: float,
                       eps: float) -> Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, once per (a, b, c), in bf16 on the wide orientation of G,
    after dividing G by its Frobenius norm (times norm_scale) so that every singular value starts <= 1."""
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * norm_scale + eps)
    for a, b, c in coefficients:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if tall else X


def newton_schulz(G: Tensor, steps: int = 5) -> Tensor:
    """R's quintic Newton-Schulz iteration pushing every singular value of G towards 1.

    The coefficients trade exactness for speed: singular values land in a band around 1
    (about [0.68, 1.13] for inputs that are not nearly singular), not on 1 exactly.
    """
    return quintic_iterations(G, [(3.4445, -4.7750, 2.0315)] * steps, 1.0, 1e-7)


# 2025-09-29_PolarExpress (Amsel et al., arXiv 2505.16932): each iteration's quintic is the minimax-optimal
# one for the singular-value interval the previous ones leave, so 5 iterations land much closer to 1.
POLAR_EXPRESS_COEFFICIENTS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def polar_express(G: Tensor, steps: int = 5) -> Tensor:
    """Polar Express orthogonalisation; the record divides by 1.02 x the norm as a safety margin for bf16."""
    return quintic_iterations(G, POLAR_EXPRESS_COEFFICIENTS[:steps], 1.02, 1e-6)


class Bucket:
    """Parameters whose summed gradient is reduce-scattered as one tensor, with its persistent buffers.

    A Muon bucket holds world_size same-shape matrices (None pads the last one): rank r receives
    matrix r's whole gradient. An Adam bucket holds one parameter: rank r receives slice r of it.
    The communication buffers live as long as the bucket, so a step allocates nothing for them.
    """

    def __init__(self, params: list[nn.Parameter | None], muon: bool, world_size: int):
        self.params, self.muon, self.world_size = params, muon, world_size
        self.real = [p for p in params if p is not None]
        ref = self.real[0]
        numel = ref.numel()
        self.shard_numel = numel if muon else -(-numel // world_size)
        self.ready = 0
        self.work = None
        self.shard: Tensor | None = None
        # Reduce-scatter input: a copy only where the gradient is not already one flat tensor.
        needs_copy = world_size > 1 and (muon or self.shard_numel * world_size != numel)
        self.grads_in = ref.new_zeros(self.shard_numel * world_size) if needs_copy else None
        self.grad_out = ref.new_empty(self.shard_numel) if world_size > 1 else None
        # All-gather buffers: Muon sends bf16 updates (as the record does), Adam the parameter's dtype.
        gather_dtype = torch.bfloat16 if muon else ref.dtype
        self.gather_in = ref.new_zeros(self.shard_numel, dtype=gather_dtype) if world_size > 1 else None
        self.gather_out = ref.new_empty(self.shard_numel * world_size, dtype=gather_dtype) if world_size > 1 else None

    def flat_grads(self) -> Tensor:
        """The gradients to reduce, flattened; a missing gradient or padding slot counts as zero."""
        if self.grads_in is None:
            g = self.real[0].grad
            return torch.zeros(self.shard_numel * self.world_size, device=self.real[0].device,
                               dtype=self.real[0].dtype) if g is None else g.view(-1)
        for j, p in enumerate(self.params):  # Muon: matrix j in slot j; Adam: the one parameter, then padding
            if p is not None:
                dest = self.grads_in[j * p.numel():(j + 1) * p.numel()]
                dest.zero_() if p.grad is None else dest.copy_(p.grad.view(-1))
        return self.grads_in


class GradientSync:
    """Reduce-scatters each bucket's gradient as early as the autograd engine allows.

    Eager backward (CPU, --compile=loss/off): each bucket is launched from post-accumulate-grad hooks
    the moment its last gradient is ready, so communication overlaps the rest of backward.
    Compiled model (--compile=model): AOTAutograd runs the whole backward as one graph node, and the
    AccumulateGrad nodes (and their hooks) run only after it returns, in one burst (bench/overlap_probe.py
    shows it on CPU). There is no backward left to overlap, so no hooks are registered: finish() launches
    every bucket in the order the optimizers consume them, and the update math of the first buckets
    overlaps the transfer of the later ones. Only the last micro-step of an accumulation step communicates.
    """

    def __init__(self, buckets: list[Bucket], world_size: int, launch_from_hooks: bool = True):
        self.buckets, self.world_size = buckets, world_size
        self.armed = False
        self.bucket_of = {p: b for b in buckets for p in b.real}
        self.launched: set[int] = set()
        if launch_from_hooks:
            for p in self.bucket_of:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def arm(self, last_micro_step: bool) -> None:
        self.armed = last_micro_step

    def _on_grad_ready(self, p: Tensor) -> None:
        if not self.armed:
            return
        bucket = self.bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.real):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        flat = bucket.flat_grads()
        if self.world_size == 1:
            bucket.shard = flat
        else:
            bucket.shard = bucket.grad_out
            bucket.work = REDUCE_SCATTER_FLAT(bucket.shard, flat, op=dist.ReduceOp.SUM, async_op=True)
        self.launched.add(id(bucket))

    def finish(self) -> None:
        """Launches the buckets not launched yet (all of them without hooks; else those without a gradient)."""
        for bucket in self.buckets:
            if id(bucket) not in self.launched:
                self._launch(bucket)
        self.armed = False

    def wait(self, bucket: Bucket, scale: float) -> Tensor:
        """This rank's summed gradient shard for the bucket, in fp32, times scale."""
        if bucket.work is not None:
            bucket.work.wait()
        shard = bucket.shard.float() * scale
        bucket.work, bucket.shard, bucket.ready = None, None, 0
        return shard

    def reset(self) -> None:
        self.launched.clear()


# torch 2.13 renamed the flat collectives; 2.11 only has the old names.
ALL_GATHER_FLAT = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def all_gather_into(bucket: Bucket):
    """Starts the all-gather of every rank's bucket.gather_in into bucket.gather_out."""
    return ALL_GATHER_FLAT(bucket.gather_out, bucket.gather_in, async_op=True)


class Muon:
    """MomentUm Orthogonalized by Newton-Schulz, for the hidden matrices.

    Rank r owns matrix r of each bucket: it keeps that matrix's momentum and orthogonalises its
    update; the bf16 updates are all-gathered and every rank applies all of them (as the record does:
    half the bytes of gathering fp32 weights, and the same fp32 arithmetic on every rank).
    """

    def __init__(self, buckets: list[Bucket], rank: int, lr: float, ns_steps: int, names: dict[Tensor, str],
                 orthogonalize=None, normuon_beta2: float | None = None, cautious_wd: float = 0.0):
        self.buckets, self.rank, self.base_lr, self.ns_steps = buckets, rank, lr, ns_steps
        self.orthogonalize = orthogonalize or newton_schulz
        self.normuon_beta2, self.cautious_wd = normuon_beta2, cautious_wd
        self.index_of = {names[b.params[rank]]: i for i, b in enumerate(buckets) if b.params[rank] is not None}
        self.momentum_buffers = {i: torch.zeros_like(self.owned(i)) for i in self.index_of.values()}
        self.second_moments = {i: neuron_second_moment(self.owned(i)) for i in self.index_of.values()} \
            if normuon_beta2 is not None else {}

    def owned(self, i: int) -> nn.Parameter | None:
        return self.buckets[i].params[self.rank]

    def step(self, sync: GradientSync, scale: float, lr_mult: float, momentum: float) -> list:
        """Updates owned matrices and starts the all-gathers; returns them for finish_step."""
        lr = self.base_lr * lr_mult
        gathers = []
        for i, bucket in enumerate(self.buckets):
            grad = sync.wait(bucket, scale)
            p = self.owned(i)
            if p is not None:
                buf = self.momentum_buffers[i]
                buf.lerp_(grad.view_as(p), 1 - momentum)
                update = self.orthogonalize(grad.view_as(p).lerp_(buf, momentum), self.ns_steps)  # Nesterov
                if self.normuon_beta2 is not None:
                    update = normuon_normalize(update, self.second_moments[i], self.normuon_beta2)
            if bucket.world_size == 1:
                self._apply(p, update, lr, self.cautious_wd)
                continue
            if p is not None:
                bucket.gather_in.copy_(update.flatten())
            gathers.append((bucket, all_gather_into(bucket), lr, self.cautious_wd))
        return gathers

    @staticmethod
    def finish_step(gathers: list) -> None:
        for bucket, work, lr, wd in gathers:
            work.wait()
            for j, p in enumerate(bucket.params):
                if p is not None:
                    Muon._apply(p, bucket.gather_out[j * bucket.shard_numel:(j + 1) * bucket.shard_numel], lr, wd)

    @staticmethod
    def _apply(p: Tensor, update: Tensor, lr: float, cautious_wd: float) -> None:
        shape_scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5  # the record's max(1, rows/cols)**0.5
        update = update.view_as(p).to(p.dtype)
        if cautious_wd:  # 2025-11-10_CautiousWD: the decay (lr * wd) joins the update where their signs agree
            update = update + (lr * cautious_wd) * cautious_mask(update, p.data) * p.data
        p.data.sub_((lr * shape_scale) * update)

    def state_tensors(self) -> dict[str, Tensor]:
        """The momenta (and NorMuon's second moments) of the matrices this rank owns, as muon/<parameter name>
        (normuon/<name>): which rank owns a matrix depends on the world size, its state's name does not."""
        return {**{f"muon/{name}": self.momentum_buffers[i] for name, i in self.index_of.items()},
                **{f"normuon/{name}": self.second_moments[i] for name, i in self.index_of.items()
                   if i in self.second_moments}}


def cautious_mask(update: Tensor, param: Tensor) -> Tensor:
    """Where the step (param -= lr * update) and the decay pull the weight the same way (sign agreement,
    zero included, as the records have it); elsewhere decaying would fight the gradient."""
    return (update * param >= 0).to(param.dtype)


def neuron_second_moment(p: Tensor) -> Tensor:
    """NorMuon's fp32 state: one mean square per row of a tall or square matrix, per column of a wide one."""
    shape = (*p.shape[:-1], 1) if p.size(-2) >= p.size(-1) else (*p.shape[:-2], 1, p.size(-1))
    return torch.zeros(shape, dtype=torch.float32, device=p.device)


def normuon_normalize(update: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """2025-10-24_NorMuon: after orthogonalisation the rows of a wide matrix (columns of a tall one) have
    equal norms, the neurons along its long side do not. Their mean squares are averaged over steps
    (second_moment, updated in place) and divided out, then the update gets its Frobenius norm back."""
    u = update.float()
    second_moment.lerp_(u.square().mean(dim=-1 if u.size(-2) >= u.size(-1) else -2, keepdim=True), 1 - beta2)
    normed = u * second_moment.clamp_min(1e-10).rsqrt()
    norm, normed_norm = u.norm(dim=(-2, -1), keepdim=True), normed.norm(dim=(-2, -1), keepdim=True)
    return normed * (norm / normed_norm.clamp_min(1e-10))


@dataclass
class FlatShard:
    """This rank's piece of a tensor flattened to numel elements: ceil(numel / world_size) elements per
    rank, rank r's starting at r times that (torch.chunk's split, which DTensor's Shard(0) uses too)."""
    local: Tensor
    numel: int


@dataclass
class AdamGroup:
    """One parameter's Adam settings."""
    param: nn.Parameter
    lr: float
    weight_decay: float = 0.0  # decoupled (AdamW)
    cautious_wd: float = 0.0  # 2025-12-18_CautiousWDAdam: lr * wd, only where update and weight agree in sign
    betas: tuple[float, float] | None = None  # None: the optimizer's


class ShardedAdam:
    """Adam for the rank-owned slice of each parameter, on an fp32 master copy of that slice.

    The update itself is torch's fused AdamW (decoupled weight decay, zero for most groups)
    over the master slices; the new slices are cast to the parameter dtype and all-gathered.
    """

    def __init__(self, groups: list[tuple[Bucket, AdamGroup]], rank: int, betas: tuple[float, float],
                 eps: float, names: dict[Tensor, str]):
        self.buckets = [bucket for bucket, _ in groups]
        self.rank = rank
        self.names = [names[bucket.real[0]] for bucket in self.buckets]
        self.masters = [self._owned_slice(bucket).float().clone() for bucket in self.buckets]
        param_groups = [dict(params=[master], lr=g.lr, base_lr=g.lr, weight_decay=g.weight_decay,
                             cautious_wd=g.cautious_wd, betas=g.betas or betas)
                        for master, (_, g) in zip(self.masters, groups)]
        fused = all(m.device.type in ("cpu", "cuda") for m in self.masters)
        self.adam = torch.optim.AdamW(param_groups, betas=betas, eps=eps, fused=fused)

    def _owned_slice(self, bucket: Bucket) -> Tensor:
        flat = bucket.real[0].data.view(-1)
        lo = min(self.rank * bucket.shard_numel, flat.numel())
        return flat[lo:min(lo + bucket.shard_numel, flat.numel())]

    def step(self, sync: GradientSync, scale: float, lr_mult: float) -> list:
        """Updates the master slices and starts the all-gathers; returns them for finish_step."""
        for bucket, master in zip(self.buckets, self.masters):
            master.grad = sync.wait(bucket, scale)[:master.numel()]
        for group in self.adam.param_groups:
            group["lr"] = group["base_lr"] * lr_mult
            if group["cautious_wd"]:
                self._cautious_decay(group)
        self.adam.step()
        gathers = []
        for bucket, master in zip(self.buckets, self.masters):
            master.grad = None
            p = bucket.real[0]
            if bucket.world_size == 1:
                p.data.view(-1).copy_(master)
                continue
            bucket.gather_in[:master.numel()].copy_(master)
            gathers.append((bucket, all_gather_into(bucket)))
        return gathers

    @staticmethod
    def finish_step(gathers: list) -> None:
        for bucket, work in gathers:
            work.wait()
            p = bucket.real[0]
            p.data.view(-1).copy_(bucket.gather_out[:p.numel()])

    def _cautious_decay(self, group: dict) -> None:
        """master -= lr * (lr * wd) * master where this step's Adam update has the master's sign. That sign
        is the new first moment's (Adam divides it by positive numbers), so it is known before the step,
        and the decay can be applied before AdamW, whose update does not depend on the weight."""
        master = group["params"][0]
        exp_avg = self.adam_state(master)["exp_avg"]
        new_exp_avg = exp_avg.lerp(master.grad, 1 - group["betas"][0])
        master.sub_((group["lr"] * group["lr"] * group["cautious_wd"]) * cautious_mask(new_exp_avg, master) * master)

    def adam_state(self, master: Tensor) -> dict[str, Tensor]:
        """AdamW's state of a master slice, created as AdamW would create it (zeros, step 0) if it has not
        stepped yet, so that a checkpoint has one layout whenever it is taken."""
        state = self.adam.state[master]
        if not state:
            fused = self.adam.defaults["fused"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device if fused else "cpu")
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(master), torch.zeros_like(master)
        return state

    def state_tensors(self) -> dict[str, Tensor | FlatShard]:
        """adam/<parameter name>/<master|exp_avg|exp_avg_sq|step>: the slices as pieces of the flat
        parameter, which any world size can cut again; the step count is the same on every rank."""
        out: dict[str, Tensor | FlatShard] = {}
        for name, bucket, master in zip(self.names, self.buckets, self.masters):
            state, numel = self.adam_state(master), bucket.real[0].numel()
            out[f"adam/{name}/master"] = FlatShard(master, numel)
            out[f"adam/{name}/exp_avg"] = FlatShard(state["exp_avg"], numel)
            out[f"adam/{name}/exp_avg_sq"] = FlatShard(state["exp_avg_sq"], numel)
            out[f"adam/{name}/step"] = state["step"]
        return out


@dataclass
class Optimizers:
    sync: GradientSync
    muon: Muon | None
    adam: ShardedAdam
    world_size: int

    def step(self, lr_mult: float, momentum: float, accum: int) -> None:
        """Muon first (its Newton-Schulz overlaps Adam's reduce-scatters), then Adam; the all-gathers
        of both are awaited last, so they overlap the other optimizer's math. The gradients summed over
        ranks and accum micro-steps are divided by the sequence count, which makes them a mean."""
        self.sync.finish()
        scale = 1.0 / (self.world_size * accum)
        muon_gathers = self.muon.step(self.sync, scale, lr_mult, momentum) if self.muon else []
        adam_gathers = self.adam.step(self.sync, scale, lr_mult)
        Muon.finish_step(muon_gathers)
        ShardedAdam.finish_step(adam_gathers)
        self.sync.reset()

    def state_tensors(self) -> dict[str, Tensor | FlatShard]:
        """Every optimizer tensor this rank holds, aliasing the live ones, under world-size-free names."""
        return {**self.adam.state_tensors(), **(self.muon.state_tensors() if self.muon else {})}


def build_optimizers(model: GPT, args: Hyperparameters, rank: int, world_size: int,
                     compiled: bool = False) -> Optimizers:
    """Muon for matrices inside the blocks; Adam for head, embeddings and scalars (and matrices without Muon).
    The gates' 12-wide weights count as scalars, at their technique's gate_lrs share of the scalar lr
    (2025-12-31_GatesToCompiledAdam moved them to Adam)."""
    gate_lrs = {name: scale for technique in TECHNIQUES for name, scale in technique.gate_lrs.items()}
    gates = {p: gate_lrs[name.rsplit(".", 1)[-1]] for name, p in model.named_parameters() if name.endswith("_gate")}
    hidden = [p for p in model.blocks.parameters() if p.ndim >= 2 and p not in gates]
    embeds = [model.embed.weight, *(e.weight for e in model.value_embeds)]
    embeds += [model.bigram_embed.weight] if model.bigram_embed is not None else []
    scalars = [p for p in model.parameters() if p.ndim < 2 or p in gates]
    adam_wd = args.adam_cautious_wd if args.cautious_wd else 0.0  # never on the scalars (the record's wd_mul 0)
    scalar_betas = (args.scalar_adam_beta1 if args.scalar_adam_beta1 is not None else args.adam_beta1,
                    args.scalar_adam_beta2 if args.scalar_adam_beta2 is not None else args.adam_beta2)
    adam_groups = [AdamGroup(model.lm_head.weight, args.head_lr, args.weight_decay, adam_wd)]
    adam_groups += [AdamGroup(p, args.embed_lr, cautious_wd=adam_wd) for p in embeds]
    adam_groups += [AdamGroup(p, args.scalar_lr * gates.get(p, 1.0), betas=scalar_betas) for p in scalars]
    muon_buckets = []
    if args.muon:
        by_shape: dict[tuple, list] = {}
        for p in hidden:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        for same in by_shape.values():
            same = same + [None] * (-len(same) % world_size)
            muon_buckets += [Bucket(same[i:i + world_size], True, world_size) for i in range(0, len(same), world_size)]
    else:
        adam_groups += [AdamGroup(p, args.matrix_adam_lr, args.weight_decay, adam_wd) for p in hidden]
    adam_buckets = [(Bucket([g.param], False, world_size), g) for g in adam_groups]
    assert sum(p.numel() for b, _ in adam_buckets for p in b.real) + sum(
        p.numel() for b in muon_buckets for p in b.real) == sum(p.numel() for p in model.parameters())
    # Consumption order (Muon, then Adam): the launch order when the compiled backward leaves no overlap.
    sync = GradientSync(muon_buckets + [b for b, _ in adam_buckets], world_size, launch_from_hooks=not compiled)
    names = {p: name for name, p in model.named_parameters()}
    # The record compiles Newton-Schulz: its five bf16 iterations fuse into a few kernels per shape.
    orthogonalize = polar_express if args.polar_express else newton_schulz
    orthogonalize = torch.compile(orthogonalize, dynamic=False) if compiled else orthogonalize
    muon = Muon(muon_buckets, rank, args.muon_lr, args.ns_steps, names, orthogonalize,
                normuon_beta2=args.normuon_beta2 if args.normuon else None,
                cautious_wd=args.muon_cautious_wd if args.cautious_wd else 0.0) if args.muon else None
    return Optimizers(sync=sync, muon=muon,
                      adam=ShardedAdam(adam_buckets, rank, (args.adam_beta1, args.adam_beta2), args.adam_eps, names),
                      world_size=world_size)


# -----------------------------------------------------------------------------
# Schedules

def lr_multiplier(step: int, num_iterations: int, cooldown_frac: float, final_frac: float) -> float:
    """1 until the cooldown starts, then linear down to final_frac at the last step."""
    progress = step / num_iterations
    if progress < 1 - cooldown_frac:
        return 1.0
    w = (1 - progress) / cooldown_frac
    return w + (1 - w) * final_frac


def muon_momentum(step: int, warmup_steps: int, start: float, end: float) -> float:
    frac = min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0
    return (1 - frac) * start + frac * end


MTP_WEIGHT_RATIO = 0.5  # 2025-12-22_MultiTokenPrediction: weights 1, 0.5, 0.25 for the next 3 tokens


def mtp_loss_weights(step: int, num_iterations: int, n_tokens: int) -> list[float]:
    """2025-12-22_MultiTokenPrediction: training is cut into n_tokens equal phases; phase p predicts the next
    n_tokens - p tokens with weights 1, 0.5, 0.25, ..., the last of them decaying linearly to 0 over the phase
    (for 3: [1, .5, .25->0] -> [1, .5->0] -> [1]). Always n_tokens weights (zeros at the end), so the shapes
    a compiled model sees never change."""
    progress = min(step / num_iterations, 1.0) * n_tokens
    phase = min(int(progress), n_tokens - 1)
    live = n_tokens - phase
    weights = [MTP_WEIGHT_RATIO ** k for k in range(live)] + [0.0] * phase
    if live > 1:
        weights[live - 1] *= 1 - (progress - phase)
    return weights


def attention_windows(step: int, args: Hyperparameters) -> tuple[int, int]:
    """(long, short) attention windows in blocks at a step. R: the long window grows linearly to
    window_final_tokens, rounded up to whole blocks; the short-window layers see half of it."""
    if not args.sliding_window:
        return window_pair(max(args.seq_len, args.val_seq_len) // BLOCK_SIZE)
    tokens = max(next_multiple(args.window_final_tokens * step / args.num_iterations, BLOCK_SIZE), BLOCK_SIZE)
    return window_pair(tokens // BLOCK_SIZE)


def window_pair(long_blocks: int) -> tuple[int, int]:
    """A long window and its short one: half of it, at least one block."""
    return long_blocks, max(long_blocks // 2, 1)


def window_tensor(long_blocks: int, device: torch.device | str | None = None) -> Tensor:
    """The model's windows input, (long, short) in blocks, for a fixed long window (the tools, tests)."""
    return torch.tensor(window_pair(long_blocks), dtype=torch.int64, device=device)


class StepTensors:
    """The schedules' per-step model inputs, made on the device once at start-up: a training step indexes
    them and never copies from the host (a copy from pageable memory waits for the device to drain)."""

    def __init__(self, args: Hyperparameters, device: torch.device):
        self.args = args
        pairs = {attention_windows(step, args) for step in range(args.num_iterations + 1)}
        self.window_tensors = {pair: torch.tensor(pair, dtype=torch.int64, device=device) for pair in pairs}
        self.mtp_table = torch.tensor([mtp_loss_weights(step, args.num_iterations, args.mtp_tokens)
                                       for step in range(args.num_iterations + 1)], device=device) \
            if args.mtp_tokens > 1 else None

    def windows(self, step: int) -> Tensor:
        """The step's (long, short) windows; past the last step (a warm-up longer than the run) the last one's."""
        return self.window_tensors[attention_windows(min(step, self.args.num_iterations), self.args)]

    def mtp_weights(self, step: int) -> list[Tensor]:
        """The model's optional loss-weights input: [the step's row] under --mtp_tokens > 1, else []."""
        return [] if self.mtp_table is None else [self.mtp_table[min(step, self.args.num_iterations)]]


# -----------------------------------------------------------------------------
# Run log, energy and profiling

class RunLog:
    """Rank 0's human-readable log: every line is flushed, so a crash never loses what was written."""

    def __init__(self, path: Path | None):
        self.path = path
        self.file = None
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.file = open(path, "a", encoding="utf-8")
            except OSError as e:
                raise UsageError(f"cannot open run log {path}: {e.strerror}; pick a writable --log_dir") from None

    def write(self, line: str, echo: bool = True) -> None:
        if self.path is None:
            return
        if echo:
            print(line, flush=True)
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except OSError as e:
            raise RunFailed(f"cannot write run log {self.path}: {e.strerror}; free disk space and resume "
                             "from the last checkpoint") from None


# The progress lines ("step:S/N name:value ..." and "final: name:value ...") are the run log's data:
# progress_line() is the one writer, records/read_records.py's parse_progress_line() the one reader (bench/ and
# tests use it too). A field's number is written with these decimals and unit; the public speedrun's logs use
# the same "step:S/N val_loss:... train_time:...ms step_avg:...ms" shape.
PROGRESS_FIELDS = {  # name: (decimals, unit)
    "val_loss": (4, ""), "train_loss": (4, ""), "train_time": (0, "ms"), "step_avg": (2, "ms"),
    "energy": (0, "J"), "hellaswag_acc": (4, ""), "hellaswag_acc_norm": (4, ""), "hellaswag_examples": (0, ""),
    "hellaswag_time": (0, "ms"), "steps": (0, ""), "tokens": (0, ""), "total_train_time": (0, "ms"),
    "resumes": (0, ""),
}


def progress_line(step: int | None, total: int, **values: float) -> str:
    """'step:S/N f:v ...' for a step, or 'final: f:v ...' when step is None; fields in the order given."""
    head = "final:" if step is None else f"step:{step}/{total}"
    parts = []
    for name, value in values.items():
        decimals, unit = PROGRESS_FIELDS[name]
        parts.append(f"{name}:{value:.{decimals}f}{unit}")
    return " ".join([head, *parts])


class Clock:
    """Training time and energy. Both run only while the model trains: every pause (validation,
    HellaSwag, a checkpoint) first waits for the device, so each stretch is timed the same way."""

    def __init__(self, rt: Runtime, energy: "EnergyMeter"):
        self.rt, self.energy = rt, energy
        self.ms, self.started = 0.0, None

    def start(self) -> None:
        self.rt.synchronize()
        self.started = time.perf_counter()
        self.energy.start()

    def pause(self) -> None:
        self.rt.synchronize()
        self.ms += 1000 * (time.perf_counter() - self.started)
        self.started = None
        self.energy.stop()

    @contextlib.contextmanager
    def paused(self):
        self.pause()
        try:
            yield
        finally:
            self.start()

    def elapsed_ms(self) -> float:
        """Training milliseconds so far (without a device sync: the last step may still be running)."""
        return self.ms + (1000 * (time.perf_counter() - self.started) if self.started is not None else 0.0)


def environment_lines(rt: Runtime) -> list[str]:
    lines = [f"python: {platform.python_version()}", f"torch: {torch.__version__}",
             f"cuda: {torch.version.cuda if rt.is_cuda else 'n/a'}", f"device: {device_name(rt)}",
             f"world_size: {rt.world_size}",
             f"attention: {rt.attention} fp8_head: {rt.fp8_head} compile: {rt.compile} dtype: {rt.dtype} "
             f"chunked_loss: {rt.chunked_loss} compile_attention: {rt.compile_attention}",
             f"PYTORCH_CUDA_ALLOC_CONF: {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')} host_malloc: {rt.host_malloc}"]
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            lines += ["nvidia-smi:", smi.stdout.rstrip()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return lines


def device_name(rt: Runtime) -> str:
    if rt.is_cuda:
        return torch.cuda.get_device_name(rt.device)
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


class NvmlCounter:
    """NVIDIA's total-energy counter of one GPU (millijoules since driver load), found by PCI bus id: NVML
    numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, so torch's index can name another GPU."""
    wrap_joules = None

    def __init__(self, pci_bus_id: str, nvml=None):
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py, an optional extra
        nvml.nvmlInit()
        self.nvml, self.handle = nvml, nvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)

    def read_joules(self) -> list[float]:
        return [self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0]


def nvml_bus_id(props) -> str:
    """NVML's domain:bus:device.function for torch.cuda.get_device_properties(device)."""
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


class RaplCounters:
    """Intel RAPL package counters under /sys/class/powercap (microjoules, wrapping at max_energy_range_uj)."""

    def __init__(self, root: Path):
        self.domains = sorted(d for d in root.glob("intel-rapl:*") if d.name.count(":") == 1)
        if not self.domains:
            raise OSError(f"no RAPL package domains under {root}")
        self.wrap_joules = [int((d / "max_energy_range_uj").read_text()) / 1e6 for d in self.domains]
        self.read_joules()

    def read_joules(self) -> list[float]:
        return [int((d / "energy_uj").read_text()) / 1e6 for d in self.domains]


class EnergyMeter:
    """Joules this rank's counters add up while the clock runs; paused for validation.

    On CPU only local rank 0 reads RAPL: the package counters cover every process on the node.
    """

    def __init__(self, counters, reason: str = ""):
        self.counters, self.reason = counters, reason
        self.joules, self.last = 0.0, None

    @staticmethod
    def open(rt: Runtime, powercap_root: Path = Path("/sys/class/powercap"), nvml=None) -> "EnergyMeter":
        try:
            if rt.is_cuda:
                return EnergyMeter(NvmlCounter(nvml_bus_id(torch.cuda.get_device_properties(rt.device)), nvml))
            if rt.local_rank != 0:
                return EnergyMeter(None, "counted by local rank 0")
            return EnergyMeter(RaplCounters(powercap_root))
        except ImportError:
            return EnergyMeter(None, "nvidia-ml-py is not installed (pip install -r requirements-extras.txt)")
        except Exception as e:  # NVML and sysfs fail in many ways (no permission, no driver support)
            return EnergyMeter(None, f"energy counters unreadable: {e}")

    def start(self) -> None:
        if self.counters is not None:
            self.last = self.counters.read_joules()

    def stop(self) -> None:
        if self.counters is None or self.last is None:
            return
        now = self.counters.read_joules()
        wraps = self.counters.wrap_joules or [None] * len(now)
        for before, after, wrap in zip(self.last, now, wraps):
            delta = after - before
            self.joules += delta + wrap if delta < 0 and wrap else delta
        self.last = None

    def total(self, rt: Runtime) -> tuple[float | None, int]:
        """(joules summed over ranks, ranks that measured), or (None, 0) when no rank could measure."""
        measured = torch.tensor([self.joules, float(self.counters is not None)], dtype=torch.float64,
                                device=rt.device)
        if rt.world_size > 1:
            dist.all_reduce(measured)
        joules, ranks = measured.tolist()
        return (joules, int(ranks)) if ranks else (None, 0)


def energy_line(joules: float | None, ranks: int, reason: str, train_s: float, tokens: int) -> str:
    if joules is None:
        return f"energy: n/a ({reason or 'no rank could read an energy counter'})"
    kwh = joules / 3.6e6
    power = joules / max(train_s, 1e-9) / max(ranks, 1)
    per_kwh = f"{tokens / kwh:.3e}" if kwh > 0 else "n/a"
    return f"energy: {joules:.1f} J ({kwh:.6f} kWh) mean_power:{power:.1f}W/device tokens_per_kWh:{per_kwh}"


class RecompileWatch:
    """Counts torch.compile recompilations once warm-up is over, with dynamo's reason for each.

    Warm-up compiles every shape and mode the run uses, so a later recompilation is timed work and a
    sign of an unintended guard (a Python scalar that changes, a new shape).
    """
    LOGGER = "torch._dynamo.guards.__recompiles"  # dynamo's "recompiles" artifact log

    def __init__(self):
        self.count, self.pending = 0, []
        self.handler = logging.Handler(logging.DEBUG)
        self.handler.emit = self._record

    def start(self) -> "RecompileWatch":
        if "TORCH_LOGS" not in os.environ:  # the user's own TORCH_LOGS setting wins
            torch._logging.set_logs(recompiles=True)
        logging.getLogger(self.LOGGER).addHandler(self.handler)
        return self

    def _record(self, record: logging.LogRecord) -> None:
        lines = [line.strip() for line in record.getMessage().splitlines() if line.strip()]
        where = lines[0].removeprefix("Recompiling function ") if lines else "?"
        guard = next((line.lstrip("- ") for line in lines[1:] if line.startswith("-")), "no guard reported")
        self.count += 1
        self.pending.append(f"{where}: {guard}")

    def drain(self) -> list[str]:
        pending, self.pending = self.pending, []
        return pending


def make_profiler(args: Hyperparameters, rt: Runtime, trace_path: Path):
    """Records args.profile_steps training steps (after one skipped and one warm-up step) as a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile, schedule
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.is_cuda else [])
    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=args.profile_steps, repeat=1),
                   on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path)))


# -----------------------------------------------------------------------------
# Checkpoints: exact resume, written atomically, verified on load, never of a diverged state

MODEL_SHAPE_FIELDS = ("vocab_size", "n_layer", "model_dim", "n_head", "head_dim", "value_embeds", "unet_skips")
# which matrices Muon owns, and what state it keeps for them
OPTIMIZER_STRUCTURE_FIELDS = ("muon",) + tuple(t.switch for t in TECHNIQUES if t.optimizer_state)
CHECKPOINT_META = "checkpoint.json"
# A torch.distributed.checkpoint folder that any world size resumes; earlier ones had a rank<r>.pt per rank.
CHECKPOINT_FORMAT = "dcp-1"


def source_sha256() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


@dataclass
class TrainingState:
    """What a run continues from. The tensors alias the live ones and are named so that they mean the
    same at any world size: model/<name> (identical on every rank), the Adam slices this rank owns as
    FlatShards, the Muon momenta of the matrices it owns. The data position is one global stream, which
    every world size walks alike. Nothing draws random numbers after the model is built, so no RNG
    state is kept (a technique that does must derive its numbers from the seed and the step)."""
    step: int
    loader: dict
    tensors: dict[str, Tensor | FlatShard]
    segments: list[dict] = dataclasses.field(default_factory=list)  # the run's history: see segment()


def training_state(model: GPT, opt: Optimizers, stream: TokenStream, step: int,
                   segments: list[dict] | None = None) -> TrainingState:
    tensors = {f"model/{name}": t for name, t in model.state_dict().items()}
    return TrainingState(step=step, loader=stream.state(), tensors={**tensors, **opt.state_tensors()},
                         segments=segments or [])


SEGMENT_KEYS = ("run_id", "start_step", "end_step", "tokens", "train_time_ms")  # one launch's share of a run


def segment(run_id: str, start_step: int, end_step: int, tokens: int | None, train_time_ms: float | None) -> dict:
    """One launch's part of a run (a resumed run has several): steps start_step+1 .. end_step, the tokens they
    trained and their training time; None where a checkpoint older than this record did not say."""
    return dict(zip(SEGMENT_KEYS, (run_id, start_step, end_step, tokens, train_time_ms)))


def recorded_segments(meta: dict) -> list[dict]:
    """The segments a checkpoint records; one of unknown tokens and time for a checkpoint that records none."""
    found = meta.get("segments")
    if isinstance(found, list) and all(isinstance(x, dict) and set(x) == set(SEGMENT_KEYS) for x in found):
        return found
    return [segment(str(meta.get("run_id")), 0, meta["step"], None, None)]


def local_part(t: Tensor | FlatShard) -> Tensor:
    return t.local if isinstance(t, FlatShard) else t


def as_dcp_state(state: TrainingState, rt: Runtime) -> dict[str, Tensor]:
    """The tensors as torch.distributed.checkpoint sees them: each FlatShard a DTensor sharded over all
    ranks, so that DCP records which piece of the flat tensor it is and re-cuts it for any world size."""
    if rt.world_size == 1:
        return {name: local_part(t) for name, t in state.tensors.items()}
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))  # not cached: a mesh holds the process group
    return {name: DTensor.from_local(t.local, mesh, [Shard(0)], run_check=False, shape=(t.numel,), stride=(1,))
            if isinstance(t, FlatShard) else t for name, t in state.tensors.items()}


def dcp_call(fn, state: dict, path: Path, world_size: int) -> None:
    """dcp.save or dcp.load on a folder (without a process group on one rank, which DCP warns about)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        fn(state, checkpoint_id=str(path), no_dist=world_size == 1)


def checkpoint_root(args: Hyperparameters, run_id: str) -> Path:
    return Path(args.log_dir) / run_id


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints (those with their metadata file) under root, oldest step first."""
    return sorted((d for d in root.glob("step_*") if (d / CHECKPOINT_META).is_file()), key=checkpoint_step)


def checkpoint_step(folder: Path) -> int:
    """The step of a step_N folder, from its name (a staging step_N.tmp or a stray name counts as -1)."""
    digits = folder.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def rotate_checkpoints(root: Path, keep: int, written: Path, resumed_from: Path | None) -> None:
    """Deletes all but the newest `keep` checkpoints of root, never the one just written nor the one this run
    resumed from (its recovery point, whatever its step)."""
    protected = {written.resolve(), resumed_from.resolve() if resumed_from else None}
    rotating = [c for c in complete_checkpoints(root) if c.resolve() not in protected]
    for old in rotating[:max(len(rotating) - (max(keep, 1) - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def set_aside_newer_checkpoints(root: Path, resumed_from: Path, rt: Runtime, log: RunLog) -> None:
    """A run resumed from an older checkpoint of its own folder (after a divergence, say) abandons the newer
    ones: they are moved into root/abandoned_after_step_N_<time>/, never deleted, so that neither rotation nor
    --resume=latest mistakes them for this run's."""
    if rt.is_master and resumed_from.parent.resolve() == root.resolve():
        step = checkpoint_step(resumed_from)
        newer = [c for c in complete_checkpoints(root) if checkpoint_step(c) > step]
        if newer:
            aside = root / f"abandoned_after_step_{step:06d}_{time.strftime('%Y%m%d-%H%M%S')}"
            aside.mkdir(exist_ok=True)
            for folder in newer:
                os.replace(folder, aside / folder.name)
            log.write(f"moved {len(newer)} checkpoint(s) newer than the resume point {resumed_from.name} "
                      f"({', '.join(c.name for c in newer)}) aside to {aside}: delete it once you no longer need it")
    ranks_agree(True, rt)


def ranks_agree(ok: bool, rt: Place) -> bool:
    """True when ok holds on every rank (a barrier that also carries a failure)."""
    if rt.world_size == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], device=rt.device)
    dist.all_reduce(flag)
    return flag.item() == 0


def file_record(path: Path) -> dict:
    """Size and sha256 of a file as it is on disk (read back, so what is recorded is what was written)."""
    with open(path, "rb") as f:
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def gather_objects(obj, rt: Place) -> list:
    if rt.world_size == 1:
        return [obj]
    out = [None] * rt.world_size
    dist.all_gather_object(out, obj)
    return out


def write_failure(e: BaseException) -> str:
    """One line for a failed write: DCP wraps each rank's error, and torch.save reports a full disk as a
    RuntimeError without errno."""
    if isinstance(e, CheckpointException) and e.failures:
        return write_failure(next(iter(e.failures.values()))[0])
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    lines = str(e).strip().splitlines()
    return lines[-1][:200] if lines else type(e).__name__


def free_mib(path: Path) -> str:
    for p in (path, *path.parents):
        if p.exists():
            return f"{shutil.disk_usage(p).free / 2**20:.0f} MiB free"
    return "free space unknown"


def files_written_by(folder: Path, rank: int) -> list[Path]:
    """The files of a DCP folder this rank wrote: its __<rank>_*.distcp, and .metadata on rank 0."""
    return sorted(folder.glob(f"__{rank}_*.distcp")) + ([folder / ".metadata"] if rank == 0 else [])


def save_checkpoint(state: TrainingState, args: Hyperparameters, rt: Runtime, run_id: str, log: RunLog,
                    resumed_from: Path | None = None) -> Path:
    """torch.distributed.checkpoint writes every rank's tensors into step_N.tmp/ (one copy of the shared
    weights, each Adam slice and Muon momentum by its owner); rank 0 adds the metadata (with every file's
    size and sha256, hashed by the rank that wrote it) and renames the folder.

    A failed write (a full disk, say) removes the staging folder on every rank and leaves every
    earlier checkpoint untouched. Rotation keeps args.checkpoint_keep, and always resumed_from.
    """
    root = checkpoint_root(args, run_id)
    final = root / f"step_{state.step:06d}"
    if not ranks_agree(not (final / CHECKPOINT_META).is_file(), rt):  # the resume point (--stop_after at it)
        log.write(f"checkpoint: {final} step:{state.step} is already written (the resume point); kept as it is")
        return final
    staging = root / (final.name + ".tmp")
    started = time.perf_counter()
    error, records = "", {}
    try:
        staging.mkdir(parents=True, exist_ok=True)
        dcp_call(dcp.save, as_dcp_state(state, rt), staging, rt.world_size)
        records = {f.name: file_record(f) for f in files_written_by(staging, rt.rank)}
    except (OSError, RuntimeError, CheckpointException) as e:
        error = write_failure(e)
    if ranks_agree(not error, rt):
        files = {name: rec for per_rank in gather_objects(records, rt) for name, rec in per_rank.items()}
        if rt.is_master:
            meta = {"format": CHECKPOINT_FORMAT, "run_id": run_id, "step": state.step, "loader": state.loader,
                    "segments": state.segments, "world_size": rt.world_size, "source_sha256": source_sha256(),
                    "hyperparameters": dataclasses.asdict(args), "runtime": rt.resolved(), "files": files}
            try:
                (staging / CHECKPOINT_META).write_text(json.dumps(meta, indent=1))
                shutil.rmtree(final, ignore_errors=True)  # an unfinished one (no checkpoint.json) only
                os.replace(staging, final)
            except OSError as e:
                error = write_failure(e)
    if not ranks_agree(not error, rt):
        shutil.rmtree(staging, ignore_errors=True)
        previous = complete_checkpoints(root)
        raise RunFailed(f"cannot write checkpoint {final} ({error or 'failed on another rank'}); partial files "
                         f"removed, previous checkpoint {previous[-1] if previous else '(none)'} is intact; "
                         f"free disk space ({free_mib(root)}) and resume with --resume=latest")
    if rt.is_master:
        rotate_checkpoints(root, args.checkpoint_keep, final, resumed_from)
        size = sum(f.stat().st_size for f in final.iterdir())
        log.write(f"checkpoint: {final} step:{state.step} size:{size / 2**20:.1f}MiB "
                  f"write_time:{time.perf_counter() - started:.2f}s")
    ranks_agree(True, rt)
    return final


class FiniteWatch:
    """Whether any training loss was non-finite, accumulated on the device (no host sync per step),
    so that a diverged state is never checkpointed and never rotates a good checkpoint away."""

    def __init__(self, device: torch.device, start_step: int, resumed_from: Path | None):
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.good_step, self.newest_good = start_step, resumed_from
        self.resumed_from = resumed_from  # the good state this run started from: rotation never deletes it

    def observe(self, loss: Tensor) -> None:
        self.bad |= ~torch.isfinite(loss)

    def state_is_finite(self, model: nn.Module, rt: Runtime) -> bool:
        """The losses so far and every weight are finite, on every rank (one reduction, one sync)."""
        flags = torch.stack([self.bad, *(~torch.isfinite(p).all() for p in model.parameters())])
        return ranks_agree(not bool(flags.any()), rt)

    def hint(self) -> str:
        return f"the newest good checkpoint is {self.newest_good or '(none)'}"


def save_finite_checkpoint(t: Trainer, watch: FiniteWatch, step: int, segments: list[dict]) -> Path:
    """save_checkpoint, refused (and the run stopped) once the loss or the weights are not finite."""
    if not watch.state_is_finite(t.model, t.rt):
        raise RunFailed(f"the loss or the weights became non-finite between step {watch.good_step} and step "
                         f"{step}; no checkpoint written, {watch.hint()}: resume from it with lower learning rates")
    state = training_state(t.model, t.opt, t.stream, step, segments)
    watch.newest_good = save_checkpoint(state, t.args, t.rt, t.run_id, t.log, watch.resumed_from)
    watch.good_step = step
    return watch.newest_good


def lock_run_log(log: RunLog, run_id: str) -> None:
    """Rank 0 holds an exclusive lock on its run log while it lives, which tells later runs in the same
    log_dir that this run's staging folders are in use (the lock dies with the process, even on kill -9)."""
    if log.file is None:
        return
    try:
        fcntl.flock(log.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"run {run_id} is running in another process ({log.path} is locked); wait for it to "
                         "end or pick another --run_id") from None
    except OSError:
        pass  # a filesystem without locks: stale staging folders of other runs are then left alone


def owner_is_gone(log_path: Path) -> bool:
    """True when no live process holds the lock on a run log (or the log is gone)."""
    try:
        with open(log_path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def clean_stale_staging(args: Hyperparameters, run_id: str, log: RunLog) -> None:
    """Rank 0 removes step_N.tmp/ folders under log_dir left by killed runs, so they cannot fill the disk."""
    if log.file is None:
        return
    for staging in sorted(Path(args.log_dir).glob("*/step_*.tmp")):
        run = staging.parent.name
        if run == run_id or owner_is_gone(Path(args.log_dir) / f"{run}.txt"):
            shutil.rmtree(staging, ignore_errors=True)
            log.write(f"removed stale checkpoint staging folder {staging} (left by a killed run)")


def checkpoint_candidates(args: Hyperparameters) -> list[Path]:
    """The folder --resume names; for 'latest', every finished checkpoint under log_dir, newest first;
    for 'auto', those of --run_id's folder (none: a fresh start, so a restarted run finds its own)."""
    if args.resume in ("latest", "auto"):
        runs = [Path(args.log_dir) / args.run_id] if args.resume == "auto" else Path(args.log_dir).glob("*")
        found = [c for run in runs if run.is_dir() for c in complete_checkpoints(run)]
        if not found and args.resume == "latest":
            raise UsageError(f"--resume=latest: no finished checkpoint under {args.log_dir}/; "
                             "train with --checkpoint_every=N first")
        return sorted(found, key=lambda c: (c.stat().st_mtime, c.name), reverse=True)
    path = Path(args.resume)
    if path.name == CHECKPOINT_META and path.is_file():  # the file that makes the folder a checkpoint
        path = path.parent
    if not (path / CHECKPOINT_META).is_file():
        what = "not found" if not path.exists() else f"incomplete (no {CHECKPOINT_META})"
        raise UsageError(f"checkpoint {path} is {what}; pass a step_N folder or --resume=latest")
    return [path]


CHECKPOINT_META_TYPES = {"step": int, "loader": dict, "hyperparameters": dict, "files": dict, "source_sha256": str}
CHECKPOINT_FILE_TYPES = {"bytes": int, "sha256": str}


def is_a(value: object, kind: type) -> bool:
    """isinstance for JSON values, where true/false must not pass for an int."""
    return isinstance(value, kind) and not isinstance(value, bool)


def meta_problem(meta: object) -> str:
    """What is wrong with a parsed checkpoint.json ('' if nothing): the keys its readers use, with their types."""
    if not isinstance(meta, dict):
        return f"it holds a {type(meta).__name__}, not an object"
    for key, kind in CHECKPOINT_META_TYPES.items():
        if key not in meta:
            return f"it has no {key!r}"
        if not is_a(meta[key], kind):
            return f"its {key!r} is {meta[key]!r}, not a {kind.__name__}"
    for name, record in meta["files"].items():
        if not isinstance(record, dict) or not all(is_a(record.get(k), kind) for k, kind in CHECKPOINT_FILE_TYPES.items()):
            return f"its record of file {name!r} is {record!r}, not {{bytes, sha256}}"
    return ""


def read_checkpoint_meta(path: Path) -> dict:
    """checkpoint.json, validated (keys and types): the one reader of it, for the trainer and the tools alike;
    a one-line error when it is truncated, from an older format, or not a checkpoint's."""
    try:
        meta = json.loads((path / CHECKPOINT_META).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"checkpoint {path} has an unreadable {CHECKPOINT_META} ({type(e).__name__}): it is "
                         "truncated or corrupt; resume from an earlier checkpoint") from None
    if isinstance(meta, dict) and meta.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"checkpoint {path} is in the per-rank format (rank<r>.pt) of a train_gpt.py older than "
                         f"the {CHECKPOINT_FORMAT} checkpoints; resume it with the train_gpt.py that wrote it "
                         "(its sha256 is in checkpoint.json) or start afresh")
    problem = meta_problem(meta)
    if problem:
        raise UsageError(f"checkpoint {path} has a {CHECKPOINT_META} that train_gpt.py did not write ({problem}): "
                         "it is corrupt or edited; resume from an earlier checkpoint") from None
    return meta


def check_compatible(path: Path, meta: dict, args: Hyperparameters) -> None:
    """Refuses a checkpoint this run cannot continue: another model shape or optimizer layout, or no
    steps left to train. Any world size can continue any other's checkpoint."""
    for names, what in ((MODEL_SHAPE_FIELDS, "model"), (OPTIMIZER_STRUCTURE_FIELDS, "optimizer")):
        for name in names:
            saved = meta["hyperparameters"].get(name, "(not recorded)")
            if saved != getattr(args, name):
                raise UsageError(f"checkpoint {path} has {name}={saved} but this run has {name}={getattr(args, name)}; "
                                 f"pass the same {what} flags to resume it")
    if meta["step"] >= args.num_iterations:
        raise UsageError(f"checkpoint {path} is at step {meta['step']}, at or past --num_iterations="
                         f"{args.num_iterations}: nothing is left to train; pass a larger --num_iterations")


def checkpoint_files_problem(path: Path, meta: dict, rank: int = 0, world_size: int = 1) -> str:
    """Why a file does not match the size and sha256 in checkpoint.json ('' when all match); each rank
    checks every world_size-th file, so the ranks share the reading (one process checks them all)."""
    for name in sorted(meta["files"])[rank::world_size]:
        recorded, file = meta["files"][name], path / name
        if not file.is_file():
            return f"{file} is missing"
        actual = file_record(file)
        if actual["bytes"] != recorded["bytes"]:
            return (f"{file} is unreadable ({actual['bytes']} bytes, {CHECKPOINT_META} recorded "
                    f"{recorded['bytes']}): it is truncated or corrupt")
        if actual["sha256"] != recorded["sha256"]:
            return f"{file} does not match the sha256 in {CHECKPOINT_META} (corrupt)"
    return ""


def choose_checkpoint(args: Hyperparameters, rt: Place) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, verified on every rank at start-up, and lines for the run log.

    An explicit folder that fails verification is refused; --resume=latest falls back to the newest
    complete checkpoint that verifies, and says so. Incompatible flags are refused either way.
    """
    candidates = checkpoint_candidates(args)
    if rt.world_size > 1:  # every rank walks rank 0's list
        shared = [candidates]
        dist.broadcast_object_list(shared, src=0)
        candidates = shared[0]
    fallback = args.resume in ("latest", "auto")
    if not candidates:  # --resume=auto before this run's first checkpoint
        return None, [f"--resume=auto: no finished checkpoint of run {args.run_id} yet: starting afresh"]
    notes = []
    for path in candidates:
        try:
            meta, problem = read_checkpoint_meta(path), ""
        except UsageError as e:
            if not fallback:
                raise
            meta, problem = None, str(e)
        if meta is not None:
            problem = checkpoint_files_problem(path, meta, rt.rank, rt.world_size)
        if ranks_agree(not problem, rt):
            if path != candidates[0]:
                notes.append(f"--resume={args.resume}: falling back to {path}")
            return path, notes
        problem = problem or "a file failed verification on another rank"
        if not fallback:
            raise UsageError(f"checkpoint {path} failed verification: {problem}; resume from an earlier checkpoint "
                             "or pass --resume=latest to use the newest one that verifies")
        notes.append(f"--resume={args.resume}: skipping checkpoint {path}: {problem}")
    raise UsageError(f"--resume={args.resume}: none of the {len(candidates)} checkpoint(s) under {args.log_dir}/ "
                     f"verifies (newest: {notes[0].split(': ', 2)[-1]}); start afresh without --resume")


OWNER_ONLY_PREFIXES = ("muon/", "normuon/")  # state that only the rank owning its matrix holds


def check_same_tensors(path: Path, state: TrainingState, args: Hyperparameters, rt: Runtime) -> None:
    """Refuses, on every rank, a checkpoint whose tensors are not this run's (another technique switched on or
    off, say), naming the first difference and the model and optimizer flags that differ, rather than calling a
    healthy checkpoint corrupt when DCP misses a key. Each rank holds the Muon state of its own matrices only."""
    stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    live = set(as_dcp_state(state, rt))
    lacking = sorted(live - stored)
    extra = sorted(name for name in stored - live if not name.startswith(OWNER_ONLY_PREFIXES))
    first = f"this run has {lacking[0]}, which it lacks" if lacking else f"it has {extra[0]}, which this run lacks" \
        if extra else ""
    if ranks_agree(not first, rt):
        return
    recorded = read_checkpoint_meta(path)["hyperparameters"]
    names = [f.name for f in fields(ModelConfig)] + list(OPTIMIZER_STRUCTURE_FIELDS)
    differ = [f"{n}={recorded.get(n, '(not recorded)')} here {getattr(args, n)}" for n in names
              if hasattr(args, n) and recorded.get(n) != getattr(args, n)]
    raise UsageError(f"checkpoint {path} holds other tensors than this run's model and optimizers "
                     f"({first or 'on another rank'}); it was written with {', '.join(differ[:4]) or 'other flags'}: "
                     "pass its flags to resume it")


def load_checkpoint(path: Path, state: TrainingState, rt: Runtime, log: RunLog) -> TrainingState:
    """Fills the live tensors from a checkpoint folder that choose_checkpoint verified at start-up, each
    rank reading the pieces its own layout needs (DCP re-cuts the Adam slices for this world size)."""
    meta = read_checkpoint_meta(path)
    if meta["source_sha256"] != source_sha256():
        log.write(f"warning: train_gpt.py changed since checkpoint {path} was written")
    try:
        dcp_call(dcp.load, as_dcp_state(state, rt), path, rt.world_size)
    except (OSError, RuntimeError, ValueError, CheckpointException) as e:
        raise UsageError(f"checkpoint {path} is unreadable ({write_failure(e)}); it is truncated or corrupt: "
                         "resume from an earlier checkpoint") from None
    return TrainingState(step=meta["step"], loader=meta["loader"], tensors=state.tensors,
                         segments=recorded_segments(meta))


def verified_checkpoint_meta(path: Path) -> dict:
    """checkpoint.json of a folder whose every file matches its recorded size and sha256, checked in this one
    process as the trainer checks them: what a program reading a checkpoint outside training trusts."""
    meta = read_checkpoint_meta(path)
    problem = checkpoint_files_problem(path, meta)
    if problem:
        raise UsageError(f"checkpoint {path} failed verification: {problem}; use another step_N folder")
    return meta


def read_checkpoint_tensors(path: Path, prefix: str = "model/") -> dict[str, Tensor]:
    """The whole (unsharded) tensors under prefix in a verified checkpoint folder, read in one process on CPU:
    model/ for the weights (tools/: sampling, export), adam/ or muon/ for the optimizer state."""
    verified_checkpoint_meta(path)
    try:
        stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        tensors = {name: torch.empty(tuple(m.size), dtype=m.properties.dtype) for name, m in stored.items()
                   if name.startswith(prefix)}
        dcp_call(dcp.load, tensors, path, 1)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, CheckpointException) as e:
        raise UsageError(f"checkpoint {path} is unreadable ({write_failure(e)}); it is truncated or corrupt: "
                         "use another step_N folder") from None
    return {name.removeprefix(prefix): t for name, t in tensors.items()}


class Interrupted(BaseException):
    """A signal before the training loop: nothing to save yet. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way (compilers, loaders) swallows or rewraps it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopSignal:
    """SIGTERM/SIGINT. Before the training loop the first one ends the run at once (Interrupted); in the
    loop it asks every rank to stop after the current step. A second signal exits at once."""

    def __init__(self):
        self.signum: int | None = None
        self.deferred = False
        self._pending = None  # the previous step's agreement: (waiter, result)

    def install(self) -> "StopSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def defer(self) -> "StopSignal":
        """From here on, a signal is acted upon at a step boundary, where a checkpoint can be written."""
        self.deferred = True
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        if not self.deferred:
            raise Interrupted(signum)

    def settle(self) -> int | None:
        """Waits for the last agreement started, lets go of it, and returns its signal (None: no signal, or
        none pending). Holding it past the run is not safe: a gloo work still referenced when the interpreter
        exits is freed after Python is gone (pytorch/pytorch#179291), one way a finished rank can abort at exit."""
        if self._pending is None:
            return None
        waiter, result = self._pending
        self._pending = None
        waiter.synchronize() if isinstance(waiter, torch.cuda.Event) else waiter.wait()
        return int(result.item()) or None  # a host tensor: no device sync

    def agreed(self, rt: Runtime) -> int | None:
        """The signal all ranks act on at this step: the largest any rank had one call earlier.

        No host sync per step: each call starts an asynchronous MAX all-reduce of this rank's signal
        and reads the one the previous call started, which finished long ago (on CUDA, waiting for it
        only keeps the host from running more than about a step ahead of the GPU). Every rank reads the
        same value at the same step, so all of them stop together, one step after the signal.
        """
        if rt.world_size == 1:
            return self.signum
        agreed = self.settle()
        flag = torch.full((1,), self.signum or 0, dtype=torch.int32, device=rt.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if rt.is_cuda:
            work.wait()  # the stream waits for the reduce, the host does not
            host = torch.empty(1, dtype=torch.int32, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending = (done, host)
        else:
            self._pending = (work, flag)
        return agreed


SIGNALS = StopSignal()  # installed by train() on its first line


# -----------------------------------------------------------------------------
# Beyond the loss: samples and HellaSwag (--sample_at_end, --hellaswag_every; tools/sample.py and
# tools/hellaswag.py run the same code on a saved model)

def gpt2_tokenizer():
    """tiktoken's GPT-2 encoding (tiktoken downloads it once, then reads it from its cache)."""
    try:
        import tiktoken  # an optional extra: only the downstream checks need it
    except ImportError:
        raise UsageError("the GPT-2 tokenizer needs tiktoken: pip install -r requirements-extras.txt") from None
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # network and cache errors of tiktoken's one-time download take many forms
        raise UsageError(f"cannot load the GPT-2 tokenizer ({type(e).__name__}): tiktoken downloads it once; "
                         "connect to the internet, or set TIKTOKEN_CACHE_DIR to a folder holding its cache") from None


def next_token(logits: Tensor, vocab_size: int, softcap: Softcap, temperature: float, top_k: int,
               generator: torch.Generator | None) -> int:
    """Greedy at temperature 0, else a draw from the softcapped distribution (top_k > 0 keeps the k likeliest).
    The head's padding rows beyond the vocabulary are never drawn."""
    logits = apply_softcap(logits[:vocab_size], softcap)
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < vocab_size:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def padded_to_blocks(tokens: list[int], device: torch.device) -> Tensor:
    """tokens followed by EOTs up to whole 128-token blocks (causal: the padding changes no earlier logit)."""
    return torch.tensor(tokens + [EOT_TOKEN] * (-len(tokens) % BLOCK_SIZE), device=device)


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, window_blocks: int, temperature: float = 1.0,
             top_k: int = 0, generator: torch.Generator | None = None, kv_cache: bool = True) -> list[int]:
    """New tokens after prompt (which fits the context), stopping before an EOT the model emits. kv_cache=False
    runs the ordinary forward over the whole prefix for every token: the reference the cache is tested against."""
    device = model.embed.weight.device
    out: list[int] = []
    if kv_cache:
        cache = KVCache(model, window_tensor(window_blocks), max_len=len(prompt) + max_new_tokens)
        logits = model.decode(torch.tensor(prompt, device=device), cache)
    window = window_tensor(window_blocks, device)
    for i in range(max_new_tokens):
        if not kv_cache:
            sequence = prompt + out
            logits = model.logits(padded_to_blocks(sequence, device), window)[0, len(sequence) - 1]
        token = next_token(logits, model.vocab_size, model.softcap, temperature, top_k, generator)
        if token == EOT_TOKEN:
            break
        out.append(token)
        if kv_cache and i + 1 < max_new_tokens:
            logits = model.decode(torch.tensor([token], device=device), cache)
    return out


END_OF_RUN_TOKENS = 64  # --sample_at_end: short samples from a document start ...
END_OF_RUN_TOP_K = 50  # ... at temperature 1 among the 50 likeliest tokens


def end_of_run_samples(model: GPT, n: int, window_blocks: int, seed: int) -> list[str]:
    """--sample_at_end: n short unconditional samples, drawn with a generator of their own."""
    enc = gpt2_tokenizer()
    generator = torch.Generator(device=model.embed.weight.device).manual_seed(seed)
    return [enc.decode(generate(model, [EOT_TOKEN], END_OF_RUN_TOKENS, window_blocks, 1.0, END_OF_RUN_TOP_K,
                                generator)) for _ in range(n)]


HELLASWAG_COMMIT = "a29ff8e9a04bba4bd6588223785ce105328adc57"  # github.com/rowanz/hellaswag
HELLASWAG_URL = f"https://raw.githubusercontent.com/rowanz/hellaswag/{HELLASWAG_COMMIT}/data/hellaswag_val.jsonl"
HELLASWAG_BLOB_SHA1 = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"  # git's id of hellaswag_val.jsonl at that commit
HELLASWAG_FILE = "hellaswag_val.jsonl"
HELLASWAG_FETCH_HINT = (f"fetch it by hand: curl -L -o {HELLASWAG_FILE} {HELLASWAG_URL}, then pass it as "
                        "--hellaswag_data (tools/hellaswag.py: --data)")
HELLASWAG_PACK_TOKENS = 1024  # candidates are scored packed into sequences of at most this many tokens


def git_blob_id(data: bytes) -> str:
    """git's id of a file's content, how GitHub names the pinned HellaSwag file: sha1 of b"blob <size>\\0" + data."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def download_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt2-speedrun"


def download_hellaswag(url: str, target: Path, expected: str) -> None:
    """Fetches url into target, atomically, only if its content has the expected git blob id."""
    import urllib.request  # only the first HellaSwag run downloads
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
    except Exception as e:  # DNS, refused connections, HTTP errors, timeouts
        raise UsageError(f"cannot download the HellaSwag validation file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:120]}); {HELLASWAG_FETCH_HINT}") from None
    if git_blob_id(data) != expected:
        raise UsageError(f"the downloaded HellaSwag file has git blob id {git_blob_id(data)}, expected {expected}: "
                         f"corrupt or changed; {HELLASWAG_FETCH_HINT}")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.part{os.getpid()}")  # ranks of one node may download at once
    part.write_bytes(data)
    os.replace(part, target)


def cached_hellaswag_file(cache_dir: Path | None = None, url: str = HELLASWAG_URL,
                          expected: str = HELLASWAG_BLOB_SHA1) -> Path:
    """The pinned validation file: downloaded on first use, verified on every use."""
    path = (cache_dir or download_cache_dir()) / HELLASWAG_FILE
    if path.is_file():
        found = git_blob_id(path.read_bytes())
        if found == expected:
            return path
        print(f"warning: cached {path} has git blob id {found}, expected {expected}; downloading it again",
              file=sys.stderr)
    download_hellaswag(url, path, expected)
    return path


@dataclass
class HellaSwagExample:
    context: str
    endings: list[str]
    label: int

    @property
    def well_formed(self) -> bool:  # endings a list of 4 strings: a 4-letter string would pass as 4 endings
        return isinstance(self.context, str) and isinstance(self.endings, list) and len(self.endings) == 4 \
            and all(isinstance(e, str) for e in self.endings) and 0 <= self.label < 4


def read_hellaswag(path: Path) -> list[HellaSwagExample]:
    """The validation split's JSONL: one object per line with "ctx", four "endings" and the "label" index."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"HellaSwag file {path} does not exist; {HELLASWAG_FETCH_HINT}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read HellaSwag file {path} ({type(e).__name__}); {HELLASWAG_FETCH_HINT}") from None
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            example = HellaSwagExample(row["ctx"], row["endings"], int(row["label"]))
            ok = example.well_formed
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise UsageError(f"line {number} of {path} is not a HellaSwag example (needs ctx, 4 endings and a "
                             f"label 0-3): corrupt or another format; {HELLASWAG_FETCH_HINT}")
        examples.append(example)
    if not examples:
        raise UsageError(f"HellaSwag file {path} holds no examples; {HELLASWAG_FETCH_HINT}")
    return examples


@dataclass
class Candidate:
    tokens: list[int]  # EOT, context, ending
    ending_start: int  # index of the ending's first token


def candidates(example: HellaSwagExample, enc, max_tokens: int) -> list[Candidate]:
    """The four scored sequences; a context too long for max_tokens loses its oldest tokens."""
    context = enc.encode_ordinary(example.context)
    out = []
    for ending in example.endings:
        end = enc.encode_ordinary(" " + ending)[:max_tokens - 2]
        kept = context[max(0, len(context) - (max_tokens - 1 - len(end))):]
        out.append(Candidate([EOT_TOKEN] + kept + end, 1 + len(kept)))
    return out


def tokenized_hellaswag(examples: list[HellaSwagExample], enc, max_tokens: int) -> list[tuple[list[Candidate], int]]:
    return [(candidates(e, enc, max_tokens), e.label) for e in examples]


def load_hellaswag(data: str, max_tokens: int, cache_dir: Path | None = None) -> tuple[list, Path]:
    """Tokenized examples of a local file (data), or of the pinned validation file when data is empty."""
    path = Path(data) if data else cached_hellaswag_file(cache_dir)
    return tokenized_hellaswag(read_hellaswag(path), gpt2_tokenizer(), max_tokens), path


def candidate_packs(rows: list[Candidate], pack_tokens: int):
    """Candidates laid out in sequences of pack_tokens, each starting on a 128-token block boundary.

    Every candidate starts with EOT, so the model's document mask keeps them apart, and on a block
    boundary its sliding windows cover what they would at position 0. Yields (tokens, [(index, start)]).
    """
    layout, used = [], 0
    for index, row in enumerate(rows):
        size = next_multiple(len(row.tokens), BLOCK_SIZE)
        if layout and used + size > pack_tokens:
            yield layout, used
            layout, used = [], 0
        layout.append((index, used))
        used += size
    if layout:
        yield layout, used


@torch.no_grad()
def ending_losses(model: GPT, rows: list[Candidate], window: Tensor, pack_tokens: int) -> list[Tensor]:
    """Per-token losses (fp32) of each candidate's ending, in order."""
    device = model.embed.weight.device
    out: list[Tensor | None] = [None] * len(rows)
    for layout, used in candidate_packs(rows, pack_tokens):
        sequence = torch.full((used,), EOT_TOKEN, dtype=torch.int64)
        for index, start in layout:
            sequence[start:start + len(rows[index].tokens)] = torch.tensor(rows[index].tokens)
        sequence = sequence.to(device)
        logits = apply_softcap(model.logits(sequence, window)[0], model.softcap)
        losses = F.cross_entropy(logits[:-1], sequence[1:], reduction="none")  # losses[p]: token p + 1
        for index, start in layout:
            row = rows[index]
            out[index] = losses[start + row.ending_start - 1:start + len(row.tokens) - 1]
    return out


@dataclass
class HellaSwagScore:
    examples: int
    correct: int  # acc: lowest summed ending loss
    correct_norm: int  # acc_norm: lowest mean ending loss
    predictions: list[tuple[int, int]]  # (acc choice, acc_norm choice) per example

    @property
    def acc(self) -> float:
        return self.correct / max(self.examples, 1)

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / max(self.examples, 1)


def hellaswag_score(model: GPT, items: list[tuple[list[Candidate], int]], window_blocks: int,
                    pack_tokens: int = HELLASWAG_PACK_TOKENS) -> HellaSwagScore:
    """acc and acc_norm over tokenized examples (ties go to the first ending)."""
    pack_tokens = min(pack_tokens, model.context_len)
    window = window_tensor(window_blocks, model.embed.weight.device)
    losses = ending_losses(model, [row for rows, _ in items for row in rows], window, pack_tokens)
    predictions, correct, correct_norm = [], 0, 0
    for i, (_, label) in enumerate(items):
        mine = losses[4 * i:4 * i + 4]
        sums, means = torch.stack([l.sum() for l in mine]), torch.stack([l.mean() for l in mine])
        choice = (int(sums.argmin()), int(means.argmin()))
        predictions.append(choice)
        correct += choice[0] == label
        correct_norm += choice[1] == label
    return HellaSwagScore(len(items), correct, correct_norm, predictions)


# -----------------------------------------------------------------------------
# Training loop

@torch.no_grad()
def evaluate(model, val_seqs: list[np.ndarray], window: Tensor, rt: Runtime) -> float:
    """Mean loss over the whole validation budget (every sequence has the same length), across ranks."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=rt.device)
    for seq in val_seqs:
        total += model(*to_device(seq, rt.device), window).double()
    stats = torch.stack([total, torch.tensor(float(len(val_seqs)), dtype=torch.float64, device=rt.device)])
    if rt.world_size > 1:
        dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def prepare_downstream(args: Hyperparameters, rt: Runtime, context_len: int) -> list | None:
    """What --hellaswag_every and --sample_at_end need (the tokenizer, the HellaSwag file), loaded before
    training so that a missing piece stops the run at start-up. Returns this rank's share of the tokenized
    HellaSwag examples."""
    if args.sample_at_end > 0:
        gpt2_tokenizer()
    if args.hellaswag_every <= 0:
        return None
    items, _ = load_hellaswag(args.hellaswag_data, min(HELLASWAG_PACK_TOKENS, context_len))
    return items[rt.rank::rt.world_size]


@torch.no_grad()
def hellaswag_accuracy(model: GPT, items: list, window: Tensor, rt: Runtime) -> tuple[float, float, int]:
    """(acc, acc_norm, examples) over every rank's share, the counts summed like evaluate()'s losses."""
    model.eval()
    result = hellaswag_score(model, items, int(window[0]))
    counts = torch.tensor([result.correct, result.correct_norm, result.examples], dtype=torch.float64,
                          device=rt.device)
    if rt.world_size > 1:
        dist.all_reduce(counts)
    model.train()
    correct, correct_norm, n = counts.tolist()
    return correct / n, correct_norm / n, int(n)


def log_samples(model: GPT, args: Hyperparameters, window: Tensor, log: RunLog) -> list[str]:
    """--sample_at_end: short samples from the final model, one JSON-quoted line each."""
    model.eval()
    texts = end_of_run_samples(model, args.sample_at_end, int(window[0]), args.seed)
    model.train()
    for i, text in enumerate(texts):
        log.write(f"sample {i + 1}/{len(texts)}: {json.dumps(text)}")
    return texts


def mean_over_ranks(value: Tensor, rt: Runtime) -> float:
    value = value.detach().double()
    if rt.world_size > 1:
        dist.all_reduce(value)
        value /= rt.world_size
    return value.item()


def peak_memory_mib(rt: Runtime) -> tuple[float, str]:
    if rt.is_cuda:
        allocated = torch.cuda.max_memory_allocated(rt.device) / 2**20
        reserved = torch.cuda.max_memory_reserved(rt.device) / 2**20
        return allocated, f"peak memory allocated: {allocated:.0f} MiB reserved: {reserved:.0f} MiB"
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return rss, f"peak memory: {rss:.0f} MiB (rank 0 process max RSS; no device memory on CPU)"


def run_id_problem(args: Hyperparameters, run_id: str, checkpoint: Path | None) -> str:
    """Why this launch may not write under run_id ('' if it may): never two runs' results or checkpoints under one
    id. A finished run's id is refused; so is one with checkpoints or a log, unless this launch continues that run
    (it resumes one of the run's own checkpoints, or --resume=auto starts afresh before its first checkpoint)."""
    log_dir = Path(args.log_dir)
    log, summary, root = log_dir / f"{run_id}.txt", log_dir / f"{run_id}.json", log_dir / run_id
    if log.exists() and not owner_is_gone(log):
        return f"run {run_id} is running in another process ({log} is locked); wait for it to end or pick another --run_id"
    if summary.exists():
        return (f"run {run_id} has finished ({summary} holds its result, which is kept): pass another --run_id to start "
                f"anew, or to train it further from one of its checkpoints (--resume={root}/step_N --run_id=NEW)")
    if args.resume == "auto" or checkpoint is not None and checkpoint.parent.resolve() == root.resolve():
        return ""
    if checkpoints := complete_checkpoints(root):
        return (f"run {run_id} has checkpoints ({checkpoints[-1]}): continue it with --resume={checkpoints[-1]}, or "
                "pass another --run_id to start anew")
    if log.exists():
        return (f"run {run_id} already has a log ({log}) of a launch that ended before a checkpoint or a result: pass "
                f"another --run_id, or delete {log} to reuse the name")
    return ""


def claim_run_id(args: Hyperparameters, place: Place, checkpoint: Path | None = None) -> str:
    """--run_id; else a resumed run keeps its checkpoint's run folder (so checkpoint_keep caps its disk
    use), and a fresh run gets time, preset and a random suffix. Rank 0 decides, and checks that the id is free
    (run_id_problem); every rank refuses together."""
    run_id = args.run_id or (checkpoint.parent.name if checkpoint else None) or \
        f"{time.strftime('%Y%m%d-%H%M%S')}_{args.preset}_{uuid.uuid4().hex[:6]}"
    decided = [run_id, run_id_problem(args, run_id, checkpoint) if place.is_master else ""]
    if place.world_size > 1:
        dist.broadcast_object_list(decided, src=0)
    if decided[1]:
        raise UsageError(decided[1])
    return decided[0]


def write_log_header(log: RunLog, args: Hyperparameters, rt: Runtime, batches: BatchSchedule, run_id: str) -> None:
    """Source, every resolved hyperparameter and the environment, before the first step line."""
    log.write("==== train_gpt.py ====", echo=False)
    log.write(Path(__file__).read_text(), echo=False)
    log.write("==== end of train_gpt.py ====", echo=False)
    log.write("hyperparameters:", echo=False)
    for name, value in dataclasses.asdict(args).items():
        log.write(f"  {name} = {value}", echo=False)
    accum = "/".join(map(str, batches.stage_accum))  # one number per batch stage
    log.write(f"  (derived) grad_accum_steps = {accum}", echo=False)
    log.write(f"  (derived) batch_stage_tokens = {'/'.join(map(str, batches.stage_tokens))}", echo=False)
    for line in environment_lines(rt) if rt.is_master else []:
        log.write(line, echo=False)
    log.write(f"run {run_id}: preset {args.preset}, {rt.world_size} rank(s) x {accum} micro-step(s), "
              f"{device_name(rt)}, attention {rt.attention}, fp8 head {rt.fp8_head}, compile {rt.compile}")
    if line := left_out_line(args):
        log.write(line)


def write_summary(path: Path, summary: dict, log: RunLog) -> None:
    """The machine-readable result next to the log, written atomically."""
    try:
        path.with_suffix(".json.part").write_text(json.dumps(summary, indent=1))
        os.replace(path.with_suffix(".json.part"), path)
    except OSError as e:
        raise RunFailed(f"cannot write {path}: {e.strerror}; the run log {log.path} is complete") from None


def train(argv: list[str]) -> int:
    SIGNALS.install()  # from the first line on: a signal during start-up ends the run in one line, not a traceback
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return EXIT_OK
    overrides = parse_overrides(argv)
    args = resolve_hyperparameters(overrides, torch.cuda.is_available())
    place = join_process_group(args)
    if place.is_master and args.preset == "cpu" and not torch.cuda.is_available() and "preset" not in overrides:
        print("no GPU found: running the cpu preset (small model, bundled sample data); "
              "pass --preset=speedrun to force the reference recipe", flush=True)
    batch_schedule(args, place.world_size)  # a world size that cannot split the batch is refused first
    checkpoint, notes = choose_checkpoint(args, place) if args.resume else (None, [])
    if checkpoint is not None:
        meta = read_checkpoint_meta(checkpoint)
        args, resumed = resumed_hyperparameters(meta["hyperparameters"], overrides, args, checkpoint)
        check_compatible(checkpoint, meta, args)
        notes += resumed
    rt = choose_runtime(place, args)
    batches = batch_schedule(args, rt.world_size)
    run_id = claim_run_id(args, rt, checkpoint)
    log = RunLog(Path(args.log_dir) / f"{run_id}.txt" if rt.is_master else None)
    lock_run_log(log, run_id)
    try:
        write_log_header(log, args, rt, batches, run_id)
        clean_stale_staging(args, run_id, log)
        for note in notes:
            log.write(note)
        return run_training(args, rt, log, batches, run_id, checkpoint)
    except Interrupted as e:
        log.write(stopped_before_training(e.signum).removeprefix("error: "), echo=False)  # main() says it once
        raise
    except Exception as e:  # the log of a failed run says why it ended, then the error propagates
        log.write(f"error: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}",
                  echo=False)
        raise


@dataclass
class Trainer:
    """What set-up builds and every phase of the run uses."""
    args: Hyperparameters
    rt: Runtime
    log: RunLog
    run_id: str
    batches: BatchSchedule
    model: GPT
    compiled: nn.Module  # the model as the steps call it (torch.compile'd under --compile=model)
    opt: Optimizers
    stream: TokenStream
    loader: DistributedTokenLoader
    schedules: StepTensors
    val_seqs: list[np.ndarray]
    hellaswag_items: list | None
    earlier_segments: list[dict] = dataclasses.field(default_factory=list)  # of the checkpoint resumed from

    def segments(self, start_step: int, step: int, clock: Clock) -> list[dict]:
        """The run's history through `step`: the earlier launches, then this one's steps and time so far."""
        tokens = self.batches.tokens_before(step) - self.batches.tokens_before(start_step)
        return self.earlier_segments + [segment(self.run_id, start_step, step, tokens, clock.ms)]


@dataclass
class Progress:
    """What the loop has measured so far: the JSON summary's curves."""
    val_loss: float = float("nan")
    val_curve: list = dataclasses.field(default_factory=list)  # [step, val_loss, train_time_ms]
    hellaswag_curve: list = dataclasses.field(default_factory=list)  # [step, acc, acc_norm, examples]


def set_up(args: Hyperparameters, rt: Runtime, log: RunLog, batches: BatchSchedule, run_id: str) -> Trainer:
    """Data, model and optimizers: everything that can fail on bad input fails here, before step 0."""
    train_files = find_shards(args.train_files, "training")
    val_files = find_shards(args.val_files, "validation")
    for f in train_files:
        shard_token_count(f)
    val_seqs = validation_sequences(val_files, args, rt.rank, rt.world_size)
    torch.manual_seed(args.seed)
    model = build_model(args, rt)
    compiled = torch.compile(model, dynamic=False) if rt.compile == "model" else model
    opt = build_optimizers(model, args, rt.rank, rt.world_size, compiled=rt.compile == "model")
    stream = TokenStream(train_files, args.vocab_size, cycle=args.train_cycle, read_ahead=True)
    loader = DistributedTokenLoader(stream, args.seq_len, rt.rank, rt.world_size, args.bos_align, args.doc_len_cap,
                                    rt.device)
    return Trainer(args, rt, log, run_id, batches, model, compiled, opt, stream, loader, StepTensors(args, rt.device),
                   val_seqs, prepare_downstream(args, rt, model.context_len))


def train_step(t: Trainer, step: int) -> Tensor:
    """One optimizer step over the stage's micro-batches; returns this rank's mean loss (on the device)."""
    args, windows, accum = t.args, t.schedules.windows(step), t.batches.accum(step)
    mtp = t.schedules.mtp_weights(step)
    losses = []
    for i, (x, y) in enumerate(t.loader.next_batch(accum)):
        t.opt.sync.arm(i == accum - 1)
        loss = t.compiled(x, y, windows, *mtp)
        loss.backward()
        losses.append(loss.detach())
    lr_mult = lr_multiplier(step, args.num_iterations, args.cooldown_frac, args.lr_final_frac) * t.batches.lr_scale(step)
    t.opt.step(lr_mult, muon_momentum(step, args.muon_momentum_warmup_steps, args.muon_momentum_start,
                                      args.muon_momentum), accum)
    t.model.zero_grad(set_to_none=True)  # R: the next backward writes fresh gradients, no zeroing kernels
    return torch.stack(losses).mean()


def warm_up(t: Trainer) -> None:
    """Compile and warm the kernels on real shapes (training and validation), then forget it happened."""
    if t.args.warmup_steps <= 0:
        return
    live = training_state(t.model, t.opt, t.stream, 0)
    saved = {name: local_part(x).clone() for name, x in live.tensors.items()}
    for step in range(t.args.warmup_steps):
        train_step(t, step)
    evaluate(t.compiled, t.val_seqs[:1], t.schedules.windows(0), t.rt)
    with torch.no_grad():
        for name, x in live.tensors.items():
            local_part(x).copy_(saved[name])
    t.stream.load_state(live.loader)


def resume(t: Trainer, checkpoint: Path | None) -> int:
    """The step to start from: 0, or the checkpoint's step with its full training state restored."""
    if checkpoint is None:
        return 0
    state = load_checkpoint(checkpoint, training_state(t.model, t.opt, t.stream, 0), t.rt, t.log)
    t.stream.load_state(state.loader)
    t.earlier_segments = state.segments
    t.log.write(f"resumed from {checkpoint} at step {state.step}")
    set_aside_newer_checkpoints(checkpoint_root(t.args, t.run_id), checkpoint, t.rt, t.log)
    return state.step


def run_training(args: Hyperparameters, rt: Runtime, log: RunLog, batches: BatchSchedule, run_id: str,
                 checkpoint: Path | None) -> int:
    """Set-up, the untimed warm-up, then the timed loop; returns the process exit status."""
    t = set_up(args, rt, log, batches, run_id)
    try:
        if checkpoint is not None:  # before the warm-up's compiles
            check_same_tensors(checkpoint, training_state(t.model, t.opt, t.stream, 0), args, rt)
        warm_up(t)
        return train_loop(t, resume(t, checkpoint), checkpoint)
    finally:
        t.stream.close()  # no shard reader outlives the run


def due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def train_loop(t: Trainer, start_step: int, checkpoint: Path | None) -> int:
    """The record's loop: validate (and score HellaSwag) when due, checkpoint or stop when due, train."""
    args, rt, log, N = t.args, t.rt, t.log, t.args.num_iterations
    energy, recompiles, stop = EnergyMeter.open(rt), RecompileWatch().start(), SIGNALS.defer()
    clock, progress, watch = Clock(rt, energy), Progress(), FiniteWatch(rt.device, start_step, checkpoint)
    clock.start()
    exit_status = None
    with profiling(t) as profiler:  # stopped on every way out of the loop
        for step in range(start_step, N + 1):
            last = step == N
            # ---------------- VALIDATION ----------------
            validate_now, hellaswag_now = last or due(step, args.val_every), \
                t.hellaswag_items is not None and (last or due(step, args.hellaswag_every))
            if validate_now or hellaswag_now:
                clock.pause()
                if validate_now:
                    validate(t, step, start_step, clock, progress, watch)
                if hellaswag_now:
                    score_hellaswag(t, step, progress)
                if last:
                    break
                clock.start()
            # ---------------- CHECKPOINT OR STOP ----------------
            exit_status = checkpoint_or_stop(t, step, start_step, stop.agreed(rt), clock, watch)
            if exit_status is not None:
                break
            # ---------------- TRAINING ----------------
            loss = train_step(t, step)
            watch.observe(loss)
            for reason in recompiles.drain():
                log.write(f"warning: torch.compile recompiled after warm-up at step {step + 1}: {reason}")
            if profiler is not None:
                profiler.step()
            log_train_step(t, step + 1, start_step, loss, clock, watch)
    stop.settle()  # every rank started the same agreements, so the last one completes
    return exit_status if exit_status is not None else finish(t, start_step, clock, progress, watch, recompiles)


def profiling(t: Trainer):
    """The profiler as a context (started on entry, stopped on every way out), or a stand-in that does nothing."""
    if t.args.profile_steps <= 0:
        return contextlib.nullcontext()
    return make_profiler(t.args, t.rt, Path(t.args.log_dir) / f"{t.run_id}_rank{t.rt.rank}.trace.json")


def validate(t: Trainer, step: int, start_step: int, clock: Clock, progress: Progress, watch: FiniteWatch) -> None:
    """Validation loss on the whole held-out budget, logged with the training time so far."""
    progress.val_loss = evaluate(t.compiled, t.val_seqs, t.schedules.windows(step), t.rt)
    progress.val_curve.append([step, progress.val_loss, clock.ms])
    joules, _ = clock.energy.total(t.rt)
    t.log.write(progress_line(step, t.args.num_iterations, val_loss=progress.val_loss, train_time=clock.ms,
                              step_avg=clock.ms / max(step - start_step, 1),
                              **({"energy": joules} if joules is not None else {})))
    if not math.isfinite(progress.val_loss):
        raise RunFailed(f"validation loss is {progress.val_loss} at step {step}; the run diverged "
                         f"(lower the learning rates and resume: {watch.hint()})")


def score_hellaswag(t: Trainer, step: int, progress: Progress) -> None:
    started = time.perf_counter()
    acc, acc_norm, n = hellaswag_accuracy(t.model, t.hellaswag_items, t.schedules.windows(step), t.rt)
    progress.hellaswag_curve.append([step, acc, acc_norm, n])
    t.log.write(progress_line(step, t.args.num_iterations, hellaswag_acc=acc, hellaswag_acc_norm=acc_norm,
                              hellaswag_examples=n, hellaswag_time=1000 * (time.perf_counter() - started)))


def checkpoint_or_stop(t: Trainer, step: int, start_step: int, signum: int | None, clock: Clock,
                       watch: FiniteWatch) -> int | None:
    """Before training step+1: write a checkpoint when one is due, a signal came or --stop_after is
    reached; returns the exit status when the run stops here, None to go on."""
    args, log = t.args, t.log
    stop_after = args.stop_after > 0 and step == args.stop_after
    if not (due(step, args.checkpoint_every) and step > start_step or signum or stop_after):
        return None
    checkpointing = args.checkpoint_every > 0 or args.checkpoint_final or args.stop_after > 0
    with clock.paused():
        if checkpointing:
            save_finite_checkpoint(t, watch, step, t.segments(start_step, step, clock))
    if signum:
        log.write(f"stopped by signal {signal.Signals(signum).name} before step {step + 1}"
                  + ("; resume with --resume=latest" if checkpointing else " (no checkpoints enabled)"))
        return 128 + signum
    if stop_after:
        log.write(f"stopped after step {step} as asked (--stop_after); resume with --resume=latest")
        return 0
    return None


def log_train_step(t: Trainer, step: int, start_step: int, loss: Tensor, clock: Clock, watch: FiniteWatch) -> None:
    """The step line; with --log_train_loss also the loss averaged over ranks (one device sync)."""
    ms = clock.elapsed_ms()
    timing = dict(train_time=ms, step_avg=ms / (step - start_step))
    if not t.args.log_train_loss:
        t.log.write(progress_line(step, t.args.num_iterations, **timing))
        return
    train_loss = mean_over_ranks(loss, t.rt)
    if not math.isfinite(train_loss):
        raise RunFailed(f"training loss is {train_loss} at step {step}; stopping (lower the learning rates and "
                         f"resume: {watch.hint()})")
    t.log.write(progress_line(step, t.args.num_iterations, train_loss=train_loss, **timing))


def run_totals(segments: list[dict], batches: BatchSchedule) -> tuple[int, float | None]:
    """Tokens of all segments (those an old checkpoint did not record, at this run's schedule) and their total
    training time (None when an old checkpoint did not record its part)."""
    tokens = sum(s["tokens"] if s["tokens"] is not None else
                 batches.tokens_before(s["end_step"]) - batches.tokens_before(s["start_step"]) for s in segments)
    times = [s["train_time_ms"] for s in segments]
    return tokens, None if None in times else sum(times)


def finish(t: Trainer, start_step: int, clock: Clock, progress: Progress, watch: FiniteWatch,
           recompiles: RecompileWatch) -> int:
    """Memory, energy and final lines, end-of-run samples and checkpoint, then the JSON summary."""
    args, rt, log, N = t.args, t.rt, t.log, t.args.num_iterations
    segments = t.segments(start_step, N, clock)
    tokens, total_ms = run_totals(segments, t.batches)
    peak_mib, memory_line = peak_memory_mib(rt)
    joules, ranks = clock.energy.total(rt)
    log.write(memory_line)
    log.write(energy_line(joules, ranks, clock.energy.reason, clock.ms / 1000, segments[-1]["tokens"]))
    resumed = {"total_train_time": total_ms, "resumes": len(segments) - 1} if len(segments) > 1 else {}
    log.write(progress_line(None, N, val_loss=progress.val_loss, steps=N, tokens=tokens, train_time=clock.ms,
                            **({k: v for k, v in resumed.items() if v is not None})))
    samples = log_samples(t.model, args, t.schedules.windows(N), log) if args.sample_at_end > 0 and rt.is_master else []
    if args.checkpoint_final:
        save_finite_checkpoint(t, watch, N, segments)
    if rt.is_master:
        kwh = joules / 3.6e6 if joules is not None else None
        summary = {"run_id": t.run_id, "git_commit": git_commit(), "preset": args.preset,
                   "world_size": rt.world_size, "devices": [device_name(rt)] * rt.world_size, "steps": N,
                   "tokens": tokens, "final_val_loss": progress.val_loss, "train_time_ms": clock.ms,
                   "peak_memory_mib": peak_mib, "energy_j": joules, "energy_kwh": kwh,
                   "tokens_per_kwh": segments[-1]["tokens"] / kwh if kwh else None, "val_curve": progress.val_curve,
                   "segments": segments, "total_train_time_ms": total_ms, "resumes": len(segments) - 1,
                   "recompiles_after_warmup": recompiles.count, "step_avg_ms": clock.ms / max(N - start_step, 1),
                   "runtime": {**rt.resolved(), "grad_accum_steps": t.batches.stage_accum[-1],
                               "batch_stages": [[t.batches.first_step(i), n, a] for i, (n, a) in
                                                enumerate(zip(t.batches.stage_tokens, t.batches.stage_accum))]}, "hyperparameters": dataclasses.asdict(args),
                   "status": "finished"}
        if args.hellaswag_every > 0:
            summary["hellaswag_curve"] = progress.hellaswag_curve
        if args.sample_at_end > 0:
            summary["samples"] = samples
        write_summary(Path(args.log_dir) / f"{t.run_id}.json", summary, log)
    return 0


# gloo words a dead peer differently per operation (a reduce-scatter wait says "Application timeout
# caused pair closure").
COLLECTIVE_FAILURE_MARKERS = ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out", "timed out",
                              "ProcessGroup", "pair closure")


def is_collective_failure(e: Exception) -> bool:
    """A peer rank died or stopped answering (gloo and NCCL report it as RuntimeError or DistError)."""
    return isinstance(e, dist.DistError) or (
        dist.is_initialized() and isinstance(e, RuntimeError) and any(m in str(e) for m in COLLECTIVE_FAILURE_MARKERS))


def main(argv: list[str] | None = None) -> int:
    try:
        return train(sys.argv[1:] if argv is None else argv)
    except UsageError as e:  # RunFailed too, with its own status
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    except Interrupted as e:
        print(stopped_before_training(e.signum), file=sys.stderr, flush=True)
        return 128 + e.signum
    except (RuntimeError, dist.DistError) as e:
        if not is_collective_failure(e):
            raise
        reason = str(e).strip().splitlines()[-1][:300]
        print(f"error: a collective failed on rank {os.environ.get('RANK', '0')} ({reason}); another rank died or "
              "stopped answering: see its output, then resume from the last checkpoint", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
    finally:
        end_distributed()


def end_distributed() -> None:
    """The one way a run lets go of its process group, on every way out: the pending stop-signal agreement
    waited for and dropped, objects that still hold the group (meshes, works, in reference cycles) collected,
    then the group destroyed, which joins gloo's threads. A gloo thread alive when the interpreter exits can
    take the GIL inside a C++ destructor and abort a finished rank (pytorch/pytorch#190489)."""
    with contextlib.suppress(RuntimeError, dist.DistError):  # a failed run's error was reported already
        SIGNALS.settle()
    if dist.is_initialized():
        failure = sys.exc_info()[1]  # an error on its way out: its traceback's frames may hold a mesh or work
        if failure is not None:
            traceback.clear_frames(failure.__traceback__)
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
