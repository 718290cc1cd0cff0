"""Rebuilds a trained model from what train_gpt.py or tools/export.py wrote, and loads the GPT-2 tokenizer.

The model's shape, recipe and attention window come from the hyperparameters recorded next to the
weights, so any model flag train_gpt.py gains flows through without a change here.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import checkpoints
import train_gpt as T
from flags import OneLineArgumentParser, missing, what_is_there


def model_parser(doc: str) -> OneLineArgumentParser:
    """The parser of a tool that runs a model, with the arguments every such tool takes: the checkpoint, and the
    attention window and device load_model runs it at. doc: the tool's docstring (its first paragraph describes)."""
    p = OneLineArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("checkpoint", help="step_N/ folder of train_gpt.py, or a tools/export.py folder")
    p.add_argument("--window", default="step", choices=["step", "final"],
                   help="attention window of the checkpoint's step, or the schedule's final one")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return p


EXPORT_CONFIG = "config.json"  # tools/export.py writes these; load_exported reads them
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_FORMAT = "gpt2-speedrun"
EXPORT_FORMAT_VERSION = 1


def safetensors_torch():
    try:
        import safetensors.torch
    except ImportError:
        raise T.UsageError("export needs safetensors: pip install -r requirements-extras.txt") from None
    return safetensors.torch


@dataclass
class LoadedModel:
    model: T.GPT
    args: T.Hyperparameters
    step: int
    windows: tuple[int, int]  # the (long, short) windows the tools run the model with: attention_windows'
    source: Path

    @property
    def window_blocks(self) -> int:
        """The long window, as the tools print it and export records it."""
        return self.windows[0]


def pick_device(name: str) -> torch.device:
    """auto: the first GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise T.UsageError(f"--device={name} but no CUDA GPU is visible; use --device=cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise T.UsageError(f"bad --device={name!r}; use auto, cpu, cuda or cuda:N") from None


def hyperparameters_from(recorded: dict, where: Path) -> T.Hyperparameters:
    """The recorded hyperparameters as this train_gpt.py's dataclass; a field it lacks means another recipe."""
    known = {f.name for f in dataclasses.fields(T.Hyperparameters)}
    unknown = sorted(set(recorded) - known)
    if unknown:
        raise T.UsageError(f"{where} records hyperparameter {unknown[0]!r}={recorded[unknown[0]]!r}, which this "
                           "train_gpt.py does not have: it comes from another recipe or version; use the "
                           "train_gpt.py that wrote it")
    for name in sorted(known - set(recorded)):
        print(f"warning: {where} records no {name!r}; using this train_gpt.py's default "
              f"{getattr(T.Hyperparameters, name)!r}", file=sys.stderr)
    args = T.Hyperparameters(**recorded)
    try:
        T.check_flag_ranges(args)  # a value this version refuses (a recipe it does not know, say): another version
    except T.UsageError as e:
        raise T.UsageError(f"{where} records hyperparameters this train_gpt.py refuses ({e}): it comes from "
                           "another recipe or version; use the train_gpt.py that wrote it") from None
    return args


def weights_shape(state: dict) -> dict[str, object]:
    """The model-shape hyperparameters that the tensors themselves imply."""
    try:
        vocab_size, model_dim = state["embed.weight"].shape
        attention_width = state["blocks.0.attn.qkv_w"].shape[1]
    except KeyError as e:
        raise T.UsageError(f"the weights have no tensor {e.args[0]!r}: not a train_gpt.py model") from None
    return {"vocab_size": vocab_size, "model_dim": model_dim,
            "n_layer": 1 + max(int(name.split(".")[1]) for name in state if name.startswith("blocks.")),
            "n_head*head_dim": attention_width,
            "value_embeds": any(name.startswith("value_embeds.") for name in state),
            "unet_skips": "skip_weights" in state or "skip_lambdas" in state}  # linear or sigmoid weights


def check_weights_fit(state: dict, args: T.Hyperparameters, where: Path) -> None:
    """Refuses weights of another model shape than the recorded hyperparameters describe, naming the field."""
    # the trainer's shape fields, with heads x width as one: the tensors show only their product
    recorded = {name: getattr(args, name) for name in T.MODEL_SHAPE_FIELDS if name not in ("n_head", "head_dim")}
    recorded["n_head*head_dim"] = args.n_head * args.head_dim
    if args.pad_embed_tables:  # the tables have the head's padded rows
        recorded["vocab_size"] = T.next_multiple(args.vocab_size, 128)
    for name, value in weights_shape(state).items():
        if recorded[name] != value:
            raise T.UsageError(f"{where}: the weights have {name}={value} but the recorded hyperparameters say "
                               f"{name}={recorded[name]}; the weights come from another model shape or recipe")


