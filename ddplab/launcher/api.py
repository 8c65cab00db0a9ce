"""``ddplab.launch``: run a script or module on N processes from a cell or a terminal."""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any, Callable, Optional, Sequence, Union

from .. import env as _env
from ..failures import share_root_cause
from ..flight_recorder import Reader
from .fallback import start_subprocess, start_torchrun
from .jobs import Job, child_env, end_jobs, fork_changes, start_forked
from .output import Streams
from .results import RunResult, job_outcome
from .spec import LaunchError, LaunchSpec, check_timeout

__all__ = ["launch", "launch_multinode", "LaunchError", "RunResult"]
DEFAULT_TIMEOUT = float(os.environ.get("DDPLAB_TIMEOUT", "3600"))


def launch(target: Union[str, os.PathLike], nprocs: int = 2, *, args: Sequence[Any] = (),
           engine: str = "torchrun", timeout: Optional[float] = None,
           env: Optional[dict[str, str]] = None, quiet: bool = False, backend: Optional[str] = None,
           threads: int = 1, cwd: Optional[Union[str, os.PathLike]] = None, nnodes: int = 1,
           node_rank: int = 0, rdzv_endpoint: Optional[str] = None,
           master_addr: Optional[str] = None, master_port: Optional[int] = None,
           live: bool = True, max_restarts: int = 0, local_rank_arg: Union[bool, str] = False,
           on_event: Optional[Callable[[dict[str, Any]], Optional[float]]] = None,
           flight_recorder: bool = False) -> RunResult:
    """Run ``target`` (a script path or a module name) on ``nprocs`` processes; what happened.

    PyTorch's engines run it: torchrun's elastic agent (``engine="torchrun"``) or the script's
    own ``mp.spawn`` (``"spawn"``). Output shows live; nothing outlives the call: ``timeout``
    (None: ``DDPLAB_TIMEOUT`` or 3600 s, ``math.inf``: none) ends the job with each running
    rank's stack, an interrupt ends it and is raised again carrying ``.result``. ``on_event``
    sees every event; a number N returned ends the launch as a timeout N s later.
    ``flight_recorder=True`` names the collective each rank waits in (``result.waits``). The
    rest are torchrun's or ddplab's options (lessons 01, 07, 10); bad input raises
    ``LaunchError`` before anything starts::

        result = ddplab.launch("ddplab.workers.train", nprocs=2, args=["--epochs", "2"])
        assert result.ok, result.error
    """
    seconds = check_timeout(timeout, DEFAULT_TIMEOUT)
    if flight_recorder and engine != "torchrun":
        raise LaunchError("flight_recorder=True needs engine='torchrun': ddplab starts each "
                          "rank's debug server, and an mp.spawn script starts its own ranks")
    flight = Reader() if flight_recorder else None
    spec = LaunchSpec(target, nprocs, args, engine, {**flight.env, **(env or {})} if flight
                      else env, backend, threads, cwd, nnodes, node_rank, rdzv_endpoint,
                      master_addr, master_port, max_restarts, local_rank_arg)
    jobs, view = _start_jobs([spec], quiet, live)
    return _run(jobs, view, seconds, on_event, flight)[0]


def launch_multinode(target: Union[str, os.PathLike], nnodes: int = 2, nproc_per_node: int = 1,
                     *, args: Sequence[Any] = (), timeout: Optional[float] = None,
                     env: Optional[dict[str, str]] = None, quiet: bool = False,
                     live: bool = False, port: Optional[int] = None) -> list[RunResult]:
    """Pretend this machine is ``nnodes`` machines (one torchrun each, one rendezvous on
    127.0.0.1); one ``RunResult`` per node, in node order. Lesson 07b."""
    seconds = check_timeout(timeout, DEFAULT_TIMEOUT)
    port = port or _env.free_port()
    specs = [LaunchSpec(target, nproc_per_node, args, env=env, nnodes=nnodes, node_rank=node,
                        rdzv_endpoint=f"127.0.0.1:{port}") for node in range(nnodes)]
    jobs, view = _start_jobs(specs, quiet, live)
    return _run(jobs, view, seconds)


