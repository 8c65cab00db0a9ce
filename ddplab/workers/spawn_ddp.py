"""DDP started by the script itself with ``torch.multiprocessing.spawn`` (no torchrun).

Run it (2 processes; add ``--epochs``, ``--batch-size``, ``--dataset``... as needed)::

    python -m ddplab.workers.spawn_ddp --nprocs 2
    python -m ddplab launch --engine spawn --nproc-per-node 2 ddplab.workers.spawn_ddp

From a notebook: ``ddplab.launch("ddplab.workers.spawn_ddp", 2, engine="spawn")``. The launcher
runs the script unchanged and adds nothing to its arguments: it sets ``MASTER_ADDR``, a free
``MASTER_PORT`` and ``DDPLAB_NPROCS=2`` in its environment; ``--nprocs`` defaults to
``DDPLAB_NPROCS`` (2 without it) and, given, overrides it.

The parent process parses the arguments and calls ``mp.spawn(main, args=(nprocs, args),
nprocs=nprocs)``, which starts ``nprocs`` fresh interpreters and calls ``main(rank, nprocs,
args)`` in each. Every rank trains on its own share of the data; DDP averages the gradients
during ``backward()``, so the weights stay identical on every rank. Each rank reports ``metric``
events: ``first_step`` (its own loss on its own first batch, the checksum of its own gradient
before the all-reduce, ``own_grad_checksum``, and of the gradient after it, ``grad_checksum``)
and ``param_checksum`` (sum of all weights at the end, float64); ranks that end with different
weights raise ``RuntimeError`` (``--seed-per-rank --no-init-sync`` makes them: other start
weights, and no broadcast in DDP's constructor to even them). Rank 0 then
emits a ``summary`` with ``param_checksums_per_rank``, ``final_accuracy``, ``world_size``,
``batch_size``, ``global_batch``, ``steps_per_epoch``, ``samples_seen_per_rank`` (over all
epochs) and ``history``.

Lesson: 03.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

import torch
import torch.distributed as torch_dist
# Imported before any process group exists: its functions take ``group=group.WORLD`` as a
# default, evaluated at import. Imported later (DDP's constructor does), they would hold the
# group for good, and its gloo threads would outlive destroy_process_group() into the
# interpreter's exit, where they abort the process now and then ("terminate called without an
# active exception").
import torch.distributed.nn  # noqa: F401
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import data, dist, events, models, train


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (``--nprocs`` is the number of processes to spawn).

    ``--nprocs`` defaults to ``DDPLAB_NPROCS``, the count ``ddplab.launch`` was asked for.
    """
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.spawn_ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=int, default=int(os.environ.get("DDPLAB_NPROCS", "2")),
                   help="processes to spawn, one per GPU (default: $DDPLAB_NPROCS, set by "
                        "ddplab.launch, or 2)")
    p.add_argument("--dataset", choices=data.DATASETS, default="digits")
    p.add_argument("--data-root", default="data")
    p.add_argument("--model", choices=models.MODELS, help="default: cnn, or resnet18 for cifar10")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seed-per-rank", action="store_true",
                   help="seed rank r with seed + r: every rank builds other weights")
    p.add_argument("--no-init-sync", action="store_true",
                   help="DDP(..., init_sync=False): the constructor broadcasts nothing")
    return p.parse_args(argv)


