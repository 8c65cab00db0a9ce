"""The line protocol between worker processes and the launcher (both sides import this).

A worker reports structured facts by printing one line per event to its stdout::

    @ddplab {"kind": "progress", "rank": 0, "epoch": 1, "step": 10, "steps": 40, "loss": 0.52}

The launcher reads every rank's output live, turns these lines into a progress bar, a live loss
plot and the ``events`` of the returned ``RunResult``, and prints every other line with a rank
prefix. Any program can speak it: the line is plain JSON after a fixed marker, so nothing here
imports torch.

Kinds used by ddplab's workers (others are passed through untouched):

- ``progress``: ``epoch``, ``epochs``, ``step``, ``steps``, ``loss`` (drives the progress bar).
- ``epoch``: one finished epoch: ``epoch``, ``loss``, ``accuracy``, ``epoch_time``, ...
- ``metric``: any named values a lesson wants to assert on.
- ``summary``: the final JSON summary of a run (one per run, from rank 0).

Example (in a worker script)::

    from ddplab import events
    events.emit("metric", name="checksum", value=1.25)

Lessons: every notebook that launches a worker (01-09).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

MARKER = "@ddplab "
#: Kinds only ddplab's launcher writes, with the fields each must hold: a rank's entry says how
#: its script ended (``exit``), the agent how the launch ended (``report``) and that it starts
#: the ranks again (``round``). The launcher takes each only from where it writes it: a line a
#: worker prints that looks like one stays an ordinary line.
RESERVED: dict[str, dict[str, Any]] = {"exit": {"rank": int, "code": int, "time": (int, float)},
                                       "report": {"status": str}, "round": {}}


def emit(kind: str, **fields: Any) -> dict[str, Any]:
    """Print one event line on stdout (flushed at once) and return the event.

    Args:
        kind: the event kind (``progress``, ``epoch``, ``metric``, ``summary`` or your own).
        **fields: JSON-serialisable values. ``rank`` defaults to the ``RANK`` environment
            variable (0 outside a distributed job).

    Returns:
        The event as a dict, as the launcher will parse it.
    """
    event: dict[str, Any] = {"kind": kind, "rank": int(os.environ.get("RANK", "0"))}
    event.update(fields)
    sys.stdout.write(MARKER + json.dumps(event, default=_jsonable) + "\n")
    sys.stdout.flush()
    return event


def parse(line: str) -> dict[str, Any] | None:
    """Return the event carried by ``line``, or None for an ordinary output line.

    A line that starts with the marker but does not hold a JSON object with a ``kind``, a
    whole-number ``rank`` where it gives one and every field of a ``RESERVED`` kind, is treated
    as ordinary output, so a worker can never crash the launcher by printing something odd.
    """
    if not line.startswith(MARKER):
        return None
    try:
        event = json.loads(line[len(MARKER):])
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
        return None
    needs = {"rank": int, **RESERVED.get(event["kind"], {})}
    given = {"rank": 0, **event}  # (rank may be left out, but from an ``exit``)
    if any(not isinstance(given.get(name), kind) or isinstance(given.get(name), bool)
           for name, kind in needs.items()) or (event["kind"] == "exit" and "rank" not in event):
        return None
    return event


def split(text: str) -> tuple[str, dict[str, Any] | None]:
    """A line as (output, event): ``print("99%", end="")`` then an event gives one line,
    ``99%@ddplab {...}``."""
    at = 0 if parse(text) is not None else max(text.rfind(MARKER), 0)
    event = parse(text[at:])
    return (text[:at], event) if event is not None else (text, None)


def _jsonable(value: Any) -> Any:
    """Convert numbers held in tensors or numpy scalars to plain Python for JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)
