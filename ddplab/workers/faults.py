"""DDP training that goes wrong: uneven inputs, an unused branch, a crashing rank; and the fixes.

Run it (2 processes; each fault on its own, then with its fix)::

    python -m ddplab launch --nproc-per-node 2 ddplab.workers.faults --fault uneven --pg-timeout 5
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.faults --fault uneven --join
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.faults --fault unused --find-unused
    python -m ddplab launch --nproc-per-node 2 --max-restarts 1 ddplab.workers.faults \
        --fault crash --epochs 3 --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m ddplab.workers.faults \
        --fault crash --epochs 3 --checkpoint-dir ckpt

Faults (``--fault``):

- ``none``: a tiny DDP training run that works (the reference).
- ``uneven``: the training data come in files of ``--file-size`` 32 samples (159 samples: 5
  files, the last one of 31), dealt out to the ranks in turn, as sharded datasets are: rank 0
  reads 3 files (3 batches of up to 32), rank 1 reads 2 (2 batches). Rank 0's third backward
  waits for an all-reduce that rank 1 never joins. Fixes: ``--join`` (DDP's ``Join`` context
  manager) or ``--sampler`` (``DistributedSampler``: equal shares of samples, padded, or
  trimmed with ``--drop-last``).
- ``unused``: the model has an auxiliary head that ``forward`` does not use: DDP waits for its
  gradient and fails at the next step. Fixes: ``--find-unused`` or ``--static-graph``.
- ``crash``: rank ``--crash-rank`` raises in the middle of epoch ``--crash-epoch``, in the first
  attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), as a flaky node would. The worker saves a
  checkpoint after every epoch and always resumes from it when one exists, so an elastic
  restart (``torchrun --max-restarts 1``) carries on from the last finished epoch. Restart
  with the c10d rendezvous (``--standalone`` on one machine): under the default static
  rendezvous the restarted gloo workers could not connect on torch 2.14.1.

``--pg-timeout`` is how long a collective waits for its peers (``init_process_group(timeout=)``):
a few seconds turns a hang into an error that names the stuck line. For DDP's own diagnostics
run with ``TORCH_DISTRIBUTED_DEBUG=INFO`` (see ``check_debug_level`` about ``DETAIL``).

Every rank emits ``metric`` events: ``debug_level``, ``restart`` (the elastic restart count),
``batches`` (in its share), ``start_epoch``, ``backward`` (n, before its n-th backward: the
n-th all-reduce), ``steps`` (optimizer steps it took), ``samples`` (samples it trained on) and
at the end ``checksum`` (the sum of its final weights, float64), just before the final barrier.

Lesson: 10.
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from typing import Any, Optional, Sequence

import torch
import torch.distributed as torch_dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from ddplab import checkpoint, data, dist, events, models, train

FAULTS = ("none", "uneven", "unused", "crash")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds a collective waits for its peers before it fails")
    p.add_argument("--join", action="store_true", help="train inside Join([model])")
    p.add_argument("--sampler", action="store_true",
                   help="uneven: shard with DistributedSampler (equal shares) instead of by hand")
    p.add_argument("--drop-last", action="store_true",
                   help="DistributedSampler(drop_last=True): trim the shares instead of padding")
    p.add_argument("--find-unused", action="store_true",
                   help="DDP(find_unused_parameters=True)")
    p.add_argument("--static-graph", action="store_true", help="DDP(static_graph=True)")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-epoch", type=int, default=2, help="numbered from 1")
    p.add_argument("--checkpoint-dir", help="save after every epoch; resume when a file is there")
    p.add_argument("--dataset", choices=data.DATASETS, default="digits")
    p.add_argument("--data-root", default="data")
    p.add_argument("--model", choices=models.MODELS, help="default: cnn, or resnet18 for cifar10")
    p.add_argument("--samples", type=int, default=159,
                   help="training samples used (159: 5 files of 32, the last one of 31); 0: all")
    p.add_argument("--file-size", type=int, default=32, help="uneven: samples per data file")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class WithAuxHead(nn.Module):
    """A model plus an auxiliary head that ``forward`` only uses when ``use_aux`` is True.

    With ``use_aux=False`` the head's parameters never receive a gradient: under DDP that is
    the ``unused`` fault.
    """

    def __init__(self, body: nn.Module, num_classes: int, use_aux: bool) -> None:
        super().__init__()
        self.body, self.use_aux = body, use_aux
        self.aux = nn.Linear(num_classes, num_classes)  # e.g. an auxiliary loss, switched off

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        logits = self.body(inputs)
        return logits + self.aux(logits) if self.use_aux else logits


def first_samples(dataset: Any, n: int) -> TensorDataset:
    """The first ``n`` samples of a tensor dataset (all of them when ``n`` <= 0)."""
    return TensorDataset(*(t[:n] if n > 0 else t for t in dataset.tensors))


def emit(name: str, value: Any) -> None:
    """Report one fact of this rank to the launcher (a ``metric`` event)."""
    events.emit("metric", name=name, value=value)


def check_debug_level() -> None:
    """Refuse ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` where it would crash DDP's constructor.

    DETAIL wraps the process group in a checking wrapper; on torch 2.14.1 (not on 2.6) building
    DDP on that wrapper with gloo kills the process with a segmentation fault. Plain
    collectives are fine (``ddplab.workers.desync`` uses DETAIL); DDP's messages need INFO.
    """
    detail = torch_dist.get_debug_level() == torch_dist.DebugLevel.DETAIL
    if detail and torch.__version__ >= "2.7" and dist.pick_backend() == "gloo":
        raise RuntimeError(
            f"TORCH_DISTRIBUTED_DEBUG=DETAIL makes DDP's constructor crash (segmentation fault) "
            f"with gloo on torch {torch.__version__}: use TORCH_DISTRIBUTED_DEBUG=INFO for DDP's "
            "diagnostics, and DETAIL for checking plain collectives.")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """One rank's life: join, build data and model, train (resuming if possible), report."""
    args = parse_args(argv)

    # [setup]
    # torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported; read it again in
    # case this process was forked from one that imported torch before the variable was set.
    torch_dist.set_debug_level_from_env()
    check_debug_level()
    info = dist.setup(timeout_s=args.pg_timeout)  # init_process_group(timeout=...)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by torchrun
    # [/setup]
    if info.world_size < 2:
        raise SystemExit("these faults need company: launch 2 processes, e.g. "
                         "python -m ddplab launch --nproc-per-node 2 ddplab.workers.faults")
    emit("debug_level", torch_dist.get_debug_level().name)
    emit("restart", restart)

    # [data]
    split = data.load_dataset(args.dataset, root=args.data_root, seed=args.seed)
    train_set = first_samples(split.train, args.samples)
    if args.fault == "uneven" and not args.sampler:
        # BUG: files of 32 samples dealt out to the ranks in turn, without balancing them:
        # 5 files on 2 ranks give rank 0 three files (3 batches) and rank 1 two (2 batches).
        files = torch.arange(len(train_set)).split(args.file_size)
        mine = torch.cat(files[info.rank::info.world_size])
        loader = data.make_loader(TensorDataset(*(t[mine] for t in train_set.tensors)),
                                  args.batch_size, seed=args.seed, device=info.device,
                                  batch_transform=split.batch_transform)
    else:  # DistributedSampler: every rank gets the same number of samples, so of batches
        loader = data.make_loader(train_set, args.batch_size, num_replicas=info.world_size,
                                  rank=info.rank, seed=args.seed, drop_last=args.drop_last,
                                  device=info.device, batch_transform=split.batch_transform)
    # [/data]
    emit("batches", len(loader))

    # [model]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    body = models.build_model(args.model or models.default_model(args.dataset),
                              split.num_classes, split.in_channels)
    use_aux = args.fault != "unused"  # BUG (unused): the auxiliary head is switched off
    model = WithAuxHead(body, split.num_classes, use_aux).to(info.device)
    model = DDP(model, device_ids=info.device_ids,
                find_unused_parameters=args.find_unused,  # look for unused ones every step
                static_graph=args.static_graph)           # or learn them in the first step
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # [/model]

    start_epoch = resume(args.checkpoint_dir, model, optimizer, info)
    emit("start_epoch", start_epoch)

    # [loop]
    steps = samples = 0
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        torch.manual_seed(train.epoch_seed(args.seed, epoch, info.rank))
        with Join([model]) if args.join else nullcontext():  # stands in for missing all-reduces
            for step, (inputs, labels) in enumerate(loader):
                maybe_crash(args, info.rank, epoch, step, restart)
                loss = F.cross_entropy(model(inputs), labels)
                optimizer.zero_grad(set_to_none=True)
                emit("backward", steps + 1)  # where this rank is: entering its n-th all-reduce
                loss.backward()  # DDP all-reduces the gradients here: every rank must take part
                optimizer.step()
                steps, samples = steps + 1, samples + len(labels)
        save(args.checkpoint_dir, model, optimizer, epoch + 1)
    # [/loop]

    emit("steps", steps)
    emit("samples", samples)
    emit("checksum", train.param_checksum(model))
    dist.print0(f"trained {steps} steps on rank 0; final loss {loss.item():.4f}"
                if steps else "nothing left to train")
    dist.barrier()  # nobody leaves while another rank may still need the group
    dist.cleanup()


def maybe_crash(args: argparse.Namespace, rank: int, epoch: int, step: int, restart: int) -> None:
    """The ``crash`` fault: one rank fails in the middle of an epoch, first attempt only."""
    # [crash]
    if (args.fault == "crash" and rank == args.crash_rank and epoch + 1 == args.crash_epoch
            and step == 1 and restart == 0):
        raise RuntimeError(f"rank {rank} crashed in epoch {epoch + 1}, step {step + 1} "
                           "(a simulated failure: a bad node, an out-of-memory kill)")
    # [/crash]


def resume(folder: Optional[str], model: nn.Module, optimizer: torch.optim.Optimizer,
           info: dist.DistInfo) -> int:
    """Load the last checkpoint if there is one; return the number of epochs it holds."""
    # [resume]
    path = os.path.join(folder, "checkpoint.pt") if folder else None
    if path is None or not os.path.exists(path):
        return 0  # the first attempt: nothing saved yet
    state = checkpoint.load_checkpoint(path, model, optimizer, device=info.device)
    dist.print0(f"resumed from {path}: {state['epoch']} epoch(s) already done")
    return int(state["epoch"])
    # [/resume]


def save(folder: Optional[str], model: nn.Module, optimizer: torch.optim.Optimizer,
         epochs_done: int) -> None:
    """Save a checkpoint after an epoch (rank 0 writes atomically, every rank waits)."""
    if folder:
        checkpoint.save_checkpoint(os.path.join(folder, "checkpoint.pt"), model, optimizer,
                                   epoch=epochs_done)


if __name__ == "__main__":
    main()
