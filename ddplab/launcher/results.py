"""What a launch returns (``RunResult``), built by ``job_outcome`` from one job's exit facts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from ..failures import (NO_RANK_HINT, SILENT, RankFailure, echo, explain, failures_of,
                        fatal_signal, reported_exits, root_cause, short_message, signal_name,
                        stderr_cause)

if TYPE_CHECKING:
    from .jobs import Job

__all__ = ["RunResult", "RankFailure", "job_outcome"]


@dataclass
class RunResult:
    """What a launch returns: status (``ok``, ``failed``, ``timeout``, ``interrupted``,
    ``error``), each rank's exit code (None where unknown: a rank still running, or ended by
    the launcher after another rank failed), logs (``"launcher"``: lines no rank claims),
    events, and ``root_cause``, the first genuine failure (not a peer that only lost it)::

        result = ddplab.launch("ddplab.workers.train", 2)
        print(result.exit_codes, result.summary, result.root_cause)
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
    #: The first genuine failure across every node of ``launch_multinode``.
    job_root_cause: Optional[RankFailure] = None
    engine: str = "torchrun"
    pids: dict[int, int] = field(default_factory=dict)
    #: After a timeout: the ranks still running then, each one's Python stack dump; with
    #: ``flight_recorder=True``, each rank's collective then and its Flight Recorder records.
    still_running: list[int] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)
    waits: dict[int, Any] = field(default_factory=dict)
    records: dict[int, Any] = field(default_factory=dict)

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

    def to_dict(self) -> dict[str, Any]:
        """Everything in the result as JSON-able values (``python -m ddplab launch --json``)."""
        return {**asdict(self), "ok": self.ok, "summary": self.summary}

    def check(self) -> "RunResult":
        """Return self when ok, else raise RuntimeError with the root cause."""
        if not self.ok:
            raise RuntimeError(self.error or self.status)
        return self

    def __repr__(self) -> str:
        cause = ""
        if self.root_cause is not None:
            rank = self.root_cause.rank
            cause = f", root_cause={'rank ' + str(rank) if rank is not None else 'launcher'}"
        return (f"RunResult(status={self.status!r}, world_size={self.world_size}, "
                f"wall_time={self.wall_time:.2f}s{cause})")


