"""What a launch returns (``RunResult``): exit facts from the agent's report (by pid) and each
rank's own ``exit`` event; a torchrun subprocess adds its error report, an mp.spawn script
only its exit code."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from .causes import (EXIT_ABORT, NO_RANK_HINT, Logs, RankFailure, failures_from_output,
                     hint_for, mark_exit_aborts, root_cause, short_message, signal_name,
                     stderr_cause, traceback_tail)

if TYPE_CHECKING:
    from .jobs import Job

__all__ = ["RunResult", "RankFailure", "EXIT_ABORT", "hint_for", "job_outcome",
           "share_root_cause", "spawn_outcome"]


@dataclass
class RunResult:
    """What a launch returns: status, per-rank exit codes, logs, events and the root cause.

    ``status`` is one of ``ok``, ``failed``, ``timeout``, ``interrupted``, ``error``; ``ok`` is
    True only for ``ok``. ``exit_codes[rank]`` is None where the launcher does not know it: a
    rank it stopped because another rank failed, a rank still running at a timeout (listed in
    ``still_running``, its stack in ``stacks``) or an interrupt, and with engine "spawn" a rank
    whose end only the launching script saw. After a timeout, a rank that had already failed
    is the ``root_cause``.

    ``logs[rank]`` holds the lines known to come from that rank; ``logs["launcher"]`` the
    launcher's own lines (torchrun's agent, or with engine "spawn" the launching script) and
    every line that does not say which rank wrote it: ``mp.spawn`` ranks share their parent's
    stdout, and only lines carrying a ``[rankN]`` prefix (``ddplab.dist.setup()`` adds one, as
    does PyTorch to an error of a rank in a process group) can be told apart.
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
    #: After a timeout: the ranks still running then, and for each the text of its Python
    #: stack dump (every thread, innermost frame first, with file paths and line numbers);
    #: empty when nothing timed out (or the ranks could not be asked: subprocess paths).
    still_running: list[int] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)
    #: After a timeout with ``flight_recorder=True``: rank -> the collective it waited in (None:
    #: in none), from torch's Flight Recorder (``ddplab.flight_recorder.Collective``).
    waits: dict[int, Any] = field(default_factory=dict)

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
        def keys(mapping: dict[Any, Any]) -> dict[str, Any]:
            return {str(key): value for key, value in mapping.items()}

        return {
            "status": self.status, "ok": self.ok, "returncode": self.returncode,
            "wall_time": self.wall_time, "world_size": self.world_size, "engine": self.engine,
            "exit_codes": keys(self.exit_codes), "pids": keys(self.pids),
            "error": self.error, "still_running": self.still_running,
            "stacks": keys(self.stacks),
            "waits": keys({rank: c and asdict(c) for rank, c in self.waits.items()}),
            "root_cause": asdict(self.root_cause) if self.root_cause else None,
            "job_root_cause": asdict(self.job_root_cause) if self.job_root_cause else None,
            "summary": self.summary, "events": keys(self.events), "logs": keys(self.logs),
        }

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


def fail(result: RunResult, cause: RankFailure, engine: str,
          logs: dict[Union[int, str], list[str]], stderr: dict[Union[int, str], list[str]]
          ) -> None:
    """Record ``cause`` as the result's failure, with a hint when ddplab knows the fix; with
    no exception line (``sys.exit("...")``), the end of its stderr is the message."""
    where: Union[int, str] = "launcher" if cause.rank is None else cause.rank
    if not cause.message and not cause.traceback and cause.signal is None:
        cause.message, cause.traceback = stderr_cause(stderr.get(where, [])[-50:])
    if not cause.hint:
        text = "\n".join([cause.message, cause.traceback, *stderr.get(where, []),
                          *logs.get(where, [])[-50:], *stderr.get("launcher", [])[-50:]])
        cause.hint = hint_for(text, engine)
    result.status, result.returncode = "failed", 1
    result.root_cause = cause
    result.error = str(cause)


