"""Each rank's input pipeline: loader workers, pinned memory, seeds, and where a step's time goes.

Run it (2 processes; every flag is optional)::

    torchrun --standalone --nproc-per-node 2 -m ddplab.workers.input_pipeline --num-workers 2
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.input_pipeline --decode-ms 2

The loader is the canonical one (``DataLoader`` + ``DistributedSampler``, as in
``ddplab/workers/plain_ddp.py``) over the digits, with a stand-in for the per-sample work of a
real pipeline: ``--decode-ms`` milliseconds of waiting per sample, as reading and decoding an
image from disk would cost, and a random augmentation (noise whose strength is drawn from
torch's random generator in the process that loads the sample). ``--loader tensor`` swaps in
the tensor-resident loader of ``ddplab.data`` (the whole dataset on the device, a batch is one
``index_select``; no decoding and no augmentation) for comparison.

Every step is split into the time the rank **waited for its batch** (``next(loader)``) and the
time it **computed** (copy to the device, forward, backward, step, device synchronised): a
step is input-bound when the first dominates.

Events, every rank: ``metric`` ``pipeline`` (the loader settings), per epoch ``metric``
``steps`` (``wait_ms`` and ``compute_ms`` medians, ``mean_wait_ms`` and ``mean_compute_ms``,
``first_wait_ms``: the wait for the epoch's first batch, ``steps``, ``samples``, ``epoch_time``,
``wait_share``: the waits' share of it), and ``metric`` ``draws``: the augmentation
strengths of the first batch of each epoch and the pids of the loader workers that produced
each epoch's batches (``workers``).

Lesson: 09b.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddplab import data, dist, events, models

#: Notebook 09b's control run adds these arguments; the notebook names them after its question.
CONTROL = ("--loader-seed-per-rank",)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.input_pipeline",
                                description=__doc__.split("\n")[0])
    p.add_argument("--loader", choices=["dataloader", "tensor"], default="dataloader")
    p.add_argument("--num-workers", type=int, default=0, help="loader processes per rank")
    p.add_argument("--persistent-workers", action="store_true",
                   help="keep the loader processes from one epoch to the next")
    p.add_argument("--loader-seed-per-rank", action="store_true",
                   help="seed each rank's loader generator and global RNG with seed + rank "
                        "(default: no generator, as DataLoader's own default)")
    p.add_argument("--decode-ms", type=float, default=0.0, help="per-sample loading time")
    p.add_argument("--width", type=int, default=32, help="channels of the CNN (its compute)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Augmented(Dataset):
    """Digits images with a per-sample loading cost and a random augmentation.

    Each item is ``(image, label, strength, pid)``: the noise strength drawn for it and the pid
    of the process that loaded it (a loader worker, or the rank itself with no workers).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, decode_ms: float) -> None:
        self.images, self.labels, self.decode_s = images, labels, decode_ms / 1000

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        if self.decode_s:
            time.sleep(self.decode_s)        # reading and decoding a file would take this long
        strength = float(torch.rand(()))    # the augmentation's random draw
        image = self.images[index] + 0.1 * strength * torch.randn_like(self.images[index])
        return image, self.labels[index], strength, os.getpid()


# [loader]
def make_loader(dataset: Dataset, args: argparse.Namespace, info: dist.DistInfo) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank,
                                 seed=args.seed)  # the same shuffle seed on every rank
    generator = None                                  # DataLoader's default
    if args.loader_seed_per_rank:
        generator = torch.Generator().manual_seed(args.seed + info.rank)
    workers = args.num_workers
    # Each worker starts with torch, random and numpy seeded from the base seed and its id
    # (torch/utils/data/_utils/worker.py); a worker_init_fn is only for other libraries.
    return DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler,
        num_workers=workers,                          # processes that load batches ahead
        pin_memory=info.device.type == "cuda",        # page-locked: async copies to the GPU
        persistent_workers=args.persistent_workers and workers > 0,   # keep them per epoch
        generator=generator,                          # draws the base seed; None: global RNG
    )
# [/loader]


def batches(loader: Any, device: torch.device) -> Any:
    """Yield ``(inputs, labels, strengths, pids)`` from either loader."""
    for batch in loader:
        if len(batch) == 2:  # the tensor loader: no augmentation, no workers
            yield batch[0], batch[1], [], [os.getpid()]
        else:
            yield batch[0], batch[1], batch[2].tolist(), batch[3].tolist()


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    info = dist.setup()
    device = info.device
    split = data.load_dataset("digits")
    images, labels = split.train.tensors
    if args.loader == "tensor":
        loader: Any = data.make_loader(split.train, args.batch_size,
                                       num_replicas=info.world_size, rank=info.rank,
                                       seed=args.seed, device=device)
        sampler: Any = loader
    else:
        loader = make_loader(Augmented(images, labels, args.decode_ms), args, info)
        sampler = loader.sampler
    events.emit("metric", name="pipeline", value={
        "loader": args.loader, "num_workers": args.num_workers,
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "pin_memory": bool(getattr(loader, "pin_memory", False)),
        "loader_seed_per_rank": args.loader_seed_per_rank, "decode_ms": args.decode_ms,
        "width": args.width, "device": str(device)})

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = models.SmallCNN(split.in_channels, split.num_classes, width=args.width).to(device)
    model = DDP(model, device_ids=info.device_ids) if info.world_size > 1 else model
    # [seed-per-rank]
    if args.loader_seed_per_rank:  # the global RNG: samples draw from it without loader workers
        torch.manual_seed(args.seed + info.rank)
    # [/seed-per-rank]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    # [timed-loop]
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        waits, computes, draws, pids, samples = [], [], [], set(), 0
        start = end = time.perf_counter()
        for inputs, targets, strengths, workers in batches(loader, device):
            got = time.perf_counter()
            waits.append(got - end)                       # waiting for the batch
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)            # GPU work is queued: wait for it
            end = time.perf_counter()
            computes.append(end - got)                    # copying and computing
            draws = draws or strengths
            pids.update(workers)
            samples += len(targets)
        # [/timed-loop]
        events.emit("metric", name="steps", epoch=epoch, samples=samples,
                    epoch_time=end - start, wait_ms=1e3 * statistics.median(waits),
                    compute_ms=1e3 * statistics.median(computes),
                    mean_wait_ms=1e3 * statistics.mean(waits),
                    mean_compute_ms=1e3 * statistics.mean(computes), steps=len(waits),
                    first_wait_ms=1e3 * waits[0], wait_share=sum(waits) / (end - start))
        events.emit("metric", name="draws", epoch=epoch, value=draws[:8],
                    workers=sorted(pids - {os.getpid()}))
    dist.cleanup()


if __name__ == "__main__":
    main()
