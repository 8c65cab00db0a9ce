"""The launcher's helper process: imports torch once, then forks one elastic agent per launch.

``ddplab.launch`` (kernel side) never imports torch. It starts this module once per kernel as
``python -m ddplab.agent`` and sends it launch requests over a Unix socket, together with the
write ends of the pipes it reads (one per local rank, one for the agent's own log, one for the
final report). For each request this process forks a child that becomes a torchrun-equivalent
agent: it calls PyTorch's own elastic launcher (``torch.distributed.launcher.api``, the engine
behind ``torchrun``) with ``start_method="fork"``, so the workers start with torch already
imported and each runs the user's script or module unchanged through ``runpy``.

Process tree and clean-up (nothing may outlive the caller):

    kernel --(own session)--> ddplab.agent --(own session, one per launch)--> agent child
                                                                               `-> rank 0..N-1

- every process below the kernel asks the kernel (Linux: ``PR_SET_PDEATHSIG``) to be killed
  when its parent dies; on other systems this process exits when its socket to the kernel
  closes and kills every agent group it started;
- each agent child leads its own session and process group, so one ``killpg`` ends a launch
  and a Jupyter interrupt (SIGINT to the kernel's group) never reaches the workers directly;
- the rendezvous store's server runs in a process of its own (a "keeper", forked by the agent
  before any thread exists there), never in the agent that forks the workers: a fork copies
  a lock that another thread holds, and a worker forked while the store's server thread was
  inside ``getnameinfo`` (accepting a peer) would hang for good on its own first connection.

Lessons: every notebook that launches a worker (01-09).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any, Optional

PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.nn", "torch.optim")
_MAX_FDS = 64


def _prctl(option: int, value: Any) -> None:
    """Linux's ``prctl(option, value)`` for this process (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def name_this_process(name: str) -> None:
    """Set the name ``ps -o comm`` and ``/proc/PID/comm`` show (15 bytes at most)."""
    _prctl(15, ctypes.c_char_p(name.encode()[:15]))  # 15 == PR_SET_NAME


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere)."""
    _prctl(1, int(sig))  # 1 == PR_SET_PDEATHSIG


# --------------------------------------------------------------------------- worker side


def run_worker(target: str, argv: list[str], rank_fds: list[int], threads: int) -> None:
    """Entry point of every rank: route output to this rank's pipe, then run the target.

    Runs in a process forked by the elastic agent; the torchrun environment (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) is already set.
    """
    set_parent_death_signal()
    local_rank = int(os.environ["LOCAL_RANK"])
    mine = rank_fds[local_rank]
    # The launcher sends one stdout pipe per rank, then (up to its fd limit) one stderr pipe per
    # rank, so that stderr stays stderr, as under torchrun.
    both = len(rank_fds) == 2 * int(os.environ["LOCAL_WORLD_SIZE"])
    err = rank_fds[len(rank_fds) // 2 + local_rank] if both else mine
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(mine, 1)
    os.dup2(err, 2)
    for fd in rank_fds:
        _close(fd)
    if _STORE_HOST.get("conn") is not None:  # the agent's: its stores end with the agent
        _STORE_HOST.pop("conn").close()
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # Tell the launcher which global rank this pipe belongs to (multi-node ranks are assigned
    # at the rendezvous, so the local rank alone does not say).
    print("@ddplab " + json.dumps({"kind": "rank", "rank": int(os.environ["RANK"]),
                                   "local_rank": local_rank, "pid": os.getpid()}), flush=True)
    import logging

    logging.disable(logging.NOTSET)
    # The agent's handlers (inherited through fork) would turn SIGTERM into an exception.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    _warn_if_cuda_unusable(torch)
    # torch reads TORCH_DISTRIBUTED_DEBUG once, when torch.distributed is imported: in the
    # helper, before this job's environment was set. Read it again, as a fresh process would.
    if torch.distributed.is_available() and hasattr(torch.distributed, "set_debug_level_from_env"):
        torch.distributed.set_debug_level_from_env()
    if callable(getattr(atexit, "_clear", None)):
        atexit._clear()  # handlers the helper registered are not this script's
    option = {"underscore": "--local_rank", "dash": "--local-rank"}.get(
        os.environ.get("DDPLAB_LOCAL_RANK_ARG", ""))
    if option:  # as torch.distributed.launch did: ddplab.launch(..., local_rank_arg=True)
        argv = [f"{option}={local_rank}", *argv]
    code: Any = 0
    try:
        _run_target(target, argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code != 0:
            raise
        # sys.exit(0) is success: return normally, or the agent waits for a return value.
    except BaseException as exc:
        code = 1
        _print_user_traceback(exc)
        raise
    finally:
        _finish_like_an_interpreter()
        print("@ddplab " + json.dumps({"kind": "exit", "rank": int(os.environ["RANK"]),
                                       "code": code, "time": time.time()}), flush=True)
        sys.stderr.flush()


def _finish_like_an_interpreter() -> None:
    """Do what ``python script.py`` does on its way out, which a forked worker would skip.

    A worker forked by the elastic agent leaves through ``os._exit``: without this, the
    script's ``atexit`` handlers would never run, and objects kept alive only by reference
    cycles (a process group's store, say) would never be finalised, so a ``file://`` store
    could stay behind after a clean job.
    """
    sys.stdout.flush()
    if callable(getattr(atexit, "_run_exitfuncs", None)):
        atexit._run_exitfuncs()
    gc.collect()


def _warn_if_cuda_unusable(torch: Any) -> None:
    """Say so, loudly, if this worker was forked after CUDA was touched (it could not use it).

    ddplab never asks CUDA anything before forking (see ``launch_config``); this guards against
    a torch version or a preloaded module that does. ``DDPLAB_LAUNCH_PATH=subprocess`` avoids
    forking altogether.
    """
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if callable(in_bad_fork) and in_bad_fork():
        print("ddplab: warning: this worker was forked after its launcher touched CUDA, so it "
              "cannot use the GPU (\"Cannot re-initialize CUDA in forked subprocess\"). "
              "Relaunch with DDPLAB_LAUNCH_PATH=subprocess and report this with your torch "
              "version.", file=sys.stderr, flush=True)


def _print_user_traceback(exc: BaseException) -> None:
    """Print the traceback from the user's code on, without this launcher's frames."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def _run_target(target: str, argv: list[str]) -> None:
    """Run a script path or a module name as ``__main__``, as ``python`` would."""
    import runpy

    if target.endswith(".py") or os.sep in target:
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = [target, *argv]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)


