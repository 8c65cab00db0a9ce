"""What SyncBatchNorm computes, by hand: BatchNorm statistics over every rank's share of the batch.

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.sync_batchnorm
    python -m ddplab launch --nproc-per-node 4 ddplab.workers.sync_batchnorm --batch-size 8

Every rank builds the same global batch (``batch-size`` images of ``channels`` x 4 x 4) from the
seed and keeps its own share, as DDP ranks do. It then normalises its share two ways:

- with its own statistics, as plain ``BatchNorm2d`` under DDP does;
- with the statistics of the whole global batch, found with one ``all_reduce`` of the
  per-channel sums, sums of squares and counts: what ``SyncBatchNorm`` computes.

Both are compared with ``BatchNorm2d`` applied to the whole global batch in one process (every
rank runs that reference itself), outputs and running statistics.

Without SyncBatchNorm, DDP keeps BatchNorm's running statistics (buffers) equal by broadcasting
rank 0's at the start of some forwards. The worker also asks a small DDP model with a BatchNorm,
after each of a few kinds of forward, whether its next forward will broadcast
(``will_sync_module_buffers()``).

Events:

- ``batchnorm`` (every rank): ``samples`` (this rank's), ``local_mean`` and ``global_mean``
  (per channel), ``global_var`` (biased, as used to normalise), ``sync_error`` and
  ``local_error`` (largest difference of this rank's normalised share from the one-process
  BatchNorm's), ``running_mean_error`` and ``running_var_error`` (the running statistics
  updated from the global ones, against the one-process BatchNorm's).
- ``buffers`` (every rank): ``rows``, a list of ``{"after": ..., "broadcasts": bool}``, in the
  order they ran: whether DDP's next forward broadcasts rank 0's buffers.

Lesson: 03b.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence

import torch
import torch.distributed as torch_dist
from torch import nn

from ddplab import dist, events


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.sync_batchnorm",
                                description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=8, help="the global batch")
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# [stats]
def global_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-channel mean and (biased) variance over every rank's ``x``, and the count.

    One all_reduce of three things per channel: the sum, the sum of squares, the count.
    """
    dims = [0, 2, 3]                                        # all but the channel dimension
    count = x.numel() // x.shape[1]
    packed = torch.cat([x.sum(dims), (x * x).sum(dims),
                        torch.tensor([float(count)], device=x.device)])
    torch_dist.all_reduce(packed)                           # sums over every rank
    channels = x.shape[1]
    total, squares, n = packed[:channels], packed[channels:2 * channels], packed[-1]
    mean = total / n
    return mean, squares / n - mean * mean, int(n.item())


def normalise(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
              eps: float = 1e-5) -> torch.Tensor:
    """BatchNorm's arithmetic with given statistics (affine weight 1, bias 0, as at the start)."""
    return (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + eps)


def running_stats(mean: torch.Tensor, var: torch.Tensor, n: int,
                  momentum: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """The running statistics after one step from (0, 1): the variance enters unbiased."""
    return momentum * mean, (1 - momentum) + momentum * var * n / (n - 1)
# [/stats]


def buffer_broadcasts(info: dist.DistInfo) -> list[dict[str, Any]]:
    """After each kind of forward, does DDP's next forward broadcast rank 0's buffers?"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(info.device)   # BatchNorm's
    net = DDP(model, device_ids=info.device_ids)                                 # buffers
    x = torch.randn(4, 3, device=info.device)
    rows = [("nothing yet (before the first forward)", net.will_sync_module_buffers())]
    net(x).sum().backward()
    rows.append(("a training forward, then backward", net.will_sync_module_buffers()))
    with torch.no_grad():
        net(x)
    rows.append(("an evaluation forward under torch.no_grad()", net.will_sync_module_buffers()))
    net(x)
    rows.append(("a forward with gradients enabled, no backward", net.will_sync_module_buffers()))
    with net.no_sync():
        net(x).sum().backward()
    rows.append(("a forward + backward told to skip the all-reduce",
                 net.will_sync_module_buffers()))
    return [{"after": after, "broadcasts": bool(will)} for after, will in rows]


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Normalise this rank's share with its own and with the global statistics; report both."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2 or args.batch_size % info.world_size:
        raise SystemExit(f"run on 2 or more processes, with --batch-size {args.batch_size} "
                         "divisible by their number: torchrun --nproc-per-node 2 ...")
    torch.manual_seed(args.seed)
    # Channels with different means and scales; the same batch on every rank (from the seed).
    scale = torch.arange(1.0, args.channels + 1)[None, :, None, None]
    shift = torch.arange(args.channels)[None, :, None, None]
    whole = torch.randn(args.batch_size, args.channels, 4, 4) * scale + shift
    share = args.batch_size // info.world_size
    mine = whole[info.rank * share:(info.rank + 1) * share].to(info.device)

    reference = nn.BatchNorm2d(args.channels)               # one process, the whole batch
    expected = reference(whole)[info.rank * share:(info.rank + 1) * share]

    mean, var, n = global_batch_stats(mine)
    synced = normalise(mine, mean, var)
    local = nn.BatchNorm2d(args.channels).to(info.device)(mine)   # what plain BatchNorm does
    run_mean, run_var = running_stats(mean, var, n)
    found = events.emit(
        "batchnorm", samples=share, local_mean=mine.mean([0, 2, 3]).tolist(),
        global_mean=mean.tolist(), global_var=var.tolist(),
        sync_error=(synced.cpu() - expected).abs().max().item(),
        local_error=(local.detach().cpu() - expected).abs().max().item(),
        running_mean_error=(run_mean.cpu() - reference.running_mean).abs().max().item(),
        running_var_error=(run_var.cpu() - reference.running_var).abs().max().item())
    events.emit("buffers", rows=buffer_broadcasts(info))
    dist.cleanup()
    return found


if __name__ == "__main__":
    main()
