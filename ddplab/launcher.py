"""Run a script or module on N processes from a notebook cell or a terminal (``ddplab.launch``).

``launch("ddplab.workers.train", 2, args=["--epochs", "3"])`` starts the job with PyTorch's own
engines, prints every rank's output live in the calling cell (prefixed ``[rank1]``), turns the
workers' ``@ddplab`` event lines into a progress bar and a live loss plot, and returns a
``RunResult`` to assert on. It never leaves a process behind: a timeout, a Jupyter interrupt, an
exception in the caller or the caller's death ends the whole worker tree.

Engines:

- ``torchrun``: PyTorch's elastic launcher (``torch.distributed.run``). On Linux the job is
  started by ``ddplab.agent``, a helper process that imported torch once and forks one agent per
  launch, so a launch costs a fraction of a cold ``torchrun``. Elsewhere, with
  ``DDPLAB_LAUNCH_PATH=subprocess``, or if CUDA is initialised in the helper (forked workers
  could not use it), a plain ``python -m torch.distributed.run`` subprocess, said once.
- ``spawn``: the script is run unchanged, as ``python script.py ARGS``, and calls
  ``torch.multiprocessing.spawn`` itself: it decides its own process count and parses its own
  command line. ddplab adds nothing to its arguments; its environment holds ``MASTER_ADDR``,
  a free ``MASTER_PORT``, ``DDPLAB_NPROCS`` (the requested process count, for scripts that
  want it: ``ddplab.workers.spawn_ddp`` reads it) and ``DDPLAB_RANK_PREFIX=1`` (ranks set up
  by ``ddplab.dist`` then tag their lines ``[rankN]``, so their output is told apart).

``KeyboardInterrupt`` (a Jupyter interrupt) ends every process of the job, says so, and is
raised again, so an interrupted cell stops "Run All" like any other; the exception carries the
``RunResult`` as ``.result``.

Example::

    result = ddplab.launch("ddplab.workers.train", nprocs=2, args=["--epochs", "2"])
    assert result.ok, result.error
    print(result.summary["final_accuracy"])

Lessons: every notebook that runs workers (01-09); 07 for the multi-node options.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from . import env as _env
from .jobs import (FastPathRefused, Job, child_env, fast_path_unavailable, popen_job,
                   start_fast, torchrun_cmd)
from .results import (RankFailure, RunResult, fail, failures_from_output, mark_exit_aborts,
                      root_cause, short_message, signal_name, spawn_outcome, stderr_cause,
                      traceback_tail)
from .streams import Streams

ENGINES = ("torchrun", "spawn")
#: ``local_rank_arg`` values: the spelling ``torch.distributed.launch`` used before torch 2.0
#: (``--local_rank=N``) and since (``--local-rank=N``).
LOCAL_RANK_ARGS = {"underscore": "--local_rank", "dash": "--local-rank"}
DEFAULT_TIMEOUT = float(os.environ.get("DDPLAB_TIMEOUT", "3600"))
_NOTICE_SHOWN: set[str] = set()


class LaunchError(ValueError):
    """Bad input to ``launch``, found before any process starts. The message says what to do."""


# --------------------------------------------------------------------------- input checks


def _resolve_target(target: Union[str, os.PathLike], cwd: str) -> str:
    """Return an absolute script path or a module name; raise LaunchError if neither exists."""
    text = os.fspath(target)
    if text.endswith(".py") or os.sep in text or "/" in text:
        path = Path(cwd, text).resolve() if not os.path.isabs(text) else Path(text)
        if not path.is_file():
            raise LaunchError(
                f"script not found: {path}. Give a path to an existing .py file (relative to "
                f"{cwd}) or a module name such as 'ddplab.workers.train'."
            )
        return str(path)
    if not _module_exists(text, [cwd, *sys.path]):
        raise LaunchError(
            f"no script or module named {text!r}. Give a path to a .py file or an importable "
            f"module name such as 'ddplab.workers.train'."
        )
    return text


def _module_exists(name: str, path: list[str]) -> bool:
    """True if ``python -m name`` would find the module (searched like ``-m``, nothing run)."""
    from importlib.machinery import PathFinder

    import importlib.util

    search: Optional[list[str]] = path
    for depth, part in enumerate(name.split(".")):
        if search is None or not part.isidentifier():
            return False
        spec = PathFinder.find_spec(part, search)
        if spec is None and depth == 0:  # installed packages (editable installs use a finder)
            spec = importlib.util.find_spec(part)
        if spec is None:
            return False
        search = list(spec.submodule_search_locations or []) or None
    return True


def _local_rank_style(value: Union[bool, str], engine: str) -> Optional[str]:
    """The ``--local_rank`` spelling to pass (None: pass nothing); LaunchError if unknown."""
    if value is False or value is None:
        return None
    style = "underscore" if value is True else {"--local_rank": "underscore",
                                                "--local-rank": "dash"}.get(str(value), value)
    if style not in LOCAL_RANK_ARGS:
        raise LaunchError(f"local_rank_arg must be True, 'underscore' (--local_rank) or 'dash' "
                          f"(--local-rank), got {value!r}.")
    if engine != "torchrun":
        raise LaunchError("local_rank_arg needs engine='torchrun': an mp.spawn script gets "
                          "its rank as the first argument of the function it spawns.")
    return str(style)


def _declares_local_rank(target: str) -> bool:
    """True if the target declares a ``--local_rank`` option and never reads ``LOCAL_RANK``.

    Such a script was written for ``torch.distributed.launch``, which passed the option; under
    torchrun (and ddplab) every rank keeps the option's default unless asked.
    """
    path = target
    if not target.endswith(".py") and not os.path.isabs(target):
        import importlib.util

        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            return False
        path = spec.origin if spec is not None and spec.origin else ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return False
    return bool(re.search(r"""["']--local[_-]rank["']""", text)) and "LOCAL_RANK" not in text


def _check_inputs(nprocs: Any, engine: str, backend: Optional[str], nnodes: int,
                  node_rank: int, port: Optional[int], host: str, max_restarts: Any = 0) -> None:
    if engine not in ENGINES:
        raise LaunchError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}.")
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise LaunchError(f"max_restarts must be a whole number >= 0, got {max_restarts!r}.")
    if max_restarts and engine != "torchrun":
        raise LaunchError("max_restarts needs engine='torchrun' (its elastic agent restarts the "
                          "workers); an mp.spawn script restarts nothing by itself.")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise LaunchError(f"nprocs must be a whole number >= 1, got {nprocs!r}.")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"node_rank must be in 0..{nnodes - 1} for nnodes={nnodes}.")
    if backend not in (None, "auto", "gloo", "nccl", "mpi"):
        raise LaunchError(f"unknown backend {backend!r}: use gloo, nccl, mpi or None (auto).")
    if backend == "nccl":
        gpus = _env.gpu_count()
        if gpus == 0:
            raise LaunchError("backend='nccl' needs CUDA GPUs and none is visible: "
                              "use backend='gloo' (or None to choose automatically).")
        if nprocs > gpus:
            raise LaunchError(f"nprocs={nprocs} but only {gpus} GPU(s) for nccl: use "
                              f"nprocs<={gpus}, or backend='gloo' to run more CPU processes.")
    if port is not None and node_rank == 0 and not _env.port_is_free(port, host):
        raise LaunchError(f"port {port} on {host} is busy: pass another master_port, or leave "
                          f"it out and ddplab picks a free one.")


