"""Join a process group with the init method named on the command line, and report what happened.

Run it (the init method is an argument, never hard-coded in the script)::

    torchrun --nproc-per-node 2 -m ddplab.workers.init_methods --init-method env://
    torchrun --nproc-per-node 2 -m ddplab.workers.init_methods --init-method tcp://127.0.0.1:29501
    torchrun --nproc-per-node 2 -m ddplab.workers.init_methods --init-method file:///tmp/pg-store
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.init_methods --init-method env://

Every rank emits one ``joined`` event with: ``rank``, ``local_rank``, ``world_size``,
``node_rank``, ``torchrun_env`` (the variables torchrun set: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and the *_SOCKET_IFNAME choices),
``init_method``, ``backend``, ``hostname``, ``pid``, ``join_seconds``, ``join_started`` and
``joined_at`` (wall-clock times, ``time.time()``, of the call and its return) and ``rank_sum``
(an all_reduce of the ranks: proof that the group really works). A rank that fails to join emits
``join_failed`` with the error and exits with code 1.

``--stagger S`` makes rank r start joining r x S seconds late, as a slow machine would: the
others wait in ``init_process_group`` (their ``join_seconds`` shows it). ``--crash`` exits
abruptly after joining (code 3), as a killed or crashed job would: with ``file://`` the store
file then stays behind, and the next job that reuses it fails.

Lesson: 07.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as torch_dist

from ddplab import dist, events

CRASH_EXIT_CODE = 3
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.init_methods",
                                description=__doc__.split("\n")[0])
    p.add_argument("--init-method", default="env://",
                   help="env:// | tcp://ADDR:PORT (rank 0's address) | file:///path (new file)")
    p.add_argument("--backend", choices=["gloo", "nccl", "mpi"], default=None,
                   help="default: nccl with GPUs, gloo without")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the others")
    p.add_argument("--stagger", type=float, default=0.0,
                   help="rank r starts joining r x STAGGER seconds late (a slow machine)")
    p.add_argument("--crash", action="store_true",
                   help="exit abruptly after joining, as a crash would (a file:// store stays)")
    return p.parse_args(argv)


def torchrun_env() -> dict[str, str]:
    """The launcher variables this process sees (those that are set)."""
    return {name: os.environ[name] for name in TORCHRUN_VARS if name in os.environ}


def join(init_method: str, backend: str, rank: int, world_size: int, timeout: float) -> None:
    """Join the default process group with ``init_method``; block until all have joined.

    Lesson: 07.
    """
    _no_agent_store_for(init_method)
    # [join]
    # Every process runs this same line; only RANK differs. env:// reads MASTER_ADDR and
    # MASTER_PORT; tcp:// names rank 0's address; file:// names a file that must not exist yet.
    torch_dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    # [/join]


def _no_agent_store_for(init_method: str) -> None:
    """Let a ``tcp://`` address that is not torchrun's own store be hosted by rank 0.

    Under torchrun every worker is told (``TORCHELASTIC_USE_AGENT_STORE``) to join the agent's
    store as a client. Recent torch applies that only when the address is the agent's
    ``MASTER_ADDR:MASTER_PORT``; torch 2.6 applies it to any ``tcp://`` address, so every rank
    would wait for a store nobody hosts. Not needed outside torchrun.
    """
    own = f"tcp://{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if init_method.startswith("tcp://") and init_method != own:
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def crash() -> None:
    """Leave at once with ``CRASH_EXIT_CODE``, skipping every cleanup (like a killed process)."""
    print("--crash: exiting abruptly, without destroy_process_group()", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Join with the requested init method, check the group with one all_reduce, report."""
    args = parse_args(argv)
    # [torchrun-env]
    # torchrun (and ddplab.launch) give every worker its identity in the environment:
    rank = int(os.environ["RANK"])              # 0 .. WORLD_SIZE-1, unique in the whole job
    local_rank = int(os.environ["LOCAL_RANK"])  # 0 .. processes on this node - 1: picks the GPU
    world_size = int(os.environ["WORLD_SIZE"])  # processes in the whole job, all nodes
    # [/torchrun-env]
    backend = dist.pick_backend(args.backend)
    device = dist.pick_device(local_rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    time.sleep(rank * args.stagger)  # the others wait for a late rank: init blocks
    started, start = time.time(), time.perf_counter()
    try:
        join(args.init_method, backend, rank, world_size, args.timeout)
        join_seconds, joined_at = time.perf_counter() - start, time.time()
        # [check]
        total = torch.tensor([float(rank)], device=device)
        torch_dist.all_reduce(total)  # 0 + 1 + ... + (world_size - 1) on every rank
        # [/check]
    except Exception as exc:  # report, then fail as any crashed worker would
        events.emit("join_failed", init_method=args.init_method, error=f"{type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}")
        raise
    report = events.emit(
        "joined", rank=rank, local_rank=local_rank, world_size=world_size,
        node_rank=int(os.environ.get("GROUP_RANK", "0")), torchrun_env=torchrun_env(),
        init_method=args.init_method, backend=backend, hostname=socket.gethostname(),
        pid=os.getpid(), join_seconds=join_seconds, join_started=started, joined_at=joined_at,
        rank_sum=total.item(),
    )
    print(f"rank {rank} (local rank {local_rank}, node {report['node_rank']}) of {world_size} "
          f"joined via {args.init_method} with {backend}", flush=True)
    if args.crash:
        crash()
    torch_dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