# --------------------------------------------------------------------------- agent side


def run_agent(req: dict[str, Any], fds: list[int]) -> None:
    """Body of the forked agent child: run one elastic launch, write a JSON report, exit."""
    report_fd, log_fd, rank_fds = fds[0], fds[1], fds[2:]
    os.setsid()
    set_parent_death_signal()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    _close(log_fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.update(req.get("env") or {})
    if req.get("cwd"):
        os.chdir(req["cwd"])
    report: dict[str, Any]
    try:
        report = _elastic_run(req, rank_fds)
    except BaseException as exc:  # the report must always be written
        report = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    _end_keepers()
    _write_all(report_fd, json.dumps(report).encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _elastic_run(req: dict[str, Any], rank_fds: list[int]) -> dict[str, Any]:
    """Call PyTorch's elastic launcher exactly as torchrun would, with forked workers."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # ddplab reports failures itself, rank by rank; torch's copy of them is noise here.
    # (Workers inherit this through fork; run_worker turns logging back on.)
    logging.disable(logging.ERROR)
    exitcodes: dict[str, int] = {}
    _optional(_record_exitcodes, exitcodes)
    nnodes = int(req["nnodes"])
    restarts = int(req.get("max_restarts", 0))
    endpoint = req["rdzv_endpoint"]
    loopback = endpoint.startswith(("127.", "localhost"))
    configs: dict[str, Any] = {"timeout": int(req.get("rdzv_timeout", 900))}
    if nnodes == 1 and restarts == 0:
        # One node, one attempt: torchrun's static rendezvous (one store on a known port, no
        # rounds to negotiate) is all it takes, with public API only.
        backend, endpoint = "static", _static_endpoint(endpoint, loopback)
        configs["rank"] = 0
    else:
        backend = "c10d"
        # Node 0 hosts the store; torch would guess from the hostname, and a guess that misses
        # (an address of this machine the hostname does not resolve to) leaves a lone node
        # waiting for a server nobody starts.
        configs["is_host"] = int(req["node_rank"]) == 0
    config = launch_config(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=int(req["nproc_per_node"]),
        run_id=req["run_id"],
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=configs,
        max_restarts=restarts,
        monitor_interval=0.01,
        start_method="fork",
        local_addr=req.get("local_addr"),
        shutdown_timeout=int(req.get("shutdown_timeout", 5)),
    )
    _optional(_stores_in_keepers, loopback)
    if backend == "c10d":
        _optional(_quick_rendezvous, single_node=nnodes == 1)
    started = time.time()
    try:
        elastic_launch(config, run_worker)(req["target"], req["args"], rank_fds,
                                           int(req["threads"]))
    except ChildFailedError as err:
        failures = {
            str(rank): {
                "local_rank": f.local_rank,
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "message": f.message if isinstance(f.message, str) else json.dumps(f.message),
                "timestamp": f.timestamp,
            }
            for rank, f in err.failures.items()
        }
        return {"status": "failed", "failures": failures, "started": started,
                "exitcodes": exitcodes}
    return {"status": "ok", "started": started, "exitcodes": exitcodes}


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
      when the device count does not match. This reads and sets a public dataclass field only.
    """
    import dataclasses

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


def patches_enabled() -> bool:
    """Whether the optional speed-ups that touch torch internals are on (``DDPLAB_TORCH_PATCHES``)."""
    return os.environ.get("DDPLAB_TORCH_PATCHES", "1") != "0"


def _optional(patch: Any, *args: Any, **kwargs: Any) -> bool:
    """Apply one adjustment of torch internals, or skip it when it does not fit this torch.

    Every such adjustment only saves time (or, for the loopback store, narrows where a store
    listens); a launch must work without it. When its target is missing or has another shape
    (an older or newer torch), or ``DDPLAB_TORCH_PATCHES=0``, it is skipped and the launch goes
    on as plain torchrun would. Returns whether it was applied.
    """
    if not patches_enabled():
        return False
    try:
        return patch(*args, **kwargs) is not False
    except Exception as exc:  # noqa: BLE001  (any mismatch means: not for this torch)
        version = getattr(sys.modules.get("torch"), "__version__", "?")
        print(f"ddplab: skipped {patch.__name__.strip('_')} on torch {version}: "
              f"{type(exc).__name__}: {exc}",
              file=sys.stderr)
        return False


def _static_endpoint(endpoint: str, loopback: bool) -> str:
    """``HOST:PORT`` for the static rendezvous, choosing a free port when none was given.

    On the loopback address the port is bound here, and the listening socket kept for the
    store (see ``_stores_in_keepers``), so nobody can take it in between.
    """
    host, _, port_text = endpoint.rpartition(":")
    port = int(port_text or 0)
    if port == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1" if loopback else "", 0))
        port = listener.getsockname()[1]
        if loopback and patches_enabled():
            listener.listen(128)
            _LISTENERS[port] = listener
        else:
            listener.close()
    return f"{host}:{port}"


def _quick_rendezvous(single_node: bool) -> None:
    """Take two fixed costs out of the rendezvous, leaving what it does unchanged.

    - Before its first round every node sleeps a random 0-0.3 s, "to skew the rendezvous
      attempts across the nodes"; with one node there is nothing to skew, so skip that sleep
      (the one-second waits between polls of a multi-node rendezvous stay).
    - Every rendezvous event records the calling method's name through ``inspect.stack()``,
      which reads the source of every frame (about 70 ms a launch); take it from the frame.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic

    if not callable(getattr(dynamic, "_delay", None)) and not callable(
            getattr(dynamic, "get_method_name", None)):
        raise AttributeError("dynamic_rendezvous has neither _delay nor get_method_name")
    if single_node and callable(getattr(dynamic, "_delay", None)):
        delay = dynamic._delay

        def fixed_delays_only(seconds: Any) -> None:
            if not isinstance(seconds, tuple):
                delay(seconds)

        dynamic._delay = fixed_delays_only  # this agent process only
    if callable(getattr(dynamic, "get_method_name", None)):

        def get_method_name(depth: int = 2) -> str:
            try:
                return sys._getframe(depth).f_code.co_name
            except ValueError:
                return "no_method_name"

        dynamic.get_method_name = get_method_name


_LISTENERS: dict[int, socket.socket] = {}  # port -> listener, open for the agent's life


def _stores_in_keepers(loopback: bool) -> None:
    """Serve every rendezvous store this agent hosts from another process, never the agent.

    The helper's store host serves it (``start_store_host``); where there is none, a keeper
    forked for the store (``_store_in_keeper``).

    On the loopback address the store also listens on 127.0.0.1 only, not on every interface:
    torch's TCPStore server binds all interfaces whatever host it is given; handed a socket
    already bound to the loopback address (``master_listen_fd``), it listens there alone. On any
    other address (a real multi-node job) it binds as torch binds it, in the keeper.
    """
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    if loopback and "master_listen_fd" not in (TCPStore.__init__.__doc__ or ""):  # pybind's
        raise TypeError("TCPStore takes no master_listen_fd")
    if not callable(getattr(dynamic.DynamicRendezvousHandler, "_create_tcp_store_server", None)):
        raise AttributeError("DynamicRendezvousHandler has no _create_tcp_store_server")
    backend.TCPStore, static.TCPStore  # noqa: B018  (AttributeError when a module changed)

    def kept_store(host: str, port: int, world_size: Any = None, is_master: bool = False,
                   *args: Any, **kwargs: Any) -> Any:
        if not is_master or "master_listen_fd" in kwargs:
            return TCPStore(host, port, world_size, is_master, *args, **kwargs)
        listener = None
        if loopback:
            listener = _LISTENERS.get(port)
            if listener is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind(("127.0.0.1", port))
                listener.listen(128)
                port = listener.getsockname()[1]
                _LISTENERS[port] = listener
        served = _store_in_host(host, port, listener, args, kwargs)
        if served is not None:
            return TCPStore(host, served, world_size, False, *args, **kwargs)
        return _store_in_keeper(host, port, world_size, listener, args, kwargs)

    # c10d: two stores listen, the rendezvous's and the one the workers bootstrap from;
    # static: one store, which the workers share.
    backend.TCPStore = kept_store  # type: ignore[assignment]  (this agent process only)
    static.TCPStore = kept_store  # type: ignore[assignment]
    dynamic.DynamicRendezvousHandler._create_tcp_store_server = (  # type: ignore[method-assign]
        lambda self, addr, port: kept_store(addr, port, is_master=True, multi_tenant=True))


# The store host: one process per helper, forked from it at start (torch loaded, no thread),
# that serves the stores of every launch the helper starts. Each agent asks it over a UNIX
# socket of its own and keeps that connection for its life; when the connection closes (the
# agent ended or died), the host drops that agent's stores. Forking a keeper per launch would
# cost a fork of a 500 MB process (~15 ms of a 150 ms warm launch).
STORE_HOST_NAME = "ddplab-stores"  # its process name (``ps -o comm``)
_STORE_HOST: dict[str, Any] = {}  # "name": its socket's address, "pid"; "conn": an agent's


def start_store_host() -> None:
    """Fork the store host (in the helper, before any agent). Without it agents fork keepers."""
    name = f"\0ddplab-stores-{os.getpid()}-{os.urandom(8).hex()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(64)
    helper = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _become_quiet_child(helper, keep={listener.fileno()})
            name_this_process(STORE_HOST_NAME)
            _host_stores(listener)
        finally:
            os._exit(1)
    listener.close()
    _STORE_HOST.update(name=name, pid=pid)


def _host_stores(listener: socket.socket) -> None:
    """The store host's loop: one request, one store; an agent's stores go with its connection."""
    import pickle

    from torch.distributed import TCPStore

    stores: dict[socket.socket, list[Any]] = {}
    while True:
        for conn in select.select([listener, *stores], [], [])[0]:
            if conn is listener:
                stores[listener.accept()[0]] = []
                continue
            try:
                msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 1)
            except OSError:
                msg, fds = b"", []
            if not msg:
                del stores[conn]  # (their servers stop as they are dropped)
                conn.close()
                continue
            try:
                host, port, args, kwargs = pickle.loads(msg)
                kwargs = _server_kwargs(kwargs, fds[0] if fds else None)
                stores[conn].append(TCPStore(host, port, None, True, *args, **kwargs))
                conn.sendall(f"ok {stores[conn][-1].port}".encode())  # (no other reference)
            except Exception as exc:  # noqa: BLE001  (told to the agent, which raises it)
                for fd in fds:
                    _close(fd)
                conn.sendall(f"{type(exc).__name__}: {exc}".encode())


def _store_in_host(host: str, port: int, listener: Optional[socket.socket],
                   args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[int]:
    """Have the store host serve this store; the port it serves on, or None without a host."""
    import pickle

    if "name" not in _STORE_HOST:
        return None
    conn = _STORE_HOST.get("conn")
    if conn is None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(_STORE_HOST["name"])
        except OSError:
            conn.close()
            return None
        _STORE_HOST["conn"] = conn
    socket.send_fds(conn, [pickle.dumps((host, port, args, kwargs))],
                    [listener.fileno()] if listener is not None else [])
    return _served_port(conn.recv(4096), "its host process died")


def _server_kwargs(kwargs: dict[str, Any], listen_fd: Optional[int]) -> dict[str, Any]:
    """A store server's options: listening on ``listen_fd`` when given one (it takes it over)."""
    import torch

    kwargs = dict(kwargs)
    if listen_fd is not None:
        kwargs["master_listen_fd"] = listen_fd
        if torch.__version__ < "2.7":  # libuv's store takes a listening socket from 2.7 on
            kwargs.setdefault("use_libuv", False)
    return kwargs


def _served_port(answer: bytes, silence: str) -> int:
    """The port from a server's ``ok PORT``; anything else is why its store did not start."""
    text = answer.decode(errors="replace")
    word, _, served = text.partition(" ")
    if word != "ok" or not served.isdigit():
        raise RuntimeError("the rendezvous store could not start: " + (text or silence))
    return int(served)


def stop_store_host() -> None:
    """End the store host (the helper is done; it would also die with the helper)."""
    pid = _STORE_HOST.pop("pid", None)
    _STORE_HOST.pop("name", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass


_KEEPERS: list[int] = []  # pids of this agent's store keepers


def _store_in_keeper(host: str, port: int, world_size: Any,
                     listener: Optional[socket.socket], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
    """Serve the store from a child process of its own; return a client of it.

    The agent forks the workers. A TCPStore server in the agent runs a thread, and a worker
    forked while that thread held one of libc's locks (``getnameinfo``'s, as it accepted a
    peer) inherited the lock held, by nobody: its own first connection then waits forever (one
    4-rank launch in 200 hung so here on torch 2.14, one in 15 on torch 2.6). The keeper is
    forked now, while the agent has no other thread; it only serves, and dies with the agent.
    It listens on ``listener`` when given one, else binds ``port`` as torch does (0: any port;
    the client is told which).
    """
    from torch.distributed import TCPStore

    server_kwargs = _server_kwargs(kwargs, listener.fileno() if listener is not None else None)
    agent = os.getpid()
    ready, said = os.pipe()
    pid = os.fork()
    if pid == 0:  # the keeper: serve until the agent goes
        try:
            keep = {said} | ({listener.fileno()} if listener is not None else set())
            _become_quiet_child(agent, keep)
            try:
                server = TCPStore(host, port, None, True, *args, **server_kwargs)
            except BaseException as exc:
                _write_all(said, f"{type(exc).__name__}: {exc}".encode())
                raise
            _write_all(said, f"ok {server.port}".encode())  # (and closes it)
            while True:
                signal.pause()
        finally:
            os._exit(1)
    os.close(said)
    answer = b""
    while chunk := os.read(ready, 4096):
        answer += chunk
    os.close(ready)
    _KEEPERS.append(pid)
    try:
        served = _served_port(answer, "its process died")
    except RuntimeError:
        _end_keepers()
        raise
    return TCPStore(host, served, world_size, False, *args, **kwargs)


def _become_quiet_child(parent: int, keep: set[int]) -> None:
    """In a freshly forked server child: die with ``parent``, no output, only ``keep`` open.

    Every other descriptor is closed, the launcher's pipes above all: they must close when
    the processes that own them end. SIGINT is ignored (the parent decides), SIGTERM ends it.
    """
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, _max_fd())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (ValueError, OSError):
        return 65536


def _end_keepers() -> None:
    """Stop this agent's store keepers and reap them (they would also die with the agent)."""
    for pid in _KEEPERS:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
    _KEEPERS.clear()


def _record_exitcodes(codes: dict[str, int]) -> None:
    """Collect every worker's exit code (pid -> code) into ``codes``, not just the first failure's.

    torch's elastic agent reports the first failed rank it notices; when rank 1 is killed and
    rank 0 then fails on the closed connection, it may notice rank 0 first. The process
    context that joins the workers knows them all, so record them as it joins.
    """
    import torch.multiprocessing  # noqa: F401  (loads the module the function shadows)

    spawn = sys.modules["torch.multiprocessing.spawn"]
    join = spawn.ProcessContext.join

    def recording_join(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return join(self, *args, **kwargs)
        finally:
            for process in getattr(self, "processes", []):
                if process.exitcode is not None:
                    codes[str(process.pid)] = process.exitcode

    spawn.ProcessContext.join = recording_join  # this agent process only


# --------------------------------------------------------------------------- server loop


def serve(sock: socket.socket) -> None:
    """Answer launch requests until the kernel closes the socket, then clean up and exit."""
    children: set[int] = set()
    # Reap each agent the moment it exits: until then it is a zombie that still counts as a
    # member of its process group, and the launcher waits for that group to be empty.
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: _reap(children))
    while True:
        _reap(children)
        if not select.select([sock], [], [], 0.2)[0]:
            continue
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, _MAX_FDS)
        except OSError:
            msg, fds = b"", []
        if not msg:
            break
        req = json.loads(msg.decode())
        if req.get("op") == "ping":
            sock.sendall(json.dumps({"ok": True, "pid": os.getpid(),
                                     "store_host": _STORE_HOST.get("pid")}).encode())
            continue
        preload(req.get("preload", ()))
        refusal = fork_refusal()
        if refusal:
            for fd in fds:
                _close(fd)
            sock.sendall(json.dumps({"refused": refusal}).encode())
            continue
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                run_agent(req, fds)
            finally:
                os._exit(70)
        for fd in fds:
            _close(fd)
        children.add(pid)
        sock.sendall(json.dumps({"pid": pid}).encode())
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # reaped below, not by the handler
    for pid in list(children):  # the kernel is gone: end every launch it started
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    _reap(children, block=True)


def fork_refusal() -> str:
    """Why forking workers from this process would be unsafe now ("" when it is safe).

    A process that has initialised CUDA cannot be forked: CUDA does not work in the child
    ("Cannot re-initialize CUDA in forked subprocess"). This helper never touches the GPU
    itself, but a module named in ``DDPLAB_PRELOAD`` might.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return ("CUDA is initialised in the launch helper (by a module in DDPLAB_PRELOAD?), "
                "and workers forked from it could not use the GPU")
    return ""


def preload(names: Any) -> None:
    """Import modules now so that every forked agent and worker starts with them loaded.

    Then freeze what exists (``gc.freeze``, as pre-forking servers do): the garbage collector
    of every forked process skips the millions of objects torch brought in, so a worker's
    collections only look at what its own script made (and do not touch, hence copy, the
    helper's memory pages).
    """
    for name in names:
        if name and name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                pass
    gc.freeze()


def _reap(children: set[int], block: bool = False) -> None:
    for pid in list(children):
        try:
            done, _status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    _close(fd)


def main() -> None:
    """``python -m ddplab.agent FD``: serve the kernel on the inherited socket FD."""
    set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    preload(PRELOAD + tuple(os.environ.get("DDPLAB_PRELOAD", "").split(",")))
    if patches_enabled():
        try:
            start_store_host()
        except OSError as exc:  # agents fork a keeper per store instead
            print(f"ddplab: no store host ({exc}); each launch forks its own", file=sys.stderr)
    sock.sendall(b'{"ready": true}')
    try:
        serve(sock)
    finally:
        stop_store_host()


if __name__ == "__main__":
    main()
