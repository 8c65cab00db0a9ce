"""The course as a learner meets it: JupyterLab in headless Chromium, Run All, look at the page.

For notebooks 01 and 03 (copies; the committed files are never touched) the test clicks
Run > Run All Cells and waits on JupyterLab's own state (kernel status, cell prompts), then
checks what a learner would see: every cell ran with no error; a training launch rendered a
live progress widget (not the text fallback) and a plot image; worker output stayed in the
cell that launched it, prefixed by rank; no worker process is left once the run is over.
A second test starts a ten-minute launch, clicks the toolbar's stop button, and checks that
the cell reports "interrupted" and the workers' processes are gone.

Run: ``make test-browser`` (sets ``DDPLAB_BROWSER=1``; skipped otherwise). Screenshots go to
``build/browser/``.

Lesson: 01 and 03 in JupyterLab; every lesson's interrupt button.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import nbformat
import pytest

from ddplab.workspace import NOTEBOOK_GLOB
from jlab import HERE, REPO, Lab, pid_alive, wait_for

# DDPLAB_BROWSER_NOTEBOOKS points the test at another folder of notebooks (e.g. drafts).
NOTEBOOKS = Path(os.environ.get("DDPLAB_BROWSER_NOTEBOOKS") or REPO / "notebooks")
COURSE = ("01", "03", "10", "11")
# Ranks whose output a learner must see in one launching cell (01 runs a single process whose
# worker prints only events; the others' workers print per-rank lines).
RANKS_SHOWN = {"01": 0, "03": 2, "10": 2, "11": 1}
# Notebooks whose training launch must show the live progress widget and the loss plot (10 and
# 11 launch faults, collectives and pipelines: no training progress to show).
TRAINING = {"01", "03"}
SLEEPER = HERE / "sleeper.py"
RUN_TIMEOUT = 600  # seconds for Run All of one notebook (about a minute here)
RANK_LINE = re.compile(r"^\[(?:node\d+ )?rank(\d+)\] ", re.M)
# What a progress bar looks like when the widget did not render (text tqdm, or Lab's
# placeholder for a widget it cannot show).
WIDGET_FALLBACK = re.compile(r"\d+%\|.*\|\s*\d+/\d+|Error displaying widget|HBox\(children="
                             r"|IProgress not found|FloatProgress\(value=")

# JupyterLab's own state, read from the app (exposed with --LabApp.expose_app_in_browser).
KERNEL_STATE_JS = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session
                 && panel.sessionContext.session.kernel;
  return kernel ? kernel.connectionStatus + ':' + kernel.status : 'no kernel';
}"""
DIRTY_JS = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  return panel && panel.context ? panel.context.model.dirty : null;
}"""
CELLS_JS = """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-Cell')).map(cell => ({
  code: cell.classList.contains('jp-CodeCell'),
  prompt: (cell.querySelector('.jp-InputArea-prompt') || {textContent: ''}).textContent,
  outputs: Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(out => ({
    mime: out.getAttribute('data-mime-type') || '',
    text: out.innerText,
    progress: Array.from(out.querySelectorAll('.widget-hprogress'))
                   .filter(bar => bar.getBoundingClientRect().width > 0).length,
    images: Array.from(out.querySelectorAll('img'))
                 .map(img => img.complete && img.naturalWidth > 0),
  })),
}))"""
TOOLBAR = ".jp-NotebookPanel-toolbar"


# --------------------------------------------------------------------------- driving the page


def open_notebook(page: Any, lab: Lab, name: str) -> None:
    """Open ``name`` in its own workspace and wait until its kernel is connected and idle."""
    page.goto(lab.notebook_url(name, workspace=Path(name).stem.replace("_", "-")))
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    wait_for(lambda: page.evaluate(KERNEL_STATE_JS) == "connected:idle", 120,
             f"the kernel of {name} to be connected and idle")


def run_all(page: Any) -> None:
    """Click Run > Run All Cells, as a learner does."""
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-item[data-command='runmenu:run-all']")


def cells(page: Any) -> list[dict[str, Any]]:
    """Every cell on the page: code or not, its prompt, and what its outputs show."""
    return page.evaluate(CELLS_JS)


def wait_idle(page: Any, timeout: float) -> list[dict[str, Any]]:
    """Wait until no cell is running or queued and the kernel is idle; return the cells.

    Done means: the kernel reports idle, no prompt shows ``[*]``, and at least one cell has
    run, seen twice in a row (a queued cell can show ``[*]`` while the kernel is still idle).
    """
    seen: list[bool] = []

    def done() -> Any:
        state = page.evaluate(KERNEL_STATE_JS)
        found = cells(page)
        prompts = [c["prompt"] for c in found if c["code"]]
        now = (state == "connected:idle" and not any("*" in p for p in prompts)
               and any(re.search(r"\[\d+\]", p) for p in prompts))
        seen.append(now)
        return found if now and seen[-2:] == [True, True] else None

    return wait_for(done, timeout, "every cell to finish", interval=0.5)


def save(page: Any, path: Path) -> nbformat.NotebookNode:
    """Click the toolbar's save button, wait until Lab says it is saved, read the file."""
    page.click(f"{TOOLBAR} [data-command='docmanager:save']")
    wait_for(lambda: page.evaluate(DIRTY_JS) is False, 60, f"{path.name} to be saved")
    return nbformat.read(path, as_version=4)