def _start_jobs(specs: list[LaunchSpec], quiet: bool, live: bool) -> tuple[list[Job], Any]:
    """Check every spec, then start them all; on any error end what already started."""
    checked = [spec.check() for spec in specs]
    from ..liveview import LiveView

    view = LiveView(quiet=quiet, live=live, plan=any(s.nprocs * s.nnodes > 1 for s in specs))
    jobs: list[Job] = []
    try:
        for index, spec in enumerate(checked):
            jobs.append(_start(spec))
            jobs[-1].node = f"node{index} " if len(checked) > 1 else ""
    except BaseException:
        end_jobs(jobs)
        view.close()
        for fd in [fd for job in jobs for fd in job.sources]:  # (Streams would have closed them)
            os.close(fd)
        raise
    return jobs, view


def _start(spec: LaunchSpec) -> Job:
    """Start one checked launch: forked from the helper where it can, else a subprocess."""
    job_env = child_env(os.environ, spec.job_env())
    if spec.engine == "spawn":
        script = [spec.resolved] if os.path.isabs(spec.resolved) else ["-m", spec.resolved]
        job_env.update(MASTER_ADDR=spec.host,
                       MASTER_PORT=str(spec.port or _env.free_port(spec.host)),
                       DDPLAB_NPROCS=str(spec.nprocs), DDPLAB_RANK_PREFIX="1")
        return start_subprocess([sys.executable, *script, *spec.argv], job_env, spec.cwd,
                                spec.nprocs, "spawn")
    endpoint = f"{spec.host}:{spec.port if spec.port is not None else 0}"
    run_id = uuid.uuid4().hex if spec.nnodes == 1 else f"ddplab-{endpoint}"
    why = _env.no_fork_reason() or fork_changes(job_env)
    if why is None and spec.nnodes == 1:
        return start_forked(spec, job_env, endpoint, run_id)
    return start_torchrun(why, spec, job_env, endpoint, run_id)


def _run(jobs: list[Job], view: Any, timeout: float,
         on_event: Optional[Callable[[dict[str, Any]], Optional[float]]] = None,
         flight: Optional[Reader] = None) -> list[RunResult]:
    """Stream every job's output until all end; end them all on timeout or interrupt (then
    raised again, once every process of every job has ended)."""
    start = time.monotonic()
    streams = Streams(jobs, view, on_event)
    interrupt: Optional[KeyboardInterrupt] = None
    running: list[list[int]] = [[] for _ in jobs]
    stacks: list[dict[int, str]] = [{} for _ in jobs]
    timed_out_at, why = 0.0, f"timed out after {timeout:g} s"
    try:
        try:
            status = streams.pump(start + timeout)
            if status == "timeout":
                timed_out_at = time.time()
                if streams.stop_at < start + timeout:
                    why = f"ended {time.monotonic() - start:.1f} s in, as on_event asked"
                running = [job.running_ranks() for job in jobs]
                stacks = streams.stacks(running, why)
                flight and flight.read()
        except KeyboardInterrupt as exc:
            status, interrupt = "interrupted", exc
        if status != "done":  # a timeout lets torchrun's agents end their workers first
            end_jobs(jobs, grace=3.0 if status == "timeout" else 0.0)
            streams.drain()
        for job in jobs:
            job.reap()
    except BaseException:  # an error in the caller, or a second interrupt: end everything
        end_jobs(jobs)
        raise
    finally:
        streams.close()
        view.close()
    wall = time.monotonic() - start
    results = [job_outcome(job, streams.read[i], status, wall, why, running[i], stacks[i],
                           timed_out_at) for i, job in enumerate(jobs)]
    share_root_cause(results, {rank: ended for job in jobs for rank, ended in job.exits().items()})
    flight and flight.report(results[0])
    if interrupt is not None:
        again = KeyboardInterrupt(f"ddplab.launch: {results[0].error}")
        again.result, again.results = results[0], results  # type: ignore[attr-defined]
        raise again from None
    for result in results:
        if not result.ok:
            view.failure(result)
    return results
