"""Every exercise launch in a notebook ends a hang within a minute (on digits), and its cell says
how long it takes (what to do on a hang is said once, in the README); every coding exercise has
a judge and a reference solution."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from ddplab.lab import judges
from ddplab.workspace import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))


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


def workload_names(notebook: str, workload: str = "digits") -> dict[str, object]:
    """The notebook's names set per workload (``NAME = {"digits": ..., ...}[WORKLOAD]``), as
    they are under ``workload``."""
    names: dict[str, object] = {}
    for kind, text in cells(ROOT / "notebooks" / f"{notebook}.ipynb"):
        for node in ast.parse(text).body if kind == "code" else ():
            value = getattr(node, "value", None)
            if isinstance(node, ast.Assign) and isinstance(value, ast.Subscript) and \
                    isinstance(value.value, ast.Dict) and getattr(value.slice, "id", "") == \
                    "WORKLOAD":
                try:
                    table = ast.literal_eval(value.value)
                except ValueError:   # not a table of plain values: not a launch's timeout
                    continue
                names.update({target.id: table[workload] for target in node.targets})
    return names


def launch_timeout(code: str, notebook: str, workload: str = "digits") -> float:
    """The launch's ``timeout=``: a number, or a name the notebook sets per workload."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "launch":
            for keyword in node.keywords:
                if keyword.arg == "timeout":
                    if isinstance(keyword.value, ast.Name):
                        return float(workload_names(notebook, workload)[keyword.value.id])
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
    assert launch_timeout(code, notebook) <= 60, (
        f"{notebook} cell {index}: on digits, give the launch a timeout of at most 60 s")
    assert re.search(r"about\s+\d+\s+s\b", before), f"{where}: say how long it takes"


def test_what_to_do_on_a_hang_is_said_once_for_every_exercise():
    """The README says it (the timeout, the judge's account of the hang, the stop button); the
    exercise cells of 05 and 13 do not repeat it."""
    readme = (ROOT / "README.md").read_text()
    assert "60 s timeout ends a deadlock" in readme and "interrupt the kernel" in readme
    for notebook, _, _, before in LAUNCHES:
        if notebook.startswith(("05", "13")):
            assert "interrupt the kernel" not in before, notebook


def test_on_cifar10_an_exercise_launch_lasts_as_long_as_the_notebooks_runs():
    """Where a notebook sets a per-workload ``TIMEOUT`` for its runs (13), the exercise's launch
    follows the workload too: a CIFAR-10 run on GPUs is not cut after a minute and called a
    hang, while digits keeps its minute (above)."""
    checked = 0
    for notebook, _, code, _ in LAUNCHES:
        names = workload_names(notebook, "cifar10")
        if "TIMEOUT" in names:
            assert launch_timeout(code, notebook, "cifar10") >= names["TIMEOUT"], notebook
            checked += 1
    assert checked >= 1


# What the notebooks' launch arguments name, as on a CPU machine running the digits workload;
# the group timeout of a run that ends by itself is a safety net here (it takes no part in its
# duration, and the notebook's 3 s would fail a right run on a busy machine).
NOTEBOOK_NAMES = {"NPROCS": 2, "BACKEND": None, "DATA": ["--dataset", "digits"],
                  "PG_TIMEOUT": ["--pg-timeout", "120"]}
FACTOR = 8   # "about N s" is a learner's order of magnitude: wrong when 8 times off, or more


def launch_args(code: str, work: Path) -> list:
    """The ``args=`` of the exercise's launch, its notebook names given their CPU values."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "launch":
            for keyword in node.keywords:
                if keyword.arg == "args":
                    names = {**NOTEBOOK_NAMES, "WORK": work}
                    return eval(compile(ast.Expression(keyword.value), "<cell>", "eval"),
                                {"__builtins__": {}}, names)
    return []


@pytest.mark.slow
@pytest.mark.parametrize("notebook, index, code, before", LAUNCHES,
                         ids=[f"{n}-{i}" for n, i, _, _ in LAUNCHES])
def test_the_stated_duration_is_that_of_a_measured_run(notebook, index, code, before,
                                                       shared_run):
    """The reference solution, launched as the cell launches the learner's, runs no longer than
    FACTOR times what the cell states (a cell that says "about 5 s" for a minute's run misleads).
    This machine's load only slows a run, so the bound grows with it (load average per core).
    No lower bound: the stated time counts a kernel's first launch (the launcher's helper starts,
    seconds), and a launch after it can take a fraction of a second."""
    import os

    claimed = float(re.search(r"about\s+(\d+)\s+s\b", before).group(1))
    solution = ROOT / "tests" / "solutions" / re.search(r"exercises/(\w+\.py)", code).group(1)
    result, load = shared_run(solution, NOTEBOOK_NAMES["NPROCS"],   # "{tmp}": a fresh folder
                              args=launch_args(code, Path("{tmp}")), timeout=900,
                              with_load=True)   # the load when it ran, maybe for another test
    assert result.ok, result.error
    busy = max(1.0, load / (os.cpu_count() or 1))
    assert result.wall_time <= claimed * FACTOR * busy, (
        f"{notebook} cell {index} says about {claimed:.0f} s; the reference ran "
        f"{result.wall_time:.1f} s here (load {busy:.1f} per core)")
