"""No warning comes from the course's own exercise code: every skeleton in ``exercises/`` and
every reference solution in ``tests/solutions/`` runs on 2 ranks under ``ddplab.launch`` with
``PYTHONWARNINGS=error::Warning:__main__``, so a warning raised by a line of the exercise file
(the workers run it as ``__main__``) becomes an exception. Warnings of other modules (torch's own
deprecations, third-party packages) are left alone: the filter names the exercise's module only.
These are the shared runs of ``tests/conftest.py`` (``shared_run``, under that filter), which the
other exercise tests judge and time.

A skeleton may end in an error of its own (an empty function, a hang cut by its process-group
timeout): that is the exercise, not a warning. The test fails only on a warning raised as an
exception, or printed, from the exercise file.

Seen in JupyterLab before: ``exercises/accumulate.py`` converted a tensor that requires grad to a
float in its fixed part, and every rank printed torch's UserWarning in red.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_exercise_cells import LAUNCHES, launch_args

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SKELETONS = ROOT / "exercises"
SOLUTIONS = ROOT / "tests" / "solutions"
# Arguments a launch needs (as the notebooks give them); {tmp} is a fresh folder per run.
ARGS = {"uneven_join.py": ["--pg-timeout", "3"], "checkpoint.py": ["--checkpoint-dir", "{tmp}"],
        "capstone.py": ["--checkpoint-dir", "{tmp}", "--epochs", "1"],
        "fsdp2.py": ["--save", "{tmp}/dcp"]}
# A solution runs as test_exercise_cells launches it (the cell's arguments, a group timeout that
# is a safety net): one run serves both tests.
SOLUTION_ARGS = {re.search(r"exercises/(\w+\.py)", code).group(1):
                 launch_args(code, Path("{tmp}")) for _, _, code, _ in LAUNCHES}
FILES = sorted(SKELETONS.glob("*.py"))
RAISED = re.compile(r"^(?:\[[^\]]*\]:?)?\s*(\w*Warning): ", re.M)  # an uncaught warning, as raised


def run(shared_run, path: Path, args=()) -> tuple[int, str]:
    """The file's launch on 2 ranks under the filter; its return code and output."""
    result = shared_run(path, 2, args=args)
    text = "\n".join(line for lines in result.logs.values() for line in lines)
    return result.returncode, text + "\n" + result.error


def test_every_skeleton_has_a_reference_solution():
    assert FILES and all((SOLUTIONS / p.name).is_file() for p in FILES)


@pytest.mark.parametrize("folder", ["exercises", "solutions"])
@pytest.mark.parametrize("name", [p.name for p in FILES])
def test_no_warning_comes_from_the_exercise_file(shared_run, folder, name):
    path = (SKELETONS if folder == "exercises" else SOLUTIONS) / name
    args = ARGS.get(name, [])
    code, text = run(shared_run, path, SOLUTION_ARGS.get(name, args) if folder == "solutions"
                     else args)
    raised = RAISED.findall(text)
    printed = re.findall(rf"{re.escape(str(path))}:\d+: (\w*Warning)", text)
    assert not raised and not printed, f"{folder}/{name} (exit {code}):\n{text[-3000:]}"
    if folder == "solutions":
        assert code == 0, f"the reference solution failed (exit {code}):\n{text[-3000:]}"


def test_the_filter_turns_a_warning_of_the_file_into_an_error(tmp_path, shared_run):
    noisy = tmp_path / "noisy.py"
    noisy.write_text("import torch\n"
                     "x = torch.ones(1, requires_grad=True)\n"
                     "print(float(x * 2))\n")
    code, text = run(shared_run, noisy)
    assert code != 0 and RAISED.search(text), text[-2000:]
