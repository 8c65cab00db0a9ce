"""Train with ``nn.DataParallel`` for a few steps and measure every GPU's peak memory.

Run it (one process; it uses every visible GPU)::

    python -m ddplab.workers.dp_memory
    python -m ddplab launch --nproc-per-node 1 ddplab.workers.dp_memory --model resnet18

DataParallel keeps the model, its gradients and the optimizer state on GPU 0 only, gathers
every replica's output there and computes the loss there; the other GPUs hold a replica and
their chunk of the batch for the duration of one forward and backward. So GPU 0's peak
(``torch.cuda.max_memory_allocated``) is larger than any other GPU's.

Emits one ``metric`` event ``max_memory_allocated`` whose value is a list of bytes, one per GPU
(``[]`` when fewer than 2 GPUs are visible: then there is nothing to compare, and the event's
``gpus`` says how many there were).

Lesson: 02.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ddplab import events, models


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.dp_memory",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=models.MODELS, default="resnet18")
    p.add_argument("--batch-size", type=int, default=256, help="the whole batch DP scatters")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> list[int]:
    args = parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        events.emit("metric", name="max_memory_allocated", value=[], gpus=gpus)
        print(f"{gpus} GPU(s) visible: DataParallel needs 2 or more to show GPU 0's surplus.")
        return []

    # [dp-memory]
    model = models.build_model(args.model, 10, 3).to("cuda:0")   # the only real copy
    model = nn.DataParallel(model)                               # replicas on every GPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for device in range(gpus):
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        inputs = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
        labels = torch.randint(0, 10, (args.batch_size,))
        outputs = model(inputs.to("cuda:0"))          # scattered, run, gathered on GPU 0
        loss = F.cross_entropy(outputs, labels.to("cuda:0"))
        optimizer.zero_grad()
        loss.backward()                               # gradients summed onto GPU 0
        optimizer.step()                              # momentum buffers: GPU 0 only
    torch.cuda.synchronize()
    peaks = [torch.cuda.max_memory_allocated(device) for device in range(gpus)]
    # [/dp-memory]

    events.emit("metric", name="max_memory_allocated", value=peaks, gpus=gpus)
    for device, peak in enumerate(peaks):
        print(f"GPU {device}: peak {peak / 2**20:.0f} MiB", flush=True)
    return peaks


if __name__ == "__main__":
    main()
