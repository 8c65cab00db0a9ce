"""Collectives out of step: one rank alone in a collective, different shapes, a different order.

Run it (2 processes; a short ``--pg-timeout`` turns a hang into an error)::

    python -m ddplab launch --nproc-per-node 2 ddplab.workers.desync --fault one_rank --pg-timeout 3
    TORCH_DISTRIBUTED_DEBUG=DETAIL python -m ddplab launch --nproc-per-node 2 \
        ddplab.workers.desync --fault shape
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc-per-node 2 -m ddplab.workers.desync \
        --fault order --pg-timeout 3

The end of an evaluation, as every training script has one: each rank scores its strided shard
of the test set (``--eval-samples`` 101: rank 0 gets 51 samples, rank 1 gets 50) with the same
model, then the ranks combine their results with collectives. Every rank must call the same
collectives, in the same order, with tensors of the same shape. Faults (``--fault``):

- ``none``: every rank calls the same collectives (the reference).
- ``one_rank``: only rank 0 calls the all-reduce that sums the loss for the log; the ranks no
  longer call the same collectives, and the job hangs until the process group's timeout
  (``--pg-timeout``) or the launcher's ends it. (Where each rank waits is notebook 10's question.)
- ``shape``: the ranks all-gather their predictions, 51 on rank 0 and 50 on rank 1:
  ``all_gather`` needs the same shape everywhere.
- ``order``: rank 0 broadcasts its early-stopping decision before the loss all-reduce, the
  others after it.

With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` every collective is first checked across the ranks (op,
shapes, dtypes), and a mismatch raises an error that names both sides.

Every rank emits ``metric`` events: ``debug_level``, ``shard`` (its number of test samples),
and at the end ``gathered`` (the length of each rank's predictions as received) and
``accuracy`` (over all ranks' predictions).

Lesson: 10.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ddplab import data, dist, events, models

FAULTS = ("none", "one_rank", "shape", "order")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.desync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds a collective waits for its peers before it fails")
    p.add_argument("--dataset", choices=data.DATASETS, default="digits")
    p.add_argument("--data-root", default="data")
    p.add_argument("--model", choices=models.MODELS, help="default: cnn, or resnet18 for cifar10")
    p.add_argument("--eval-samples", type=int, default=101, help="test samples scored")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Score this rank's shard, combine the results with collectives, leave."""
    args = parse_args(argv)

    # [setup]
    # torch reads TORCH_DISTRIBUTED_DEBUG when torch.distributed is imported; read it again in
    # case this process was forked from one that imported torch before the variable was set.
    torch_dist.set_debug_level_from_env()
    info = dist.setup(timeout_s=args.pg_timeout)  # init_process_group(timeout=...)
    # [/setup]
    if info.world_size < 2:
        raise SystemExit("collectives need company: launch 2 processes, e.g. "
                         "python -m ddplab launch --nproc-per-node 2 ddplab.workers.desync")
    events.emit("metric", name="debug_level", value=torch_dist.get_debug_level().name)

    # [score]
    split = data.load_dataset(args.dataset, root=args.data_root, seed=args.seed)
    test_set = TensorDataset(*(t[:args.eval_samples] for t in split.test.tensors))
    loader = data.make_eval_loader(test_set, 256, num_replicas=info.world_size, rank=info.rank,
                                   device=info.device, batch_transform=split.batch_transform)
    torch.manual_seed(args.seed)  # the same weights on every rank, as after DDP training
    model = models.build_model(args.model or models.default_model(args.dataset),
                               split.num_classes, split.in_channels).to(info.device).eval()
    with torch.no_grad():
        outputs = [(model(inputs), labels) for inputs, labels in loader]
    predictions = torch.cat([logits.argmax(1) for logits, _ in outputs])
    loss_sum = sum(F.cross_entropy(logits, labels, reduction="sum") for logits, labels in outputs)
    count = torch.tensor(len(predictions), dtype=torch.float64, device=info.device)
    total = torch.stack([loss_sum.double(), count])  # [sum of losses, samples] of this shard
    # [/score]
    events.emit("metric", name="shard", value=len(predictions))

    # [log-loss]
    if args.fault == "one_rank":
        if info.is_main:                  # rank 0 prints the loss below
            torch_dist.all_reduce(total)  # the sum and count of the test loss
    elif args.fault == "order":
        decide_early_stop(info, total)    # an early-stopping decision, and the loss summed
    else:
        torch_dist.all_reduce(total)      # every rank calls it; only rank 0 prints
    dist.print0(f"test loss {total[0].item() / total[1].item():.4f} on {int(total[1])} samples")
    # [/log-loss]

    # [gather]
    if args.fault == "shape":   # BUG: 51 predictions on rank 0, 50 on rank 1
        gathered = [torch.empty_like(predictions) for _ in range(info.world_size)]
        torch_dist.all_gather(gathered, predictions)
    else:                       # the fix: pad to the longest shard (or all_gather_object)
        gathered = gather_padded(predictions, info)
    # [/gather]
    labels = [test_set.tensors[1][r::info.world_size] for r in range(info.world_size)]
    events.emit("metric", name="gathered", value=[len(g) for g in gathered])
    correct = sum(int((g.cpu()[:len(t)] == t).sum()) for g, t in zip(gathered, labels))
    events.emit("metric", name="accuracy", value=correct / len(test_set))
    dist.print0(f"accuracy {correct / len(test_set):.3f} on {len(test_set)} test samples")

    dist.barrier()  # every rank is done before anyone leaves
    dist.cleanup()


def decide_early_stop(info: dist.DistInfo, total: torch.Tensor) -> None:
    """The ``order`` fault: the same two collectives, called in a different order by rank 0."""
    # [order]
    stop = torch.zeros(1, device=info.device)
    if info.is_main:
        torch_dist.broadcast(stop, src=0)  # rank 0: first tell everyone whether to stop...
        torch_dist.all_reduce(total)       # ...then sum the loss
    else:
        torch_dist.all_reduce(total)       # the others: sum the loss first...
        torch_dist.broadcast(stop, src=0)  # ...then hear the decision
    # [/order]


def gather_padded(values: torch.Tensor, info: dist.DistInfo) -> list[torch.Tensor]:
    """All-gather 1-D tensors of different lengths: share the lengths, pad, gather, cut."""
    # [pad]
    length = torch.tensor([len(values)], device=values.device)
    lengths = [torch.zeros_like(length) for _ in range(info.world_size)]
    torch_dist.all_gather(lengths, length)             # every rank learns every length
    longest = int(max(lengths))
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[:len(values)] = values
    gathered = [torch.empty_like(padded) for _ in range(info.world_size)]
    torch_dist.all_gather(gathered, padded)            # now every shape is the same
    return [g[:int(n)] for g, n in zip(gathered, lengths)]
    # [/pad]


if __name__ == "__main__":
    main()
