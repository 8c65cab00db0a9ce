"""The baseline: one process, one device, the plain training loop, timed per epoch.

Run it (every flag is optional)::

    python -m ddplab.workers.single --epochs 3
    python ddplab/workers/single.py --epochs 3
    python -m ddplab launch --nproc-per-node 1 ddplab.workers.single --epochs 3

From a notebook: ``ddplab.launch("ddplab.workers.single", 1, args=["--epochs", "3"])``.

Nothing here is distributed: pick the device, load the data, build the model, loop. Lesson 03's
``ddplab/workers/plain_ddp.py`` is this same file plus the lines that make it data-parallel
(the process group, ``DistributedSampler``, the DDP wrap, rank-0 saves) and the flags lessons 03
to 05 use to show pitfalls (``--no-set-epoch``, ``--stop-after-epoch``, ``--resume``...). What
it reports
(``@ddplab`` event lines, see ``ddplab.events``):

- ``epoch`` per epoch: ``epoch`` (from 1), ``loss`` (mean), ``samples``, ``steps``,
  ``epoch_time`` (s, training only) and ``accuracy`` (test set);
- metric ``checksum`` at the end: the weights' float64 sum;
- with ``--time-steps N``, metric ``step_times`` (rule 1 of lesson 01 at work): ``N`` clock
  readings, one per training step, each after ``sync`` (``--no-sync``: without it), and
  ``total``, the seconds of all ``N`` steps up to a final ``sync``.

Lesson: 01.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddplab import data, events, models


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.single", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=data.DATASETS, default="digits")
    p.add_argument("--data-root", default="data", help="folder of CIFAR-10")
    p.add_argument("--download", action="store_true", help="fetch CIFAR-10 if it is missing")
    p.add_argument("--model", choices=models.MODELS, help="default: cnn, resnet18 for cifar10")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--time-steps", type=int, default=0,
                   help="after training, time this many steps one by one on one batch")
    p.add_argument("--no-sync", action="store_true",
                   help="with --time-steps: read the clock without torch.cuda.synchronize()")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The whole run: device, data, model, the timed loop."""
    args = parse_args(argv)

    # [setup]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # the one decision
    # [/setup]

    # [data]
    split = data.load_dataset(args.dataset, root=args.data_root, download=args.download,
                              as_tensors=False)     # digits: a plain TensorDataset
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(split.train, batch_size=args.batch_size, shuffle=True,
                        generator=generator, num_workers=args.num_workers,
                        pin_memory=device.type == "cuda")
    test_loader = DataLoader(split.test, batch_size=512)
    # [/data]

    # [model]
    torch.manual_seed(args.seed)
    name = args.model or models.default_model(args.dataset)
    model = models.build_model(name, split.num_classes, split.in_channels).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # [/model]

    # [loop]
    for epoch in range(args.epochs):
        sync(device)
        start = time.perf_counter()
        loss, samples, steps = train_one_epoch(model, loader, optimizer, device)
        sync(device)
        report_epoch(epoch, args.epochs, time.perf_counter() - start, loss, samples, steps,
                     model, test_loader, device)
    # [/loop]

    if args.time_steps:
        times, total = time_steps(model, loader, optimizer, device, args.time_steps,
                                  synced=not args.no_sync)
        events.emit("metric", name="step_times", value=times, total=total,
                    synced=not args.no_sync, device=device.type)
    events.emit("metric", name="checksum", value=checksum(model))


def train_one_epoch(model: torch.nn.Module, loader: DataLoader,
                    optimizer: torch.optim.Optimizer, device: torch.device
                    ) -> tuple[float, int, int]:
    """Train one epoch; return (mean loss, samples, steps)."""
    model.train()
    loss_sum, samples, steps = torch.zeros((), device=device), 0, 0
    # [step]
    for inputs, labels in loader:
        inputs, labels = inputs.to(device), labels.to(device)   # the batch goes to the model
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)             # forward
        loss.backward()                                           # gradients
        optimizer.step()                                          # the update
        # [/step]
        loss_sum += loss.detach() * len(labels)
        samples, steps = samples + len(labels), steps + 1
    return float(loss_sum) / max(samples, 1), samples, steps


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work before reading the clock (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
               device: torch.device, steps: int, synced: bool = True
               ) -> tuple[list[float], float]:
    """Time ``steps`` training steps on one batch, reading the clock after each.

    With ``synced`` the clock is read after ``sync``, as rule 1 asks; without it, after the
    step's work was queued. ``total`` is always read after a final ``sync``: the real time.
    Returns (one reading per step, total seconds).
    """
    model.train()
    inputs, labels = next(iter(loader))
    inputs, labels = inputs.to(device), labels.to(device)
    times = []
    sync(device)
    begin = time.perf_counter()
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        if synced:
            sync(device)
        times.append(time.perf_counter() - start)
    sync(device)
    return times, time.perf_counter() - begin


def checksum(model: torch.nn.Module) -> float:
    """Sum of all weights in float64: equal weights give equal sums."""
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


@torch.no_grad()
def accuracy(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Accuracy on the whole test set."""
    model.eval()
    correct = total = 0
    for inputs, labels in loader:
        predictions = model(inputs.to(device)).argmax(dim=1)
        correct += int((predictions == labels.to(device)).sum())
        total += len(labels)
    return correct / total


def report_epoch(epoch: int, epochs: int, epoch_time: float, loss: float, samples: int,
                 steps: int, model: torch.nn.Module, test_loader: DataLoader,
                 device: torch.device) -> None:
    """Emit the ``epoch`` event (and the progress for the live view)."""
    score = accuracy(model, test_loader, device)
    events.emit("epoch", epoch=epoch + 1, epochs=epochs, loss=loss, samples=samples,
                steps=steps, epoch_time=epoch_time, accuracy=score)
    events.emit("progress", epoch=epoch + 1, epochs=epochs, step=steps, steps=steps, loss=loss)
    print(f"epoch {epoch + 1}: loss {loss:.4f}, accuracy {score:.1%}, {epoch_time:.2f} s",
          flush=True)


if __name__ == "__main__":
    main()