# --------------------------------------------------------------------------- public API


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
) -> RunResult:
    """Run ``target`` on ``nprocs`` processes and return what happened.

    Args:
        target: a ``.py`` file or a module name (``"ddplab.workers.train"``).
        nprocs: processes on this node (torchrun's ``--nproc-per-node``).
        args: command-line arguments for the target.
        engine: ``"torchrun"`` or ``"spawn"`` (the script calls ``mp.spawn`` itself).
        timeout: seconds before the whole job is ended and reported as a timeout
            (default ``DDPLAB_TIMEOUT`` or 3600).
        env: extra environment variables for the workers.
        quiet: print nothing (output is still kept in the result).
        backend: None (auto: nccl with GPUs, gloo without), or force ``gloo``/``nccl``; passed
            to the workers as ``DDPLAB_BACKEND``, which ``ddplab.dist.setup()`` honours.
        threads: torch threads per worker (``OMP_NUM_THREADS`` unless already set).
        cwd: working directory of the job (default: the caller's).
        nnodes, node_rank, rdzv_endpoint, master_addr, master_port: multi-node options as in
            torchrun; by default one node with a rendezvous on 127.0.0.1 and a free port.
        live: show a progress bar and live loss plot from the workers' events.
        max_restarts: how many times the elastic agent restarts every worker of the job after
            one fails (torchrun's ``--max-restarts``; engine ``torchrun`` only). A restarted
            worker sees ``TORCHELASTIC_RESTART_COUNT`` > 0 and resumes from its checkpoint
            (lesson 10).
        local_rank_arg: pass each rank ``--local_rank=N`` before its arguments, as the old
            ``torch.distributed.launch`` did, for scripts written for it (lesson 07): True or
            ``"underscore"`` for ``--local_rank``, ``"dash"`` for ``--local-rank`` (what it
            passed since torch 2.0). torchrun passes nothing: the rank is in ``LOCAL_RANK``.
        on_event: called with every event a worker emits, as it arrives (the CLI prints one
            line per epoch with it).

    Returns:
        A ``RunResult``; ``result.ok`` is False for any failure or timeout.

    Raises:
        LaunchError: bad input (missing script, nprocs < 1, unknown engine, nccl without
            enough GPUs, a busy port you asked for), before anything starts.
        KeyboardInterrupt: the launch was interrupted (a Jupyter interrupt, Ctrl-C), raised
            again once every process of the job has ended; ``.result`` holds the RunResult.
    """
    jobs, view = _start_jobs([dict(target=target, nprocs=nprocs, args=args, engine=engine,
                                   env=env, backend=backend, threads=threads, cwd=cwd,
                                   nnodes=nnodes, node_rank=node_rank,
                                   rdzv_endpoint=rdzv_endpoint, master_addr=master_addr,
                                   master_port=master_port, max_restarts=max_restarts,
                                   local_rank_arg=local_rank_arg)],
                              quiet, live)
    return _run(jobs, view, timeout, on_event)[0]


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
    """Pretend this machine is ``nnodes`` machines: one torchrun agent per "node".

    Each agent is started exactly as on a real cluster (``--nnodes``, ``--node-rank`` and one
    ``--rdzv-endpoint``), here all on 127.0.0.1; they meet at the rendezvous and form one job.

    Returns:
        One ``RunResult`` per node, in node-rank order.

    Lesson: 07.
    """
    port = port or _env.free_port()
    specs = [dict(target=target, nprocs=nproc_per_node, args=args, engine="torchrun", env=env,
                  backend=None, threads=1, cwd=None, nnodes=nnodes, node_rank=node,
                  rdzv_endpoint=f"127.0.0.1:{port}", master_addr=None, master_port=None)
             for node in range(nnodes)]
    jobs, view = _start_jobs(specs, quiet, live)
    return _run(jobs, view, timeout)


