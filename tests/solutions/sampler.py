"""Reference solution of exercise 04 (the tests run it; the notebook never shows it).

Exercise 04: give every rank its own share, in a new order every epoch. Two TODO(exercise)s.

Run it from notebook 04 (about 5 s; a hang is ended after 60 s), or from the repository root::

    python -m ddplab launch --nproc-per-node 2 exercises/sampler.py
    torchrun --standalone --nproc-per-node 2 exercises/sampler.py

and hand the launch's result to the judge: ``ddplab.check("04", result)``.

As the file stands, the ``DataLoader`` shuffles the whole training set on every rank: with the
same seed everywhere, every rank reads all the samples, the same ones as its neighbours, and an
epoch of DDP costs N times the work for nothing. Make these true:

1. every rank reads its own share of the training set: the shares of one epoch are disjoint
   (apart from a few repeats that make them equal in size) and together cover the whole set
   (notebook 04, sections 1 and 3);
2. every epoch reads the shares in a new order, or every epoch repeats the first one's and
   the model sees the same batches again and again (notebook 04, section 4).

The dataset hands out each sample's index with it, so the fixed part reports exactly which
indices each rank read in each epoch, in order (``metric`` events named ``read``).

Lesson: 04.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddplab import data, events, models
from ddplab.dist import pick_backend

EPOCHS = 2


def main() -> None:
    # setup: one process per device; gloo on CPUs, nccl on GPUs
    backend = pick_backend()
    dist.init_process_group(backend)
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    # data: the digits, each sample with its index, so we can see who reads what
    images, labels = data.digits().train.tensors
    train_set = TensorDataset(images, labels, torch.arange(len(labels)))
    sampler = DistributedSampler(train_set, seed=0)  # rank and world size from the group
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    events.emit("metric", name="dataset", value=len(train_set))

    # model
    model = models.build_model("cnn", num_classes=10, in_channels=1).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    # the loop
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        read = []
        for inputs, labels, index in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
            read += index.tolist()
        events.emit("metric", name="read", epoch=epoch, value=read)
        print(f"epoch {epoch}: read {len(read)} samples, first {read[:5]}", flush=True)

    # cleanup
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
