"""Read a failed launch like a debugger would: where each rank stopped, what is still running.

A hung or crashed job leaves evidence in its ``RunResult``: every rank's output, with the
traceback of a Python exception or the stack that ``faulthandler`` prints when a process is
killed by a signal. These helpers pull out the facts a notebook cell prints and asserts::

    result = ddplab.launch("ddplab.workers.desync", 2, args=["--fault", "one_rank",
                                                             "--pg-timeout", "3"])
    for rank in sorted(result.logs):
        print(rank, postmortem.stopped_at(result, rank))   # the worker's line each rank was on
    assert postmortem.survivors(result.pids) == []           # nothing left running

torch's Flight Recorder names the collective each rank waits in, with its sequence number (the
same number on every rank for the same collective); ``launch(..., flight_recorder=True)`` reads
it at a timeout (``result.waits``), and :func:`collective_waits` (from ``ddplab.flight_recorder``)
reads a page of ``torch.distributed.debug``'s server saved earlier (:func:`recording`)::

    waits = postmortem.collective_waits(postmortem.debug_server_records(page))
    print("; ".join(postmortem.describe_waits(waits)))   # rank 0 waits in all_reduce #1; ...

Kernel side: reads text and asks ``ps``; imports neither torch nor any worker module.

Lesson: 10.
"""

from __future__ import annotations

import json
import linecache
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from .. import torch_words
from ..flight_recorder import (Collective, collective_waits, debug_server_records,  # noqa: F401
                              describe_waits, flight_records)

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+),? in (?P<func>\S+)')
_LIBRARY = re.compile(r"site-packages|dist-packages|<frozen|/lib/python\d|ddplab/launcher/")
_WORKER_SCRIPT = re.compile(r"[/\\]ddplab[/\\]workers[/\\]")  # the lessons' scripts, even installed


@dataclass(frozen=True)
class Frame:
    """One line of user code in a traceback: file, line number, function and the code itself."""

    path: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        name = self.path.rsplit("/", 1)[-1]
        return f"{name}:{self.line} in {self.function}: {self.code}"


def user_frames(lines: Iterable[str]) -> list[Frame]:
    """The frames of user code (not torch, not the standard library) in ``lines``, innermost last.

    Reads Python tracebacks (most recent call last) and ``faulthandler`` dumps (most recent
    call first, printed when a process dies of a signal such as SIGABRT).
    """
    frames: list[Frame] = []
    block: list[Frame] = []
    reverse = False
    for text in lines:
        if "most recent call first" in text or "most recent call last" in text:
            frames += reversed(block) if reverse else block
            block, reverse = [], "first" in text
            continue
        match = _FRAME.match(text)
        if match and (_WORKER_SCRIPT.search(match["path"]) or not _LIBRARY.search(match["path"])):
            path, line = match["path"], int(match["line"])
            code = linecache.getline(path, line).strip()
            block.append(Frame(path, line, match["func"], code))
    frames += reversed(block) if reverse else block
    return frames


def short_stack(text: str, width: int = 100) -> str:
    """A traceback or ``faulthandler`` dump cut to what a reader needs: its last stack's frames
    of user code, innermost last, then the exception's lines; torch's and Python's frames are
    counted, not shown, and every line is cut to ``width`` columns.

    ``"rank 1's stack, your code only (2 frames of torch and Python left out):"``, then one
    ``"  desync.py:143 in gather_padded: torch_dist.all_gather(...)"`` line per frame.
    """
    lines = text.splitlines()
    start = max((i for i, line in enumerate(lines) if "most recent call" in line), default=0)
    stack = lines[start:]
    frames = user_frames(stack)
    at = [i for i, line in enumerate(stack) if _FRAME.match(line)]
    after = stack[at[-1] + 1:] if at else stack   # the last frame's code, then the exception
    first = next((i for i, line in enumerate(after) if line and not line[0].isspace()), None)
    hidden = len(at) - len(frames)
    shown = [f"your code only ({hidden} frame{'s' * (hidden != 1)} of torch and Python left out):",
             *(f"  {frame}" for frame in frames), *(after[first:] if first is not None else [])]
    return "\n".join(line if len(line) <= width else line[:width - 4] + " ..."
                     for line in shown if line.strip())


