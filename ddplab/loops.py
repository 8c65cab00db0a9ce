"""What the three versions of lesson 07b's training loop share: arguments and reports.

Worker side. ``ddplab.workers.loop_ddp``, ``loop_accelerate`` and ``loop_fabric`` import it, so
that their own files hold only what differs between the libraries.

Example::

    args = parse_args("loop_ddp")                 # --epochs, --batch-size, --lr, ...
    report_epoch(epoch, loss)                     # an ``epoch`` event

Lesson: 07b.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

import torch

from ddplab import data, events


def parse_args(name: str, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The loop's command line: epochs, per-process batch, learning rate, seed, where to save."""
    p = argparse.ArgumentParser(prog=f"python -m ddplab.workers.{name}")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=".", help="where model.pt is written")
    args = p.parse_args(argv)
    if not os.path.isdir(args.checkpoint_dir):
        p.error(f"--checkpoint-dir {args.checkpoint_dir} does not exist: create it first")
    return args


def report_epoch(epoch: int, loss: torch.Tensor) -> None:
    """Emit this rank's last loss of the epoch."""
    events.emit("epoch", epoch=epoch + 1, loss=loss.item())


@torch.no_grad()
def report_result(library: str, model: torch.nn.Module, split: data.DataSplit,
                  device: torch.device, path: str, is_main: bool) -> None:
    """Rank 0 scores the (unwrapped) model on the test set and reports it with the saved file."""
    if not is_main:
        return
    images, labels = split.test.tensors
    predictions = model(images.to(device)).argmax(1)
    accuracy = (predictions == labels.to(device)).float().mean().item()
    events.emit("result", library=library, accuracy=accuracy, saved=os.path.exists(path))
