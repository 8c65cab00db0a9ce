"""Every exercise launch in a notebook ends a hang within a minute (on digits), and its cell says
how long it takes and when a hang ends; what to do on a hang is said once, in the README's
section that every exercise cell points to. Every coding exercise has a judge and a reference
solution."""

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
HANGS = "If a run hangs"   # the README's section on hangs, named by every exercise cell


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
        # a cell magic (%%writefile) is not Python
        python = kind == "code" and not text.startswith("%%")
        for node in ast.parse(text).body if python else ():
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


def launch_keyword(code: str, name: str) -> ast.expr | None:
    """The value of keyword ``name`` in the first of the cell's ``launch(...)`` calls that pass
    it, if one does."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "launch":
            for keyword in node.keywords:
                if keyword.arg == name:
                    return keyword.value
    return None


def launch_timeout(code: str, notebook: str, workload: str = "digits") -> float:
    """The launch's ``timeout=``: a number, or a name the notebook sets per workload."""
    value = launch_keyword(code, "timeout")
    if value is None:
        return float("inf")
    if isinstance(value, ast.Name):
        return float(workload_names(notebook, workload)[value.id])
    return float(ast.literal_eval(value))


def says_when_a_hang_ends(text: str, code: str, notebook: str) -> bool:
    """The cell names the launch's timeout (``FIRST_TIMEOUT``), or says that a hang ends (times
    out, fails) after N s, N at most the launch's timeout: a process-group timeout ends it
    sooner."""
    value = launch_keyword(code, "timeout")
    if isinstance(value, ast.Name):
        return f"`{value.id}`" in text
    stated = re.findall(r"\bafter\b[^.;()]{0,30}?\b(\d+) s\b", " ".join(text.split()))
    return any(float(seconds) <= launch_timeout(code, notebook) for seconds in stated)


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
    assert says_when_a_hang_ends(before, code, notebook), (
        f"{where}: say when a hang ends (\"a hang ends after 60 s\", or the timeout's name)")
    assert f"README's \"{HANGS}\"" in " ".join(before.split()), (
        f"{where}: point to the README's \"{HANGS}\" for what to do on a hang")
    assert "interrupt the kernel" not in before, (
        f"{where}: what to do on a hang is said once, in the README's \"{HANGS}\"")


def readme_section(title: str) -> str:
    """The text under the README's heading ``title``, up to the next heading."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", readme, re.M | re.S)
    assert found, f"README.md has no section \"{title}\""
    return " ".join(found.group(1).split())


def test_the_readme_says_once_what_to_do_on_a_hang():
    """The section every exercise cell points to: the exercises' timeout, what the judge then
    says, and how to stop a launch sooner."""
    section = readme_section(HANGS)
    longest = max(launch_timeout(code, notebook) for notebook, _, code, _ in LAUNCHES)
    assert f"{longest:.0f} s" in section, f"the README's \"{HANGS}\" gives the timeout"
    assert "where each rank waited" in section
    assert "interrupt the kernel" in section and "every rank goes with it" in section


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
    value = launch_keyword(code, "args")
    if value is None:
        return []
    names = {**NOTEBOOK_NAMES, "WORK": work}
    return eval(compile(ast.Expression(value), "<cell>", "eval"), {"__builtins__": {}}, names)


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