def _start_jobs(specs: list[dict[str, Any]], quiet: bool, live: bool) -> tuple[list[Job], Any]:
    """Check every spec, then start them all; on any error end what already started."""
    prepared = [_prepare(**spec) for spec in specs]
    from .widgets import LiveView

    view = LiveView(quiet=quiet, live=live)
    jobs: list[Job] = []
    try:
        for index, (starter, kwargs) in enumerate(prepared):
            try:
                job = starter(**kwargs)
            except FastPathRefused as refused:
                starter, kwargs = _subprocess_path(str(refused), **kwargs)
                job = starter(**kwargs)
            job.node = f"node{index} " if len(prepared) > 1 else ""
            jobs.append(job)
    except BaseException:
        for job in jobs:
            job.kill(signal.SIGKILL)
        view.close()
        raise
    return jobs, view


def _prepare(target: Any, nprocs: Any, args: Sequence[Any], engine: str,
             env: Optional[dict[str, str]], backend: Optional[str], threads: int,
             cwd: Any, nnodes: int, node_rank: int, rdzv_endpoint: Optional[str],
             master_addr: Optional[str], master_port: Optional[int], max_restarts: int = 0,
             local_rank_arg: Union[bool, str] = False
             ) -> tuple[Callable[..., Job], dict[str, Any]]:
    """Validate one launch and return the function and arguments that start it."""
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    host = master_addr or "127.0.0.1"
    port = master_port
    if rdzv_endpoint:
        host, _, port_text = rdzv_endpoint.rpartition(":")
        port = int(port_text) if port_text else None
    _check_inputs(nprocs, engine, backend, nnodes, node_rank, port, host, max_restarts)
    style = _local_rank_style(local_rank_arg, engine)
    resolved = _resolve_target(target, cwd)
    argv = [str(a) for a in args]
    extra = dict(env or {})
    if style:
        extra["DDPLAB_LOCAL_RANK_ARG"] = style  # read where each rank's argv is built
    elif engine == "torchrun" and not any(a.startswith(("--local_rank", "--local-rank"))
                                          for a in argv) and _declares_local_rank(resolved):
        print(f"ddplab.launch: {resolved} declares --local_rank (written for "
              f"torch.distributed.launch, which passed it) and does not read LOCAL_RANK: every "
              f"rank will keep the option's default. Pass local_rank_arg=True (CLI: "
              f"--local-rank-arg) to give each rank --local_rank=N, or read "
              f"int(os.environ['LOCAL_RANK']) in the script.", file=sys.stderr)
    if backend not in (None, "auto"):
        extra["DDPLAB_BACKEND"] = str(backend)
    extra.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(threads)))
    if max_restarts:
        # Since torch 2.5 the workers share the rendezvous's store by default, and a restarted
        # attempt reads the addresses the failed attempt published there, so it cannot connect
        # (pytorch/pytorch#135712). A store of their own per attempt avoids that.
        extra.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                         os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"))
    if host.startswith("127.") and nnodes == 1 or rdzv_endpoint and host.startswith("127."):
        extra.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    job_env = child_env(os.environ, extra)
    if engine == "spawn":
        if not resolved.endswith(".py") and not os.path.isabs(resolved):
            cmd = [sys.executable, "-m", resolved]
        else:
            cmd = [sys.executable, resolved]
        job_env.update(MASTER_ADDR=host, MASTER_PORT=str(port or _env.free_port(host)),
                       DDPLAB_NPROCS=str(nprocs), DDPLAB_RANK_PREFIX="1")
        return popen_job, dict(cmd=[*cmd, *argv], job_env=job_env, cwd=cwd, world_size=nprocs,
                                engine="spawn")
    endpoint = f"{host}:{port if port is not None else 0}"
    run_id = uuid.uuid4().hex if nnodes == 1 else f"ddplab-{endpoint}"
    fast = dict(target=resolved, args=argv, nprocs=nprocs, job_env=job_env, cwd=cwd,
                threads=threads, nnodes=nnodes, node_rank=node_rank, endpoint=endpoint,
                run_id=run_id, preload=_preload(resolved), max_restarts=max_restarts)
    why_not = fast_path_unavailable()
    if why_not is None:
        return start_fast, fast
    return _subprocess_path(why_not, **fast)


