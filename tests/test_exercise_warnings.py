"""No warning comes from the course's own exercise code: every skeleton in ``exercises/`` and
every reference solution in ``tests/solutions/`` runs on 2 gloo ranks under ``ddplab.launch`` with
``PYTHONWARNINGS=error::Warning:__main__``, so a warning raised by a line of the exercise file
(the workers run it as ``__main__``) becomes an exception. Warnings of other modules (torch's own
deprecations, third-party packages) are left alone: the filter names the exercise's module only.

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

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SKELETONS = ROOT / "exercises"
SOLUTIONS = ROOT / "tests" / "solutions"
# Arguments a launch needs (as the notebooks give them); {tmp} is a fresh folder per run.
ARGS = {"uneven_join.py": ["--pg-timeout", "3"], "checkpoint.py": ["--checkpoint-dir", "{tmp}"],
        "capstone.py": ["--checkpoint-dir", "{tmp}", "--epochs", "1"],
        "fsdp2.py": ["--save", "{tmp}/dcp"]}
FILES = sorted(SKELETONS.glob("*.py"))
RAISED = re.compile(r"^(?:\[[^\]]*\]:?)?\s*(\w*Warning): ", re.M)  # an uncaught warning, as raised


def run(path: Path, tmp: Path) -> tuple[int, str]:
    """Launch the file on 2 gloo ranks as a notebook does; its return code and output."""
    import ddplab

    tmp.mkdir(parents=True)
    args = [a.replace("{tmp}", str(tmp)) for a in ARGS.get(path.name, [])]
    result = ddplab.launch(str(path), 2, args=args, cwd=str(tmp), backend="gloo", quiet=True,
                           live=False, env={"PYTHONWARNINGS": "error::Warning:__main__"},
                           timeout=240)  # a safety net: one launch takes 1 to 45 s
    text = "\n".join(line for lines in result.logs.values() for line in lines)
    return result.returncode, text + "\n" + result.error


def test_every_skeleton_has_a_reference_solution():
    assert FILES and all((SOLUTIONS / p.name).is_file() for p in FILES)


@pytest.mark.parametrize("folder", ["exercises", "solutions"])
@pytest.mark.parametrize("name", [p.name for p in FILES])
def test_no_warning_comes_from_the_exercise_file(tmp_path, folder, name):
    path = (SKELETONS if folder == "exercises" else SOLUTIONS) / name
    code, text = run(path, tmp_path / "run")
    raised = RAISED.findall(text)
    printed = re.findall(rf"{re.escape(str(path))}:\d+: (\w*Warning)", text)
    assert not raised and not printed, f"{folder}/{name} (exit {code}):\n{text[-3000:]}"
    if folder == "solutions":
        assert code == 0, f"the reference solution failed (exit {code}):\n{text[-3000:]}"


def test_the_filter_turns_a_warning_of_the_file_into_an_error(tmp_path):
    noisy = tmp_path / "noisy.py"
    noisy.write_text("import torch\n"
                     "x = torch.ones(1, requires_grad=True)\n"
                     "print(float(x * 2))\n")
    code, text = run(noisy, tmp_path / "run")
    assert code != 0 and RAISED.search(text), text[-2000:]