def cell_text(cell: dict[str, Any]) -> str:
    return "\n".join(out["text"] for out in cell["outputs"])


def first_line(source: str) -> str:
    return (source.strip().splitlines() or [""])[0][:80]


# --------------------------------------------------------------------------- what is checked


def unfinished_cells(found: list[dict[str, Any]], saved: nbformat.NotebookNode) -> list[str]:
    """Code cells whose prompt does not show an execution count (they never ran). A collapsed
    proof cell (its source hidden) has no prompt on the page: Lab's saved file says whether it
    ran."""
    def ran(i: int, cell: dict[str, Any]) -> bool:
        if saved.cells[i].metadata.get("jupyter", {}).get("source_hidden"):
            return saved.cells[i].get("execution_count") is not None
        return bool(re.search(r"\[\d+\]", cell["prompt"]))

    return [f"cell {i} {c['prompt']} {first_line(saved.cells[i].source)}"
            for i, c in enumerate(found) if c["code"] and not ran(i, c)]


def error_outputs(saved: nbformat.NotebookNode) -> list[str]:
    """Error outputs in the saved notebook (what the kernel reported, as Lab stored it)."""
    return [f"cell {i} {first_line(cell.source)}: {out.get('ename')}: {out.get('evalue')}"
            for i, cell in enumerate(saved.cells) if cell.cell_type == "code"
            for out in cell.get("outputs", []) if out.get("output_type") == "error"]


def training_cells(found: list[dict[str, Any]]) -> list[int]:
    """Cells that show a rendered progress widget and a loaded plot image."""
    return [i for i, c in enumerate(found)
            if any(out["progress"] for out in c["outputs"])
            and any(all(out["images"]) and out["images"] for out in c["outputs"])]


def fallbacks(found: list[dict[str, Any]]) -> list[str]:
    """Outputs that show a progress bar as text: the widget did not render."""
    return [f"cell {i}: {m.group(0)!r}" for i, c in enumerate(found)
            for out in c["outputs"] for m in [WIDGET_FALLBACK.search(out["text"])] if m]


def misplaced_rank_lines(found: list[dict[str, Any]], saved: nbformat.NotebookNode
                         ) -> list[str]:
    """Rank-prefixed lines shown in a cell that launched nothing (output that leaked)."""
    return [f"cell {i} {first_line(saved.cells[i].source)}: {rank_lines(cell_text(c))[:3]}"
            for i, c in enumerate(found)
            if rank_lines(cell_text(c)) and "launch" not in saved.cells[i].source]


