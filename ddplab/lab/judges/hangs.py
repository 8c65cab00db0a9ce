"""Explain a run that did not finish: where each rank waited, and who never arrived.

A deadlocked exercise is ended by the launch's timeout. When the launcher kept a stack dump of
every rank still running (``RunResult.stacks``: rank -> the text ``faulthandler`` prints, most
recent call first), :func:`explain_timeout` reads it like a teacher would::

    deadlock: rank 1 waits in barrier at line 60 of exercises/checkpoint.py (in save:
    `dist.barrier()`), rank 0 never arrives (it had finished).

Without stacks it names the ranks that did not finish and says what usually causes it. Every
judge starts with :func:`run_failed`, which also explains a crash (with or without a traceback)
and an interrupt.

Kernel side: reads text only; imports neither torch nor any worker module.

Lessons: the coding exercises of 03-11.
"""

from __future__ import annotations

import linecache
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
_THREAD = re.compile(
    r"(Current thread|Thread|Stack) ?(0x[0-9a-fA-F]+)? ?\(most recent call first\)")
_LIBRARY = re.compile(r"site-packages|dist-packages|<frozen|/lib/python\d|/torch/")
#: Where a rank waits when the innermost torch frame is one of these files.
_WAITS = (
    ("torch/distributed/distributed_c10d.py", None),  # the function: barrier, all_reduce, ...
    ("torch/distributed/algorithms/join.py", "Join (shadowing the other ranks' all-reduces)"),
    ("torch/autograd/", "backward() (DDP's gradient all-reduce)"),
    ("torch/nn/parallel/distributed.py", "DDP's forward (its buffer broadcast)"),
)
_PACKAGE = Path(__file__).resolve().parents[2]
_REPOSITORY = _PACKAGE.parent


@dataclass(frozen=True)
class StackFrame:
    """One frame of a stack dump."""

    path: str
    line: int
    function: str


@dataclass(frozen=True)
class Wait:
    """Where one rank was stuck: the operation it waited in and the learner's line."""

    rank: int
    operation: str  # "barrier", "all_reduce", "backward() (...)", or "" when unknown
    frame: Optional[StackFrame]  # innermost frame of the learner's code

    def where(self) -> str:
        if self.frame is None:
            return "in code outside your file"
        code = linecache.getline(self.frame.path, self.frame.line).strip()
        code = f": `{code}`" if code else ""
        return (f"at line {self.frame.line} of {display_path(self.frame.path)} "
                f"(in {self.frame.function}{code})")

    def __str__(self) -> str:
        what = f"waits in {self.operation}" if self.operation else "waits"
        return f"rank {self.rank} {what} {self.where()}"


def parse_stack(text: str) -> list[StackFrame]:
    """The frames of the thread that runs the script, innermost first, from a faulthandler dump.

    A dump lists every thread; the one that runs a script's ``<module>`` frame (the main
    thread) is chosen, else the first thread with a frame of the learner's code, else the first.
    """
    threads: list[list[StackFrame]] = []
    for line in text.splitlines():
        if _THREAD.search(line):
            threads.append([])
            continue
        match = _FRAME.match(line)
        if match:
            if not threads:
                threads.append([])
            threads[-1].append(StackFrame(match["path"], int(match["line"]), match["func"]))
    threads = [t for t in threads if t]
    for choose in (lambda t: any(f.function == "<module>" and is_learner(f.path) for f in t),
                   lambda t: any(is_learner(f.path) for f in t)):
        for thread in threads:
            if choose(thread):
                return thread
    return threads[0] if threads else []


def is_learner(path: str) -> bool:
    """Whether ``path`` is the learner's code: not torch, not Python's, not ddplab's package."""
    if _LIBRARY.search(path):
        return False
    try:
        Path(path).resolve().relative_to(_PACKAGE)
    except ValueError:
        return True
    return False


def display_path(path: str) -> str:
    """``path`` relative to the repository when inside it (``exercises/checkpoint.py``)."""
    try:
        return str(Path(path).resolve().relative_to(_REPOSITORY))
    except ValueError:
        return path


def waiting(rank: int, text: str) -> Wait:
    """Where ``rank`` waited, read from its stack dump."""
    frames = parse_stack(text)
    operation = ""
    for frame in frames:  # innermost first
        path = frame.path.replace("\\", "/")
        found = next((name for part, name in _WAITS if part in path), False)
        if found is not False:
            operation = found or frame.function
            break
    learner = next((f for f in frames if is_learner(f.path)), None)
    if not operation and learner is not None:
        operation = _call_on_line(learner)
    return Wait(rank, operation, learner)


