"""``ddplab.launch``: run a script or module on N processes from a cell or a terminal.

PyTorch's own engines run the job (torchrun's elastic agent, or the script's ``mp.spawn``);
every rank's output shows live, events become progress and plots, a ``RunResult`` comes back.
Nothing outlives it: a timeout (after each rank still running showed its stack), an interrupt
(raised again, carrying ``.result``), an error in the caller or its death ends the whole job.
Example::

    result = ddplab.launch("ddplab.workers.train", nprocs=2, args=["--epochs", "2"])
    assert result.ok, result.error
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any, Callable, Optional, Sequence, Union

from .. import env as _env
from ..flight_recorder import Reader
from .fallback import start_subprocess, torchrun_subprocess
from .jobs import ForkRefused, Job, child_env, end_jobs, start_forked, why_no_fork
from .output import Streams
from .results import RunResult, job_outcome, share_root_cause
from .spec import LaunchError, LaunchSpec, check_timeout, declares_local_rank

__all__ = ["launch", "launch_multinode", "LaunchError", "RunResult"]
DEFAULT_TIMEOUT = float(os.environ.get("DDPLAB_TIMEOUT", "3600"))


def launch(
    target: Union[str, os.PathLike],
    nprocs: int = 2,
    *,
    args: Sequence[Any] = (),
    engine: str = "torchrun",
    timeout: Optional[float] = None,
    env: Optional[dict[str, str]] = None,
    quiet: bool = False,
    backend: Optional[str] = None,
    threads: int = 1,
    cwd: Optional[Union[str, os.PathLike]] = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: Optional[str] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    live: bool = True,
    max_restarts: int = 0,
    local_rank_arg: Union[bool, str] = False,
    on_event: Optional[Callable[[dict[str, Any]], None]] = None,
    flight_recorder: bool = False,
) -> RunResult:
    """Run ``target`` on ``nprocs`` processes and return what happened.

    Args:
        target: a script (a file, with or without ``.py``, or a directory or zip with
            ``__main__.py``) or a module name (``"ddplab.workers.train"``).
        nprocs: processes on this node (torchrun's ``--nproc-per-node``), 1 to ``MAX_NPROCS``.
        args: command-line arguments for the target.
        engine: ``"torchrun"`` or ``"spawn"`` (the script calls ``mp.spawn`` itself).
        timeout: seconds (> 0) before the whole job is ended and reported as a timeout
            (None: ``DDPLAB_TIMEOUT`` or 3600; ``math.inf``: no limit).
        env: extra environment variables for the workers.
        quiet: print nothing (output is still kept in the result).
        backend: None (auto: nccl with GPUs, gloo without), or force ``gloo``/``nccl``; passed
            to the workers as ``DDPLAB_BACKEND``, which ``ddplab.dist.setup()`` honours.
        threads: torch threads per worker (``OMP_NUM_THREADS`` unless already set).
        cwd: working directory of the job (default: the caller's).
        nnodes, node_rank, rdzv_endpoint, master_addr, master_port: multi-node options as in
            torchrun; by default one node with a rendezvous on 127.0.0.1 and a free port.
        live: show a progress bar and live loss plot from the workers' events.
        max_restarts: torchrun's ``--max-restarts`` (engine ``torchrun``): every worker is
            restarted after one fails, with ``TORCHELASTIC_RESTART_COUNT`` > 0 (lesson 10).
        local_rank_arg: pass each rank ``--local_rank=N`` (True or ``"underscore"``) or
            ``--local-rank=N`` (``"dash"``), as ``torch.distributed.launch`` did (lesson 07).
        on_event: called with every event a worker emits, as it arrives.
        flight_recorder: on a timeout, name the collective each rank waits in and its sequence
            number (``result.waits``), from torch's Flight Recorder (``ddplab.flight_recorder``:
            a debug server per rank, engine ``torchrun``; lesson 10).

    Returns:
        A ``RunResult``; ``result.ok`` is False for any failure or timeout.

    Raises:
        LaunchError: bad input, before anything starts.
        KeyboardInterrupt: the launch was interrupted (a Jupyter interrupt, Ctrl-C), raised
            again once every process of the job has ended; ``.result`` holds the RunResult.
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


def launch_multinode(
    target: Union[str, os.PathLike],
    nnodes: int = 2,
    nproc_per_node: int = 1,
    *,
    args: Sequence[Any] = (),
    timeout: Optional[float] = None,
    env: Optional[dict[str, str]] = None,
    quiet: bool = False,
    live: bool = False,
    port: Optional[int] = None,
) -> list[RunResult]:
    """Pretend this machine is ``nnodes`` machines: one torchrun per "node", started as on a
    cluster (one rendezvous on 127.0.0.1); one ``RunResult`` per node, in node order. Lesson 07b.
    """
    seconds = check_timeout(timeout, DEFAULT_TIMEOUT)
    port = port or _env.free_port()
    specs = [LaunchSpec(target, nproc_per_node, args, env=env, nnodes=nnodes, node_rank=node,
                        rdzv_endpoint=f"127.0.0.1:{port}") for node in range(nnodes)]
    jobs, view = _start_jobs(specs, quiet, live)
    return _run(jobs, view, seconds)


def _start_jobs(specs: list[LaunchSpec], quiet: bool, live: bool) -> tuple[list[Job], Any]:
    """Check every spec, then start them all; on any error end what already started."""
    prepared = [_prepare(spec.check()) for spec in specs]
    from ..lab.widgets import LiveView

    view = LiveView(quiet=quiet, live=live)
    jobs: list[Job] = []
    try:
        for index, (starter, kwargs) in enumerate(prepared):
            try:
                job = starter(**kwargs)
            except ForkRefused as refused:
                starter, kwargs = torchrun_subprocess(str(refused), **kwargs)
                job = starter(**kwargs)
            job.node = f"node{index} " if len(prepared) > 1 else ""
            jobs.append(job)
    except BaseException:
        end_jobs(jobs)
        view.close()
        raise
    return jobs, view


def _prepare(spec: LaunchSpec) -> tuple[Callable[..., Job], dict[str, Any]]:
    """The function and arguments that start one checked launch."""
    extra = dict(spec.env or {})
    if spec.local_rank_style:
        extra["DDPLAB_LOCAL_RANK_ARG"] = spec.local_rank_style  # read by the rank's entry
    elif spec.engine == "torchrun" and not any(a.startswith(("--local_rank", "--local-rank"))
                                               for a in spec.argv) \
            and declares_local_rank(spec.resolved):
        print(f"ddplab.launch: {spec.resolved} declares --local_rank (written for "
              f"torch.distributed.launch, which passed it) and does not read LOCAL_RANK: every "
              f"rank will keep the option's default. Pass local_rank_arg=True (CLI: "
              f"--local-rank-arg) to give each rank --local_rank=N, or read "
              f"int(os.environ['LOCAL_RANK']) in the script.", file=sys.stderr)
    if spec.backend not in (None, "auto"):
        extra["DDPLAB_BACKEND"] = str(spec.backend)
    extra.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(spec.threads)))
    if spec.nnodes > 1 or spec.max_restarts:
        # A torchrun subprocess's workers would share its c10d rendezvous's store (torch >= 2.5),
        # and a restarted attempt read the failed one's addresses there (pytorch#135712).
        extra.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                         os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"))
    if spec.host.startswith("127."):
        extra.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    job_env = child_env(os.environ, extra)
    if spec.engine == "spawn":
        script = [spec.resolved] if os.path.isabs(spec.resolved) else ["-m", spec.resolved]
        job_env.update(MASTER_ADDR=spec.host,
                       MASTER_PORT=str(spec.port or _env.free_port(spec.host)),
                       DDPLAB_NPROCS=str(spec.nprocs), DDPLAB_RANK_PREFIX="1")
        return start_subprocess, dict(cmd=[sys.executable, *script, *spec.argv],
                                      job_env=job_env, cwd=spec.cwd, world_size=spec.nprocs,
                                      engine="spawn")
    endpoint = f"{spec.host}:{spec.port if spec.port is not None else 0}"
    run_id = uuid.uuid4().hex if spec.nnodes == 1 else f"ddplab-{endpoint}"
    fast = dict(target=spec.resolved, args=spec.argv, nprocs=spec.nprocs, job_env=job_env,
                cwd=spec.cwd, threads=spec.threads, nnodes=spec.nnodes,
                node_rank=spec.node_rank, endpoint=endpoint, run_id=run_id,
                preload=_preload(spec.resolved), max_restarts=spec.max_restarts)
    why_not = why_no_fork()
    if why_not is None and spec.nnodes == 1:
        return start_forked, fast
    return torchrun_subprocess(why_not, **fast)