def checksum(tensors: Sequence[torch.Tensor]) -> float:
    """Sum of all values as a float64 Python number (equal tensors give equal sums)."""
    return float(sum(t.detach().double().sum().item() for t in tensors))


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """One rank's life: join the group, build data and model, train, compare, leave.

    ``mp.spawn`` calls it as ``main(rank, *args)``: the rank comes first, then ``args``.
    """
    if os.environ.get("DDPLAB_RANK_PREFIX") == "1":
        dist.prefix_output(rank)  # the spawned ranks share one stdout: tag each line

    # [setup]
    backend = dist.pick_backend()               # nccl with GPUs, gloo on CPU
    torch_dist.init_process_group(              # rank 0 waits for all ranks (gloo: every rank)
        backend, init_method="env://",          # rendezvous at MASTER_ADDR:MASTER_PORT
        world_size=world_size, rank=rank,
    )
    device = dist.pick_device(rank, backend)    # one machine: the rank is the local rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # [/setup]

    # [data]
    split = data.load_dataset(args.dataset, root=args.data_root, seed=args.seed)
    loader = data.make_loader(split.train, args.batch_size, num_replicas=world_size, rank=rank,
                              seed=args.seed, device=device, batch_transform=split.batch_transform)
    test_loader = data.make_eval_loader(split.test, 512, num_replicas=world_size, rank=rank,
                                        device=device, batch_transform=split.batch_transform)
    # [/data]

    # [model]
    torch.manual_seed(args.seed + rank if args.seed_per_rank else args.seed)   # DDP broadcasts
    name = args.model or models.default_model(args.dataset)
    model = models.build_model(name, split.num_classes, split.in_channels).to(device)
    model = DDP(model, device_ids=[rank] if device.type == "cuda" else None,
                **({"init_sync": False} if args.no_init_sync else {}))   # (torch >= 2.7)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # [/model]

    # [train]
    history, seen = [], 0
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)                 # a new shuffle each epoch, the same on all ranks
        losses = []
        for step, (inputs, labels) in enumerate(loader):
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            own = own_gradient(loss, model) if epoch == 0 and step == 0 else None   # (reported)
            loss.backward()                     # DDP all-reduces (averages) gradients here
            if own is not None:
                report_first_step(rank, loss, model, own)
            optimizer.step()                    # same gradient, same step, on every rank
            losses.append(loss.item())
            seen += len(labels)
            if rank == 0 and ((step + 1) % max(1, len(loader) // 4) == 0
                              or step + 1 == len(loader)):
                events.emit("progress", rank=0, epoch=epoch + 1, epochs=args.epochs,
                            step=step + 1, steps=len(loader), loss=loss.item())
        history.append(finish_epoch(rank, epoch, losses, model, test_loader, device))
    # [/train]

    # [checksum]
    mine = checksum(list(model.parameters()))
    everyone = dist.all_gather_floats(mine, device)   # every rank's checksum, in rank order
    samples = [int(n) for n in dist.all_gather_floats(seen, device)]
    print(f"param checksum {mine:.12f}", flush=True)
    events.emit("metric", rank=rank, name="param_checksum", value=mine)
    if len(set(everyone)) != 1:
        raise RuntimeError(f"ranks disagree on the weights: {everyone}")
    # [/checksum]

    if rank == 0:
        events.emit("summary", rank=0, param_checksum=mine, param_checksums_per_rank=everyone,
                    final_loss=history[-1]["loss"], final_accuracy=history[-1]["accuracy"],
                    world_size=world_size, batch_size=args.batch_size,
                    global_batch=args.batch_size * world_size, steps_per_epoch=len(loader),
                    samples_seen_per_rank=samples, dataset=args.dataset,
                    model=name, lr=args.lr, history=history, backend=backend,
                    device=str(device))
    dist.cleanup()


def own_gradient(loss: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's own gradient, before any all-reduce.

    ``torch.autograd.grad`` returns the gradients without accumulating them into ``.grad``, so
    DDP's hooks (which run when a gradient is accumulated) do not fire and nothing is sent; the
    graph is kept for the ``backward()`` that follows.
    """
    return list(torch.autograd.grad(loss, list(model.parameters()), retain_graph=True))


def report_first_step(rank: int, loss: torch.Tensor, model: torch.nn.Module,
                      own: Sequence[torch.Tensor]) -> None:
    """Print and emit this rank's own loss, own gradient's and all-reduced gradient's checksums."""
    grad = checksum([p.grad for p in model.parameters()])
    print(f"first step: my loss {loss.item():.6f}, averaged gradient checksum {grad:.12f}",
          flush=True)
    events.emit("metric", rank=rank, name="first_step", loss=loss.item(), grad_checksum=grad,
                own_grad_checksum=checksum(own))


def finish_epoch(rank: int, epoch: int, losses: list[float], model: torch.nn.Module,
                 test_loader: data.Loader, device: torch.device) -> dict:
    """Average the loss over ranks, measure test accuracy (all ranks), emit the epoch event."""
    loss = dist.all_reduce_mean(sum(losses) / len(losses), device)
    accuracy = train.evaluate(model, test_loader, device)
    record = {"epoch": epoch + 1, "loss": loss, "accuracy": accuracy}
    if rank == 0:
        events.emit("epoch", rank=0, **record)
    return record


if __name__ == "__main__":
    # [spawn]
    args = parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where rank 0 listens (this machine)
    os.environ.setdefault("MASTER_PORT", "29500")      # any free port; ddplab.launch sets one
    mp.spawn(main, args=(args.nprocs, args), nprocs=args.nprocs)  # main(rank, nprocs, args)
    # [/spawn]
