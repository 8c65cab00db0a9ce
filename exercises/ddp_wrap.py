"""Exercise 03: wrap the model in DistributedDataParallel. Fill in the TODO(exercise) block.

Run it from notebook 03, or from the repository root::

    python -m ddplab launch --nproc-per-node 2 exercises/ddp_wrap.py
    torchrun --standalone --nproc-per-node 2 exercises/ddp_wrap.py

and hand the launch's result to the judge: ``ddplab.check("03", result)``.

Every rank builds its model from a seed of its own, so the ranks start from different weights,
and trains on its own share of the digits. As the file stands, nothing connects the ranks: each
trains a model of its own and they end with different weights. Your job is the one step that
turns N separate trainings into one: move the model to this rank's device, then wrap it in
``DDP`` (``device_ids=[local_rank]`` on a GPU, ``None`` on the CPU). DDP then copies rank 0's
weights to every rank when it wraps the model and averages the gradients during
``backward()``, so every rank takes the same step and ends with the same weights.

The fixed part reports every rank's weight checksum after your block (``start``) and after
training (``end``), and the device it used (``metric`` events).

Lesson: 03.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddplab import data, events, models
from ddplab.dist import pick_backend


def checksum(model: torch.nn.Module) -> float:
    """Sum of all weights in float64: equal weights give equal sums."""
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def main() -> None:
    # setup: one process per device; gloo on CPUs, nccl on GPUs
    backend = pick_backend()
    dist.init_process_group(backend)
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    # data: each rank reads its own share
    train_set = data.digits().train
    sampler = DistributedSampler(train_set, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)

    # model: a different starting point on every rank, on purpose
    torch.manual_seed(rank)
    model = models.build_model("cnn", num_classes=10, in_channels=1)
    # TODO(exercise): move the model to `device` first, then wrap it in DDP. DDP wants
    #   device_ids=[local_rank] for a model on a GPU, and device_ids=None on the CPU.
    events.emit("metric", name="device", value=str(device))
    events.emit("metric", name="start", value=checksum(model))

    # the plain loop, two epochs
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
    events.emit("metric", name="end", value=checksum(model))
    print(f"rank {rank}: weights checksum {checksum(model):.10f}", flush=True)

    # cleanup
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
