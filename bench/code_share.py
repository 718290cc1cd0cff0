"""How much of train_gpt.py is the speedrun's math, section by section (no torch needed).

    python -m bench.code_share

Counted: the lines of every top-level definition (function, class, or assignment such as a table), from its
first line (decorators included) to its last, without blank lines and lines that hold only a comment; code
between definitions (imports, the section banners) is not inside a definition and is not counted. A
definition belongs to the section whose banner ("# ---" then "# Title") comes before it. The math sections
are the speedrun's own: data, model, optimizers, schedules and the training loop; the others (configuration,
recipe v2's declarations, flag validation, supported torch, distributed setup and device choices, stopping)
are the machinery around it. The share of math is what tests/test_layout.py holds at 55% or more.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MATH_SECTIONS = ("Data", "Model", "Optimizers", "Schedules", "Training loop")


def sections(source: str) -> list[tuple[int, str]]:
    """(first line, title) of each section banner, in order."""
    lines = source.splitlines()
    return [(i + 2, lines[i + 1].lstrip("# ").split(":")[0].strip())
            for i in range(len(lines) - 1) if lines[i].startswith("# ----") and lines[i + 1].startswith("# ")]


def counted_lines(source: str) -> dict[str, int]:
    """Lines inside top-level definitions, per section title."""
    lines = source.splitlines()
    banners = sections(source)
    out: dict[str, int] = {title: 0 for _, title in banners}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr, ast.If)):
            continue  # imports, the docstring, the `if __name__` block
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        title = next((t for line, t in reversed(banners) if line <= first), None)
        if title is None:
            continue  # before the first section: the signal handler of the imports
        body = lines[first - 1:node.end_lineno]
        out[title] += sum(1 for text in body if text.strip() and not text.strip().startswith("#"))
    return out


def is_math(title: str) -> bool:
    return any(title.startswith(name) for name in MATH_SECTIONS)


def main() -> int:
    source = (REPO / "train_gpt.py").read_text()
    counts = counted_lines(source)
    math_lines = sum(n for t, n in counts.items() if is_math(t))
    total = sum(counts.values())
    print(f"train_gpt.py: {len(source.splitlines())} lines, {total} inside top-level definitions\n")
    print("| section | lines in definitions | math |")
    print("|---|---|---|")
    for title, n in counts.items():
        print(f"| {title} | {n} | {'yes' if is_math(title) else 'no'} |")
    print(f"\nthe speedrun's math: {math_lines} of {total} lines = {100 * math_lines / total:.1f}%")
    for sibling in sorted(REPO.glob("*.py")):
        if sibling.name != "train_gpt.py":
            print(f"sibling {sibling.name}: {len(sibling.read_text().splitlines())} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