def job_outcome(job: Job, read: dict[str, Any], status: str, wall: float, timeout: float,
                running: list[int], stacks: dict[int, str], timed_out_at: float = 0.0
                ) -> RunResult:
    """Build one job's RunResult (``read``: its logs, stderr and events, see ``output``;
    ``timed_out_at``: the ``time.time()`` of a timeout, before anything was ended)."""
    logs, stderr = read["logs"], read["stderr"]
    result = RunResult(status="ok", returncode=0, wall_time=wall, world_size=job.world_size,
                       logs=logs, events=read["events"], engine=job.engine,
                       pids=dict(job.pids) or job.spawned_ranks() or {})
    if status == "interrupted":
        result.status, result.returncode = "interrupted", 130
        result.error = "interrupted: every process of the job was ended."  # shown once
        return result
    if job.engine == "spawn" and status != "timeout":
        code = job.popen.returncode if job.popen is not None else None
        return spawn_outcome(result, code, job.spawned_ranks(), job.said_exit, logs, stderr)
    if status == "timeout":
        return _timed_out(result, job, timeout, running, stacks, timed_out_at)
    if job.popen is not None:
        return _subprocess_outcome(result, job, logs, stderr)
    report, exits = job.report, job.exits()
    if report.get("status") not in ("ok", "failed") and not job.stuck:
        result.status, result.returncode = "error", 1
        result.error = "the launcher failed:\n" + "\n".join(logs.get("launcher", [])[-30:])
        if report.get("error"):
            result.error += f"\n{report.get('traceback') or report['error']}"
        return result
    clean = report.get("status") == "ok"
    result.exit_codes = {rank: exits[rank][0] if rank in exits else (0 if clean else None)
                         for rank in sorted(job.pids)}
    failures = _failed(result.exit_codes, logs)
    if job.stuck:
        failures += [RankFailure(rank=rank, exitcode=None, message=(
            "ended without returning to the launcher (os._exit or a crash of the "
            "interpreter); end worker scripts normally or with sys.exit"))
            for rank in sorted(job.pids) if rank not in job.said_exit
            and result.exit_codes.get(rank) in (0, None)]
    if failures:
        mark_exit_aborts(failures, logs, job.said_exit, stderr)
        fail(result, root_cause(failures, exits), job.engine, logs, stderr)
    return result


def _timed_out(result: RunResult, job: Job, timeout: float, running: list[int],
               stacks: dict[int, str], wall_clock_at_timeout: float) -> RunResult:
    """A timeout keeps what is known: exit codes of ranks that had ended, and who still ran."""
    exits = job.exits(before=wall_clock_at_timeout)
    ranks = sorted(job.pids) or sorted(result.pids) if job.engine == "spawn" else \
        sorted(job.pids) or list(range(job.world_size))  # (a subprocess's ranks: unknown)
    result.exit_codes = {rank: None if rank in running else exits.get(rank, (None,))[0]
                         for rank in ranks}
    result.still_running, result.stacks = list(running), dict(stacks)
    failures = _failed(result.exit_codes, result.logs)
    if failures:
        result.root_cause = root_cause(failures, exits)
    result.status, result.returncode = "timeout", 124
    where = f"; still running: {', '.join(f'rank {r}' for r in running)}" if running else ""
    seen = " (their Python stacks are in result.stacks)" if stacks else ""
    result.error = f"timed out after {timeout:g} s{where}{seen}: every process of the job " \
                   f"was ended."
    if result.root_cause is not None:
        result.error += f"\nbefore that, {result.root_cause}"
    return result


def _failed(codes: dict[int, Optional[int]], logs: Logs) -> list[RankFailure]:
    """A failure for every rank whose exit code is known and not 0, with its last error."""
    return [RankFailure(rank=rank, exitcode=code, signal=signal_name(code),
                        message=short_message(logs.get(rank, [])),
                        traceback=traceback_tail(logs.get(rank, [])))
            for rank, code in codes.items() if code not in (0, None)]


