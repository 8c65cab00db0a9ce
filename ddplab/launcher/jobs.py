"""A started launch (``Job``): one process group, the agent's (``start_forked``) or a
subprocess's (``fallback``); where its output comes from, how it ends."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..env import age, cmdline, process_table, running, start_time
from .helper import HELPER_TOKEN, Helper
from .procs import group_running, kill_group, rank_channel

# Imported once by the helper, so that no forked worker pays seconds for them (DDP: dynamo).
PRELOAD_TRAINING = ("torch._dynamo", "torchvision", "ddplab.data", "ddplab.models",
                    "ddplab.checkpoint", "ddplab.train")


@dataclass
class Job:
    """One started launch: where its output comes from and how to end it."""

    world_size: int
    engine: str
    pgid: int
    sources: dict[int, Union[int, str]]  # fd -> rank, "launcher", or "accept" (the socket)
    node: str = ""
    err_fds: set[int] = field(default_factory=set)  # the sources that carry stderr
    popen: Optional[subprocess.Popen] = None
    helper: Optional[subprocess.Popen] = None  # (the fork path's helper, its agent's parent)
    report: dict[str, Any] = field(default_factory=dict)  # the agent's last word
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid (it said so; stacks)
    started: dict[int, Optional[int]] = field(default_factory=dict)  # pid -> its start time
    said_exit: dict[int, tuple[int, float]] = field(default_factory=dict)  # its "exit" event
    workers_gone_at: Optional[float] = None
    stale: set[int] = field(default_factory=set)  # the pids of ranks before the last restart
    stuck: bool = False
    # engine "spawn": the processes its script started (pid -> start time), seen in /proc
    spawned: dict[int, int] = field(default_factory=dict)
    _not_ranks: set[int] = field(default_factory=set)
    _watched_at: float = 0.0
    on_reap: Optional[Callable[[], None]] = None  # (a torchrun subprocess: end what it left)

    def ended(self) -> bool:
        """True once the agent (after every rank) or the subprocess has exited."""
        if self.popen is not None:
            return self.popen.poll() is not None
        return not running(self.pgid) or start_time(self.pgid) != self.started[self.pgid]

    def exits(self, before: float = math.inf) -> dict[int, tuple[int, float]]:
        """rank -> (exit code, time): each rank's ``exit`` event, then the code of the rank
        torch's agent saw fail (``report``, seen ``before``; a peer it then ended: unknown)."""
        found = dict(self.said_exit)
        for rank, (code, at) in self.report.get("exits", {}).items():
            if at <= before:
                found[int(rank)] = (int(code), found.get(int(rank), (0, float(at)))[1])
        return found

    def running_ranks(self) -> list[int]:
        """The ranks that said who they are and whose script still runs."""
        return sorted(rank for rank, pid in self.pids.items()
                      if running(pid) and rank not in self.said_exit)

    def workers_gone(self) -> bool:
        """True once every forked worker has said its pid and none of them runs any more."""
        if self.popen is not None or len(self.pids) < self.world_size \
                or self.stale & set(self.pids.values()):  # (restarting: not all said again)
            return False
        return not any(running(pid) for pid in self.pids.values())

    def alive(self) -> bool:
        """True while a process of the job runs (zombies waiting for their reaper do not)."""
        if self.popen is not None and self.popen.poll() is None:
            return True
        return group_running(self.pgid)

    def watch_spawned(self, every: float = 0.2, young: float = 0.1) -> None:
        """Note an ``mp.spawn`` script's ranks: its children running ``spawn_main``, its
        forkserver's, and its forks still the script at ``young`` s old (one about to run a
        program is a copy of it for a moment) and never seen running another."""
        now = time.monotonic()
        if self.popen is None or self.engine != "spawn" or now - self._watched_at < every:
            return
        self._watched_at = now
        script, table = cmdline(self.popen.pid), process_table(self.pgid)
        servers = {pid for pid, (ppid, _start) in table.items() if ppid == self.popen.pid
                   and "multiprocessing.forkserver" in cmdline(pid)}
        for pid, (ppid, start) in table.items():
            if ppid not in servers | {self.popen.pid} or pid in self._not_ranks \
                    or not (command := cmdline(pid)):
                continue  # (a command line empty mid-exec or exiting: looked at again later)
            if ppid in servers or "spawn_main" in command \
                    or command == script and age(start) >= young:
                self.spawned[pid] = start
            elif command != script:  # (a program, or the forkserver, seen as the script once)
                self._not_ranks.add(pid)
                self.spawned.pop(pid, None)

    def spawned_ranks(self) -> Optional[dict[int, int]]:
        """The spawned processes seen, rank -> pid (None without ``/proc``)."""
        if not os.path.isdir("/proc"):
            return None
        return dict(enumerate(sorted(self.spawned, key=lambda pid: (self.spawned[pid], pid))))

    def __post_init__(self) -> None:
        self.started[self.pgid] = start_time(self.pgid)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        kill_group(self.pgid, sig, self.started[self.pgid])
        if sig == signal.SIGKILL and self.on_reap is not None:
            self.on_reap()

    def reap(self) -> None:
        """End what the ranks left in the job's group (SIGTERM, SIGKILL 1 s later)."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.popen.wait()
        if self.alive():
            end_jobs([self], grace=1.0)
        if self.on_reap is not None:
            self.on_reap()


def end_jobs(jobs: list[Job], grace: float = 0.0, wait: float = 10.0) -> None:
    """Signal every job, then wait (``grace``: SIGTERM first); an exception meanwhile (a
    second Ctrl-C) is raised again once every job had the signal."""
    pending: list[BaseException] = []

    def signal_all(sig: int) -> None:
        for job in jobs:
            try:
                job.kill(sig)
            except BaseException as exc:  # noqa: BLE001  (raised below, after every job)
                pending.append(exc)
                job.kill(sig)

    def wait_all(seconds: float) -> None:
        end = time.monotonic() + seconds
        while any(job.alive() for job in jobs) and time.monotonic() < end:
            time.sleep(0.02)

    if grace > 0:
        signal_all(signal.SIGTERM)
        if not pending:
            wait_all(grace)
    signal_all(signal.SIGKILL)
    if pending:
        raise pending[0]
    wait_all(wait)


def child_env(base: Any, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The caller's environment, ``extra`` on top, this package importable."""
    merged = {str(k): str(v) for k, v in dict(base).items()}
    merged.update({str(k): str(v) for k, v in (extra or {}).items()})
    merged.pop(HELPER_TOKEN, None)  # a launch from inside a rank has a helper of its own
    root = str(Path(__file__).resolve().parent.parent.parent)
    paths = merged.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        merged["PYTHONPATH"] = os.pathsep.join(p for p in [root, *paths] if p)
    merged.setdefault("PYTHONUNBUFFERED", "1")
    return merged


