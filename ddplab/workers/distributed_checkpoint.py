"""Distributed checkpoints: save an FSDP2 model from N ranks, load it into M ranks or one process.

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.distributed_checkpoint --save ckpt/dcp
    torchrun --nproc-per-node 4 -m ddplab.workers.distributed_checkpoint --load ckpt/dcp
    python -m ddplab.workers.distributed_checkpoint --load ckpt/dcp

``--save DIR`` trains an MLP sharded with ``fully_shard`` (FSDP2) for a few steps with Adam and
writes model and optimizer with ``torch.distributed.checkpoint`` (DCP): every rank writes its
own shards, in parallel, into DIR; nothing is gathered on one rank. ``--load DIR`` builds the
same MLP from another seed (so every weight differs), shards it over however many ranks this
job has (one process: not sharded at all), and loads DIR into it: DCP reads, for each rank,
exactly the pieces its shards need, whatever world size wrote them.

Events:

- ``dcp`` (every rank): ``action`` (``save`` or ``load``), ``world_size``, ``param_bytes``
  (what this rank holds), ``optimizer_bytes``, ``sharded`` (whether FSDP2 sharded the model).
- ``weights`` (rank 0): ``action``, ``values`` (every parameter, whole, flattened; after the
  save, or after the load), ``optimizer_steps`` (Adam's step count), ``exp_avg`` and
  ``exp_avg_sq`` (Adam's two moments of every parameter, whole, flattened).
- ``files`` (rank 0, after a save): ``names`` and ``bytes`` of what DIR holds.
- ``skipped`` (rank 0): ``reason``, when FSDP2 cannot run here (the CPU before torch 2.7).

Lesson: 11.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ddplab import dist, events
from ddplab.sharded import fsdp_problem, fully_shard, local_bytes, optimizer_bytes


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.distributed_checkpoint",
                                description=__doc__.split("\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", metavar="DIR", help="train, then save a checkpoint into DIR")
    what.add_argument("--load", metavar="DIR", help="load the checkpoint in DIR")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(info: dist.DistInfo, seed: int, hidden: int) -> tuple[nn.Module, bool]:
    """An MLP (64 -> hidden -> 10), sharded with FSDP2 over every rank when there are several."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10)).to(info.device)
    if info.world_size == 1:
        return model, False
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh), True


def whole(model: nn.Module) -> list[list[float]]:
    """Every parameter, gathered whole (a collective for DTensors: every rank calls it)."""
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return [t.detach().flatten().tolist() for t in full]


# [save]
def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank writes its own shards of model and optimizer into ``path`` (a directory)."""
    model_state, optim_state = get_state_dict(model, optimizer)   # DTensors: local shards
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
# [/save]


# [load]
def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Fill this rank's shards from ``path``, whatever world size wrote it."""
    model_state, optim_state = get_state_dict(model, optimizer)   # the shapes we want
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)                            # read in place
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
# [/load]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, info: dist.DistInfo,
          steps: int) -> None:
    """A few Adam steps on random data (the same on every rank), so the state is not fresh."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=generator).to(info.device)
        y = torch.randint(0, 10, (16,), generator=generator).to(info.device)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def adam_steps(optimizer: torch.optim.Optimizer) -> float:
    """Adam's step count of the first parameter (a tensor, possibly a DTensor)."""
    step = next(iter(optimizer.state.values()))["step"]
    return float(step.full_tensor() if isinstance(step, DTensor) else step)


def moments(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[list[float]]]:
    """Adam's ``exp_avg`` and ``exp_avg_sq`` of every parameter, gathered whole (a collective
    for DTensors: every rank calls it)."""
    found: dict[str, list[list[float]]] = {"exp_avg": [], "exp_avg_sq": []}
    for p in model.parameters():
        for name, values in found.items():
            t = optimizer.state[p][name]
            values.append((t.full_tensor() if isinstance(t, DTensor) else t).flatten().tolist())
    return found


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Save or load, and report what each rank held."""
    args = parse_args(argv)
    if args.load and not (Path(args.load) / ".metadata").is_file():
        raise SystemExit(f"no checkpoint in {args.load} (DCP writes a .metadata file there): "
                         f"save one first with --save {args.load}")
    info = dist.setup()
    problem = fsdp_problem(info.device) if info.world_size > 1 else None
    if problem:
        dist.print0(f"skipping: {problem}")
        if info.is_main:
            events.emit("skipped", reason=problem)
        dist.cleanup()
        return {}
    action = "save" if args.save else "load"
    # Another seed for loading: every weight differs until the checkpoint is read.
    model, sharded = build(info, args.seed if args.save else args.seed + 1, args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optimizer, info, args.steps if args.save else 1)   # Adam's state exists
    if args.save:
        save(model, optimizer, args.save)
    else:
        load(model, optimizer, args.load)
    found = events.emit("dcp", action=action, world_size=info.world_size, sharded=sharded,
                        param_bytes=local_bytes(model.parameters()),
                        optimizer_bytes=optimizer_bytes(optimizer))
    values, steps, adam = whole(model), adam_steps(optimizer), moments(model, optimizer)
    if info.is_main:
        events.emit("weights", action=action, values=values, optimizer_steps=steps, **adam)
        if args.save:
            files = sorted(Path(args.save).iterdir())
            events.emit("files", names=[f.name for f in files],
                        bytes=[os.path.getsize(f) for f in files])
    dist.cleanup()
    return found


if __name__ == "__main__":
    main()
