"""torch's Flight Recorder, read from a hung job: the collective each rank waits in, and its number.

Each process group numbers its collectives 1, 2, 3, ... in the order a rank calls them; torch's
Flight Recorder (``TORCH_FR_BUFFER_SIZE``) keeps in every rank its last collectives with that
number and whether each one ended. ``ddplab.launch(..., flight_recorder=True)`` switches it on
and reads it when the launch times out, before the ranks are ended::

    hung = ddplab.launch("ddplab.workers.desync", 2, args=["--fault", "one_rank"], timeout=30,
                         flight_recorder=True)
    print(hung.waits)   # {0: Collective(op='all_reduce', seq=1, ...), 1: ... 'all_gather' ...}
    print(hung.error)   # ... Flight Recorder: rank 0 waits in all_reduce #1; rank 1 waits in ...

How: every rank starts ``torch.distributed.debug.start_debug_server`` (:func:`start_in_rank`,
which the launcher's entry calls before the script runs; experimental in torch); rank 0's
server serves the page ``/fr_trace_json``, every rank's records, on a free port the launcher chose
(:class:`Reader`). The same parsers read a page saved earlier (:func:`debug_server_records`,
:func:`collective_waits`, :func:`describe_waits`; lesson 10 also reads a recording).

Needs a torch with ``torch.distributed.debug.start_debug_server`` and, on rank 0, the packages
its server imports (tabulate, jinja2, requests); without them the report says so in one line.
Kernel side (the launcher, ``ddplab.lab.postmortem``); :func:`start_in_rank` runs in a rank.

Lesson: 10.
"""

from __future__ import annotations

import html
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from . import events
from .env import free_port

PORT_ENV = "DDPLAB_FLIGHT_RECORDER"  # in each rank's environment: rank 0's debug server port
EVENT = "flight_recorder"  # what a rank emits when its debug server could not start
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # (rank 0 is local)
_RANK_RECORDS = re.compile(r"<h2>Rank (?P<rank>\d+):[^<]*</h2>\s*<pre>(?P<json>.*?)</pre>", re.S)


@dataclass(frozen=True)
class Collective:
    """One collective in a rank's Flight Recorder: its name, sequence number, and whether it ended.

    ``seq`` counts the collectives of the process group ``group``: the n-th collective has the
    same number on every rank, so two ranks in different collectives with the same number are
    out of step, and a rank with a smaller number than the others is the one they wait for.
    """

    op: str
    seq: int
    group: str
    finished: bool
    shapes: tuple

    def __str__(self) -> str:
        return f"{self.op} #{self.seq}"


def debug_server_records(page: str) -> dict[int, dict]:
    """Each rank's Flight Recorder records from the debug server's ``/fr_trace_json`` page.

    ``torch.distributed.debug.start_debug_server()`` (each rank calls it) serves on rank 0's
    ``port`` a page that holds, rank by rank, the JSON that rank's recorder returned. Raises
    ValueError for a page without any.
    """
    found = {int(m["rank"]): json.loads(html.unescape(m["json"]))
             for m in _RANK_RECORDS.finditer(page)}
    if not found:
        raise ValueError("no rank's records on this page: pass the text of the debug server's "
                         "/fr_trace_json page (http://RANK0_HOST:PORT/fr_trace_json)")
    return found


def flight_records(record: Mapping[str, Any]) -> list[Collective]:
    """The collectives (not point-to-point sends) in one rank's Flight Recorder JSON, oldest first.

    Reads ``entries``: ``profiling_name`` (``"gloo:all_reduce"``), ``collective_seq_id`` and
    ``retired`` (the work ended; on gloo ``state`` stays ``"scheduled"`` even after that).
    """
    if "entries" not in record:
        raise ValueError("not a Flight Recorder record: it has no 'entries' (pass one rank's JSON, "
                         "e.g. a value of debug_server_records(page))")
    return [Collective(op=entry["profiling_name"].split(":", 1)[-1],
                       seq=int(entry["collective_seq_id"]),
                       group=str(entry.get("process_group", ["0"])[0]),
                       finished=bool(entry["retired"]),
                       shapes=tuple(tuple(size) for size in entry.get("input_sizes", [])))
            for entry in sorted(record["entries"], key=lambda entry: entry.get("record_id", 0))
            if not entry.get("is_p2p")]


def collective_waits(records: Mapping[int, Mapping[str, Any]]) -> dict[int, Optional[Collective]]:
    """For each rank, the oldest collective it entered and never finished; None if none.

    Args:
        records: rank -> that rank's Flight Recorder JSON (e.g. from :func:`debug_server_records`).
    """
    return {rank: next((c for c in flight_records(record) if not c.finished), None)
            for rank, record in sorted(records.items())}


