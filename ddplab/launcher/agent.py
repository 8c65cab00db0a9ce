"""One elastic agent per launch, forked by the helper: torchrun's engine with forked ranks.

``run_agent`` makes the child a session of its own, then calls PyTorch's ``elastic_launch``
with ``start_method="fork"``; each rank runs ``entry.run_rank``. Exit statuses are read as
ranks end (``_note_exits``), completed by torch's ``ChildFailedError``, and sent back in one
JSON report, by pid.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

from . import entry, stores
from .procs import close_quietly, set_parent_death_signal, write_all

_EXITS: dict[int, tuple[int, float]] = {}  # pid -> (exit code or -signal, time it ended)


def run_agent(req: dict[str, Any], fds: list[int], helper: int) -> None:
    """Body of the forked agent child: run one elastic launch, write a JSON report, exit."""
    report_fd, log_fd, rank_fds = fds[0], fds[1], fds[2:]
    os.setsid()
    set_parent_death_signal()
    if os.getppid() != helper:  # the helper died before the line above: so must this launch
        os._exit(70)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    close_quietly(log_fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.update(req.get("env") or {})
    if req.get("cwd"):
        os.chdir(req["cwd"])
    signal.signal(signal.SIGCHLD, _note_exits)
    report: dict[str, Any]
    try:
        stores.connect_agent(own_group=True)
        report = _elastic_run(req, rank_fds, report_fd)
    except BaseException as exc:  # the report must always be written
        report = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    _note_exits()
    report["exits"] = {str(pid): ended for pid, ended in _EXITS.items()}
    sys.stdout.flush()
    sys.stderr.flush()
    write_all(report_fd, json.dumps(report).encode())
    os._exit(0)


def _elastic_run(req: dict[str, Any], rank_fds: list[int], report_fd: int) -> dict[str, Any]:
    """Call PyTorch's elastic launcher exactly as torchrun would, with forked workers."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # ddplab reports failures itself, rank by rank; torch's copy of them is noise here.
    # (Workers inherit this through fork; the rank entry turns logging back on.)
    logging.disable(logging.ERROR)
    nnodes = int(req["nnodes"])
    configs: dict[str, Any] = {"timeout": int(req.get("rdzv_timeout", 900))}
    if nnodes == 1:
        backend = stores.RDZV_BACKEND
    else:
        backend = stores.RDZV_NODES_BACKEND
        # Node 0 hosts the store; torch would guess from the hostname, and a guess that misses
        # leaves a lone node waiting for a server nobody starts.
        configs["is_host"] = int(req["node_rank"]) == 0
    config = launch_config(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=int(req["nproc_per_node"]),
        run_id=req["run_id"], rdzv_backend=backend, rdzv_endpoint=req["rdzv_endpoint"],
        rdzv_configs=configs, max_restarts=int(req.get("max_restarts", 0)),
        monitor_interval=0.01, start_method="fork", local_addr=req.get("local_addr"),
        shutdown_timeout=int(req.get("shutdown_timeout", 5)),
    )
    try:
        elastic_launch(config, entry.run_rank)(req["target"], req["args"], rank_fds,
                                               int(req["threads"]), [report_fd])
    except ChildFailedError as err:
        for failure in err.failures.values():  # what this agent's accounting did not see
            _EXITS.setdefault(failure.pid, (failure.exitcode, float(failure.timestamp)))
        return {"status": "failed"}
    return {"status": "ok"}


def _note_exits(_sig: Any = None, _frame: Any = None) -> None:
    """Record the exit status of every child that has ended, leaving it to be reaped.

    ``waitid(..., WNOWAIT)`` reads a child's status without reaping it, so torch's own
    process context still joins it as usual. Runs on SIGCHLD, in the agent's main thread.
    """
    for pid in _children():
        if pid in _EXITS:
            continue
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        if info is not None:
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            _EXITS[pid] = (code, time.time())


def _children() -> list[int]:
    pids: list[int] = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as text:
                pids += [int(pid) for pid in text.read().split()]
    except OSError:
        pass
    return pids


def launch_config(**options: Any) -> Any:
    """PyTorch's ``LaunchConfig`` for the installed torch, built without asking CUDA anything.

    - Options this torch does not know are left out (``shutdown_timeout`` came in 2.7, for
      example), so the same request works from the oldest supported torch to the newest.
    - Since torch 2.8 ``LaunchConfig.__post_init__`` asks the accelerator how many devices there
      are (``torch.accelerator.device_count()``) to pick default NUMA binding when
      ``numa_options`` is None. That question initialises the CUDA runtime's device count, and
      every process forked afterwards cannot use CUDA ("Cannot re-initialize CUDA in forked
      subprocess"): our workers are forked from this process. Any value other than None skips
      the question; it is then set back to None, so workers run unbound, as torchrun runs them
      when the device count does not match. This reads and sets a public dataclass field of
      the config ddplab builds, not of torch.
    """
    from torch.distributed.launcher.api import LaunchConfig

    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    options = {name: value for name, value in options.items() if name in known}
    if "numa_options" in known and options.get("numa_options") is None:
        options["numa_options"] = _numa_placeholder()
        config = LaunchConfig(**options)
        config.numa_options = None
        return config
    return LaunchConfig(**options)


def _numa_placeholder() -> Any:
    """A ``numa_options`` value that only stops ``LaunchConfig`` from asking the accelerator.

    (accelerate's ``notebook_launcher``, which also forks its workers, does the same.)
    """
    try:
        from torch.numa.binding import AffinityMode, NumaOptions

        return NumaOptions(AffinityMode.NODE)
    except (ImportError, AttributeError, TypeError):
        return object()
