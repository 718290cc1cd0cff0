"""Export a trained model: python -m tools.export <checkpoint> <out_dir>

Writes out_dir/model.safetensors (every weight, in the dtype it trained in) and out_dir/config.json
(the recorded hyperparameters, the step and its attention window). tools/loading.py's load_model(out_dir)
rebuilds the model from those two files alone, with the model code of train_gpt.py:

    from tools.loading import load_model
    model = load_model("out_dir").model          # GPT; model.logits(tokens, window) as in training

The other tools take out_dir wherever they take a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from flags import OneLineArgumentParser, new_file_mode, run_cli
from tools.loading import (EXPORT_CONFIG, EXPORT_FORMAT, EXPORT_FORMAT_VERSION, EXPORT_WEIGHTS, LoadedModel, T,
                           load_model, safetensors_torch)

def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuses a folder that holds a file of the export's names: a user's own file is never replaced, and an
    earlier export only with overwrite."""
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        raise T.UsageError(f"OUT_DIR {out_dir} is not a folder; pick a folder (made if missing)")
    existing = [name for name in (EXPORT_WEIGHTS, EXPORT_CONFIG) if (out_dir / name).exists()]
    if existing and not overwrite:
        raise T.UsageError(f"{out_dir} already holds {' and '.join(existing)}; pick an empty folder, or pass "
                           "--overwrite to replace an earlier export there")
    if existing and not is_export(out_dir):
        raise T.UsageError(f"{out_dir / EXPORT_CONFIG} is not a {EXPORT_FORMAT} export; it is left as is: pick "
                           "another folder")


def is_export(out_dir: Path) -> bool:
    try:
        return json.loads((out_dir / EXPORT_CONFIG).read_text()).get("format") == EXPORT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def export(loaded: LoadedModel, out_dir: Path, overwrite: bool = False) -> None:
    """Weights and config, each written to a temporary name first, so a failure leaves no half export."""
    st = safetensors_torch()
    check_out_dir(out_dir, overwrite)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_export(st, loaded, out_dir)
    except OSError as e:
        raise T.UsageError(f"cannot write the export into {out_dir} ({e.strerror or type(e).__name__}); pick a "
                           "writable folder") from None


def write_export(st, loaded: LoadedModel, out_dir: Path) -> None:
    """model.safetensors and config.json, each under a .part name until it is whole."""
    state = {name: t.detach().cpu().contiguous() for name, t in loaded.model.state_dict().items()}
    config = {"format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION, "step": loaded.step,
              "window_blocks": loaded.window_blocks, "hyperparameters": dataclasses.asdict(loaded.args),
              "exported_from": str(loaded.source)}
    weights, meta = out_dir / EXPORT_WEIGHTS, out_dir / EXPORT_CONFIG
    st.save_file(state, str(weights) + ".part", metadata={"format": EXPORT_FORMAT})
    os.chmod(str(weights) + ".part", new_file_mode())  # safetensors writes 0600, whatever the umask says
    (out_dir / (EXPORT_CONFIG + ".part")).write_text(json.dumps(config, indent=1))
    os.replace(str(weights) + ".part", weights)
    os.replace(out_dir / (EXPORT_CONFIG + ".part"), meta)


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="step_N/ folder of train_gpt.py")
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in out_dir")
    opts = p.parse_args(argv)
    safetensors_torch()
    check_out_dir(Path(opts.out_dir), opts.overwrite)  # before the minutes of loading
    loaded = load_model(opts.checkpoint, "cpu")
    export(loaded, Path(opts.out_dir), opts.overwrite)
    size = (Path(opts.out_dir) / EXPORT_WEIGHTS).stat().st_size
    print(f"exported {loaded.source} (step {loaded.step}) to {opts.out_dir}/: {EXPORT_WEIGHTS} "
          f"{size / 2**20:.1f} MiB, {EXPORT_CONFIG}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
