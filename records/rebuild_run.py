#!/usr/bin/env python3
"""Rebuild a run from its log alone: the trainer's sources it embeds, and the command that trains it again.

Usage:
    python -m records.rebuild_run LOG OUT_DIR

A log that train_gpt.py wrote embeds its own source and that of every sibling module it imported
(checkpoints.py, runlog.py, ...), then every resolved hyperparameter. This writes each source into OUT_DIR
under its file name and prints the command line that reruns the run with them: `python OUT_DIR/train_gpt.py`
and every hyperparameter of the log's first launch as --name=value. Run it from the checkout that holds the
data (relative shard globs are read from the working directory), with another --log_dir or --run_id appended
(the last value of a flag wins). OUT_DIR must not hold any of the files already. No torch needed.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from flags import OneLineArgumentParser, UsageError, output_folder, read_user_file, run_cli, write_user_file
from records.read_records import hyperparameter_blocks, log_sources  # the run log's one reader


def logged_hyperparameters(lines: list[str]) -> dict[str, str]:
    """The first launch's 'hyperparameters:' block as name -> value text."""
    blocks = hyperparameter_blocks(lines)
    if not blocks:
        raise UsageError("the log has no hyperparameters block: it is cut short, or not a train_gpt.py log")
    return blocks[0]


def as_flag(name: str, text: str) -> str:
    """A logged value (Python's str() of it) as the trainer's command line writes it."""
    return f"--{name}={text.lower() if text in ('True', 'False', 'None') else text}"


def rebuild(log: Path, out_dir: Path) -> tuple[list[str], list[str]]:
    """Writes the log's sources into out_dir; returns the command that reruns the run and the files written."""
    text = read_user_file(log, "the log", "pass a <run_id>.txt that train_gpt.py wrote")
    sources, rest = log_sources(text)
    if "train_gpt.py" not in sources:
        raise UsageError(f"{log} embeds no train_gpt.py source: not a run log of this project's trainer")
    values = logged_hyperparameters(rest)
    output_folder(out_dir, "OUT_DIR", "pass an empty or new folder you can write")
    taken = [name for name in sources if os.path.lexists(out_dir / name)]
    if taken:
        raise UsageError(f"{out_dir} already holds {taken[0]}; pass an empty or new folder")
    for name, source in sources.items():
        write_user_file(out_dir / name, source, "the source", "pass an empty or new folder you can write")
    return [sys.executable, str(out_dir / "train_gpt.py"), *(as_flag(n, v) for n, v in values.items())], sorted(sources)


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="a <run_id>.txt that train_gpt.py wrote")
    p.add_argument("out_dir", type=Path, help="where to write the sources (made if missing)")
    opts = p.parse_args(argv)
    command, written = rebuild(opts.log, opts.out_dir)
    print(f"wrote {', '.join(written)} into {opts.out_dir}; rerun with:")
    print(shlex.join(command))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