def _subprocess_path(why: str, target: str, args: list[str], nprocs: int,
                     job_env: dict[str, str], cwd: str, nnodes: int, node_rank: int,
                     endpoint: str, run_id: str, max_restarts: int = 0, **_fast_only: Any
                     ) -> tuple[Callable[..., Job], dict[str, Any]]:
    """The same launch as a plain torchrun subprocess; say why once per session."""
    _notice_once("subprocess", f"ddplab: launching through a torchrun subprocess (slower): "
                 f"{why}.")
    if job_env.get("DDPLAB_LOCAL_RANK_ARG"):  # torchrun has no such option: a tiny wrapper
        target, args = "ddplab.local_rank_arg", [target, *args]
    cmd = torchrun_cmd(target, args, nprocs, nnodes, node_rank, endpoint, run_id, max_restarts)
    return popen_job, dict(cmd=cmd, job_env=job_env, cwd=cwd, world_size=nprocs * nnodes,
                            engine="torchrun")


def _preload(target: str) -> bool:
    """Whether the helper should preload the training stack before this launch.

    A notebook launches many training runs, so it pays the imports once (default). The CLI
    sets ``DDPLAB_PRELOAD_TRAINING=auto``: preload only for ddplab's own training workers.
    """
    mode = os.environ.get("DDPLAB_PRELOAD_TRAINING", "1")
    if mode == "auto":
        return target.startswith("ddplab.workers")
    return mode != "0"