def job_outcome(job: Job, read: dict[str, Any], status: str, wall: float, why: str,
                running: list[int], stacks: dict[int, str], timed_out_at: float = 0.0
                ) -> RunResult:
    """One job's RunResult from its exit facts: each rank's ``exit`` event, torch's failure
    report (the agent's ``ChildFailedError``, or a subprocess's exit code and printed report)."""
    logs, stderr = read["logs"], read["stderr"]
    watched = job.spawned_ranks()  # (an mp.spawn script's ranks; None: not watchable here)
    result = RunResult(status="ok", returncode=0, wall_time=wall, world_size=job.world_size,
                       logs=logs, events=read["events"], engine=job.engine,
                       pids=dict(job.pids) or watched or {})
    if status == "interrupted":
        result.status, result.returncode = "interrupted", 130
        result.error = "interrupted: every process of the job was ended."  # shown once
        return result
    if status == "timeout":
        return _timed_out(result, job, why, running, stacks, timed_out_at)
    report = job.report.get("status")
    if job.popen is None and report not in ("ok", "failed") and not job.stuck:
        result.status, result.returncode = "error", 1
        said = logs.get("launcher", [])[-30:]
        died = job.helper.poll() if job.helper is not None else None
        if job.report.get("error"):
            said.append(job.report.get("traceback") or job.report["error"])
        elif died is not None:  # (its agent and ranks die with it)
            how = f"by {signal_name(died)}" if died < 0 else f"with status {died}"
            said.append(f"the ddplab launch helper (pid {job.helper.pid}) ended {how} during "
                        f"the launch, and the launch with it (a kill, or the OOM killer: see "
                        f"dmesg); the next launch starts a fresh helper.")
        elif not said:
            said.append(f"its agent (pid {job.pgid}) ended without a report (a kill, or the "
                        f"OOM killer: see dmesg).")
        result.error = "the launcher failed:\n" + "\n".join(said)
        return result
    code = job.popen.returncode if job.popen is not None else None
    reported = reported_exits(logs) if code else {}  # torchrun's or mp.spawn's error report
    if job.engine == "spawn":
        known = set(result.pids) | {r for r in logs if isinstance(r, int)} | set(reported)
        ranks = list(range(max(known) + 1 if known else 0))
        if watched is not None or ranks:  # (the processes seen, in the order they started)
            result.world_size, result.pids = len(ranks), watched or {}
    else:
        ranks = sorted(job.pids) if job.popen is None else list(range(job.world_size))
        known = set(ranks)
    exits = job.exits()
    clean = report == "ok" if job.popen is None else code == 0
    result.exit_codes = {rank: exits[rank][0] if rank in exits else
                         (0 if clean and rank in known else None) for rank in ranks}
    result.exit_codes.update(reported)
    for rank in [rank for rank, code in result.exit_codes.items() if code is None]:
        if (died := fatal_signal(stderr.get(rank, []))) is not None:  # (faulthandler said)
            result.exit_codes[rank], exits[rank] = died, (died, math.inf)  # (when: unknown)
    failures = failures_of(result.exit_codes, logs,
                           logs.get("launcher", []) if job.popen else [])
    if job.stuck:
        failures += [RankFailure(rank=rank, exitcode=None, message=(
            "ended without returning to the launcher (os._exit or a crash of the "
            "interpreter); end worker scripts normally or with sys.exit"))
            for rank in ranks if rank not in job.said_exit
            and result.exit_codes.get(rank) in (0, None)]
    # torch reports the first failure it saw: under load, a peer that lost a killed rank
    silent = [rank for rank in sorted(job.pids) if result.exit_codes.get(rank) is None
              and rank not in job.said_exit and not short_message(logs.get(rank, []))]
    if failures and len(silent) == 1 and job.engine != "spawn" and all(map(echo, failures)):
        failures.append(RankFailure(rank=silent[0], exitcode=None, when=SILENT))
    no_rank = job.engine == "spawn" and watched is not None and not ranks
    if not failures and (code or no_rank):  # the launching process itself failed
        message, tail = stderr_cause(stderr.get("launcher", []))
        cause = RankFailure(rank=None, exitcode=code, signal=signal_name(code), message=message,
                            traceback=tail)
        if no_rank:
            cause.when = "before starting any rank" if code else "without starting any rank"
            cause.hint = "" if code else NO_RANK_HINT
        failures = [cause]
    if failures:
        result.root_cause = explain(failures, exits, logs, stderr, job.said_exit, job.engine)
        result.status, result.returncode, result.error = "failed", 1, str(result.root_cause)
    return result


def _timed_out(result: RunResult, job: Job, why: str, running: list[int],
               stacks: dict[int, str], wall_clock_at_timeout: float) -> RunResult:
    """A timeout keeps the exit codes of ranks that had ended, and who still ran."""
    exits = job.exits(before=wall_clock_at_timeout)
    ranks = sorted(job.pids) or (sorted(result.pids) if job.engine == "spawn" else
                                 list(range(job.world_size)))  # (a subprocess's: unknown)
    result.exit_codes = {rank: None if rank in running else exits.get(rank, (None,))[0]
                         for rank in ranks}
    result.still_running, result.stacks = list(running), dict(stacks)
    if failures := failures_of(result.exit_codes, result.logs):
        result.root_cause = root_cause(failures, exits)
    result.status, result.returncode = "timeout", 124
    where = f"; still running: {', '.join(f'rank {r}' for r in running)}" if running else ""
    seen = " (their Python stacks are in result.stacks)" if stacks else ""
    result.error = f"{why}{where}{seen}: every process of the job was ended."
    result.error += "" if result.root_cause is None else f"\nbefore that, {result.root_cause}"
    return result
