"""The launcher stays small enough to read top-down: ``ddplab/launcher/`` holds at most 1,800
lines in all (docstrings, comments and blank lines included) and no module over 300. A change
that would grow it past either makes room first. (Why a failed job failed is
``ddplab/failures.py``'s, on the kernel side, outside this count: it reads finished logs and
starts nothing.)"""

from __future__ import annotations

from pathlib import Path

LAUNCHER = Path(__file__).resolve().parent.parent / "ddplab" / "launcher"
MOST_LINES, MOST_LINES_A_MODULE = 1800, 300


def test_the_launcher_keeps_to_its_line_budget() -> None:
    sizes = {path.name: len(path.read_text().splitlines())
             for path in sorted(LAUNCHER.glob("*.py"))}
    assert len(sizes) >= 10, f"the launcher's modules were not found in {LAUNCHER}"
    assert sum(sizes.values()) <= MOST_LINES, f"{sum(sizes.values())} lines: {sizes}"
    over = {name: lines for name, lines in sizes.items() if lines > MOST_LINES_A_MODULE}
    assert not over, f"modules over {MOST_LINES_A_MODULE} lines: {over}"
