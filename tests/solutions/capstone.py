"""Reference solution of the capstone in plain torch (the tests run it; the notebook never shows it).

The capstone (13): one DDP run with every lesson of the course. Write the nine functions.

Run it from notebook 13, or from the repository root::

    python -m ddplab launch --nproc-per-node 2 exercises/capstone.py --checkpoint-dir ckpt/a
    python -m ddplab launch --nproc-per-node 2 exercises/capstone.py --checkpoint-dir ckpt/b \\
        --kill-rank 1 --kill-epoch 3                     # rank 1 dies halfway through epoch 3
    python -m ddplab launch --nproc-per-node 2 exercises/capstone.py --checkpoint-dir ckpt/b

and hand the three launches to the judge:
``ddplab.check("13", {"unbroken": a, "killed": b, "resumed": c})``.

The fixed part (``ddplab/capstone.py``, called at the bottom of this file)
joins the process group, loads the data, builds the model with the same seed on every rank,
and then calls your functions: ``make_loader``, ``wrap_model``, ``mixed_precision``,
``learning_rate``, ``read_checkpoint`` and ``resume`` once; then, every epoch,
``train_epoch``, ``save_checkpoint`` and ``evaluate``. A launch on a folder that already holds
a checkpoint resumes from it, as a restarted job does. Every function below says what it must
do; each is a lesson of the course (the number in brackets). While a function is empty the run
stops there and the judge says which one to write next.

``info`` is what ``ddplab.dist.setup()`` returned: ``info.rank``, ``info.local_rank``,
``info.world_size``, ``info.device`` (``cpu`` here, ``cuda:<local_rank>`` on GPUs).

Lesson: 13.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddplab.dist import DistInfo


def make_loader(train_set: Dataset, batch_size: int, info: DistInfo, seed: int) -> Any:
    """Return the training loader of this rank (04).

    A ``DataLoader`` of ``batch_size`` samples per batch whose ``sampler=`` is a
    ``DistributedSampler(train_set, num_replicas=info.world_size, rank=info.rank,
    shuffle=True, seed=seed)``: each rank reads its own share, in an order drawn from
    ``seed + epoch`` (no ``shuffle=True`` on the DataLoader itself: the sampler shuffles).
    """
    sampler = DistributedSampler(train_set, num_replicas=info.world_size, rank=info.rank,
                                 shuffle=True, seed=seed)
    return DataLoader(train_set, batch_size=batch_size, sampler=sampler)


def wrap_model(model: nn.Module, info: DistInfo) -> nn.Module:
    """Return ``model`` (already on ``info.device``) wrapped in DistributedDataParallel (03).

    ``device_ids=[info.local_rank]`` on a GPU, None on a CPU.
    """
    return DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)


def mixed_precision(device: torch.device) -> tuple[torch.dtype, torch.amp.GradScaler]:
    """Return ``(autocast dtype, GradScaler)`` for this device (06).

    On a CPU, ``torch.bfloat16`` and a *disabled* ``torch.amp.GradScaler("cpu",
    enabled=False)`` (bfloat16 has float32's range: nothing to scale). On a GPU,
    ``torch.float16`` and an enabled ``torch.amp.GradScaler("cuda")``.
    """
    if device.type == "cuda":
        return torch.float16, torch.amp.GradScaler("cuda")
    return torch.bfloat16, torch.amp.GradScaler("cpu", enabled=False)


def learning_rate(step: int, base_lr: float, world_size: int, warmup_steps: int) -> float:
    """Return the LR of optimizer step ``step`` (0-based, counted from the start of the job) (03).

    The linear scaling rule makes the peak ``base_lr * world_size`` (the global batch is
    ``world_size`` times one process's). The LR climbs linearly to it over the first
    ``warmup_steps`` steps, ``peak * min(1, (step + 1) / warmup_steps)``, then stays there;
    with ``warmup_steps == 0`` it is the peak from the start.
    """
    peak = base_lr * world_size
    return peak if warmup_steps == 0 else peak * min(1.0, (step + 1) / warmup_steps)


def read_checkpoint(path: str, device: torch.device) -> dict[str, Any]:
    """Return the dictionary saved at ``path``, its tensors on ``device`` (05).

    ``torch.load(path, map_location=device, weights_only=True)``: without ``map_location``
    tensors go back to the device that saved them (rank 0's GPU, for every rank), and
    ``weights_only=True`` refuses files holding pickled Python objects (they can run code).
    """
    return torch.load(path, map_location=device, weights_only=True)


def resume(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
           scaler: torch.amp.GradScaler, device: torch.device) -> int:
    """Continue from the checkpoint at ``path``; return the number of epochs it holds (05).

    No file at ``path``: change nothing and return 0. Otherwise read it with
    ``read_checkpoint(path, device)`` and load its ``"model"`` into the unwrapped model
    (``model.module``), its ``"optimizer"`` into the optimizer and its ``"scaler"`` into the
    scaler, and return its ``"epoch"``.
    """
    if not os.path.exists(path):
        return 0
    state = read_checkpoint(path, device)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    return state["epoch"]


# [train_epoch]
def train_epoch(model: nn.Module, loader: Any, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler, *, epoch: int, amp_dtype: torch.dtype,
                base_lr: float, world_size: int, warmup_steps: int,
                device: torch.device) -> float:
    """Train one epoch (``epoch`` counts from 0) on this rank's share; return the mean loss.

    1. ``loader.sampler.set_epoch(epoch)`` first, or every epoch repeats one order (04);
    2. for batch ``i`` of ``(inputs, labels)``: move both to ``device``; set ``lr`` of every
       ``optimizer.param_groups`` entry to ``learning_rate(epoch * len(loader) + i, ...)``
       (03); zero the gradients; compute the output *and* the loss
       (``F.cross_entropy``) inside ``torch.autocast(device.type, dtype=amp_dtype)``; then
       ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``, ``scaler.update()``
       (06).
    """
    loader.sampler.set_epoch(epoch)
    total, steps = 0.0, 0
    for i, (inputs, labels) in enumerate(loader):
        inputs, labels = inputs.to(device), labels.to(device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(epoch * len(loader) + i, base_lr, world_size,
                                        warmup_steps)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=amp_dtype):
            loss = F.cross_entropy(model(inputs), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        total, steps = total + loss.item(), steps + 1
    return total / steps
# [/train_epoch]


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, epoch: int, rank: int) -> None:
    """Save the checkpoint after ``epoch`` epochs, once, on rank 0, atomically (05).

    Rank 0 writes ``{"model": model.module.state_dict(), "optimizer": ...state_dict(),
    "scaler": scaler.state_dict(), "epoch": epoch}`` with ``torch.save`` to a temporary
    file in the same folder, then ``os.replace``s it onto ``path`` (a crash mid-write then
    leaves the previous checkpoint whole). Every rank then waits at ``dist.barrier()``, so
    that no rank returns before the file is complete.
    """
    if rank == 0:
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "scaler": scaler.state_dict(), "epoch": epoch}
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()


def evaluate(model: nn.Module, test_set: Dataset, device: torch.device,
             rank: int) -> Optional[float]:
    """Return the test accuracy on rank 0, None at once on every other rank (01, 04).

    Rank 0 scores the *unwrapped* model (``model.module``: DDP's forward could wait for the
    other ranks) on the whole test set, in order, no sampler, under ``torch.no_grad()`` and in
    ``eval()`` mode, puts the model back in ``train()`` mode, and returns correct / total.
    """
    if rank != 0:
        return None
    net = model.module
    net.eval()
    correct = 0
    with torch.no_grad():
        for inputs, labels in DataLoader(test_set, batch_size=512):
            inputs, labels = inputs.to(device), labels.to(device)
            correct += (net(inputs).argmax(dim=1) == labels).sum().item()
    net.train()
    return correct / len(test_set)


if __name__ == "__main__":
    from ddplab import capstone

    capstone.run(sys.modules[__name__])