def _notice_once(key: str, text: str) -> None:
    if key not in _NOTICE_SHOWN:
        _NOTICE_SHOWN.add(key)
        print(text, file=sys.stderr)


# --------------------------------------------------------------------------- running


def _run(jobs: list[Job], view: Any, timeout: Optional[float],
         on_event: Optional[Callable[[dict[str, Any]], None]] = None) -> list[RunResult]:
    """Stream every job's output until all end; end them all on timeout or interrupt.

    Raises:
        KeyboardInterrupt: again, after every process of every job has ended.
    """
    start = time.monotonic()
    deadline = start + (DEFAULT_TIMEOUT if timeout is None else float(timeout))
    streams = Streams(jobs, view, on_event)
    interrupt: Optional[KeyboardInterrupt] = None
    try:
        try:
            status = streams.pump(deadline)
        except KeyboardInterrupt as exc:
            status, interrupt = "interrupted", exc
        if status != "done":
            for job in jobs:
                job.terminate()
            streams.drain()
        for job in jobs:
            job.reap()
    except BaseException:  # an error in the caller, or a second interrupt: end everything
        for job in jobs:
            job.terminate(grace=0.5)
        raise
    finally:
        streams.close()
        view.close()
    wall = time.monotonic() - start
    results = [_result(i, job, streams, status, wall, timeout) for i, job in enumerate(jobs)]
    _job_root_cause(results, jobs)
    if interrupt is not None:
        again = KeyboardInterrupt(f"ddplab.launch: {results[0].error}")
        again.result, again.results = results[0], results  # type: ignore[attr-defined]
        raise again from None
    for result in results:
        if not result.ok:
            view.failure(result)
    return results


def _job_root_cause(results: list[RunResult], jobs: list[Job]) -> None:
    """Give every node's result the first genuine failure across all nodes of the job."""
    causes = [r.root_cause for r in results if r.root_cause is not None]
    if not causes:
        return
    exits = {rank: ended for job in jobs for rank, ended in job.exits.items()}
    first = root_cause(causes, exits)
    for index, result in enumerate(results):
        result.job_root_cause = first
        if len(results) > 1 and result.root_cause is not first:
            where = next(i for i, r in enumerate(results) if r.root_cause is first)
            result.error = (f"{result.error}\n" if result.error else "") + \
                f"first failure of the whole job, on node {where}: {first}"


