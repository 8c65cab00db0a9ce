"""DDP against sharded data parallel (ZeRO-1, ZeRO-2, FSDP2's ``fully_shard``): bytes per rank.

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.sharding
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.sharding --modes ddp zero3 --steps 5

Every mode trains the same MLP from the same seed on the same batches, one mode after the other
in one job, with Adam (two state tensors per parameter, so the optimizer state is twice the
weights):

- ``ddp``: ``DistributedDataParallel``; every rank keeps everything (weights, gradients, state);
- ``zero1``: DDP with ``ZeroRedundancyOptimizer``; each rank keeps the optimizer state of its
  share of the parameters (whole parameters, balanced by size) and broadcasts them after its step;
- ``zero2``: ``fully_shard(..., reshard_after_forward=False)``; gradients and optimizer state
  sharded, the weights gathered for forward and kept whole until backward is done;
- ``zero3``: ``fully_shard(...)`` (FSDP2); weights sharded too: each layer's weights are
  gathered just before the layer runs and freed again after it.

Events:

- ``memory`` (every rank, one per mode): ``mode``, and the bytes this rank holds for
  ``params`` (after the step), ``params_in_backward`` (between forward and backward), ``grads``
  (after backward), ``optimizer`` (after the step), plus ``full_params``, the whole model's;
  ``collectives``: how many of each collective the last step ran (``allreduce``,
  ``allgather``, ``reduce_scatter``, ``broadcast``); ``layers`` (the model's ``Linear`` layers,
  each sharded on its own) and ``tensors`` (its parameter tensors).
- ``loss`` (rank 0, one per mode and step): ``mode``, ``step``, ``loss`` (mean over every
  rank's samples); mode ``single`` is the same MLP trained in one process on the whole global
  batches, the reference every sharded mode must match (FSDP2's gradient averaging on gloo
  had an open silent-correctness report, pytorch/pytorch#162338).
- ``skipped`` (rank 0, only when FSDP cannot run here): ``modes``, ``reason``.

FSDP2 is ``torch.distributed.fsdp.fully_shard`` (public from torch 2.6, the course's floor); it
runs on GPUs with nccl, and on CPUs with gloo from torch 2.7 (on an older torch the worker
skips ``zero2`` and ``zero3`` on the CPU and says why).

Lesson: 11.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import data, dist, events
from ddplab.sharded import collectives, fsdp_problem, fully_shard, local_bytes, optimizer_bytes

MODES = ("ddp", "zero1", "zero2", "zero3")
SHARDED_BY_FSDP = ("zero2", "zero3")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.sharding",
                                description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--dataset", choices=("digits", "cifar10"), default="digits")
    p.add_argument("--data-root", default="data", help="where CIFAR-10 lives")
    p.add_argument("--hidden", type=int, default=256, help="width of the hidden layers")
    p.add_argument("--depth", type=int, default=2, help="hidden-to-hidden layers")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_mlp(inputs: int, hidden: int, depth: int, classes: int) -> nn.Sequential:
    """A plain MLP: ``Linear(inputs, hidden)``, ``depth`` x ``Linear(hidden, hidden)``, a head."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


# [wrap]
def wrap(model: nn.Sequential, mode: str, info: dist.DistInfo) -> nn.Module:
    """Wrap ``model`` for data parallel training in ``mode`` (one of ``MODES``)."""
    if mode in ("ddp", "zero1"):
        return DDP(model, device_ids=info.device_ids)     # a full replica on every rank
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    keep_whole = mode == "zero2"                           # ZeRO-2: weights stay gathered
    for layer in model:                                    # one shard group per layer, so
        if isinstance(layer, nn.Linear):                   # only one layer is whole at a time
            fully_shard(layer, mesh=mesh, reshard_after_forward=not keep_whole)
    return fully_shard(model, mesh=mesh, reshard_after_forward=not keep_whole)


