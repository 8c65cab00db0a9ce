"""Exercise 05: save on rank 0 behind a barrier, load onto this rank's device. Two TODO(exercise)s.

Run it from notebook 05, or from the repository root::

    python -m ddplab launch --nproc-per-node 2 exercises/checkpoint.py
    torchrun --standalone --nproc-per-node 2 exercises/checkpoint.py

and hand the launch's result to the judge: ``ddplab.check("05", result)``.

After every epoch the fixed part calls your ``save`` on every rank, then your ``load`` on every
rank, as a job does when its ranks restart from the file. Write them:

1. ``save(state, path, rank)``: every rank holds the same weights, so one copy is enough: only
   rank 0 writes it (with the ``write_file`` given below, atomic and slow like a big model on a
   busy disk), and no rank may return before the file is complete (``dist.barrier()``).
2. ``load(path, device)``: read the file onto ``device``, this rank's own device, with
   ``torch.load(..., map_location=..., weights_only=True)``. Without ``map_location`` the tensors
   go back to the device that saved them: rank 0's GPU, for every rank.

The fixed part reports who wrote (``wrote``), which epoch each rank loaded and where the tensors
landed (``loaded``). To see whether ``load`` honours its ``device`` on a machine without GPUs,
it also asks it for the ``meta`` device, where tensors have a shape but no data (``probe``).

Lesson: 05.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddplab import data, events, models
from ddplab.dist import pick_backend


def write_file(state: dict[str, Any], path: str) -> None:
    """Write ``state`` to ``path`` atomically (a temporary file, then a rename); takes a while."""
    time.sleep(0.5)  # a big model on a busy disk
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    events.emit("metric", name="wrote", epoch=state["epoch"])


def save(state: dict[str, Any], path: str, rank: int) -> None:
    """Write ``state`` to ``path`` once, on rank 0; return on every rank once it is complete."""
    # TODO(exercise) 1: only rank 0 should call write_file, and every rank should wait (with
    #   dist.barrier()) until the file is complete before it returns.
    write_file(state, path)


def load(path: str, device: torch.device) -> dict[str, Any]:
    """Read the checkpoint at ``path`` with its tensors on ``device``."""
    # TODO(exercise) 2: put the tensors on `device` (map_location), not where they were saved.
    return torch.load(path, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="exercise 05")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "local")
    parser.add_argument("--checkpoint-dir", default=os.path.join(
        tempfile.gettempdir(), f"ddplab-exercise-05-{run_id}"))  # the same on every rank
    args = parser.parse_args()

    # setup: one process per device; gloo on CPUs, nccl on GPUs
    backend = pick_backend()
    dist.init_process_group(backend)
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    path = os.path.join(args.checkpoint_dir, "checkpoint.pt")

    # data and model
    train_set = data.digits().train
    sampler = DistributedSampler(train_set, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    torch.manual_seed(0)
    model = models.build_model("cnn", num_classes=10, in_channels=1).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), labels).backward()
            optimizer.step()

        # your save, then your load, on every rank
        state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "epoch": epoch + 1}
        save(state, path, rank)
        report_load(path, device, epoch + 1)

    # cleanup: wait until nobody reads the file any more, then remove it
    dist.barrier()
    if rank == 0:
        shutil.rmtree(args.checkpoint_dir, ignore_errors=True)
    dist.destroy_process_group()


def report_load(path: str, device: torch.device, epoch: int) -> None:
    """Call ``load`` and report what came back: the epoch, where the tensors are."""
    try:
        state = load(path, device)
    except FileNotFoundError:
        events.emit("metric", name="loaded", expected=epoch, epoch=None, device=str(device),
                    devices=[], error="FileNotFoundError")
        print(f"epoch {epoch}: no checkpoint file to load yet", flush=True)
        return
    where = sorted({str(t.device) for t in state["model"].values()})
    events.emit("metric", name="loaded", expected=epoch, epoch=state["epoch"],
                device=str(device), devices=where)
    probe = load(path, torch.device("meta"))
    events.emit("metric", name="probe", value=sorted({str(t.device) for t in
                                                      probe["model"].values()}))
    print(f"epoch {epoch}: loaded the checkpoint of epoch {state['epoch']} onto {where}",
          flush=True)


if __name__ == "__main__":
    main()
