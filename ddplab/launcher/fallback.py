"""A launch as a subprocess of its own session that dies with the caller: a cold torchrun
(several nodes, no fork here: said once), or an mp.spawn script. Its ranks connect to the job's
socket as on the fork path; its own output is the ``launcher``'s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any, Optional

from ..env import dies_with_parent
from .jobs import Job
from .procs import kill_marked, private_folder, rank_channel

JOB_TOKEN = "DDPLAB_JOB"  # in a subprocess's environment: marks what its job started
_NOTICE_SHOWN: set[str] = set()


def torchrun_command(target: str, args: list[str], nprocs: int, nnodes: int, node_rank: int,
                     endpoint: str, run_id: str, max_restarts: int = 0) -> list[str]:
    """A cold torchrun whose ranks run ``entry``; node 0 hosts the store (torch would guess
    from the hostname, and a wrong guess leaves every node waiting)."""
    options = ["--nnodes", str(nnodes), "--nproc-per-node", str(nprocs), "--rdzv-backend",
               "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts",
               str(max_restarts), "--monitor-interval", "0.02",  # (its default: 0.1 s a launch)
               "--node-rank", str(node_rank), "--rdzv-conf", f"is_host={int(node_rank == 0)}"]
    if endpoint.startswith("127."):
        options += ["--local-addr", "127.0.0.1"]
    return [sys.executable, "-m", "ddplab.launcher.fallback", *options,
            "-m", "ddplab.launcher.entry", target, *args]


def start_torchrun(why: Optional[str], spec: Any, job_env: dict[str, str], endpoint: str,
                   run_id: str) -> Job:
    """Start a checked ``LaunchSpec`` as a cold torchrun; say ``why`` once (None: nothing)."""
    if why and why not in _NOTICE_SHOWN:
        _NOTICE_SHOWN.add(why)
        print(f"ddplab: launching through a torchrun subprocess (a few seconds a launch): "
              f"{why}.", file=sys.stderr)
    cmd = torchrun_command(spec.resolved, spec.argv, spec.nprocs, spec.nnodes, spec.node_rank,
                           endpoint, run_id, spec.max_restarts)
    return start_subprocess(cmd, job_env, spec.cwd, spec.nprocs * spec.nnodes, "torchrun")


def start_subprocess(cmd: list[str], job_env: dict[str, str], cwd: str, world_size: int,
                     engine: str) -> Job:
    """Start ``cmd`` in a session of its own, its stdout and stderr read apart; what it leaves
    (in sessions of their own too) is marked, and ends with the job."""
    channel, address, token = *rank_channel(), os.urandom(8).hex()
    # torchrun, told by SIGTERM, ends its workers first
    cmd = dies_with_parent(cmd, signal.SIGTERM if engine == "torchrun" else signal.SIGKILL)
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env={**job_env, "DDPLAB_RANK_SOCKET": address,
                                                   JOB_TOKEN: token},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except BaseException:
        channel.close()
        raise
    out, err = os.dup(proc.stdout.fileno()), os.dup(proc.stderr.fileno())  # (ours to close)
    proc.stdout.close()
    proc.stderr.close()
    return Job(world_size=world_size, engine=engine, pgid=proc.pid, popen=proc, err_fds={err},
               sources={out: "launcher", err: "launcher", channel.detach(): "accept"},
               on_reap=lambda: kill_marked(JOB_TOKEN, token))


def main() -> None:
    """``python -m ddplab.launcher.fallback ARGS``: torchrun, then what its job left ends
    (in sessions of their own too: torchrun ends its ranks, not what they started)."""
    import runpy
    import shutil

    logs = private_folder("ddplab-agent-")  # (torch's log folders; its own would stay in /tmp)
    sys.argv = ["torchrun", "--log-dir", logs, *sys.argv[1:]]
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    finally:  # (also when the caller died: SIGTERM, which torchrun raises as an exception)
        kill_marked(JOB_TOKEN, os.environ.get(JOB_TOKEN, ""))
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main()