def stopped_at(result: Any, rank: int, script: str = "") -> Optional[Frame]:
    """The innermost line of user code in the last of ``rank``'s stacks (tracebacks,
    ``faulthandler`` dumps) that shows one, or None. (A dump of an abort while the interpreter
    exits, after the traceback, shows only the exit's frames: the traceback is read.)

    Args:
        result: a launch's ``RunResult``.
        rank: whose output to read.
        script: only frames of files whose path ends with this (e.g. ``"desync.py"``), to skip
            helpers the script called.
    """
    lines = list(result.logs.get(rank, []))
    starts = [i for i, text in enumerate(lines) if "most recent call" in text]
    for start, end in reversed(list(zip(starts, [*starts[1:], len(lines)]))):
        frames = [f for f in user_frames(lines[start:end]) if f.path.endswith(script)]
        if frames:
            return frames[-1]
    return None


def error_lines(result: Any, rank: int, pattern: str) -> list[str]:
    """Every line of ``rank``'s output that matches the regular expression ``pattern``."""
    found = re.compile(pattern)
    return [text for text in result.logs.get(rank, []) if found.search(text)]


def fingerprints(message: str) -> dict[int, str]:
    """The collectives each rank was running, from a ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` error.

    ``"Detected mismatch between collectives on ranks. Rank 0 is running collective:
    CollectiveFingerPrint(SequenceNumber=1, OpType=ALLGATHER, TensorShape=[51], ...), but
    Rank 1 is running ..."`` becomes ``{0: "ALLGATHER [51] Long", 1: "ALLGATHER [50] Long"}``
    (the wording is read by ``ddplab.torch_words``).
    """
    return {rank: " ".join(fields[key] for key in ("op", "shape", "dtype") if key in fields)
            for rank, fields in torch_words.fingerprints(message).items()}


def mismatch_lines(result: Any, rank: int) -> list[str]:
    """``rank``'s lines that report a DETAIL mismatch (each names every rank's collective)."""
    return torch_words.DETAIL_MISMATCH.lines(result.logs.get(rank, []))


def timed_out(failure: Any) -> bool:
    """True when a ``RankFailure`` is a collective that waited past the group's timeout."""
    return bool(torch_words.COLLECTIVE_TIMEOUT.search(failure.message + "\n" + failure.traceback))


def unused_parameters(result: Any, rank: int) -> set[str]:
    """The parameters DDP reported as getting no gradient on ``rank`` (needs
    ``TORCH_DISTRIBUTED_DEBUG=INFO`` or ``DETAIL``), or an empty set."""
    return torch_words.unused_parameters(result.logs.get(rank, [])).get(rank, set())


def uneven_hang(world_size: int, grace: float = 1.0) -> Callable[[dict], Optional[float]]:
    """An ``on_event`` for ``ddplab.launch`` that ends the hang of uneven inputs once it is certain.

    It reads the ``metric`` events of ``ddplab.workers.faults``: ``backward`` (n, before a rank's
    n-th backward, so its n-th all-reduce), then ``steps`` and ``checksum`` when a rank has
    finished training. A rank that finished after n steps while another enters backward n + 1
    means an all-reduce that nobody will join: the returned function then answers ``grace``,
    and the launch ends ``grace`` seconds later as a timeout would, each rank's stack taken.
    Until then it answers None (keep waiting).
    """
    said: dict[tuple[Any, Any], Any] = {}  # (rank, metric name) -> its last value

    def on_event(event: dict) -> Optional[float]:
        if event.get("kind", "metric") == "metric":
            said[event.get("rank"), event.get("name")] = event.get("value")
        done = [said[rank, "steps"] for rank in range(world_size)
                if (rank, "checksum") in said and (rank, "steps") in said]
        entered = max((said.get((rank, "backward")) or 0) for rank in range(world_size))
        return grace if done and entered > min(done) else None

    return on_event


def survivors(pids: Iterable[int]) -> list[int]:
    """The processes among ``pids`` that are still running (zombies count as gone).

    Asks ``ps`` (Linux and macOS), so it also sees processes that are not children of the
    caller.
    """
    wanted = sorted({int(pid) for pid in pids})
    if not wanted:
        return []
    out = subprocess.run(["ps", "-o", "pid=,stat=", "-p", ",".join(map(str, wanted))],
                         capture_output=True, text=True, check=False).stdout
    alive = []
    for row in out.splitlines():
        fields = row.split()
        if len(fields) >= 2 and not fields[1].startswith("Z"):
            alive.append(int(fields[0]))
    return alive


RECORDINGS = Path(__file__).resolve().parent / "recordings"


def recording(name: str) -> dict:
    """A recording shipped with ddplab (``ddplab/lab/recordings/NAME.json``): what a tool showed on
    a run that cannot be repeated here, with ``about`` saying how and on which torch it was made."""
    path = RECORDINGS / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in RECORDINGS.glob("*.json"))
        raise FileNotFoundError(f"no recording {name!r}; the recordings are {known}")
    return json.loads(path.read_text())
