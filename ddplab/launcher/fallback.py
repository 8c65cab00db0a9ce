"""A launch as a subprocess: a cold torchrun (``torch.distributed.run``), or an mp.spawn script.

Engine "spawn" always runs here; engine "torchrun" where the helper cannot fork workers (not
Linux, ``DDPLAB_LAUNCH_PATH=subprocess``, CUDA in the helper), said once. The subprocess leads
a session of its own and dies with the caller; torchrun's ranks run ``entry.main``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Any, Callable, Optional, Union

from .jobs import Job
from .procs import dies_with_parent, kill_marked, socket_folder, whole_lines

JOB_TOKEN = "DDPLAB_JOB"  # in a torchrun subprocess's environment: marks what its job started
_NOTICE_SHOWN: set[str] = set()


def torchrun_subprocess(why: str, target: str, args: list[str], nprocs: int,
                    job_env: dict[str, str], cwd: str, nnodes: int, node_rank: int,
                    endpoint: str, run_id: str, max_restarts: int = 0,
                    **_fast_only: Any) -> tuple[Callable[..., Job], dict[str, Any]]:
    """The same launch through a cold torchrun subprocess; say why once."""
    if "subprocess" not in _NOTICE_SHOWN:
        _NOTICE_SHOWN.add("subprocess")
        print(f"ddplab: launching through a torchrun subprocess (a few seconds a launch): "
              f"{why}.", file=sys.stderr)
    cmd = torchrun_cmd("ddplab.launcher.entry", [target, *args], nprocs, nnodes, node_rank,
                       endpoint, run_id, max_restarts)
    return start_subprocess, dict(cmd=cmd, job_env={**job_env, JOB_TOKEN: os.urandom(8).hex()},
                           cwd=cwd, world_size=nprocs * nnodes, engine="torchrun")


def start_subprocess(cmd: list[str], job_env: dict[str, str], cwd: str, world_size: int,
              engine: str) -> Job:
    """Start a subprocess in its own session; its stdout and stderr are read apart.

    torchrun's ranks share these two pipes; their lines are told apart by a ``[rankN]``
    prefix (``--log-line-prefix-template``). An ``mp.spawn`` script's ranks set up by
    ``ddplab.dist`` connect to a socket of the launcher's instead (``DDPLAB_RANK_SOCKET``),
    one connection per rank and stream, so that their lines, however long, arrive whole and
    attributed: ranks writing to one shared pipe cut into each other's long lines.
    """
    channel = None
    if engine == "spawn" and hasattr(socket, "AF_UNIX"):
        channel, address = _rank_channel()
        job_env = {**job_env, "DDPLAB_RANK_SOCKET": address}
    # torchrun, told by SIGTERM, ends its workers first
    cmd = dies_with_parent(cmd, signal.SIGTERM if engine == "torchrun" else signal.SIGKILL)
    proc = subprocess.Popen(cmd, cwd=cwd, env=job_env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    job = _popen_as_job(proc, world_size, engine, channel)
    if JOB_TOKEN in job_env:  # what the ranks left, also in sessions of their own, goes too
        job.on_reap = lambda: kill_marked(JOB_TOKEN, job_env[JOB_TOKEN])
    return job


def _rank_channel() -> tuple[socket.socket, str]:
    """A listening UNIX socket for an mp.spawn script's ranks, and its address as
    ``DDPLAB_RANK_SOCKET`` says it: ``@name`` in Linux's abstract namespace (nothing on disk),
    elsewhere a path in a private temporary folder (removed at exit)."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if sys.platform.startswith("linux"):
        address = f"@ddplab-ranks-{os.getpid()}-{os.urandom(8).hex()}"
        channel.bind("\0" + address[1:])
    else:
        address = os.path.join(socket_folder("ddplab-ranks-"), "ranks")
        channel.bind(address)
    channel.listen(128)
    return channel, address


def _popen_as_job(proc: subprocess.Popen, world_size: int, engine: str,
                  channel: Optional[socket.socket]) -> Job:
    out = os.dup(proc.stdout.fileno())  # the launcher owns and closes these copies
    err = os.dup(proc.stderr.fileno())
    proc.stdout.close()
    proc.stderr.close()
    sources: dict[int, Union[int, str]] = {out: "launcher", err: "launcher"}
    if channel is not None:
        sources[channel.detach()] = "accept"
    return Job(world_size=world_size, engine=engine, pgid=proc.pid, popen=proc,
               sources=sources, err_fds={err})


def torchrun_options(nprocs: int, nnodes: int, node_rank: int, endpoint: str, run_id: str,
                     max_restarts: int = 0) -> tuple[list[str], dict[str, str]]:
    """torchrun's options for this launch, and the environment they need.

    torchrun looks at its workers every 20 ms (its default, 100 ms, is a tenth of a second
    added to every launch). Every output line gets a ``[rankN]:`` prefix (``--tee 3`` and a
    prefix template). torchrun takes the template as ``--log-line-prefix-template`` since
    torch 2.14; older releases (2.6 to 2.13) read it from ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` only. The version comes
    from the package metadata: torch is not imported here.
    """
    import re
    from importlib.metadata import version

    template = "[rank${rank}]:"
    release = tuple(int(x) for x in re.findall(r"\d+", version("torch"))[:2])
    options = ["--nnodes", str(nnodes), "--nproc-per-node", str(nprocs), "--rdzv-backend",
               "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts",
               str(max_restarts), "--tee", "3", "--monitor-interval", "0.02"]
    env: dict[str, str] = {}
    if release >= (2, 14):
        options += ["--log-line-prefix-template", template]
    else:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = template
    if nnodes > 1:
        options += ["--node-rank", str(node_rank)]
    else:  # the only node hosts the store (torch would guess from the hostname)
        options += ["--rdzv-conf", "is_host=1"]
    if endpoint.startswith("127."):
        options += ["--local-addr", "127.0.0.1"]
    return options, env


def torchrun_cmd(target: str, args: list[str], nprocs: int, nnodes: int, node_rank: int,
                  endpoint: str, run_id: str, max_restarts: int = 0) -> list[str]:
    """The cold torchrun command line for the installed torch (``python -m
    ddplab.launcher.fallback``, which is ``python -m torch.distributed.run`` writing each line
    whole, see ``main``); on torch before 2.14 it starts with ``env`` setting the prefix
    template (see ``torchrun_options``)."""
    import shutil

    options, env = torchrun_options(nprocs, nnodes, node_rank, endpoint, run_id, max_restarts)
    cmd = [sys.executable, "-m", "ddplab.launcher.fallback", *options]
    if env:
        cmd = [shutil.which("env") or "/usr/bin/env",
               *(f"{name}={value}" for name, value in env.items()), *cmd]
    return cmd + (["-m", target] if not os.path.isabs(target) else [target]) + args


def main() -> None:
    """``python -m ddplab.launcher.fallback ARGS``: torchrun, each line it copies written whole.

    torchrun's ``--tee`` copies every rank's lines to its own stdout from one thread per rank;
    with an unbuffered stdout (``PYTHONUNBUFFERED``, which the ranks need to be live) two
    threads' long lines can cut into each other. Here stdout and stderr are line-buffered
    streams whose writes hold a lock, so each copied line reaches the launcher whole.
    """
    import runpy

    whole_lines()
    sys.argv = ["torchrun", *sys.argv[1:]]
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    finally:  # (also when the caller died: SIGTERM, which torchrun raises as an exception)
        kill_marked(JOB_TOKEN, os.environ.get(JOB_TOKEN, ""))


if __name__ == "__main__":
    main()
