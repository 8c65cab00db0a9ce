"""One elastic agent per launch, forked by the helper: torch's ``elastic_launch`` forking ranks
(``entry.run_rank``). Its rendezvous keeps the agent's store in-process and serves the workers'
store only once they are forked (a rank forked while a store thread holds a lock would hang).
How it ended goes back as its last line (a ``report`` event: torch's ``ChildFailedError``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

from ..env import become_subreaper, set_parent_death_signal
from ..events import MARKER
from . import entry
from .procs import connect_streams, end_children, private_folder

RDZV_BACKEND = "ddplab"


def run_agent(req: dict[str, Any], helper: int) -> None:
    """Run one elastic launch, report on stdout, exit."""
    os.setsid()
    set_parent_death_signal(parent=helper)
    become_subreaper()  # (what a rank leaves in a session of its own comes back to be ended)
    # The helper's directory, environment and path are the first launch's: this one's instead
    # (its ranks put this job's PYTHONPATH and directory on the path, as a fresh python would;
    # tempfile and time read this job's TMPDIR and TZ again).
    first = {os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)}
    sys.path[:] = [path for path in sys.path if path not in first]
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None
    time.tzset()
    connect_streams("launcher")
    os.chdir(req["cwd"])
    try:
        report = _elastic_run(req)
    except BaseException as exc:  # the report must always be written
        report = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    report["kind"] = "report"
    sys.stderr.flush()
    print(MARKER + json.dumps(report), flush=True)
    os._exit(0)


def _elastic_run(req: dict[str, Any]) -> dict[str, Any]:
    """Call PyTorch's elastic launcher as torchrun would, with forked workers."""
    import logging

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.launcher.api import elastic_launch

    # ddplab reports failures itself (the rank entry turns logging back on).
    logging.disable(logging.ERROR)
    handler = _one_node_handler()
    rendezvous_handler_registry.register(RDZV_BACKEND, handler)
    logs = private_folder("ddplab-agent-")  # (torch's log folders; its own would stay in /tmp)
    config = launch_config(
        min_nodes=1, max_nodes=1, nproc_per_node=int(req["nproc_per_node"]),
        run_id=req["run_id"], rdzv_backend=RDZV_BACKEND, rdzv_endpoint=req["rdzv_endpoint"],
        max_restarts=int(req.get("max_restarts", 0)), monitor_interval=0.01,
        start_method="fork", shutdown_timeout=5, logs_specs=DefaultLogsSpecs(log_dir=logs))
    try:
        elastic_launch(config, entry.run_rank)(req["target"], req["args"], int(req["threads"]))
    except ChildFailedError as err:  # the rank torch saw fail first: its exit code or -signal
        return {"status": "failed", "exits": {rank: (failure.exitcode, failure.timestamp)
                                              for rank, failure in err.failures.items()}}
    finally:
        handler.drop()
        end_children()
        shutil.rmtree(logs, ignore_errors=True)
    return {"status": "ok"}


def _one_node_handler() -> Any:
    """The ``ddplab`` rendezvous handler class: one node, rank 0 of 1."""
    from torch.distributed import HashStore, PrefixStore
    from torch.distributed.elastic.rendezvous import (RendezvousHandler, RendezvousInfo,
                                                      RendezvousParameters,
                                                      RendezvousStoreInfo)

    class OneNode(RendezvousHandler):
        # This round's listening socket, bound before torch's agent forks the ranks, and the
        # ranks' TCPStore on it, started after: a rank forked while a store thread held a
        # lock (libc's resolver's, as it accepts a peer) would hang. (One handler an agent.)
        listener: Any = None
        store: Any = None

        def __init__(self, params: RendezvousParameters) -> None:
            host, _, port = params.endpoint.rpartition(":")
            self.host, self.port, self.run_id = host or "127.0.0.1", int(port or 0), params.run_id

        def next_rendezvous(self) -> Any:
            # Each round a fresh store: a restarted round must not read the failed one's
            # addresses (pytorch/pytorch#135712). A port given is the first round's.
            port = 0 if OneNode.listener else self.port
            if OneNode.listener:
                OneNode.drop()  # (its thread joined: none runs when the ranks are forked again)
                print(MARKER + json.dumps({"kind": "round"}), flush=True)  # (output.Streams)
            OneNode.listener = listen(self.host, port)
            return RendezvousInfo(PrefixStore(self.run_id, HashStore()), 0, 1,
                                  RendezvousStoreInfo(self.host, OneNode.listener[1]))

        def num_nodes_waiting(self) -> int:
            # torch's agent first asks this from its monitor loop, once it forked the ranks
            # (they wait in the socket's backlog until then): the store starts now.
            if OneNode.listener and OneNode.store is None:
                OneNode.store = serve_store(self.host, *OneNode.listener)
            return 0

        @staticmethod
        def drop() -> None:
            if OneNode.store is None and OneNode.listener:
                os.close(OneNode.listener[0])
            OneNode.store = OneNode.listener = None

        def get_backend(self) -> str:
            return RDZV_BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True  # the workers are clients of the store served by this agent

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

    return OneNode


def listen(host: str, port: int) -> tuple[int, int]:
    """A socket listening on ``host:port`` (0: any) for the ranks' store; its fd and port. On
    loopback it listens there only (a TCPStore would listen on every interface)."""
    import socket

    if host.startswith("127.") or host == "localhost":
        server = socket.create_server(("127.0.0.1", port), backlog=socket.SOMAXCONN)
    elif socket.has_dualstack_ipv6():
        server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True,
                                      backlog=socket.SOMAXCONN)
    else:
        server = socket.create_server(("", port), backlog=socket.SOMAXCONN)
    port = server.getsockname()[1]
    return server.detach(), port


def serve_store(host: str, fd: int, port: int) -> Any:
    """The ranks' TCPStore, served in this process on the listening socket ``fd``."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    options: dict[str, Any] = {"master_listen_fd": fd}
    if tuple(map(int, re.findall(r"\d+", torch.__version__)[:2])) < (2, 7):
        options["use_libuv"] = False  # (before 2.7 only the older server takes a socket)
    return TCPStore(host, port, None, True, timedelta(seconds=900), **options)


def launch_config(**options: Any) -> Any:
    """PyTorch's ``LaunchConfig`` without options this torch lacks, built without asking CUDA
    anything (from 2.8 ``numa_options=None`` asks the accelerator: set after a placeholder)."""
    from torch.distributed.launcher.api import LaunchConfig

    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    numa = "numa_options" in known
    config = LaunchConfig(**{name: value for name, value in options.items() if name in known},
                          **({"numa_options": object()} if numa else {}))
    if numa:
        config.numa_options = None
    return config