def _result(index: int, job: Job, streams: Streams, status: str, wall: float,
            timeout: Optional[float]) -> RunResult:
    """Build one job's RunResult from what was read and the agent's report."""
    logs = {label: lines for (i, label), lines in streams.logs.items() if i == index}
    stderr = {label: lines for (i, label), lines in streams.stderr.items() if i == index}
    events = {rank: evs for (i, rank), evs in streams.events.items() if i == index}
    result = RunResult(status="ok", returncode=0, wall_time=wall, world_size=job.world_size,
                       logs=logs, events=events, engine=job.engine,
                       pids=dict(job.pids) or job.spawned_ranks() or {})
    if status == "timeout":
        result.status, result.returncode = "timeout", 124
        result.error = f"timed out after {timeout if timeout is not None else DEFAULT_TIMEOUT}" \
                       f" s: every process of the job was ended."
        return result
    if status == "interrupted":
        result.status, result.returncode = "interrupted", 130
        result.error = "interrupted: every process of the job was ended."  # shown once
        return result
    if job.engine == "spawn":
        code = job.popen.returncode if job.popen is not None else None
        return spawn_outcome(result, code, job.spawned_ranks(), job.exits, logs, stderr)
    failures, codes = _failures(job, logs, stderr)
    if job.stuck:
        failures = [RankFailure(rank=rank, exitcode=None, message=(
            "ended without returning to the launcher (os._exit or a crash of the interpreter); "
            "end worker scripts normally or with sys.exit")) for rank in sorted(job.pids)
            if rank not in job.exits]
        codes = {rank: job.exits.get(rank, (None, 0))[0] for rank in sorted(job.pids)}
    if failures is None:
        result.status, result.returncode = "error", 1
        result.error = "the launcher failed:\n" + "\n".join(logs.get("launcher", [])[-30:])
        report = _report(job)
        if report.get("error"):
            result.error += f"\n{report.get('traceback') or report['error']}"
        return result
    result.exit_codes = codes
    if failures:
        mark_exit_aborts(failures, logs, job.exits, stderr)
        fail(result, root_cause(failures, job.exits), job.engine, logs, stderr)
    return result


def _failures(job: Job, logs: dict[Union[int, str], list[str]],
              stderr: Optional[dict[Union[int, str], list[str]]] = None
              ) -> tuple[Optional[list[RankFailure]], dict[int, Optional[int]]]:
    """Failed ranks and every rank's exit code; (None, {}) when the launcher itself failed."""
    if job.popen is not None:
        found = failures_from_output(job.popen.returncode, logs, ranks_only=True)
        if job.popen.returncode and not found:  # torchrun itself failed, before any rank did
            message, tail = stderr_cause((stderr or {}).get("launcher", []))
            found = [RankFailure(rank=None, exitcode=job.popen.returncode,
                                 signal=signal_name(job.popen.returncode), message=message,
                                 traceback=tail)]
        codes: dict[int, Optional[int]] = {r: (None if found else 0) for r in range(job.world_size)}
        codes.update({f.rank: f.exitcode for f in found if f.rank is not None})
        return found, codes
    report = _report(job)
    if report.get("status") not in ("ok", "failed"):
        return None, {}
    by_pid = report.get("exitcodes", {})
    codes = {rank: by_pid.get(str(pid)) for rank, pid in job.pids.items()}
    for rank_text, info in report.get("failures", {}).items():
        codes[int(rank_text)] = info["exitcode"]
    found = []
    for rank, code in sorted(codes.items()):
        if code in (0, None):
            continue
        lines = logs.get(rank, [])
        found.append(RankFailure(
            rank=rank, exitcode=code, signal=signal_name(code),
            message=short_message(lines), traceback=traceback_tail(lines)))
    return found, codes


def _report(job: Job) -> dict[str, Any]:
    """The agent's JSON report ({} when it died before writing one)."""
    try:
        return dict(json.loads(job.report.decode() or "{}"))
    except ValueError:
        return {}