def rank_lines(text: str) -> list[str]:
    """Lines of worker output: ``[rank1] ...`` (or ``[node1 rank1] ...``)."""
    return [line for line in text.splitlines() if RANK_LINE.match(line)]


def most_ranks_in_one_cell(found: list[dict[str, Any]]) -> int:
    """The largest number of distinct ranks whose output shows in a single cell."""
    return max([len({RANK_LINE.match(line).group(1) for line in rank_lines(cell_text(c))})
                for c in found] + [0])


def slowest_cells(saved: nbformat.NotebookNode, count: int = 3) -> str:
    """The slowest cells and their run time, from the timing Lab recorded in the metadata."""
    timed = []
    for i, cell in enumerate(saved.cells):
        stamps = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in stamps and "shell.execute_reply" in stamps:
            begin, end = (datetime.fromisoformat(stamps[k].replace("Z", "+00:00"))
                          for k in ("iopub.execute_input", "shell.execute_reply"))
            timed.append(((end - begin).total_seconds(), i, first_line(cell.source)))
    return "; ".join(f"cell {i} {s:.1f} s ({line})" for s, i, line in sorted(timed)[-count:])


def describe(procs: list[Any]) -> list[str]:
    return [f"{p.pid} (parent {p.ppid}): {p.cmd}" for p in procs]


def report(name: str, problems: dict[str, list[str]]) -> None:
    """Fail with every problem found (not only the first), grouped by what was checked."""
    found = {what: items for what, items in problems.items() if items}
    if found:
        pytest.fail(f"{name}:\n" + "\n".join(
            f"- {what}:\n    " + "\n    ".join(map(str, items)) for what, items in found.items()),
            pytrace=False)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def course(lab: Lab) -> dict[str, str]:
    """Copy the course notebooks (and any file beside them) into the Lab's folder, and the
    coding exercises beside that folder, as in the repository (notebooks launch
    ``../exercises/NAME.py``).

    Returns:
        Notebook number -> file name, for the notebooks that exist.
    """
    shutil.copytree(NOTEBOOKS, lab.root, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    shutil.copytree(REPO / "exercises", lab.root.parent / "exercises", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return {path.name.split("_")[0]: path.name for path in sorted(lab.root.glob(NOTEBOOK_GLOB))}


def write_notebook(path: Path, sources: list[str]) -> None:
    """Write a scratch notebook with one code cell per source."""
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    book.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}}
    nbformat.write(book, path)


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(RUN_TIMEOUT + 300)
@pytest.mark.parametrize("number", COURSE)
def test_notebook_runs_in_jupyterlab(number: str, lab: Lab, course: dict[str, str], page: Any,
                                     shots: Path) -> None:
    """Run All in JupyterLab: no error, widget + plot, rank output in place, nothing left."""
    assert number in course, f"notebooks/{number}_*.ipynb does not exist (found: {sorted(course)})"
    name = course[number]
    open_notebook(page, lab, name)
    started = time.monotonic()
    run_all(page)
    found = wait_idle(page, RUN_TIMEOUT)
    run_time = time.monotonic() - started
    left = lab.leftovers()  # right away: a launch must clean up before its cell returns
    saved = save(page, lab.root / name)
    stem = Path(name).stem
    page.screenshot(path=str(shots / f"{stem}.png"))
    try:  # widgets and images render just after their output arrives: give them a moment
        trained = wait_for(lambda: training_cells(cells(page)), 10, "a widget and a plot")
    except AssertionError:
        trained = []
    if trained:
        page.locator(".jp-Notebook .jp-Cell").nth(trained[0]).screenshot(
            path=str(shots / f"{stem}_training.png"))
    print(f"\n{name}: Run All took {run_time:.0f} s in JupyterLab; training cells {trained}; "
          f"slowest: {slowest_cells(saved)}")

    assert len(found) == len(saved.cells), "the page and the saved file disagree on the cells"
    report(name, {
        "cells that did not run (an earlier cell failed or Run All stopped)":
            unfinished_cells(found, saved),
        "cells with an error": error_outputs(saved),
        "no cell shows both a rendered progress widget and a plot image":
            [] if trained or number not in TRAINING else ["(none found)"],
        "progress shown as text, not as a widget": fallbacks(found),
        "worker output in a cell that launched nothing": misplaced_rank_lines(found, saved),
        f"no cell shows the output of {RANKS_SHOWN[number]} ranks":
            [] if most_ranks_in_one_cell(found) >= RANKS_SHOWN[number] else
            [f"at most {most_ranks_in_one_cell(found)} in one cell"],
        "processes left after Run All": describe(left),
        "JavaScript errors in the page": page.js_errors,
    })