#: Read once, when Python starts or torch is imported: a rank forked from the helper keeps
#: the helper's values, so a launch that sets others runs as a cold torchrun.
READ_AT_IMPORT = ("PYTHONHASHSEED", "PYTHONOPTIMIZE", "PYTHONDEVMODE", "PYTHONUTF8",
                  "TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT", "TORCH_TRACE",
                  "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES")
#: Set, these make torch's agent start a thread before it forks the ranks (a watchdog, a
#: health-check server): a rank forked beside a thread may hang, so such a launch runs cold.
THREAD_STARTERS = ("TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_HEALTH_CHECK_PORT")
REQUEST_BYTES = 150_000  # the most a launch's request may take (one socket message: ~212 KB)


def fork_changes(job_env: dict[str, str]) -> Optional[str]:
    """Why ``job_env`` cannot reach a rank forked from the helper (None: it can)."""
    helper = Helper._current  # (the one the launch would use, or the one it would start)
    base = helper.env if helper and helper.proc.poll() is None else child_env(os.environ)
    changed = [name for name in READ_AT_IMPORT if job_env.get(name) != base.get(name)]
    if threads := [name for name in THREAD_STARTERS if job_env.get(name, "0") not in ("", "0")]:
        return f"this launch sets {', '.join(threads)}, which starts a thread in torch's agent"
    if (size := len(json.dumps(job_env))) > REQUEST_BYTES:
        return f"this launch's environment ({size // 1000} KB) is too large for the helper"
    return f"this launch sets {', '.join(changed)} otherwise than the launch helper, whose " \
        f"values a forked rank would keep (read once, at start)" if changed else None


def start_forked(spec: Any, job_env: dict[str, str], endpoint: str, run_id: str) -> Job:
    """Start a checked one-node torchrun-engine ``LaunchSpec`` through the helper."""
    # DDPLAB_PRELOAD_TRAINING: 1 (default) the helper imports the training stack first, 0
    # never, "auto" for ddplab's own workers only.
    mode = os.environ.get("DDPLAB_PRELOAD_TRAINING", "1")
    preload = spec.resolved.startswith("ddplab.workers") if mode == "auto" else mode != "0"
    channel, address = rank_channel()
    req = {"op": "launch", "target": spec.resolved, "args": spec.argv, "run_id": run_id,
           "nproc_per_node": spec.nprocs, "rdzv_endpoint": endpoint, "cwd": spec.cwd,
           "threads": spec.threads, "env": {**job_env, "DDPLAB_RANK_SOCKET": address},
           "max_restarts": spec.max_restarts, "preload": PRELOAD_TRAINING if preload else ()}
    try:
        with Helper.lock:
            reply = (helper := Helper.get(child_env(os.environ))).request(req)
    except BaseException:  # (the helper, and what it started for this request, has ended)
        channel.close()
        raise
    return Job(world_size=spec.nprocs, engine="torchrun", pgid=int(reply["pid"]),
               sources={channel.detach(): "accept"}, helper=helper.proc)
