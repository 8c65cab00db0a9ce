"""The training loop every worker shares: single process, DataParallel or DDP, AMP, accumulation.

One loop, three modes (``--mode``):

- ``single``: one process, the plain model.
- ``dp``: one process, ``nn.DataParallel`` over every visible GPU (on a CPU it runs the module).
- ``ddp``: one process per device, ``DistributedDataParallel(model, device_ids=info.device_ids)``.

Every device decision is a small pure function, so the CPU path runs the same code as the GPU
path and each decision is tested with CUDA faked: ``dp_device_ids`` and ``sync_device`` here,
the backend, the device and DDP's ``device_ids`` in ``ddplab.dist``, the autocast dtype and the
GradScaler in ``ddplab.amp`` (and ``checkpoint.map_location_for``).

One optimizer step with ``grad_accum = k`` runs k micro-batches and steps once, on the mean
gradient over the micro-batches, all-reduced once per step under DDP (``accumulate``; writing it
is exercise 03b). ``data.make_loader(..., interleave=k)`` feeds those micro-batches from the
shares of k virtual ranks, so the samples of a step depend only on the global batch: ``--mode
single --grad-accum 2`` with batch b ends with the weights of DDP on 2 processes with batch b.

Lessons: 01 (loop, timing), 02 (DataParallel), 03 (DDP, accumulation, LR scaling),
05 (resume), 06 (AMP), 09 (benchmark).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, ContextManager, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

from ddplab import checkpoint, dist, events
from ddplab.amp import autocast_dtype
from ddplab.schedule import lr_at
from ddplab.data import Batch, Loader

MODES = ("single", "dp", "ddp")
STOP_EXIT_CODE = 3  # the exit code of --stop-after-epoch, so a test can tell it from a bug


# ------------------------------------------------------------------ device decisions (pure)


def dp_device_ids(device: torch.device) -> Optional[list[int]]:
    """Return DataParallel's ``device_ids``: every visible GPU, or None on the CPU.

    Lesson: 02.
    """
    return list(range(torch.cuda.device_count())) if device.type == "cuda" else None


def sync_device(device: torch.device) -> None:
    """Wait for the GPU's queued work before reading a clock (a no-op on the CPU).

    CUDA kernels run asynchronously: without this a timer measures how fast work was queued.

    Lesson: 01.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ model and seeding


def check_mode(mode: str, world_size: int) -> None:
    """Refuse a mode that does not fit the number of processes, saying what to run instead.

    Lesson: 02, 03.
    """
    if mode not in MODES:
        raise ValueError(f"unknown --mode {mode!r}: choose one of {', '.join(MODES)}.")
    if mode in ("single", "dp") and world_size > 1:
        raise ValueError(
            f"--mode {mode} runs in one process but {world_size} were started: run it with "
            "plain `python -m ddplab.workers.train` (or --nproc-per-node 1), or use --mode ddp."
        )


