"""`python -m ddplab course` (make course) executes notebooks into build/; `--strip` (make strip,
and the pre-commit hook) brings a notebook with outputs back to its committed form."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from ddplab.workspace import NOTEBOOK_GLOB

ROOT = Path(__file__).resolve().parent.parent
REAL = sorted((ROOT / "notebooks").glob(NOTEBOOK_GLOB))[0]   # committed, stripped


def ddplab_course(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "ddplab", "course", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)  # a safety net


def tiny_notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python",
                                  "name": "python3"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json.loads(nbformat.writes(nb)), indent=1) + "\n")  # as stripped
    return path


def with_outputs(path: Path) -> None:
    """What Jupyter leaves in a notebook after a run: outputs, counts, timings, widget state."""
    nb = json.loads(path.read_text())
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb["metadata"]["language_info"] = {"name": "python", "version": "3.11.9",
                                       "mimetype": "text/x-python"}
    count = 0
    for cell in nb["cells"]:
        cell["metadata"]["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00.000Z"}
        if cell["cell_type"] == "code":
            count += 1
            cell["execution_count"] = count
            cell["outputs"] = [
                {"output_type": "stream", "name": "stdout", "text": ["rank 0: loss 0.1\n"]},
                {"output_type": "execute_result", "execution_count": count, "metadata": {},
                 "data": {"text/plain": ["42"]}},
                {"output_type": "display_data", "metadata": {},
                 "data": {"image/png": "iVBORw0KGgo=", "text/plain": ["<Figure>"]}}]
    path.write_text(json.dumps(nb, indent=1))


def test_make_course_executes_every_notebook_into_build(tmp_path):
    """In a course folder, no arguments: each notebook runs in a fresh kernel in notebooks/."""
    course = tmp_path / "course"
    (course / "exercises").mkdir(parents=True)
    (course / "notebooks" / "numbers.txt").parent.mkdir()
    (course / "notebooks" / "numbers.txt").write_text("6 7\n")
    tiny_notebook(course / "notebooks" / "00_tiny.ipynb",
                  "import ddplab\na, b = map(int, open('numbers.txt').read().split())",
                  "print('product', a * b)")
    second_source = tiny_notebook(course / "notebooks" / "01_second.ipynb",
                                  "print('second', 'a' in dir())", "6 * 7")
    done = ddplab_course(cwd=course)
    assert done.returncode == 0, done.stderr
    built = course / "build" / "notebooks"
    assert sorted(p.name for p in built.iterdir()) == ["00_tiny.ipynb", "01_second.ipynb"]
    first = nbformat.read(built / "00_tiny.ipynb", as_version=4)
    assert [c.execution_count for c in first.cells] == [1, 2]
    assert first.cells[1].outputs[0]["text"] == "product 42\n"
    second = nbformat.read(built / "01_second.ipynb", as_version=4)
    assert second.cells[0].outputs[0]["text"] == "second False\n"   # a fresh kernel each
    assert second.cells[1].outputs[0]["data"]["text/plain"] == "42"
    assert "00_tiny.ipynb" in done.stdout and str(built / "01_second.ipynb") in done.stdout
    assert json.loads((course / "notebooks" / "00_tiny.ipynb").read_text())["cells"][1][
        "outputs"] == []                                              # the source is untouched
    # The outputs of a real execution (nbclient's, not made up) strip back to the source.
    assert ddplab_course("--strip", str(built / "01_second.ipynb"), cwd=course).returncode == 0
    assert (built / "01_second.ipynb").read_text() == second_source.read_text()


def test_a_failing_cell_fails_the_build(tmp_path):
    notebook = tiny_notebook(tmp_path / "nb" / "00_broken.ipynb", "raise ValueError('cell 1')")
    done = ddplab_course(str(notebook), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode != 0 and "cell 1" in done.stderr
    assert not (tmp_path / "out" / "00_broken.ipynb").exists()


def test_strip_brings_an_executed_notebook_back_to_what_is_committed(tmp_path):
    """A real notebook of the course with a run's outputs: stripped, it is byte for byte the
    committed file; stripping again changes nothing."""
    copy = tmp_path / REAL.name
    shutil.copy(REAL, copy)
    with_outputs(copy)
    assert copy.read_text() != REAL.read_text()
    done = ddplab_course("--strip", str(copy), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"stripped {copy}"
    assert copy.read_text() == REAL.read_text()
    again = ddplab_course("--strip", str(copy), cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == ""


def test_the_pre_commit_hook_strips_a_notebook_with_outputs(tmp_path):
    """The hook's own entry and file pattern, from .pre-commit-config.yaml, on a real notebook."""
    (hook,) = [h for repo in yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
               ["repos"] for h in repo["hooks"] if h["id"] == "strip-notebooks"]
    relative = f"notebooks/{REAL.name}"
    assert re.search(hook["files"], relative)
    assert not re.search(hook["files"], "exercises/checkpoint.py")
    (tmp_path / "notebooks").mkdir()
    shutil.copy(REAL, tmp_path / relative)
    with_outputs(tmp_path / relative)
    entry = shlex.split(hook["entry"])
    assert entry[:3] == ["python", "-m", "ddplab"]      # run here with this interpreter
    done = ddplab_course(*entry[4:], relative, cwd=tmp_path) if entry[3] == "course" else None
    assert done is not None, f"the hook no longer runs `ddplab course`: {hook['entry']}"
    assert done.returncode == 0, done.stderr
    assert (tmp_path / relative).read_text() == REAL.read_text()
