"""What a launch returns, and how a failed job's root cause is found.

``RunResult`` is the record a notebook asserts on; the functions below read per-rank exit codes
and output to name the rank that really failed (not the peers that lost their connection to it).

Lessons: every notebook that launches workers (01-09).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Errors a healthy rank reports when a peer died first: never the root cause.
_SECONDARY = re.compile(
    r"Connection closed by peer|Connection reset by peer|ECONNRESET|Broken pipe|"
    r"SignalException|Socket Timeout|terminated by the launcher",
    re.IGNORECASE,
)


@dataclass
class RankFailure:
    """Why one rank failed: exit code or signal, and the tail of its traceback."""

    rank: int
    exitcode: Optional[int]
    signal: Optional[str] = None
    message: str = ""
    traceback: str = ""

    def __str__(self) -> str:
        how = f"was killed by {self.signal}" if self.signal else f"exited with code {self.exitcode}"
        text = f"rank {self.rank} {how}"
        if self.message:
            text += f": {self.message}"
        if self.traceback:
            text += "\n" + self.traceback
        return text


@dataclass
class RunResult:
    """What a launch returns: status, per-rank exit codes, logs, events and the root cause.

    ``status`` is one of ``ok``, ``failed``, ``timeout``, ``interrupted``, ``error``; ``ok`` is
    True only for ``ok``. ``exit_codes[rank]`` is None for a rank the launcher stopped because
    another rank failed (or a timeout or interrupt came).
    """

    status: str
    returncode: int
    wall_time: float
    world_size: int
    exit_codes: dict[int, Optional[int]] = field(default_factory=dict)
    logs: dict[Union[int, str], list[str]] = field(default_factory=dict)
    events: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    root_cause: Optional[RankFailure] = None
    error: str = ""
    #: The first genuine failure of the whole job: ``root_cause`` for one node; across every
    #: node for ``launch_multinode`` (a node whose ranks only lost their peers points here).
    job_root_cause: Optional[RankFailure] = None
    engine: str = "torchrun"
    pids: dict[int, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def summary(self) -> Optional[dict[str, Any]]:
        """The last ``summary`` event (rank 0's final JSON line), or None."""
        found = self.events_of("summary")
        return found[-1] if found else None

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        """All events of one kind, rank by rank, in the order each rank sent them."""
        return [e for rank in sorted(self.events) for e in self.events[rank] if e["kind"] == kind]

    def log(self, rank: Union[int, str] = 0) -> str:
        """One rank's output (or ``"launcher"``) as text, event lines left out."""
        return "\n".join(self.logs.get(rank, []))

    def check(self) -> "RunResult":
        """Return self when ok, else raise RuntimeError with the root cause."""
        if not self.ok:
            raise RuntimeError(self.error or self.status)
        return self

    def __repr__(self) -> str:
        cause = f", root_cause=rank {self.root_cause.rank}" if self.root_cause else ""
        return (f"RunResult(status={self.status!r}, world_size={self.world_size}, "
                f"wall_time={self.wall_time:.2f}s{cause})")


def signal_name(code: Optional[int]) -> Optional[str]:
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def failures_from_output(code: int, logs: dict[Union[int, str], list[str]]
                         ) -> list[RankFailure]:
    """Failures of a subprocess job, read from torchrun's or mp.spawn's error report."""
    if code == 0:
        return []
    text = "\n".join(logs.get("launcher", []))
    found: list[RankFailure] = []
    for match in re.finditer(r"^\s*rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", text, re.M):
        code = int(match.group(2))
        found.append(RankFailure(rank=int(match.group(1)), exitcode=code,
                                 signal=signal_name(code)))
    for match in re.finditer(r"[Pp]rocess (\d+) terminated with (?:exit code (\d+)|signal "
                             r"(SIG\w+)|the following error)", text):
        exitcode = int(match.group(2)) if match.group(2) else (None if match.group(3) else 1)
        found.append(RankFailure(rank=int(match.group(1)), exitcode=exitcode,
                                 signal=match.group(3)))
    if not found:
        signame = signal.Signals(-code).name if code < 0 else None
        found.append(RankFailure(rank=0, exitcode=code, signal=signame))
    for failure in found:
        lines = logs.get(failure.rank, []) or logs.get("launcher", [])
        failure.traceback = traceback_tail(lines)
        failure.message = short_message(lines)
    return found


def root_cause(failures: list[RankFailure],
                exits: dict[int, tuple[int, float]]) -> RankFailure:
    """The failure that came first and is not a peer's echo of it (e.g. "connection closed").

    A rank killed by SIGTERM was stopped by the launcher after another rank failed, and a
    rank that reports a closed connection lost a peer: both rank after a genuine failure.
    """
    def key(f: RankFailure) -> tuple[bool, float, int]:
        echo = bool(_SECONDARY.search(f.message + "\n" + f.traceback)) or f.signal == "SIGTERM"
        return echo, exits.get(f.rank, (0, 0.0))[1], f.rank
    return sorted(failures, key=key)[0]


def traceback_tail(lines: list[str], limit: int = 25) -> str:
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    return "\n".join(lines[starts[-1]:][-limit:]) if starts else ""


def short_message(lines: list[str]) -> str:
    """The exception line of the last traceback in ``lines``, or ""."""
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b", line):
            return line.strip()
    return ""