def wrap_model(model: nn.Module, mode: str, info: dist.DistInfo, sync_bn: bool = False
               ) -> nn.Module:
    """Wrap a model that is already on ``info.device`` for ``mode``.

    ``ddp`` in a world of one process (no process group) returns the model unwrapped: it is the
    same computation. ``sync_bn`` converts BatchNorm layers to SyncBatchNorm (DDP only).

    Raises:
        ValueError: ``sync_bn`` outside DDP, or on CPU ranks (PyTorch's SyncBatchNorm refuses
            CPU tensors in training: it accepts accelerator devices only).

    Lesson: 02, 03.
    """
    check_mode(mode, info.world_size)
    if sync_bn:
        if mode != "ddp":
            raise ValueError("--sync-bn synchronises BatchNorm across DDP ranks: use --mode ddp.")
        if info.world_size > 1 and info.device.type != "cuda":
            raise ValueError(
                "--sync-bn needs GPUs: PyTorch's SyncBatchNorm refuses CPU tensors in training "
                "(it accepts accelerator devices only). Drop --sync-bn on this machine."
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if mode == "dp":
        return nn.DataParallel(model, device_ids=dp_device_ids(info.device))
    if mode == "ddp" and torch_dist.is_available() and torch_dist.is_initialized():
        return nn.parallel.DistributedDataParallel(model, device_ids=info.device_ids)
    return model


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Return the seed of one rank's epoch (distinct per rank and epoch, fixed per run).

    Lesson: 05.
    """
    return (seed * 1_000_003 + epoch * 1_009 + rank) % (2**31)


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy and torch (CPU and every GPU).

    Lesson: 01, 05.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def param_checksum(model: nn.Module) -> float:
    """Return the sum of every parameter as a float64 Python float (equal weights, equal sum).

    Lesson: 03, 05.
    """
    params = checkpoint.unwrap_model(model).parameters()
    return float(sum(p.detach().double().sum().item() for p in params))


# ------------------------------------------------------------------ the loop


def micro_batches(loader: Iterable[Batch], grad_accum: int) -> Iterator[list[Batch]]:
    """Group a loader's batches into lists of ``grad_accum`` (the last list may be shorter).

    Lesson: 03.
    """
    group: list[Batch] = []
    for batch in loader:
        group.append(batch)
        if len(group) == grad_accum:
            yield group
            group = []
    if group:
        yield group


def _sync_unless_last(model: nn.Module, last: bool) -> ContextManager:
    """DDP's ``no_sync()`` for all but the last micro-batch of a step; nothing otherwise."""
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def accumulate(
    model: nn.Module,
    group: Sequence[Batch],
    scaler: torch.amp.GradScaler,
    device: torch.device,
    amp_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    """Run forward and backward over the micro-batches of one optimizer step.

    Each loss is divided by the number of micro-batches, so the summed gradient is their mean
    (what DDP's all-reduce computes across ranks). Backward runs outside autocast.

    Returns:
        The step's loss (mean over micro-batches), detached, on ``device``.

    Lesson: 03, 06.
    """
    total = torch.zeros((), device=device)
    for i, (inputs, labels) in enumerate(group):
        inputs = inputs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with _sync_unless_last(model, i == len(group) - 1):
            # [amp-forward]
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(inputs), labels) / len(group)
            scaler.scale(loss).backward()
            # [/amp-forward]
        total += loss.detach().float()
    return total


@dataclass
class EpochRecord:
    """What one epoch produced; ``history`` entries are ``asdict`` of these minus local fields.

    Lesson: 01.
    """

    epoch: int
    loss: float
    accuracy: float
    epoch_time: float
    samples_per_s: float
    samples: int
    lr: float


def train_epoch(
    model: nn.Module,
    loader: Loader,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    *,
    device: torch.device,
    amp_dtype: Optional[torch.dtype],
    grad_accum: int,
    lr: float,
    warmup_steps: int,
    first_step: int,
    epoch: int,
    epochs: int,
    report: bool,
) -> tuple[float, int, int]:
    """Train one epoch on this rank.

    Emits ``progress`` events about four times per epoch when ``report`` (rank 0).

    Returns:
        ``(sum of step losses, steps, samples trained on by this rank)``.

    Lesson: 01, 03, 06 (its ``# [amp-step]`` lines).
    """
    model.train()
    steps = math.ceil(len(loader) / grad_accum)
    every = max(1, steps // 4)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for step, group in enumerate(micro_batches(loader, grad_accum)):
        for group_ in optimizer.param_groups:
            group_["lr"] = lr_at(first_step + step, lr, warmup_steps)
        # [amp-step]
        step_loss = accumulate(model, group, scaler, device, amp_dtype)
        scaler.step(optimizer)
        scaler.update()
        # [/amp-step]
        optimizer.zero_grad(set_to_none=True)
        loss_sum += step_loss
        samples += sum(len(labels) for _, labels in group)
        if report and ((step + 1) % every == 0 or step + 1 == steps):
            events.emit("progress", epoch=epoch, epochs=epochs, step=step + 1, steps=steps,
                        loss=float(step_loss))
    return float(loss_sum), steps, samples


@torch.no_grad()
def evaluate(model: nn.Module, loader: Loader, device: torch.device,
             amp_dtype: Optional[torch.dtype] = None) -> float:
    """Return the accuracy over the whole test set, summed over every rank's shard.

    Each rank scores its strided shard (``data.make_eval_loader``: no padding, no sample twice)
    with the unwrapped model, then correct and total counts are all-reduced.

    Lesson: 01, 04.
    """
    net = checkpoint.unwrap_model(model)
    was_training = net.training
    net.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, labels in loader:
        inputs, labels = inputs.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            predictions = net(inputs).argmax(dim=1)
        counts[0] += (predictions == labels).sum()
        counts[1] += len(labels)
    net.train(was_training)
    counts = dist.all_reduce_sum(counts)
    return float(counts[0] / counts[1]) if counts[1] > 0 else float("nan")


def fit_epoch(
    model: nn.Module,
    loader: Loader,
    test_loader: Loader,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    *,
    info: dist.DistInfo,
    epoch: int,
    epochs: int,
    seed: int,
    amp: str = "off",
    grad_accum: int = 1,
    lr: float,
    warmup_epochs: float = 0.0,
    set_epoch: bool = True,
) -> tuple[EpochRecord, int]:
    """Train and evaluate epoch ``epoch`` (0-based) and emit its ``epoch`` event from rank 0.

    The epoch starts from a seed derived from (seed, epoch, rank) and the sampler is set to
    ``epoch``, so an epoch computes the same thing whether or not the run was resumed before it.
    The time covers training only, between two ``sync_device`` calls.

    Args:
        model, loader, test_loader, optimizer, scaler: the run's objects.
        info: this rank (from ``dist.setup()``).
        epoch: 0-based epoch index; events and records count from 1.
        epochs: total number of epochs (for progress).
        seed: the run's seed.
        amp: ``--amp`` value.
        grad_accum: micro-batches per optimizer step.
        lr: peak learning rate (after scaling).
        warmup_epochs: length of the linear warm-up, in epochs (may be fractional).
        set_epoch: call ``loader.set_epoch(epoch)``; False shows the repeated-order bug.

    Returns:
        ``(record, samples trained on by this rank)``.

    Lesson: 01, 03, 04, 05.
    """
    seed_everything(epoch_seed(seed, epoch, info.rank))
    if set_epoch:
        loader.set_epoch(epoch)
    steps = math.ceil(len(loader) / grad_accum)
    amp_dtype = autocast_dtype(amp, info.device.type)
    sync_device(info.device)
    start = time.perf_counter()
    loss_sum, steps_done, samples = train_epoch(
        model, loader, optimizer, scaler, device=info.device, amp_dtype=amp_dtype,
        grad_accum=grad_accum, lr=lr, warmup_steps=round(warmup_epochs * steps),
        first_step=epoch * steps, epoch=epoch + 1, epochs=epochs, report=info.is_main,
    )
    sync_device(info.device)
    epoch_time = time.perf_counter() - start
    totals = dist.all_reduce_sum(torch.tensor([loss_sum, steps_done, samples],
                                              dtype=torch.float64, device=info.device))
    accuracy = evaluate(model, test_loader, info.device, amp_dtype)
    record = EpochRecord(
        epoch=epoch + 1, loss=float(totals[0] / totals[1]), accuracy=accuracy,
        epoch_time=epoch_time, samples_per_s=float(totals[2]) / epoch_time,
        samples=int(totals[2]), lr=optimizer.param_groups[0]["lr"],
    )
    if info.is_main:
        events.emit("epoch", **asdict(record))
    return record, samples


# ------------------------------------------------------------------ resume, stop, summary


def resume(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
           scaler: torch.amp.GradScaler, device: torch.device) -> tuple[int, list[dict]]:
    """Load ``path`` if it exists; return ``(epochs already done, their history)``.

    A missing file is not an error (the first attempt of a restartable job has none yet).

    Lesson: 05.
    """
    if not os.path.exists(path):
        dist.print0(f"no checkpoint at {path}: starting from epoch 1")
        return 0, []
    state = checkpoint.load_checkpoint(path, model, optimizer, scaler=scaler, device=device)
    dist.print0(f"resumed from {path} after epoch {state['epoch']}")
    return state["epoch"], list(state["extra"].get("history", []))


def stop_after(epoch: int) -> None:
    """Simulate a crash: leave at once with ``STOP_EXIT_CODE``, no cleanup (``os._exit``).

    Lesson: 05.
    """
    dist.print0(f"--stop-after-epoch {epoch}: exiting abruptly, as a crash would", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STOP_EXIT_CODE)


def throughput(history: Sequence[dict]) -> float:
    """Return the median samples/s over epochs, leaving out the first (warm-up) when possible.

    Lesson: 01, 09.
    """
    rates = [h["samples_per_s"] for h in history]
    rates = rates[1:] if len(rates) > 1 else rates
    return float(statistics.median(rates)) if rates else float("nan")


def summarize(
    model: nn.Module,
    info: dist.DistInfo,
    history: Sequence[dict],
    /,
    *,
    samples_seen: int,
    lr: float,
    batch_size: int,
    grad_accum: int,
    emit: bool = True,
    **config: Any,
) -> dict[str, Any]:
    """Build the run's summary on every rank and emit it once, from rank 0.

    Collective: every rank must call it (checksums and sample counts are gathered).

    Args:
        model: the trained model.
        info: this rank.
        history: one dict per epoch (``EpochRecord`` fields).
        samples_seen: samples this rank trained on in this process's lifetime.
        lr: the effective (peak) learning rate.
        batch_size: per-process micro-batch size.
        grad_accum: micro-batches per optimizer step.
        emit: print the ``summary`` event on rank 0.
        **config: more fields to report as they are (mode, amp, dataset, ...).

    Returns:
        The summary dict (see the worker's docstring for its fields).

    Lesson: every lesson that launches the training worker.
    """
    checksums = dist.all_gather_floats(param_checksum(model), info.device)
    seen = dist.all_gather_floats(samples_seen, info.device)
    last = history[-1] if history else {}
    summary = {
        **config,
        "param_checksum": checksums[0],
        "param_checksums_per_rank": checksums,
        "final_loss": last.get("loss", float("nan")),
        "final_accuracy": last.get("accuracy", float("nan")),
        "epochs": len(history),
        "world_size": info.world_size,
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "global_batch": batch_size * info.world_size * grad_accum,
        "lr": lr,
        "history": list(history),
        "samples_seen_per_rank": [int(s) for s in seen],
        "samples_per_s": throughput(history),
        "train_time": float(sum(h["epoch_time"] for h in history)),
        "device": str(info.device),
        "backend": info.backend,
    }
    if emit and info.is_main:
        events.emit("summary", **summary)
    return summary
