"""Spawn from a notebook cell: what ``torch.multiprocessing.spawn`` does with a cell's function.

Kernel side (see ``ddplab.lab.demos``). ``spawn_from_notebook`` really calls ``mp.spawn`` on a
function defined in a notebook cell, captures what the children print on stderr (the
unpickling error: ``Can't get attribute 'hello' on <module '__main__'>``), and ends every child,
so the cell always finishes::

    def hello(rank, world_size):
        print(f"hello from rank {rank} of {world_size}")

    attempt = spawning.spawn_from_notebook(hello, args=(2,), nprocs=2, timeout=60)
    assert not attempt.ok and attempt.name_not_found

Lesson: 03.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from ...torch_words import UNPICKLABLE_MAIN


@dataclass
class SpawnAttempt:
    """What happened when ``torch.multiprocessing.spawn`` ran a function from the notebook.

    Lesson: 03.
    """

    ok: bool
    exception: str
    exit_codes: list[Optional[int]]
    stderr: str
    wall_time: float
    pids: list[int] = field(default_factory=list)

    @property
    def message(self) -> str:
        """The line that says why the children failed (the unpickling error), or ""."""
        for line in reversed(self.stderr.splitlines()):
            if UNPICKLABLE_MAIN.search(line) or line.startswith(("AttributeError", "Error")):
                return line.strip()
        return ""

    @property
    def name_not_found(self) -> bool:
        """True when a child could not find the function by its name in ``__main__``."""
        return UNPICKLABLE_MAIN.search(self.stderr) is not None


def spawn_from_notebook(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 2,
                        timeout: float = 60.0) -> SpawnAttempt:
    """Run ``torch.multiprocessing.spawn(fn, args, nprocs)`` and report how it ended.

    ``mp.spawn`` starts fresh interpreters that receive ``fn`` by *name* (pickled as
    ``__main__.fn``) and import it. A function defined in a notebook cell lives only in the
    kernel's memory, so every child fails while unpickling, before ``fn`` runs. The children
    write that traceback to file descriptor 2, which is captured here so the cell can show it.

    Never leaves a process behind: after ``timeout`` seconds, or on any error (including a
    Jupyter interrupt), the children still alive are killed.

    Args:
        fn: the function to run; it receives the rank first, then ``args``.
        args: further arguments for ``fn``.
        nprocs: number of processes.
        timeout: seconds to wait for the children.

    Returns:
        A ``SpawnAttempt``: ``ok``, the parent's exception text, exit codes, the children's
        stderr, the wall time and the children's pids.

    Lesson: 03.
    """
    import torch.multiprocessing as mp

    start = time.monotonic()
    context, exception = None, ""
    with tempfile.TemporaryFile() as capture, _stderr_to(capture), _quiet_spawn_log():
        try:
            context = mp.spawn(fn, args=tuple(args), nprocs=nprocs, join=False)
            exception = _join(context, start + timeout)
        finally:
            _end(context)
        capture.seek(0)
        stderr = capture.read().decode("utf-8", "replace")
    processes = context.processes if context else []
    return SpawnAttempt(not exception, exception, [p.exitcode for p in processes], stderr,
                        time.monotonic() - start, [p.pid for p in processes])


def _join(context: Any, deadline: float) -> str:
    """Wait for every child until ``deadline``; return the failure text ("" when all ended 0)."""
    try:
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                return "timeout: the children did not finish and were killed"
    except Exception as exc:  # ProcessExitedException / ProcessRaisedException: the lesson
        return f"{type(exc).__name__}: {exc}"
    return ""


def _end(context: Any) -> None:
    """Kill and reap every child still alive."""
    for process in getattr(context, "processes", []):
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


@contextlib.contextmanager
def _stderr_to(handle: Any) -> Iterator[None]:
    """Point file descriptor 2 at ``handle`` (children inherit it), then restore it."""
    saved = os.dup(2)
    os.dup2(handle.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _quiet_spawn_log() -> Iterator[None]:
    """Silence torch's "Terminating process ... via signal SIGTERM" warning during the demo."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def child_error(stderr: str, lines: int = 10) -> str:
    """The first exception a child printed: its ``...Error`` line and the ``lines`` after it.

    What ``python hello.py`` printed when its children failed (notebook 03's Your turn), without
    the tracebacks around it; 10 lines keep multiprocessing's bootstrapping error through the
    idiom it names. "" when no line names an exception.

    Lesson: 03.
    """
    said = stderr.splitlines()
    first = next((i for i, line in enumerate(said)
                  if line.split(":")[0].endswith(("Error", "Exception"))), None)
    return "" if first is None else "\n".join(said[first:first + lines + 1]).rstrip()


def verdict(tried: Any, flags: Sequence[str]) -> str:
    """What a launch of ``spawn_ddp.py`` with ``flags`` shows, in words (notebook 03's Try it).

    Its status and the worker's refusal if the ranks' final weights differed; and, when the first
    gradients were equal but the final weights were not, why: equal steps from unequal starting
    weights keep them unequal.

    Lesson: 03.
    """
    metrics = tried.events_of("metric")
    grads = {e["rank"]: e["grad_checksum"] for e in metrics if e["name"] == "first_step"}
    weights = {e["rank"]: e["value"] for e in metrics if e["name"] == "param_checksum"}
    raised = [line for lines in tried.logs.values() for line in lines
              if line.startswith("RuntimeError: ranks disagree")]
    said = f"{' '.join(flags)}: status {tried.status!r}" + (
        f": {raised[0]}" if raised else ", every rank ended with the same weights")
    if len(set(grads.values())) == 1 < len(set(weights.values())):
        said += ("\nThe first gradients were equal (DDP averaged them), yet the weights ended "
                 "apart: equal steps from unequal starting weights keep them unequal.")
    return said
