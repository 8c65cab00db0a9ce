"""The launch as a subprocess: a plain ``python -m torch.distributed.run``, or an mp.spawn script.

Used for engine "spawn" always, and for engine "torchrun" where the helper cannot fork workers
(not Linux, ``DDPLAB_LAUNCH_PATH=subprocess``, or CUDA initialised in the helper), said once.
The subprocess leads a session of its own and dies with the caller (torchrun, told by SIGTERM,
ends its workers first).

Lesson: every notebook that launches workers; 03 for engine "spawn".
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Any, Callable, Union

from .jobs import Job
from .procs import set_parent_death_signal

_NOTICE_SHOWN: set[str] = set()


def subprocess_path(why: str, target: str, args: list[str], nprocs: int,
                    job_env: dict[str, str], cwd: str, nnodes: int, node_rank: int,
                    endpoint: str, run_id: str, max_restarts: int = 0, **_fast_only: Any
                    ) -> tuple[Callable[..., Job], dict[str, Any]]:
    """The same launch as a plain torchrun subprocess; say why once per session."""
    if "subprocess" not in _NOTICE_SHOWN:
        _NOTICE_SHOWN.add("subprocess")
        print(f"ddplab: launching through a torchrun subprocess (slower): {why}.",
              file=sys.stderr)
    if job_env.get("DDPLAB_LOCAL_RANK_ARG"):  # torchrun has no such option: ddplab's entry
        target, args = "ddplab.launcher.entry", [target, *args]
    cmd = torchrun_cmd(target, args, nprocs, nnodes, node_rank, endpoint, run_id, max_restarts)
    return popen_job, dict(cmd=cmd, job_env=job_env, cwd=cwd, world_size=nprocs * nnodes,
                           engine="torchrun")


def _torchrun_child() -> None:
    set_parent_death_signal(signal.SIGTERM)


def popen_job(cmd: list[str], job_env: dict[str, str], cwd: str, world_size: int,
              engine: str) -> Job:
    """Start a subprocess in its own session; its stdout and stderr are read apart.

    torchrun's ranks share these two pipes; their lines are told apart by a ``[rankN]``
    prefix (``--log-line-prefix-template``). An ``mp.spawn`` script's ranks set up by
    ``ddplab.dist`` connect to a socket of the launcher's instead (``DDPLAB_RANK_SOCKET``),
    one connection per rank and stream, so that their lines, however long, arrive whole and
    attributed: ranks writing to one shared pipe cut into each other's long lines.
    """
    channel = None
    if engine == "spawn":
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"ddplab-ranks-{os.getpid()}-{os.urandom(8).hex()}"
        channel.bind("\0" + name)
        channel.listen(128)
        job_env = {**job_env, "DDPLAB_RANK_SOCKET": name}
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=job_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_torchrun_child if engine == "torchrun" else set_parent_death_signal,
    )
    out = os.dup(proc.stdout.fileno())  # the launcher owns and closes these copies
    err = os.dup(proc.stderr.fileno())
    proc.stdout.close()
    proc.stderr.close()
    sources: dict[int, Union[int, str]] = {out: "launcher", err: "launcher"}
    if channel is not None:
        sources[channel.detach()] = "accept"
    return Job(world_size=world_size, engine=engine, pgid=proc.pid, popen=proc,
               sources=sources, err_fds={err})


def torchrun_cmd(target: str, args: list[str], nprocs: int, nnodes: int, node_rank: int,
                  endpoint: str, run_id: str, max_restarts: int = 0) -> list[str]:
    """The torchrun command line for the installed torch (``python -m ddplab.launcher.fallback``,
    which is ``python -m torch.distributed.run`` writing each line whole, see ``main``).

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
    cmd = [sys.executable, "-m", "ddplab.launcher.fallback", "--nnodes", str(nnodes),
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


def main() -> None:
    """``python -m ddplab.launcher.fallback ARGS``: torchrun, each line it copies written whole.

    torchrun's ``--tee`` copies every rank's lines to its own stdout from one thread per rank;
    with an unbuffered stdout (``PYTHONUNBUFFERED``, which the ranks need to be live) two
    threads' long lines can cut into each other. Here stdout and stderr are line-buffered
    streams whose writes hold a lock, so each copied line reaches the launcher whole.
    """
    import io
    import runpy

    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=True,
                                            errors="backslashreplace"))
    sys.argv = ["torchrun", *sys.argv[1:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
