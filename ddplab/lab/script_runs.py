"""A script the learner runs in a terminal: read what its run wrote, or run it from here.

``output_of_a_run(script, output)`` returns the text of ``output`` when a run of the *current*
``script`` wrote it (the file is newer than the script); otherwise it launches ``script`` with
``ddplab.launch`` and reads the file that run wrote. A run that does not finish raises
``RuntimeError`` after printing the line of ``script`` each rank was at when it ended.

Example::

    seen = json.loads(output_of_a_run(RUN_DIR / "whoami.py", RUN_DIR / "seen.json"))

Lesson: 07.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Union

PathLike = Union[str, Path]


def written_since(output: PathLike, script: PathLike) -> bool:
    """True when ``output`` exists and was written no earlier than ``script`` last changed."""
    output, script = Path(output), Path(script)
    return output.exists() and output.stat().st_mtime >= script.stat().st_mtime


def lines_reached(result: Any, script: PathLike) -> dict[int, str]:
    """Rank -> the line of ``script`` (``"12: dist.barrier()"``) its stack dump was at."""
    script = Path(script)
    lines = script.read_text().splitlines()
    reached = {}
    for rank, stack in sorted(getattr(result, "stacks", {}).items()):
        found = re.findall(rf"{re.escape(script.name)}\", line (\d+)", str(stack))
        if found:   # a dump lists the innermost frame first ("most recent call first")
            number = int(found[0])
            reached[rank] = f"{number}: {lines[number - 1].strip()}"
    return reached


def output_of_a_run(script: PathLike, output: PathLike, nprocs: int = 2,
                    timeout: float = 30.0) -> str:
    """The text a run of the current ``script`` wrote to ``output``; launched here if needed."""
    script, output = Path(script), Path(output)
    if not written_since(output, script):
        import ddplab

        print(f"no {output.name} from a run of this {script.name}: launching it from here")
        output.unlink(missing_ok=True)
        run = ddplab.launch(script, nprocs, timeout=timeout, quiet=True)
        if not run.ok:
            for rank, line in lines_reached(run, script).items():
                print(f"rank {rank} was at line {line}")
            raise RuntimeError(f"{script.name} did not finish ({run.status}): restore it, run "
                               "the cell that writes it again, then this one")
    return output.read_text()