@pytest.mark.timeout(300)
def test_stop_button_interrupts_a_launch(lab: Lab, page: Any, shots: Path) -> None:
    """A long launch shows live rank output, progress and plot in its cell; the toolbar's stop
    button ends it, the cell says so and stops with KeyboardInterrupt (so Run All stops there,
    as at any interrupted cell), and no worker pid survives."""
    name = "interrupt_scratch.ipynb"
    write_notebook(lab.root / name, [
        f"import ddplab\nr = ddplab.launch({str(SLEEPER)!r}, 2)\nr.status"])
    open_notebook(page, lab, name)
    run_all(page)

    def both_ranks_started() -> dict[int, int]:
        text = cell_text(cells(page)[0])
        pids = {int(r): int(p) for r, p in re.findall(r"^\[rank(\d+)\] pid=(\d+)", text, re.M)}
        return pids if len(pids) == 2 else {}

    pids = wait_for(both_ranks_started, 120, "both ranks' pid lines in the launching cell")
    assert all(pid_alive(pid) for pid in pids.values()), f"workers not running: {pids}"
    # Live: the widget and the loss plot show while the job is still running.
    live = wait_for(lambda: training_cells(cells(page)), 30, "a live progress widget and plot")
    assert live == [0], f"the live widget and plot are in cells {live}, not in the launching one"
    assert "*" in cells(page)[0]["prompt"], "the launch ended before the stop button was pressed"
    try:  # the worker's last progress event says 23 of 40 steps (see sleeper.py)
        wait_for(lambda: "23/40" in cell_text(cells(page)[0]), 5, "the bar to show 23/40")
    except AssertionError:
        print("NOTE: the progress widget does not show the last progress event while the job "
              "runs (tqdm's mininterval held it back, and nothing refreshes the bar later)")
    page.screenshot(path=str(shots / "interrupt_running.png"))

    clicked = time.monotonic()
    page.click(f"{TOOLBAR} [data-command='notebook:interrupt-kernel']")
    found = wait_idle(page, 120)
    stop_time = time.monotonic() - clicked
    survivors = [pid for pid in pids.values() if pid_alive(pid)]
    left = lab.leftovers()
    page.screenshot(path=str(shots / "interrupt_done.png"))
    text = cell_text(found[0])
    print(f"interrupt: the cell finished {stop_time:.1f} s after the click; pids {pids}")

    assert re.search(r"\[\d+\]", found[0]["prompt"]), "the launching cell did not finish"
    assert "every process of the job was ended" in text, f"the cell does not say so:\n{text}"
    assert "KeyboardInterrupt" in text, f"the interrupt was swallowed, Run All would go on:\n{text}"
    assert not survivors, f"worker pids still alive after the interrupt: {survivors}"
    assert not left, "processes left after the interrupt:\n" + "\n".join(describe(left))
    assert stop_time < 60, f"the interrupt took {stop_time:.0f} s to end the launch"
    assert not page.js_errors, f"JavaScript errors in the page: {page.js_errors}"
