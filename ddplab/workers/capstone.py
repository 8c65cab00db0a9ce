"""The capstone's reference solution: every function ``exercises/capstone.py`` asks for.

Run it (2 processes; ``--help`` lists the options of the run)::

    python -m ddplab launch --nproc-per-node 2 ddplab.workers.capstone --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node 2 -m ddplab.workers.capstone --checkpoint-dir ckpt

The run itself (setup, data, model, the epoch loop, the fault injection, the reports the judge
reads) is the fixed part, ``ddplab.capstone``, which calls the nine functions
below; the learner's skeleton has the same nine, empty, each with the same specification. Each
one here is a few lines on top of the course's helpers: ``data`` (lesson 04), ``train``
(03, 06), ``schedule`` (03), ``amp`` (06) and ``checkpoint`` (05).

Lesson: 13.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ddplab import amp, checkpoint, data, dist, schedule, train

EVAL_BATCH = 512


# [loader]
def make_loader(train_set: Dataset, batch_size: int, info: dist.DistInfo, seed: int) -> Any:
    """This rank's training batches: a ``DistributedSampler`` share, shuffled by seed + epoch."""
    kind = "tensor" if isinstance(train_set, TensorDataset) else "dataloader"
    return data.make_loader(train_set, batch_size, num_replicas=info.world_size,
                            rank=info.rank, seed=seed, kind=kind, device=info.device)
# [/loader]


# [wrap]
def wrap_model(model: nn.Module, info: dist.DistInfo) -> nn.Module:
    """The model, already on ``info.device``, wrapped in DistributedDataParallel."""
    return train.wrap_model(model, "ddp", info)
# [/wrap]


# [precision]
def mixed_precision(device: torch.device) -> tuple[torch.dtype, torch.amp.GradScaler]:
    """bfloat16 and a disabled scaler on a CPU; float16 and an enabled scaler on a GPU."""
    mode = "fp16" if device.type == "cuda" else "bf16"
    return amp.autocast_dtype(mode, device.type), amp.make_grad_scaler(mode, device)
# [/precision]


# [lr]
def learning_rate(step: int, base_lr: float, world_size: int, warmup_steps: int) -> float:
    """The LR of optimizer step ``step``: scaled with the world size, after a linear warm-up."""
    peak = schedule.effective_lr(base_lr, world_size, grad_accum=1, scale_lr=True)
    return schedule.lr_at(step, peak, warmup_steps)
# [/lr]


# [epoch]
def train_epoch(model: nn.Module, loader: Any, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler, *, epoch: int, amp_dtype: Optional[torch.dtype],
                base_lr: float, world_size: int, warmup_steps: int,
                device: torch.device) -> float:
    """Train one epoch (0-based ``epoch``) on this rank's share; return its mean loss."""
    loader.set_epoch(epoch)  # a new order every epoch, the same one after a resume
    peak = schedule.effective_lr(base_lr, world_size, grad_accum=1, scale_lr=True)
    loss_sum, steps, _ = train.train_epoch(
        model, loader, optimizer, scaler, device=device, amp_dtype=amp_dtype, grad_accum=1,
        lr=peak, warmup_steps=warmup_steps, first_step=epoch * len(loader), epoch=epoch + 1,
        epochs=epoch + 1, report=False)
    return loss_sum / max(steps, 1)
# [/epoch]


# [save]
def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, epoch: int, rank: int) -> None:
    """Rank 0 writes model, optimizer, scaler and epoch atomically; every rank waits."""
    checkpoint.save_checkpoint(path, model, optimizer, scaler=scaler, epoch=epoch)
# [/save]


# [read]
def read_checkpoint(path: str, device: torch.device) -> dict[str, Any]:
    """The checkpoint's dictionary, its tensors on ``device``, read with weights_only=True."""
    return checkpoint.read_checkpoint(path, device)
# [/read]


# [resume]
def resume(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
           scaler: torch.amp.GradScaler, device: torch.device) -> int:
    """Load the checkpoint at ``path`` if there is one; return the epochs it holds (else 0)."""
    if not os.path.exists(path):
        return 0
    state = read_checkpoint(path, device)
    checkpoint.load_model_state(model, state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    return int(state["epoch"])
# [/resume]


# [evaluate]
@torch.no_grad()
def evaluate(model: nn.Module, test_set: Dataset, device: torch.device,
             rank: int) -> Optional[float]:
    """Rank 0: accuracy of the unwrapped model over the whole test set. Others: None."""
    if rank != 0:
        return None
    kind = "tensor" if isinstance(test_set, TensorDataset) else "dataloader"
    net = checkpoint.unwrap_model(model)  # DDP's forward would wait for the other ranks
    net.eval()
    correct = total = 0
    for inputs, labels in data.make_eval_loader(test_set, EVAL_BATCH, kind=kind, device=device):
        inputs, labels = inputs.to(device), labels.to(device)
        correct += int((net(inputs).argmax(dim=1) == labels).sum())
        total += len(labels)
    net.train()
    return correct / total
# [/evaluate]


def main(argv: Optional[list[str]] = None) -> Optional[dict[str, Any]]:
    """Run the capstone with these functions (see ``ddplab.capstone.run``)."""
    from ddplab import capstone

    return capstone.run(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