def make_optimizer(model: nn.Module, mode: str, lr: float) -> torch.optim.Optimizer:
    """Adam; under ZeRO-1 each rank keeps the state of its share of the parameters only."""
    if mode == "zero1":
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                       lr=lr)
    return torch.optim.Adam(model.parameters(), lr=lr)
# [/wrap]




def batches(split: data.DataSplit, info: dist.DistInfo, args: argparse.Namespace,
            whole: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of each global batch (the whole batch with ``whole``); the same global
    batches for every mode."""
    images, labels = split.train.tensors
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(args.seed))
    per_step = args.batch_size * info.world_size
    for step in range(args.steps):
        chosen = order[torch.arange(step * per_step, (step + 1) * per_step) % len(order)]
        mine = chosen if whole else chosen[info.rank * args.batch_size:
                                           (info.rank + 1) * args.batch_size]
        x, y = images[mine].to(info.device), labels[mine].to(info.device)
        yield (split.batch_transform(x) if split.batch_transform else x), y


# [train]
def train(mode: str, split: data.DataSplit, info: dist.DistInfo,
          args: argparse.Namespace) -> dict[str, Any]:
    """Train one mode for ``args.steps`` steps; return the bytes this rank held."""
    torch.manual_seed(args.seed)                           # the same weights in every mode
    inputs = split.train.tensors[0][0].numel()
    model = build_mlp(inputs, args.hidden, args.depth, split.num_classes)
    full_params = local_bytes(model.parameters())
    model = wrap(model.to(info.device), mode, info)
    optimizer = make_optimizer(model, mode, args.lr)
    for step, (x, y) in enumerate(batches(split, info, args), start=1):
        with collectives() as sent:                        # what this step exchanged
            out = model(x)
            params_in_backward = local_bytes(model.parameters())   # what backward needs
            loss = F.cross_entropy(out, y)
            loss.backward()
            grads = local_bytes(p.grad for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad()
        mean_loss = dist.all_reduce_mean(loss.item(), info.device)
        if info.is_main:
            events.emit("loss", mode=mode, step=step, loss=mean_loss)
    return events.emit("memory", mode=mode, hidden=args.hidden, full_params=full_params,
                       params=local_bytes(model.parameters()),
                       params_in_backward=params_in_backward, grads=grads,
                       optimizer=optimizer_bytes(optimizer), collectives=sent,
                       layers=sum(isinstance(m, nn.Linear) for m in model.modules()),
                       tensors=len(list(model.parameters())))
# [/train]


def single_process(split: data.DataSplit, info: dist.DistInfo, args: argparse.Namespace
                   ) -> None:
    """The reference: the same MLP, seed and Adam in one process, on the whole global batches.

    Every rank computes it alone (no collective); rank 0 reports its losses as mode ``single``.
    """
    torch.manual_seed(args.seed)
    inputs = split.train.tensors[0][0].numel()
    model = build_mlp(inputs, args.hidden, args.depth, split.num_classes).to(info.device)
    optimizer = make_optimizer(model, "single", args.lr)
    for step, (x, y) in enumerate(batches(split, info, args, whole=True), start=1):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if info.is_main:
            events.emit("loss", mode="single", step=step, loss=loss.item())


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Train every requested mode in turn; return this rank's ``memory`` events."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("sharding needs at least 2 processes: torchrun --nproc-per-node 2 ...")
    split = data.load_dataset(args.dataset, root=args.data_root)
    problem = fsdp_problem(info.device)
    skipped = [mode for mode in args.modes if problem and mode in SHARDED_BY_FSDP]
    if skipped:
        dist.print0(f"skipping {', '.join(skipped)}: {problem}")
        if info.is_main:
            events.emit("skipped", modes=skipped, reason=problem)
    modes = [mode for mode in args.modes if mode not in skipped]
    found = [train(mode, split, info, args) for mode in modes]
    single_process(split, info, args)
    dist.print0(f"trained {', '.join(modes)} for {args.steps} steps on "
                f"{info.world_size} processes ({info.backend})")
    dist.cleanup()
    return found


if __name__ == "__main__":
    main()
