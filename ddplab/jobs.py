"""Starting a launch: one ``Job`` per torchrun agent or subprocess, and the preloaded helper.

``launcher.py`` decides what to run and ``streams.py`` reads the output; this module only
starts processes and knows how to end them (each job is one process group).

Lesson: every notebook that launches workers (01-09).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

MAX_FDS = 64  # file descriptors one request to the helper may carry (ddplab.agent._MAX_FDS)

# What training workers import on top of torch (DDP's constructor alone imports torch._dynamo,
# seconds per process): the helper imports these once, so every later fork has them.
PRELOAD_TRAINING = ("torch._dynamo", "torchvision", "ddplab.data", "ddplab.models",
                    "ddplab.checkpoint", "ddplab.train")


@dataclass
class Job:
    """One started launch: where its output comes from and how to end it."""

    world_size: int
    engine: str
    pgid: int
    sources: dict[int, Union[int, str]]  # fd -> rank label (local rank int) or "launcher"
    node: str = ""
    err_fds: set[int] = field(default_factory=set)  # the sources that carry stderr
    report_fd: Optional[int] = None
    popen: Optional[subprocess.Popen] = None
    report: bytes = b""
    nproc_per_node: int = 1
    rank_of: dict[Union[int, str], int] = field(default_factory=dict)  # source label -> rank
    pids: dict[int, int] = field(default_factory=dict)
    exits: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (code, time)
    workers_gone_at: Optional[float] = None
    stuck: bool = False
    # engine "spawn": the processes the script started with mp.spawn (pid -> start time), as
    # seen in /proc while the job ran; their exit codes are the script's to know, not ours.
    spawned: dict[int, int] = field(default_factory=dict)
    _not_ranks: set[int] = field(default_factory=set)
    _forks: set[int] = field(default_factory=set)
    _watched_at: float = 0.0

    def workers_gone(self) -> bool:
        """True once every local worker has reported its pid and none of them runs any more."""
        if self.popen is not None or len(self.pids) < self.nproc_per_node:
            return False
        return not any(_running(pid) for pid in self.pids.values())

    def alive(self) -> bool:
        """True while a process of the job runs (zombies waiting for their reaper do not)."""
        if self.popen is not None and self.popen.poll() is None:
            return True
        return _group_running(self.pgid)

    def watch_spawned(self, every: float = 0.2) -> None:
        """Note the rank processes an ``mp.spawn`` script has started (engine "spawn").

        A rank is a child of the script (or, with the forkserver start method, of its
        forkserver) that runs multiprocessing's ``spawn_main``, or a fork of the script (the fork
        start method) still running as the script two looks apart. Any other child is not a rank:
        multiprocessing's resource tracker, and short-lived programs the script or its imports
        run (``import torch`` runs ``ldconfig -p``), which a fork looks like until it executes.
        """
        now = time.monotonic()
        if self.popen is None or self.engine != "spawn" or now - self._watched_at < every:
            return
        self._watched_at = now
        script = _cmdline(self.popen.pid)
        parents = {self.popen.pid}
        table = _process_table(self.pgid)
        for pid, (ppid, _start) in table.items():
            if ppid == self.popen.pid and "multiprocessing.forkserver" in _cmdline(pid):
                parents.add(pid)
        for pid, (ppid, start) in table.items():
            if ppid not in parents or pid in parents or pid in self.spawned \
                    or pid in self._not_ranks:
                continue
            command = _cmdline(pid)
            if "spawn_main" in command or ppid != self.popen.pid:
                self.spawned[pid] = start
            elif command != script:
                self._not_ranks.add(pid)
            elif pid in self._forks:
                self.spawned[pid] = start
            else:
                self._forks.add(pid)  # a rank if it still runs as the script next time

    def spawned_ranks(self) -> Optional[dict[int, int]]:
        """The spawned processes seen, as rank -> pid (in the order they were started).

        None where processes cannot be watched (no ``/proc``: not Linux).
        """
        if not os.path.isdir("/proc"):
            return None
        order = sorted(self.spawned, key=lambda pid: (self.spawned[pid], pid))
        return dict(enumerate(order))

    def kill(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self, grace: float = 3.0) -> None:
        """SIGTERM the job's process group, then SIGKILL whatever is left after ``grace``."""
        self.kill(signal.SIGTERM)
        end = time.monotonic() + grace
        while self.alive() and time.monotonic() < end:
            time.sleep(0.02)
        self.kill(signal.SIGKILL)

    def reap(self) -> None:
        """Wait for the job's processes to be gone (killing stragglers that kept running)."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.popen.wait()
        end = time.monotonic() + 5.0
        while self.alive() and time.monotonic() < end:
            time.sleep(0.02)
        if self.alive():
            self.kill(signal.SIGKILL)


def _group_running(pgid: int) -> bool:
    """True while a process of group ``pgid`` runs.

    A zombie does not count: an orphan of the job (multiprocessing's resource tracker, say)
    waits as a zombie until PID 1 reaps it, which takes a second in some containers and
    forever in others.
    """
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not sys.platform.startswith("linux"):
        return True
    return bool(_process_table(pgid))


def _process_table(pgid: int) -> dict[int, tuple[int, int]]:
    """Running (non-zombie) processes of group ``pgid``: pid -> (parent pid, start time)."""
    found: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            found[int(name)] = (int(fields[1]), int(fields[19]))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (Linux: read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class AgentServer:
    """The kernel's handle on its ``ddplab.agent`` process (one per calling process)."""

    _lock = threading.Lock()
    _current: Optional["AgentServer"] = None

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddplab.agent", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], start_new_session=True,
            stdin=subprocess.DEVNULL, cwd=os.getcwd(), env=child_env(os.environ),
        )
        theirs.close()
        self.sock.settimeout(300)
        if self.sock.recv(4096) != b'{"ready": true}':
            raise RuntimeError("ddplab.agent did not start: see the messages above.")
        self.sock.settimeout(None)

    @classmethod
    def get(cls) -> "AgentServer":
        if cls._current is None or cls._current.proc.poll() is not None:
            cls._current = cls()
        return cls._current

    def request(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        socket.send_fds(self.sock, [json.dumps(req).encode()], fds)
        return json.loads(self.sock.recv(1 << 16).decode())

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def child_env(base: Any, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of the job: the caller's, ``extra`` on top, this package importable."""
    merged = {str(k): str(v) for k, v in dict(base).items()}
    merged.update({str(k): str(v) for k, v in (extra or {}).items()})
    root = str(Path(__file__).resolve().parent.parent)
    paths = merged.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        merged["PYTHONPATH"] = os.pathsep.join(p for p in [root, *paths] if p)
    merged.setdefault("PYTHONUNBUFFERED", "1")
    return merged


class FastPathRefused(RuntimeError):
    """The helper will not fork workers in this session; launch through a subprocess."""


_REFUSED: list[str] = []  # why the helper refused to fork, once it has (for this session)


def fast_path_unavailable() -> Optional[str]:
    """Why launches cannot fork from the preloaded helper here, or None when they can.

    The helper is a fresh interpreter (started by exec, never forked from the caller), so a
    caller that has already initialised CUDA does not matter; what matters is CUDA in the
    helper itself, which the helper checks before every fork (see ``start_fast``).
    """
    if os.environ.get("DDPLAB_LAUNCH_PATH", "") == "subprocess":
        return "DDPLAB_LAUNCH_PATH=subprocess asks for it"
    if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
        return f"fast launches fork workers from a helper process, which needs Linux " \
               f"(this is {sys.platform})"
    return _REFUSED[0] if _REFUSED else None


def start_fast(target: str, args: list[str], nprocs: int, job_env: dict[str, str], cwd: str,
               threads: int, nnodes: int, node_rank: int, endpoint: str, run_id: str,
               preload: bool = True, max_restarts: int = 0) -> Job:
    """Start a torchrun-engine job through the preloaded ``ddplab.agent`` helper.

    Raises:
        FastPathRefused: the helper cannot fork workers safely (CUDA is initialised in it).
    """
    rank_pipes = [os.pipe() for _ in range(nprocs)]
    # A second pipe per rank for its stderr (a helper that predates them writes both streams to
    # the first pipe, and these simply close); beyond the fds one request may carry, one pipe.
    err_pipes = [os.pipe() for _ in range(nprocs)] if 2 + 2 * nprocs <= MAX_FDS else []
    log_r, log_w = os.pipe()
    report_r, report_w = os.pipe()
    req = {
        "op": "launch", "target": target, "args": args, "nproc_per_node": nprocs,
        "nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": endpoint, "run_id": run_id,
        "env": job_env, "cwd": cwd, "threads": threads, "max_restarts": max_restarts,
        "preload": list(PRELOAD_TRAINING) if preload else [],
        "local_addr": "127.0.0.1" if endpoint.startswith(("127.", "localhost")) else None,
    }
    write_ends = [report_w, log_w, *[w for _r, w in rank_pipes + err_pipes]]
    try:
        with AgentServer._lock:
            reply = AgentServer.get().request(req, write_ends)
    finally:
        for fd in write_ends:
            os.close(fd)
    if "refused" in reply:
        for fd in [report_r, log_r, *[r for r, _w in rank_pipes + err_pipes]]:
            os.close(fd)
        _REFUSED.append(str(reply["refused"]))
        raise FastPathRefused(reply["refused"])
    sources: dict[int, Union[int, str]] = {log_r: "launcher"}
    sources.update({r: i for i, (r, _w) in enumerate(rank_pipes)})
    sources.update({r: i for i, (r, _w) in enumerate(err_pipes)})
    # The agent's own log is torchrun's stderr: its warnings and errors.
    err_fds = {log_r, *[r for r, _w in err_pipes]}
    return Job(world_size=nprocs * nnodes, engine="torchrun", pgid=int(reply["pid"]),
                sources=sources, report_fd=report_r, nproc_per_node=nprocs, err_fds=err_fds)


def popen_job(cmd: list[str], job_env: dict[str, str], cwd: str, world_size: int,
               engine: str) -> Job:
    """Start a subprocess in its own session; its stdout and stderr are read apart.

    Ranks share these two pipes; their lines are told apart by a ``[rankN]`` prefix (torchrun's
    ``--log-line-prefix-template``, or ``ddplab.dist``'s for ``mp.spawn`` ranks).
    """
    from .agent import set_parent_death_signal

    proc = subprocess.Popen(
        cmd, cwd=cwd, env=job_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, preexec_fn=set_parent_death_signal,
    )
    out = os.dup(proc.stdout.fileno())  # the launcher owns and closes these copies
    err = os.dup(proc.stderr.fileno())
    proc.stdout.close()
    proc.stderr.close()
    return Job(world_size=world_size, engine=engine, pgid=proc.pid, popen=proc,
               sources={out: "launcher", err: "launcher"}, err_fds={err})


def torchrun_cmd(target: str, args: list[str], nprocs: int, nnodes: int, node_rank: int,
                  endpoint: str, run_id: str, max_restarts: int = 0) -> list[str]:
    """The ``python -m torch.distributed.run`` command line for the installed torch.

    Every output line gets a ``[rankN]:`` prefix (``--tee 3`` and a prefix template). torchrun
    takes the template as ``--log-line-prefix-template`` since torch 2.14; older releases (2.6
    to 2.13) read it from ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` only, so there the command
    starts with ``env`` setting that variable. The version comes from the package metadata:
    torch is not imported here.
    """
    import re
    import shutil
    from importlib.metadata import version

    template = "[rank${rank}]:"
    release = tuple(int(x) for x in re.findall(r"\d+", version("torch"))[:2])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc-per-node", str(nprocs), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", str(max_restarts),
           "--tee", "3"]
    if release >= (2, 14):
        cmd += ["--log-line-prefix-template", template]
    else:
        cmd = [shutil.which("env") or "/usr/bin/env",
               f"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE={template}", *cmd]
    if nnodes > 1:
        cmd += ["--node-rank", str(node_rank)]
    else:  # the only node hosts the store (torch would guess from the hostname)
        cmd += ["--rdzv-conf", "is_host=1"]
    if endpoint.startswith("127."):
        cmd += ["--local-addr", "127.0.0.1"]
    return cmd + (["-m", target] if not os.path.isabs(target) else [target]) + args
