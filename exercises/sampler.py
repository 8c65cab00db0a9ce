"""Exercise 04: shard each epoch, every sample once, a new order every epoch. Two TODO(exercise)s.

Run it from notebook 04 (about 5 s; a hang is ended after 60 s), or from the repository root::

    python -m ddplab launch --nproc-per-node 2 exercises/sampler.py
    torchrun --standalone --nproc-per-node 2 exercises/sampler.py

and hand the launch's result to the judge: ``ddplab.check("04", result)``.

As the file stands, the ``DataLoader`` shuffles the whole training set on every rank: with the
same seed everywhere, every rank reads all the samples, the same ones as its neighbours, and an
epoch of DDP costs N times the work for nothing.

This run asks more of its shares than notebook 04's script does: every epoch weighs each sample
once. Padding (notebook 04, section 2) reads a few samples twice, and a sample read twice counts
twice in that epoch's gradients and in its mean loss; on a small dataset over many ranks that is
no longer a few (10 samples on 4 ranks: 2 of the 12 reads). Make these true, on any number of
ranks (``ddplab check`` launches 2 and 4):

1. every rank reads a share of its own: within one epoch no sample is read twice, by two ranks
   or by one;
2. every rank reads the same number of samples (a rank with an extra batch would block in an
   all-reduce its peers never join, until the process group's timeout), and an epoch leaves out
   only what does not divide: fewer samples than there are ranks;
3. the samples left out are not the same in every epoch, so that each one gets its turn;
4. every epoch reads in a new order (notebook 04, section 5).

Any way that makes these true passes: torch's ``DistributedSampler``, if its arguments allow it
(https://docs.pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler),
or a sampler of your own (an object with ``__iter__`` yielding indices and ``__len__``, given to
the ``DataLoader`` as ``sampler=``). The dataset hands out each sample's index with it, so the
fixed part reports exactly which indices each rank read in each epoch, in order (``metric``
events named ``read``); the judge reads those, not your code.

Lesson: 04.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from ddplab import data, events, models
from ddplab.dist import pick_backend

EPOCHS = 3  # enough to see whether the samples left out change


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
    # TODO(exercise) 1: give each rank its share of train_set (goals 1-3 of the docstring).
    loader = DataLoader(train_set, batch_size=32, shuffle=True)
    events.emit("metric", name="dataset", value=len(train_set))

    # model
    model = models.build_model("cnn", num_classes=10, in_channels=1).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    # the loop
    for epoch in range(EPOCHS):
        # TODO(exercise) 2: make this epoch's order differ from the earlier ones' (goal 4).
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