def build(args: T.Hyperparameters, state: dict, step: int, device: torch.device, window: str,
          source: Path) -> LoadedModel:
    """The model in eval mode on device: dtypes as in training, SDPA attention (any device, any length)."""
    check_weights_fit(state, args, source)
    rt = T.Runtime(rank=0, local_rank=0, world_size=1, device=device,
                   dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
                   attention="banded", fp8_head=False, compile="off")
    model = T.build_model(args, rt)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise T.UsageError(f"{source}: the weights do not fit the model its hyperparameters describe ({detail})") \
            from None
    model.eval()
    at = {"step": step, "final": args.num_iterations}[window]
    windows = T.attention_windows(at, args)
    T.follow_yarn(model, at, args)  # track 2: the rotary tables and attention scale of that step
    return LoadedModel(model=model, args=args, step=step, windows=windows, source=source)


def load_checkpoint(path: Path, device: torch.device, window: str = "step") -> LoadedModel:
    """A step_N/ folder of train_gpt.py: checkpoint.json (validated by the trainer's reader) and the model weights
    of its DCP files (each file's size and sha256 verified first, as the trainer verifies them)."""
    meta = checkpoints.read_checkpoint_meta(path)
    args = hyperparameters_from(meta["hyperparameters"], path / checkpoints.CHECKPOINT_META)
    return build(args, checkpoints.read_checkpoint_tensors(path), meta["step"], device, window, path)


def load_model(path: str | Path, device: str | torch.device = "auto", window: str = "step") -> LoadedModel:
    """A train_gpt.py checkpoint folder or a tools/export.py folder, whichever path is.

    window: "step" runs the model with the attention window of the step it was saved at (what it was
    validated with then), "final" with the schedule's final window.
    """
    path = Path(path)
    device = device if isinstance(device, torch.device) else pick_device(device)
    if (path / checkpoints.CHECKPOINT_META).is_file():
        return load_checkpoint(path, device, window)
    if (path / EXPORT_CONFIG).is_file() and (path / EXPORT_WEIGHTS).is_file():
        return load_exported(path, device, window)
    try:
        there = what_is_there(path) or "a file"
        what = (f"has no {checkpoints.CHECKPOINT_META} (nor {EXPORT_CONFIG} + {EXPORT_WEIGHTS})" if path.is_dir()
                else f"is {there}, not a folder")
    except (FileNotFoundError, NotADirectoryError):
        what = missing(path, said="does not exist")
    except OSError as e:
        what = f"cannot be read ({e.strerror or e})"
    raise T.UsageError(f"{path} {what}; pass a step_N folder that train_gpt.py wrote (train with "
                       "--checkpoint_final=true) or a folder tools/export.py wrote")


def load_exported(out_dir: str | Path, device: str | torch.device = "cpu", window: str = "step") -> LoadedModel:
    """The model rebuilt from config.json and model.safetensors alone."""
    out_dir = Path(out_dir)
    try:
        config = json.loads((out_dir / EXPORT_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise T.UsageError(f"cannot read {out_dir / EXPORT_CONFIG} ({type(e).__name__}); export again") from None
    if config.get("format") != EXPORT_FORMAT or config.get("format_version") != EXPORT_FORMAT_VERSION:
        raise T.UsageError(f"{out_dir / EXPORT_CONFIG} is not a {EXPORT_FORMAT} export version {EXPORT_FORMAT_VERSION}")
    args = hyperparameters_from(config["hyperparameters"], out_dir / EXPORT_CONFIG)
    try:
        state = safetensors_torch().load_file(str(out_dir / EXPORT_WEIGHTS))
    except Exception as e:  # safetensors reports truncation and bad headers as several exception types
        raise T.UsageError(f"{out_dir / EXPORT_WEIGHTS} is unreadable ({type(e).__name__}); export again") from None
    device = device if isinstance(device, torch.device) else pick_device(device)
    return build(args, state, int(config["step"]), device, window, out_dir)