def _subprocess_outcome(result: RunResult, job: Job, logs: Logs, stderr: Logs) -> RunResult:
    """A torchrun subprocess: the failed ranks as its error report names them."""
    code = job.popen.returncode if job.popen is not None else None
    found = failures_from_output(code or 0, logs, ranks_only=True)
    if code and not found:  # torchrun itself failed, before any rank did
        message, tail = stderr_cause(stderr.get("launcher", []))
        found = [RankFailure(rank=None, exitcode=code, signal=signal_name(code),
                             message=message, traceback=tail)]
    result.exit_codes = {r: (None if found else 0) for r in range(job.world_size)}
    # each rank said how its script ended (its ``exit`` event, see ``entry.main``)
    result.exit_codes.update({rank: said[0] for rank, said in job.said_exit.items()
                              if rank in result.exit_codes})
    result.exit_codes.update({f.rank: f.exitcode for f in found if f.rank is not None})
    if found:
        mark_exit_aborts(found, logs, job.said_exit, stderr)
        fail(result, root_cause(found, job.said_exit), job.engine, logs, stderr)
    return result


def share_root_cause(results: list[RunResult], jobs: list[Job]) -> None:
    """Give every node's result the first genuine failure across all nodes of the job."""
    causes = [r.root_cause for r in results if r.root_cause is not None]
    if not causes:
        return
    exits = {rank: ended for job in jobs for rank, ended in job.exits().items()}
    first = root_cause(causes, exits)
    for result in results:
        result.job_root_cause = first
        if len(results) > 1 and result.root_cause is not first:
            where = next(i for i, r in enumerate(results) if r.root_cause is first)
            result.error = (f"{result.error}\n" if result.error else "") + \
                f"first failure of the whole job, on node {where}: {first}"


def spawn_outcome(result: RunResult, code: Optional[int], ranks: Optional[dict[int, int]],
                  exits: dict[int, tuple[int, float]], logs: dict[Union[int, str], list[str]],
                  stderr: dict[Union[int, str], list[str]]) -> RunResult:
    """What is known of an ``mp.spawn`` script's ranks (their exit codes reach the script):
    the processes seen (``ranks``, None where unwatchable), lines with a rank, mp.spawn's
    report of a failed rank, and the script's exit code (0: every rank exited with 0)."""
    found = failures_from_output(code or 0, logs, ranks_only=True) if code else []
    mark_exit_aborts(found, logs, exits, stderr)
    seen = set(ranks or {}) | {r for r in logs if isinstance(r, int)} | {
        f.rank for f in found if f.rank is not None}
    count = max(seen) + 1 if seen else 0
    if ranks is None and not count:
        result.exit_codes = {}
        if code:
            message, tail = stderr_cause(stderr.get("launcher", []))
            fail(result, RankFailure(rank=None, exitcode=code, signal=signal_name(code),
                                     message=message, traceback=tail), "spawn", logs, stderr)
        return result
    result.world_size, result.pids = count, ranks or {}
    codes: dict[int, Optional[int]] = {rank: None for rank in range(count)}
    if code == 0:
        codes.update({rank: 0 for rank in seen})
    codes.update({f.rank: f.exitcode for f in found if f.rank is not None})
    result.exit_codes = codes
    if found:
        fail(result, root_cause(found, exits), "spawn", logs, stderr)
    elif code != 0 or not count:
        message, tail = stderr_cause(stderr.get("launcher", []))
        cause = RankFailure(rank=None, exitcode=code, signal=signal_name(code),
                            message=message, traceback=tail)
        if not count:
            cause.when = "before starting any rank" if code else "without starting any rank"
            cause.hint = "" if code else NO_RANK_HINT
        fail(result, cause, "spawn", logs, stderr)
    return result


