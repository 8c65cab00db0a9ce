"""Every exercise launch in a notebook ends a hang within a minute, and its cell says how long it
takes and what to do on a hang; every coding exercise has a judge and a reference solution."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from ddplab.lab import judges

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def cells(path: Path) -> list[tuple[str, str]]:
    found = []
    for cell in json.loads(path.read_text())["cells"]:
        source = cell["source"]
        found.append((cell["cell_type"], "".join(source) if isinstance(source, list) else source))
    return found


def exercise_launches() -> list[tuple[str, int, str, str]]:
    """(notebook, cell index, the launching code, the markdown just before it)."""
    found = []
    for path in NOTEBOOKS:
        notebook = cells(path)
        for i, (kind, text) in enumerate(notebook):
            if kind == "code" and re.search(r"launch\(\s*\"\.\./exercises/", text):
                before = next(t for k, t in reversed(notebook[:i]) if k == "markdown")
                found.append((path.stem, i, text, before))
    return found


def launch_timeout(code: str) -> float:
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "launch":
            for keyword in node.keywords:
                if keyword.arg == "timeout":
                    return float(ast.literal_eval(keyword.value))
    return float("inf")


LAUNCHES = exercise_launches()


def test_every_coding_exercise_is_launched_from_a_notebook():
    launched = {re.search(r"exercises/(\w+\.py)", code).group(1) for _, _, code, _ in LAUNCHES}
    assert launched == {exercise.skeleton for exercise in judges.load_all().values()}
    for exercise in judges.load_all().values():
        assert (ROOT / "tests" / "solutions" / exercise.skeleton).is_file()


@pytest.mark.parametrize("notebook, index, code, before", LAUNCHES,
                         ids=[f"{n}-{i}" for n, i, _, _ in LAUNCHES])
def test_an_exercise_launch_ends_a_hang_and_says_what_to_expect(notebook, index, code, before):
    where = f"{notebook}, the cell before cell {index}"
    assert launch_timeout(code) <= 60, f"{notebook} cell {index}: give the launch timeout=60"
    assert re.search(r"about\s+\d+\s+s\b", before), f"{where}: say how long it takes"
    assert "interrupt the kernel" in before, f"{where}: say what to do on a hang"