def _call_on_line(frame: StackFrame) -> str:
    """A collective written on the learner's line (``request.wait()``, ``dist.recv(...)``)."""
    code = linecache.getline(frame.path, frame.line)
    match = re.search(r"\b(wait|recv|irecv|send|isend|barrier|all_reduce|broadcast|all_gather|"
                      r"reduce_scatter\w*)\s*\(", code)
    return f"{match.group(1)}()" if match else ""


def explain_timeout(result: Any) -> str:
    """The verdict on a run that the launch's timeout ended (a deadlock, most often)."""
    ranks = list(range(result.world_size or 0))
    stacks = {int(r): text for r, text in (getattr(result, "stacks", {}) or {}).items()}
    seconds = f" after {result.wall_time:.0f} s" if getattr(result, "wall_time", 0) else ""
    if not stacks:
        left = [r for r in ranks if result.exit_codes.get(r) != 0] or ranks
        names = ", ".join(str(r) for r in left)
        return (f"the run did not finish: the launch's timeout ended it{seconds}, with rank(s) "
                f"{names} still running, and no stack was kept to say where. Most often "
                "this is a deadlock: a collective (dist.barrier(), all_reduce, the all-reduce "
                "in a DDP backward(), a recv) that not every rank reaches, for instance one "
                "inside `if rank == 0:`. Every rank must call the same collectives in the same "
                "order; check each one in your code, then launch again.")
    waits = [waiting(rank, stacks[rank]) for rank in sorted(stacks)]
    absent = [r for r in ranks if r not in stacks]
    text = "deadlock: " + ", ".join(str(w) for w in waits)
    if absent:
        names = ", ".join(f"rank {r}" for r in absent)
        done = [r for r in absent if result.exit_codes.get(r) == 0]
        why = " (it had finished)" if done and len(absent) == 1 else ""
        text += (f"; {names} never arrive{'s' if len(absent) == 1 else ''}{why}. A collective "
                 "completes only when every rank calls it: make sure every rank reaches that "
                 "line, for instance by moving it out of an `if rank == ...:` block.")
    elif len({(w.operation, w.frame) for w in waits}) > 1:
        text += (". The ranks wait in different places, so none of them can complete: every "
                 "rank must call the same collectives in the same order (look for one inside "
                 "`if rank == ...:`, or a loop that runs a different number of times on each "
                 "rank).")
    elif re.search(r"recv|send|wait", waits[0].operation):
        text += (". Every rank waits at the same place for something no rank sends: a recv "
                 "needs a matching send on the rank it names, and a blocking send posted by "
                 "every rank first waits for a receiver (post isend/irecv, then wait).")
    else:
        text += (". Every rank reached the same line, yet the collective never completes: the "
                 "ranks' calls do not match (a different tensor shape, or a different number of "
                 "collectives before this one). TORCH_DISTRIBUTED_DEBUG=DETAIL (notebook 10, "
                 "section 3) "
                 "compares them and says how they differ.")
    return text + f" (The launch's timeout ended the run{seconds}.)"


def run_failed(result: Any) -> Optional[str]:
    """A hint when the run itself failed (every judge starts with this), else None."""
    if result.ok:
        return None
    if result.status == "timeout":
        return explain_timeout(result)
    if result.status == "interrupted":
        return "the run was interrupted before it finished: launch it again and let it end."
    cause = result.root_cause
    if cause is None:
        return (f"the run did not finish: {result.status}"
                + (f" ({result.error.splitlines()[0]})" if result.error else "")
                + ". No rank printed a traceback; read the launch's own message above.")
    who = "the launching process" if cause.rank is None else f"rank {cause.rank}"
    how = cause.message or (f"killed by {cause.signal}" if cause.signal
                            else f"exit code {cause.exitcode}")
    if cause.traceback:
        return (f"the run did not finish: {result.status} ({who}: {how}). Read the "
                "traceback printed above the result, fix that line of your file, and launch "
                "it again.")
    return (f"the run did not finish: {result.status} ({who}: {how}), without a Python "
            "traceback: the process was killed or crashed inside a library. Read its last "
            "lines of output above the result, and launch again.")
