"""How much of train_gpt.py is the speedrun's math, definition by definition (no torch needed).

    python -m bench.code_share

Counted: the lines of every top-level definition (function, class, or assignment such as a table), from its
first line (decorators included) to its last, without blank lines and lines that hold only a comment; code
between definitions (imports, the section banners) is not inside a definition and is not counted. A
definition belongs to the section whose banner ("# ---" then "# Title") comes before it.

Math is only what computes the run: the model and its loss, the attention windows and their masks, the
optimizers' update math and how the parameters are grouped for it, the schedules, the data as tensors and the
training step. Everything else is machinery: configuration, techniques and validation, device set-up, reading
shards, moving gradients between ranks (the gradient's path), the loop around the step, logging, checkpoints,
the summary, stopping. The output lists, per section, which definitions counted as math.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Sections whose every definition is math, but for these: the tools' decoding cache, the inputs' checks and
# putting the model on its device
MATH_SECTIONS = ("Attention windows", "Model", "Optimizers", "Schedules")
NOT_MATH = {"KVCache", "check_model_inputs", "build_model"}
# Math in the other sections: the data as tensors, the optimizers' grouping and step order, the training step
MATH_DEFINITIONS = {"to_device", "DistributedTokenLoader", "Optimizers", "build_optimizers", "train_step",
                    "lr_multiplier_at"}


def sections(source: str) -> list[tuple[int, str]]:
    """(first line, title) of each section banner, in order."""
    lines = source.splitlines()
    return [(i + 2, lines[i + 1].lstrip("# ").split(":")[0].strip())
            for i in range(len(lines) - 1) if lines[i].startswith("# ----") and lines[i + 1].startswith("# ")]


def definition_name(node: ast.stmt) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return ", ".join(t.id for t in targets if isinstance(t, ast.Name)) or type(node).__name__


def counted_definitions(source: str) -> list[tuple[str, str, int]]:
    """(section title, definition name, lines) of every top-level definition after the first banner."""
    lines = source.splitlines()
    banners = sections(source)
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr, ast.If)):
            continue  # imports, the docstring, the `if __name__` block
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        title = next((t for line, t in reversed(banners) if line <= first), None)
        if title is None:
            continue  # before the first section: the signal handler of the imports
        body = lines[first - 1:node.end_lineno]
        out.append((title, definition_name(node),
                    sum(1 for text in body if text.strip() and not text.strip().startswith("#"))))
    return out


def is_math(title: str, name: str) -> bool:
    if title in MATH_SECTIONS:
        return name not in NOT_MATH
    return name in MATH_DEFINITIONS


def math_share(source: str) -> float:
    counted = counted_definitions(source)
    return math_lines(counted) / sum(n for _, _, n in counted)


def math_lines(counted: list[tuple[str, str, int]]) -> int:
    return sum(n for t, name, n in counted if is_math(t, name))


def main() -> int:
    source = (REPO / "train_gpt.py").read_text()
    counted = counted_definitions(source)
    titles = list(dict.fromkeys(t for t, _, _ in counted))
    total = sum(n for _, _, n in counted)
    print(f"train_gpt.py: {len(source.splitlines())} lines, {total} inside top-level definitions\n")
    print("| section | lines in definitions | math lines | counted as math |")
    print("|---|---|---|---|")
    for title in titles:
        mine = [(name, n) for t, name, n in counted if t == title]
        math = [name for name, _ in mine if is_math(title, name)]
        what = ("all" if len(math) == len(mine) else
                f"all but {', '.join(name for name, _ in mine if name not in math)}" if title in MATH_SECTIONS else
                ", ".join(math) or "none")
        print(f"| {title} | {sum(n for _, n in mine)} | {sum(n for name, n in mine if name in math)} | {what} |")
    math_total = math_lines(counted)
    print(f"\nthe speedrun's math: {math_total} of {total} lines = {100 * math_total / total:.1f}%")
    for sibling in sorted(REPO.glob("*.py")):
        if sibling.name != "train_gpt.py":
            print(f"sibling {sibling.name}: {len(sibling.read_text().splitlines())} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