def describe_waits(waits: Mapping[int, Optional[Collective]]) -> list[str]:
    """One line per rank (``"rank 1 waits in all_reduce #7"``), then what the numbers say."""
    lines = [f"rank {rank} waits in {c}" if c else f"rank {rank} waits in no collective"
             for rank, c in sorted(waits.items())]
    waiting = {rank: c for rank, c in waits.items() if c}
    idle = sorted(rank for rank, c in waits.items() if c is None)
    seqs = sorted({c.seq for c in waiting.values()})
    if not waiting:
        return lines
    if idle:
        lines.append(f"rank(s) {idle} are not in a collective, and the others wait for them: still "
                     "computing or loading data, or past a branch that skipped the collective")
    elif len(seqs) > 1:
        behind = sorted(rank for rank, c in waiting.items() if c.seq == seqs[0])
        lines.append(f"rank(s) {behind} are behind: the others already wait in a later collective")
    elif len({c.op for c in waiting.values()}) > 1:
        lines.append(f"the ranks called different collectives as #{seqs[0]}: they are out of step "
                     "(a collective in a rank-dependent branch, or a different order)")
    else:
        lines.append(f"every rank is in {next(iter(waiting.values()))}: the collective itself does "
                     "not end (shapes that differ, or the network)")
    return lines


def dump_files(records: Mapping[int, Mapping[str, Any]], folder: str) -> list[str]:
    """Write each rank's records as the dump file NCCL's watchdog would (``folder/rank_N``, a
    pickle), for torch's own analyser: ``torchfrtrace folder``. Returns the paths written.

    gloo leaves the group's name out of ``pg_config`` (keyed ``""``); the analyser looks the
    group up by name, so the name and description in each entry's ``process_group`` are put in.
    """
    import pickle

    os.makedirs(folder, exist_ok=True)
    written = []
    for rank, record in sorted(records.items()):
        record = dict(record)
        if "" in record.get("pg_config", {}) and record.get("entries"):
            name, desc = record["entries"][0]["process_group"]
            record["pg_config"] = {name: {**record["pg_config"][""], "name": name, "desc": desc}}
        path = os.path.join(folder, f"rank_{rank}")
        with open(path, "wb") as file:
            pickle.dump(record, file)
        written.append(path)
    return written


def torchfrtrace() -> Optional[Any]:
    """The function the ``torchfrtrace`` command runs (its console-script entry point), to call
    with the command's arguments (``torchfrtrace()([folder, "-o", "db.pkl"])``); None when this
    torch has no such command, or one whose module its wheel lacks (torch 2.6)."""
    from importlib.metadata import entry_points

    try:
        return entry_points(group="console_scripts", name="torchfrtrace")["torchfrtrace"].load()
    except (KeyError, ImportError):
        return None


class Reader:
    """One launch's Flight Recorder, seen from the launcher: what its ranks need in their
    environment (``env``), the read at a timeout (:meth:`read`), and the report (:meth:`report`).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.port = free_port(host)
        self.url = f"http://localhost:{self.port}/fr_trace_json"
        self.env = {"TORCH_FR_BUFFER_SIZE": "100", PORT_ENV: str(self.port)}
        self.waits: Optional[dict[int, Optional[Collective]]] = None
        self.records: dict[int, dict] = {}   # each rank's records, as the server served them
        self.problem = "not asked"

    def read(self, seconds: float = 10.0) -> None:
        """Fetch rank 0's ``/fr_trace_json`` and find each rank's collective (``waits``), or note
        why not (``problem``). At most ``seconds``; a server not listening is asked for 2 s."""
        start = time.monotonic()
        while True:
            try:
                with _NO_PROXY.open(self.url, timeout=seconds) as reply:
                    self.records = debug_server_records(reply.read().decode())
                    self.waits = collective_waits(self.records)
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, ConnectionRefusedError) and time.monotonic() < start + 2:
                    time.sleep(0.1)  # (rank 0's server may be starting)
                    continue
                self.problem = f"{self.url} did not answer ({exc.reason}): rank 0's debug server " \
                               "did not start (see rank 0's output)"
            except (OSError, ValueError, KeyError) as exc:
                self.problem = f"{self.url} gave no records ({type(exc).__name__}: {exc})"
            return

    def report(self, result: Any) -> None:
        """Give a timed-out ``RunResult`` what was read: ``waits``, ``records`` (what
        :func:`dump_files` writes for ``torchfrtrace``) and a line of ``error``."""
        if result.status != "timeout":
            return
        if self.waits is not None:
            result.waits, result.records = self.waits, self.records
            result.error += "\nFlight Recorder: " + "; ".join(describe_waits(self.waits))
            return
        said = [e["error"] for rank in sorted(result.events) for e in result.events[rank]
                if e.get("kind") == EVENT]
        result.error += f"\nFlight Recorder not read: {said[0] if said else self.problem}"


def start_in_rank() -> None:
    """Start torch's debug server in this rank, if the launch asked for it (``PORT_ENV``).

    In a thread: it connects to the job's store, which rank 0 may serve only once the script
    calls ``init_process_group``. If it cannot start, the rank says why (an ``EVENT`` event).
    """
    if os.environ.get(PORT_ENV):
        threading.Thread(target=_serve, args=(int(os.environ[PORT_ENV]),), daemon=True,
                         name="ddplab-flight-recorder").start()


def _serve(port: int) -> None:
    import atexit

    import torch

    try:
        from torch.distributed.debug import start_debug_server, stop_debug_server

        if os.environ.get("RANK") == "0":
            import requests  # noqa: F401  (its frontend imports it only when it is asked)
        start_debug_server(port=port)
        atexit.register(stop_debug_server)
    except Exception as exc:  # noqa: BLE001  (the report names it; the script runs on)
        events.emit(EVENT, error=f"rank {os.environ.get('RANK')}: torch {torch.__version__}'s "
                                 f"debug server could not start ({type(exc).__name__}: {exc})")
