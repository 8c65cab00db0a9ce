"""Every example in ddplab.dist's and ddplab.checkpoint's docstrings runs as written.

These two modules are the ones learners copy into their own scripts, so each ``::`` block of
their docstrings (module, functions, classes) is a whole script: it is written to a file and run
on 2 ranks by ``ddplab.launch`` (torchrun's engine, its ranks forked from a process that has
already imported torch) in an empty folder. Each path runs once: every example on 2 ranks, and
the two module examples (which use every helper a plain script needs) also as a cold plain
``python``, a world of one. The examples assert what they claim, so running them checks them.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = [ROOT / "ddplab" / "dist.py", ROOT / "ddplab" / "checkpoint.py"]


def literal_blocks(docstring: str) -> list[str]:
    """The ``::`` literal blocks of a reST docstring, dedented."""
    lines = docstring.expandtabs().splitlines()
    blocks = []
    for index, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for follow in lines[index + 1:]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                break
            body.append(follow)
        text = textwrap.dedent("\n".join(body)).strip("\n")
        if text:
            blocks.append(text + "\n")
    return blocks


def examples() -> list[tuple[str, str]]:
    """``(module.name, script)`` for every example of the two modules."""
    found = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(
            n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)))]
        for node in nodes:
            doc = ast.get_docstring(node) or ""
            name = getattr(node, "name", "<module>")
            for number, block in enumerate(literal_blocks(doc)):
                found.append((f"{path.stem}.{name}#{number}", block))
    return found


EXAMPLES = examples()


def test_every_public_function_with_an_example_is_collected():
    names = {name.split("#")[0] for name, _ in EXAMPLES}
    assert {"dist.<module>", "dist.setup", "dist.pick_backend", "checkpoint.<module>",
            "checkpoint.strip_module_prefix"} <= names
    assert not any(">>>" in script for _, script in EXAMPLES), "examples are scripts, not doctests"


def _run_plain(script: str, folder: Path) -> tuple[int, str]:
    """Run ``script`` as a plain ``python example.py`` in ``folder``: (exit code, output)."""
    folder.mkdir()
    (folder / "example.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "LOCAL_WORLD_SIZE", "DDPLAB_BACKEND"):
        env.pop(name, None)
    run = subprocess.Popen([sys.executable, "example.py"], cwd=folder, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out, _ = run.communicate(timeout=240)  # a safety net: a run takes seconds
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    return run.returncode, out


def _run_ranks(script: str, folder: Path, nprocs: int) -> tuple[bool, str]:
    """Run ``script`` on ``nprocs`` ranks with torchrun's engine in ``folder``: (ok, output)."""
    import ddplab

    folder.mkdir()
    (folder / "example.py").write_text(script)
    result = ddplab.launch(str(folder / "example.py"), nprocs, cwd=str(folder), quiet=True,
                           live=False, timeout=240)  # a safety net: a run takes seconds
    logs = "\n".join(f"[{who}] {line}" for who, lines in result.logs.items() for line in lines)
    return result.ok, f"{result.status} {result.exit_codes}\n{logs}"


RUNS = [(name, script, 2) for name, script in EXAMPLES] + [
    (name, script, 1) for name, script in EXAMPLES if name.endswith(".<module>#0")]


def test_both_module_examples_also_run_as_plain_python():
    assert sorted(name for name, _, nprocs in RUNS if nprocs == 1) == [
        "checkpoint.<module>#0", "dist.<module>#0"]


@pytest.mark.slow
@pytest.mark.parametrize("name,script,nprocs", RUNS,
                         ids=[f"{name}-{nprocs}" for name, _, nprocs in RUNS])
def test_example_runs_as_written(name, script, nprocs, tmp_path):
    folder = tmp_path / f"nprocs{nprocs}"
    if nprocs == 1:
        code, out = _run_plain(script, folder)
        ok = code == 0
    else:
        ok, out = _run_ranks(script, folder, nprocs)
    assert ok, f"{name} failed on {nprocs} process(es):\n{script}\n{out[-5000:]}"
