"""Save a checkpoint on two nodes: guarded by ``local_rank == 0`` (one source) or ``rank == 0``.

Run it on two "nodes" of this machine (2 processes each), from a notebook or two terminals::

    ddplab.launch_multinode("ddplab.workers.multinode_save", nnodes=2, nproc_per_node=2,
                            args=["--out", "/tmp/ckpt"])
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29500 --rdzv-id job1 -m ddplab.workers.multinode_save \
        --out /tmp/ckpt    # the same command in each of the two terminals

On two real machines, run that command on each, with the first machine's address (reachable
from the other) in place of 127.0.0.1. The c10d rendezvous numbers the nodes itself: no
``--node-rank`` is needed.

Each checkpoint is saved twice under ``--out``, to two kinds of storage:

- ``shared/``: one folder every node sees, as on a shared filesystem (NFS, Lustre);
- ``node<GROUP_RANK>/``: a folder per node, as each machine's own local disk.

What is saved is a small model first trained with DDP for a few steps, each rank on data of
its own: ranks under two agents, one set of weights. Every write also appends one line
(``rank node``) to ``<guard>_writes.log`` next to the file, so the writes can be counted
afterwards. After a barrier, every rank loads the file from its node's view of the storage.

Events: ``identity`` per rank (``rank``, ``local_rank``, ``group_rank``, ``world_size``,
``agent_pid``: the pid of the torchrun agent that started this worker, ``hostname``);
``metric`` ``checksum`` per rank (``value``: the sum of the trained weights, float64;
``initial``: the same before training); ``metric`` ``loaded`` per rank, guard and storage
(``guard``, ``storage``, ``ok``, ``error``).

Lesson: 07b.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import checkpoint, dist, events, train

STORAGES = ("shared", "node-local")
STEPS = 3  # DDP steps before the save


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.multinode_save",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for shared/ and node<N>/")
    return p.parse_args(argv)


def write(state: dict, path: Path, rank: int, node: int) -> None:
    """Save atomically and log the write (one line per write, appended)."""
    checkpoint.atomic_save(state, str(path))
    with open(path.with_name(path.stem + "_writes.log"), "a") as log:
        log.write(f"{rank} {node}\n")


# [save-local-rank]
def save_as_the_source(state: dict, path: Path, info: dist.DistInfo, node: int) -> None:
    if info.local_rank == 0:       # one process per NODE passes this test
        write(state, path, info.rank, node)
    dist.barrier()
# [/save-local-rank]


# [save-rank]
def save_on_rank_0(state: dict, path: Path, info: dist.DistInfo, node: int) -> None:
    if info.rank == 0:             # one process in the whole JOB passes this test
        write(state, path, info.rank, node)
    dist.barrier()                 # nobody loads before the file is complete
# [/save-rank]


GUARDS: dict[str, Callable[[dict, Path, dist.DistInfo, int], None]] = {
    "local_rank": save_as_the_source, "rank": save_on_rank_0}


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    info = dist.setup()
    node = int(os.environ.get("GROUP_RANK", "0"))  # assigned by the rendezvous
    events.emit("identity", local_rank=info.local_rank, group_rank=node,
                world_size=info.world_size, agent_pid=os.getppid(),
                hostname=socket.gethostname())

    # [train]
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Linear(4, 2)
    initial = train.param_checksum(model)
    ddp = DDP(model)  # a CPU module: no device_ids
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(info.rank)  # each rank its own samples
    for _ in range(STEPS):
        inputs = torch.randn(8, 4, generator=data)
        loss = F.mse_loss(ddp(inputs), inputs[:, :2])
        optimizer.zero_grad()
        loss.backward()  # the gradients are averaged over all ranks, on both nodes
        optimizer.step()
    events.emit("metric", name="checksum", value=train.param_checksum(model), initial=initial)
    # [/train]
    state = {"model": model.state_dict()}
    for storage in STORAGES:
        folder = Path(args.out, "shared" if storage == "shared" else f"node{node}")
        folder.mkdir(parents=True, exist_ok=True)
        for guard, save in GUARDS.items():
            path = folder / f"{guard}_guard.pt"
            save(state, path, info, node)
            try:
                torch.load(path, map_location="cpu", weights_only=True)
                ok, error = True, ""
            except FileNotFoundError as exc:
                ok, error = False, f"FileNotFoundError: {exc.filename}"
            events.emit("metric", name="loaded", guard=guard, storage=storage, ok=ok,
                        error=error, node=node)
    dist.barrier()
    print(f"rank {info.rank} (node {node}, local rank {info.local_rank}) done", flush=True)
    dist.cleanup()


if __name__ == "__main__":
    main()
