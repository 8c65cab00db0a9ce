"""Every rank's output, read live in the caller's main thread (so nbval sees it too): one
selector reads each rank's own connections (``procs.connect_streams``) and a subprocess's pipes,
prints each line with its rank and turns ``@ddplab`` event lines into progress and metrics."""

from __future__ import annotations

import math
import os
import re
import selectors
import socket
import sys
import time
from typing import Any, Callable, Optional, Union

from .. import events as _events
from ..env import start_time
from .entry import STACK_SIGNAL
from .jobs import Job, end_jobs
from .procs import signal_process

_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:? ?")
_NOT_KEPT = re.compile(r"^\[ddplab: (\d+) earlier lines not kept\]$")
#: A result keeps about KEEP_LINES lines a rank (the newest), each cut to LONGEST_PARTIAL
#: characters; ``DDPLAB_KEEP_LINES=N`` (``ddplab check``): about N, cut to LONGEST_LINE.
KEEP_LINES, LONGEST_LINE, LONGEST_PARTIAL = 100_000, 8192, 1 << 22


class Streams:
    """Read every job's connections and pipes: lines, events, reports."""

    def __init__(self, jobs: list[Job], view: Any,
                 on_event: Optional[Callable[[dict[str, Any]], Optional[float]]] = None) -> None:
        self.view, self.on_event, self.jobs = view, on_event, jobs
        self.sel = selectors.DefaultSelector()
        self.partial: dict[int, bytes] = {}
        # What each job's RunResult is built from: logs, stderr lines and events, by rank.
        self.read: list[dict[str, dict[Any, list[Any]]]] = [
            {"logs": {}, "stderr": {}, "events": {}} for _ in jobs]
        self.keep = int(os.environ.get("DDPLAB_KEEP_LINES") or 0) or KEEP_LINES
        self.longest = LONGEST_LINE if self.keep != KEEP_LINES else LONGEST_PARTIAL
        self.dumps: dict[tuple[int, Union[int, str]], list[str]] = {}  # (job, rank) -> stderr
        for index, job in enumerate(jobs):
            for fd, label in job.sources.items():
                os.set_blocking(fd, False)
                self.sel.register(fd, selectors.EVENT_READ, (index, job, label))
        self.tick = 0.2 if any(job.engine == "spawn" for job in jobs) else 0.5
        self.closing: set[int] = set()  # jobs whose agent (or torchrun) closed its output
        self.stop_at = math.inf  # on_event returned a number: end as at a timeout then

    def pump(self, deadline: float) -> str:
        """Read until every job has ended ("done") or the deadline passes ("timeout")."""
        open_jobs = set(range(len(self.jobs)))
        while open_jobs:
            remaining = min(deadline, self.stop_at) - time.monotonic()
            if remaining <= 0:
                return "timeout"
            # An agent that closed its output is exiting: look again soon, not a tick later.
            tick = 0.002 if self.closing & open_jobs else self.tick
            for key, _mask in self.sel.select(timeout=min(remaining, tick)):
                self._read(key.fd, *key.data)
            self._watch()
            for index in list(open_jobs):
                if self.jobs[index].ended():
                    self._finish(index)
                    open_jobs.discard(index)
        return "done"

    def _finish(self, index: int) -> None:
        """Read what an ended job's connections hold (first accepting those waiting), in turns
        (a flood on one starves none), then close them, whoever else holds them (a process the
        ranks left): 2 s at most."""
        def mine(accepting: bool) -> list[int]:
            return [k.fd for k in list(self.sel.get_map().values())
                    if k.data[0] == index and (k.data[2] == "accept") == accepting]
        end = time.monotonic() + 2.0
        for accepting in (True, False):
            fds = mine(accepting)
            while fds and time.monotonic() < end:  # (a hello names its connection's rank)
                fds = [fd for fd in fds if fd in self.sel.get_map()
                       and self._read(fd, *self.sel.get_key(fd).data)]
            for fd in mine(accepting):
                self._lines(fd, *self.sel.get_key(fd).data, b"")  # (its last line; closed)

    def stacks(self, running: list[list[int]], why: str) -> list[dict[int, str]]:
        """Ask each rank still running that said its pid for its Python stack; the dumps."""
        self.dumps = {(index, rank): [] for index, ranks in enumerate(running) for rank in ranks}
        for index, ranks in enumerate(running):
            job = self.jobs[index]
            if ranks and not self.view.quiet:
                print(f"ddplab.launch: {why}; still running: "
                      f"{', '.join(f'rank {r}' for r in ranks)}. Where each one is:",
                      file=sys.stderr, flush=True)
            for rank in ranks:
                signal_process(job.pids[rank], STACK_SIGNAL, job.started.get(job.pids[rank]))
        end, quiet_since = time.monotonic() + 3.0, time.monotonic()
        while self.dumps and time.monotonic() < end and time.monotonic() - quiet_since < 0.5:
            for key, _mask in self.sel.select(timeout=0.1):
                if self._read(key.fd, *key.data):
                    quiet_since = time.monotonic()
        found: list[dict[int, str]] = [{} for _ in self.jobs]
        for (index, rank), lines in self.dumps.items():
            first = next((i for i, line in enumerate(lines) if "most recent call first" in line),
                         None)
            found[index][int(rank)] = "\n".join(lines[first:]) if first is not None else ""
        self.dumps = {}
        return found

    def _watch(self, grace: float = 3.0) -> None:
        """End an agent that waits for a return value from workers gone by ``os._exit``."""
        now = time.monotonic()
        for job in self.jobs:
            job.watch_spawned()
            if job.stuck or not job.workers_gone():
                job.workers_gone_at = None
                continue
            job.workers_gone_at = job.workers_gone_at or now
            if now - job.workers_gone_at > grace:
                job.stuck = True
                end_jobs([job], grace=1.0)

    def drain(self) -> None:
        """After killing the jobs, take what is left (2 s at most)."""
        self.stop_at = math.inf
        self.pump(time.monotonic() + 2.0)

    def _read(self, fd: int, index: int, job: Job, label: Union[int, str]) -> bool:
        """Read once from ``fd``; False when it had nothing to give now."""
        if label == "accept":  # the job's socket: a rank (or the agent) connects
            try:
                conn, _addr = socket.socket(fileno=os.dup(fd)).accept()
            except BlockingIOError:
                return False
            conn.setblocking(False)
            self.sel.register(conn.detach(), selectors.EVENT_READ, (index, job, "hello"))
            return True
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if label == "hello":  # a rank's own connection: "rank N out|err" comes first
            rest = self._hello(fd, index, job, chunk)
            if rest and fd in self.sel.get_map():
                self._lines(fd, index, job, self.sel.get_key(fd).data[2], rest)
            return bool(chunk)
        self._lines(fd, index, job, label, chunk)
        return bool(chunk)

    def _hello(self, fd: int, index: int, job: Job, chunk: bytes) -> bytes:
        """A connection's first line says whose it is, a rank's (with its pid) or the agent's."""
        data = self.partial.pop(fd, b"") + chunk
        first, newline, rest = data.partition(b"\n")
        words = first.decode(errors="replace").split()
        if not newline:
            if chunk:
                self.partial[fd] = data
            else:
                self._close(fd)
            return b""
        rank = len(words) == 4 and words[0] == "rank" and words[1].isdigit()
        self.sel.modify(fd, selectors.EVENT_READ, (index, job, int(words[1]) if rank else
                                                   "launcher"))
        if len(words) == 4 and words[2] == "err":
            job.err_fds.add(fd)
        if rank and words[3].isdigit():  # its pid: it dumps its stack on demand
            job.pids[int(words[1])] = pid = int(words[3])
            job.started[pid] = start_time(pid)
        return rest

    def _lines(self, fd: int, index: int, job: Job, label: Union[int, str],
               chunk: bytes) -> None:
        """Print and record the whole lines ``chunk`` completes (all at the end)."""
        data = self.partial.pop(fd, b"") + chunk
        lines, err = data.split(b"\n"), fd in job.err_fds
        if chunk:
            self.partial[fd] = lines.pop()
            if len(self.partial[fd]) > LONGEST_PARTIAL:
                lines.append(self.partial.pop(fd))
        else:
            self._close(fd)
            job.err_fds.discard(fd)  # (its number may come back for another rank's stdout)
            if label == "launcher":
                self.closing.add(index)
            if lines and not lines[-1]:
                lines.pop()
        for raw in lines:
            self._line(index, job, label, raw.decode("utf-8", "replace").rstrip("\r"), err)

    def _close(self, fd: int) -> None:
        self.sel.unregister(fd)
        os.close(fd)

    def close(self) -> None:
        """Close every pipe still open and the selector."""
        for key in list(self.sel.get_map().values()):
            self._close(key.fd)
        self.sel.close()

    def _line(self, index: int, job: Job, label: Union[int, str], text: str, err: bool) -> None:
        """Show and keep one line of a rank (or the launcher); note the event it carries."""
        rank = label
        match = _RANK_PREFIX.match(text) if label == "launcher" else None
        if match:  # an mp.spawn rank's line (``ddplab.dist.prefix_output``, torch's errors)
            rank, text = int(match.group(1)), text[match.end():]
            again = _RANK_PREFIX.match(text)  # torch's own "[rankN]:" on an error's lines
            if again and int(again.group(1)) == rank:
                text = text[again.end():]
        text, event = _events.split(line := text)
        if event and event["kind"] in _events.RESERVED and not (
                event["rank"] == label if event["kind"] == "exit" else
                label == "launcher" and job.popen is None):  # (a rank's own line, not ours)
            text, event = line, None
        if text:  # a line, or a last line without its newline that an event line followed
            self._keep(self.read[index]["logs"].setdefault(rank, []), text)
            if err:
                self._keep(self.read[index]["stderr"].setdefault(rank, []), text)
                self.dumps.get((index, rank), []).append(text)
            self.view.line(f"{job.node}rank{rank}" if isinstance(rank, int) else
                           f"{job.node}{rank}", text, err)
        if event is None:
            return
        if event["kind"] == "report":
            job.report = event  # the agent's last line
            return
        if event["kind"] == "round":
            job.stale = set(job.pids.values())  # a restart: these ranks are gone, for now
            return
        if event["kind"] == "exit":
            job.said_exit[event["rank"]] = (event["code"], float(event["time"]))
            return
        self.read[index]["events"].setdefault(int(event.get(
            "rank", rank if isinstance(rank, int) else 0)), []).append(event)
        self.view.event(event)
        answer = self.on_event(event) if self.on_event is not None else None
        if isinstance(answer, (int, float)) and not isinstance(answer, bool) and answer == answer:
            self.stop_at = min(self.stop_at, time.monotonic() + max(0.0, answer))

    def _keep(self, lines: list[str], text: str) -> None:
        """Append ``text``; past twice ``keep`` lines, the oldest go, and the first line says
        how many went."""
        lines.append(f"{text[:self.longest]} [cut]" if len(text) > self.longest else text)
        if len(lines) > 2 * self.keep:
            said = _NOT_KEPT.match(lines[0])
            gone = len(lines) - self.keep + (int(said[1]) if said else 1)
            lines[:len(lines) - self.keep + 1] = [f"[ddplab: {gone} earlier lines not kept]"]
