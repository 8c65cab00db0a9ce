"""A script the learner runs in a terminal: read what its run wrote, or run it from here.

``output_of_a_run(script, output)`` returns the text of ``output`` when a run of the *current*
``script`` wrote it (the file is newer than the script); otherwise it launches ``script`` with
``ddplab.launch`` and reads the file that run wrote. A run that does not finish raises
``RuntimeError`` after printing the line of ``script`` each rank was at when it ended.
``terminal_events(logs, kind)`` reads the ``@ddplab`` events that terminal runs saved with
``... 2>&1 | tee LOG``, or None when a terminal has not run.

Example::

    seen = json.loads(output_of_a_run(RUN_DIR / "whoami.py", RUN_DIR / "seen.json"))
    joined = terminal_events([RUN_DIR / "terminal_1.log", RUN_DIR / "terminal_2.log"], "joined")

Lessons: 07, 07b.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Sequence, Union

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
                    timeout: float = 60.0) -> str:
    """The text a run of the current ``script`` wrote to ``output``; launched here if needed.

    ``timeout`` (seconds) ends a run that hangs; it includes every rank's start (importing
    torch), which takes many seconds on a busy machine.
    """
    script, output = Path(script), Path(output)
    if not written_since(output, script):
        import ddplab

        print(f"no {output.name} from a run of this {script.name}: launching it from here")
        output.unlink(missing_ok=True)
        run = ddplab.launch(script, nprocs, timeout=timeout, quiet=True)
        if not run.ok:
            for rank, line in lines_reached(run, script).items():
                print(f"rank {rank} was at line {line}")
            why = getattr(run, "error", None)
            raise RuntimeError(f"{script.name} did not finish ({run.status}"
                               + (f": {why}" if why else "") + "): restore it, run the cell "
                               "that writes it again, then this one")
    return output.read_text()


def terminal_events(logs: Sequence[PathLike], kind: str) -> Optional[dict[str, list[dict]]]:
    """``{log's name without suffix: its events of kind}``, in the order they were printed.

    Each log is a terminal's output saved with ``tee``; an event line may follow other text on
    its line (a prefix such as torchrun's ``[default0]:``). None when a log is missing or holds
    no such event: that terminal has not run (or not to the end).
    """
    from .. import events

    found: dict[str, list[dict]] = {}
    for log in map(Path, logs):
        if not log.exists():
            return None
        lines = (events.split(line)[1] for line in log.read_text(errors="replace").splitlines())
        found[log.stem] = [e for e in lines if e is not None and e["kind"] == kind]
        if not found[log.stem]:
            return None
    return found