def _preload(target: str) -> bool:
    """Whether the helper imports the training stack first (``DDPLAB_PRELOAD_TRAINING``)."""
    mode = os.environ.get("DDPLAB_PRELOAD_TRAINING", "1")
    if mode == "auto":
        return target.startswith("ddplab.workers")
    return mode != "0"


def _run(jobs: list[Job], view: Any, timeout: float,
         on_event: Optional[Callable[[dict[str, Any]], None]] = None,
         flight: Optional[Reader] = None) -> list[RunResult]:
    """Stream every job's output until all end; end them all on timeout or interrupt (then
    raised again, once every process of every job has ended)."""
    start = time.monotonic()
    streams = Streams(jobs, view, on_event)
    interrupt: Optional[KeyboardInterrupt] = None
    running: list[list[int]] = [[] for _ in jobs]
    stacks: list[dict[int, str]] = [{} for _ in jobs]
    timed_out_at = 0.0
    try:
        try:
            status = streams.pump(start + timeout)
            if status == "timeout":
                timed_out_at = time.time()
                running = [job.running_ranks() for job in jobs]
                stacks = streams.stacks(running, timeout)
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
    results = [job_outcome(job, streams.of_job(i), status, wall, timeout, running[i], stacks[i],
                           timed_out_at) for i, job in enumerate(jobs)]
    share_root_cause(results, jobs)
    flight and flight.report(results[0])
    if interrupt is not None:
        again = KeyboardInterrupt(f"ddplab.launch: {results[0].error}")
        again.result, again.results = results[0], results  # type: ignore[attr-defined]
        raise again from None
    for result in results:
        if not result.ok:
            view.failure(result)
    return results
