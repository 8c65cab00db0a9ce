"""Rendezvous stores served outside the agent, and ddplab's rendezvous handlers.

A ``TCPStore`` server runs a thread; a rank forked while that thread held one of libc's locks
hangs on its first connection. So stores live in the **store host**, forked once by the helper
before any thread; each agent keeps a connection to it, and when that closes the host drops
the agent's stores and ends what is left of its group. When the helper dies, the host ends
every process marked with its token (``DDPLAB_HELPER``). The agent reaches the stores through
handlers registered with torch's public ``rendezvous_handler_registry``: ``ddplab`` (one node)
and ``ddplab-c10d`` (torch's c10d rendezvous for several nodes).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
from typing import Any, Optional

from .procs import (become_quiet_child, kill_group, kill_marked, name_this_process,
                    set_parent_death_signal, start_time)

STORE_HOST_NAME = "ddplab-stores"  # its process name (``ps -o comm``)
RDZV_BACKEND = "ddplab"  # one node
RDZV_NODES_BACKEND = "ddplab-c10d"  # several nodes: torch's c10d rendezvous, store outside
HELPER_TOKEN = "DDPLAB_HELPER"  # environment variable marking every process of one helper
_HOST: dict[str, Any] = {}  # "name": the host's socket address, "pid"; "conn": an agent's


def start_store_host() -> None:
    """Fork the store host (in the helper, before any agent)."""
    name = f"\0ddplab-stores-{os.getpid()}-{os.urandom(8).hex()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(name)
    listener.listen(64)
    helper = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            become_quiet_child(helper, keep={listener.fileno()})
            name_this_process(STORE_HOST_NAME)
            _host_stores(listener)
        finally:
            os._exit(1)
    listener.close()
    _HOST.update(name=name, pid=pid)


def _host_stores(listener: socket.socket) -> None:
    """The store host's loop: one store per agent; an agent's stores go with its connection."""
    from torch.distributed import TCPStore

    # connection -> [(agent pid, its start time), stores...]
    agents: dict[socket.socket, list[Any]] = {}

    def end_everything(_sig: int, _frame: Any) -> None:  # the helper (so the caller) died
        for (pid, started), *_stores in agents.values():
            kill_group(pid, signal.SIGKILL, started)
        kill_marked(HELPER_TOKEN, os.environ.get(HELPER_TOKEN, ""), keep=os.getppid())
        os._exit(0)

    signal.signal(signal.SIGTERM, end_everything)
    set_parent_death_signal(signal.SIGTERM)
    while True:
        for conn in select.select([listener, *agents], [], [])[0]:
            if conn is listener:
                new = listener.accept()[0]  # (one message per request: a SEQPACKET socket)
                said = new.recv(64).decode(errors="replace")
                pid = int(said) if said.isdigit() else 0  # the agent says its pid
                agents[new] = [(pid, start_time(pid) if pid else None)]
                continue
            try:
                msg = conn.recv(1 << 16)
            except OSError:
                msg = b""
            if not msg:  # the agent is gone: so are its stores and what its group left
                pid, started = agents.pop(conn)[0]
                kill_group(pid, signal.SIGKILL, started)
                conn.close()
                continue
            try:
                host, port, timeout = pickle.loads(msg)
                port, options = _listen(host, port)
                agents[conn].append(TCPStore(host, port, None, True, timeout, **options))
                conn.sendall(f"ok {agents[conn][-1].port}".encode())  # (no other reference)
            except Exception as exc:  # noqa: BLE001  (told to the agent, which raises it)
                conn.sendall(f"{type(exc).__name__}: {exc}".encode())


def _listen(host: str, port: int) -> tuple[int, dict[str, Any]]:
    """The port and the options that make a loopback store listen on 127.0.0.1 only.

    torch's TCPStore server binds every interface whatever host it is given; handed a socket
    already bound to the loopback address (``master_listen_fd``, which it takes over), it
    listens there alone. It must be told that socket's port (torch 2.6 checks they agree, so
    port 0 becomes the port the socket got). libuv's store takes such a socket from 2.7 on.
    """
    if not host.startswith("127.") and host != "localhost":
        return port, {}
    import torch

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    port = listener.getsockname()[1]
    options: dict[str, Any] = {"master_listen_fd": listener.detach()}
    if _release(torch.__version__) < (2, 7):
        options["use_libuv"] = False
    return port, options


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def connect_agent(own_group: bool = False) -> None:
    """Connect to the store host (raises OSError when there is none).

    An agent (``own_group``: it leads its launch's process group) has the host end that group
    when the connection closes: what the ranks left in it goes with the agent.
    """
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(_HOST["name"])
    except (OSError, KeyError):
        conn.close()
        raise OSError("the launch helper's store host is not running")
    conn.sendall(str(os.getpid() if own_group else 0).encode())
    _HOST["conn"] = conn


def close_agent_connection() -> None:
    """In a rank: drop the agent's connection, which must end with the agent."""
    conn = _HOST.pop("conn", None)
    if conn is not None:
        conn.close()


def serve_store(host: str, port: int, timeout: Any) -> int:
    """Have the store host serve a store on ``host:port`` (0: any port); the port it serves."""
    conn = _HOST["conn"]
    conn.sendall(pickle.dumps((host, port, timeout)))
    text = conn.recv(4096).decode(errors="replace")
    word, _, served = text.partition(" ")
    if word != "ok" or not served.isdigit():
        raise RuntimeError("the rendezvous store could not start: " + (text or "its host died"))
    return int(served)


def store_host_pid() -> Optional[int]:
    return _HOST.get("pid")


def stop_store_host() -> None:
    """End the store host, which ends whatever its agents left (it would also die with us)."""
    pid = _HOST.pop("pid", None)
    _HOST.pop("name", None)
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
        except OSError:
            pass


def register_rendezvous() -> None:
    """Register the ``ddplab`` one-node rendezvous with torch's public handler registry."""
    import datetime
    import inspect

    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo,
                                                      RendezvousParameters,
                                                      rendezvous_handler_registry)

    shares = "bootstrap_store_info" in inspect.signature(RendezvousInfo).parameters

    class OneNodeRendezvous(RendezvousHandler):
        """One node, rank 0 of 1; its store served by the store host, shared with the workers."""

        def __init__(self, params: RendezvousParameters) -> None:
            host, _, port = params.endpoint.rpartition(":")
            self.host, self.port = host or "127.0.0.1", int(port or 0)
            self.run_id = params.run_id
            self.timeout = datetime.timedelta(seconds=int(params.config.get("timeout", 900)))
            self.store: Any = None
            self.served = 0

        def get_backend(self) -> str:
            return RDZV_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> Any:
            # A fresh store every round: a restarted attempt must not read the addresses the
            # failed attempt's workers published (pytorch/pytorch#135712). A port given is
            # the first round's; later rounds take any free port.
            port = self.port if self.store is None else 0
            self.served = serve_store(self.host, port, self.timeout)
            self.store = TCPStore(self.host, self.served, None, False, self.timeout)
            store = PrefixStore(self.run_id, self.store)
            if not shares:  # (a torch without RendezvousStoreInfo)
                return RendezvousInfo(store, 0, 1)  # type: ignore[call-arg]
            from torch.distributed.elastic.rendezvous import RendezvousStoreInfo

            return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(self.host, self.served))

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

    class NodesRendezvous(RendezvousHandler):
        """torch's c10d rendezvous for several nodes, its store served by node 0's store host."""

        def __init__(self, params: RendezvousParameters) -> None:
            from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
                C10dRendezvousBackend)
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

            host, _, port_text = params.endpoint.rpartition(":")
            port = int(port_text or 29400)
            timeout = datetime.timedelta(seconds=int(params.config.get("read_timeout", 60)))
            if params.get_as_bool("is_host", False):
                port = serve_store(host, port, timeout)
            store = TCPStore(host, port, None, False, timeout)
            self.c10d = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)

        def get_backend(self) -> str:
            return RDZV_NODES_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return bool(self.c10d.use_agent_store)

        def next_rendezvous(self) -> Any:
            return self.c10d.next_rendezvous()

        def is_closed(self) -> bool:
            return bool(self.c10d.is_closed())

        def set_closed(self) -> None:
            self.c10d.set_closed()

        def num_nodes_waiting(self) -> int:
            return int(self.c10d.num_nodes_waiting())

        def get_run_id(self) -> str:
            return str(self.c10d.get_run_id())

        def shutdown(self) -> bool:
            return bool(self.c10d.shutdown())

    rendezvous_handler_registry.register(RDZV_BACKEND, OneNodeRendezvous)
    rendezvous_handler_registry.register(RDZV_NODES_BACKEND, NodesRendezvous)
