"""The canonical DDP script: DataLoader + DistributedSampler + set_epoch, and the plain loop.

Run it (2 processes; every flag is optional)::

    torchrun --standalone --nproc-per-node 2 -m ddplab.workers.plain_ddp --epochs 3
    torchrun --standalone --nproc-per-node 2 ddplab/workers/plain_ddp.py --epochs 3
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.plain_ddp --epochs 3

From a notebook: ``ddplab.launch("ddplab.workers.plain_ddp", 2, args=["--epochs", "3"])``.

Every DDP training script has this shape (PyTorch's ``ddp-tutorial-series/multigpu_torchrun.py``
too): join the process group, pick this process's device, give each rank its own share of the
data with ``DistributedSampler``, wrap the model in ``DistributedDataParallel``, run the plain
loop, save on rank 0 behind a barrier, leave the group. Swap in your own data and model and it
is yours. What it reports (``@ddplab`` event lines, see ``ddplab.events``), every rank unless
said otherwise:

- metric ``wrap``: float64 checksum of the weights ``before`` and ``after`` DDP wrapped them;
- ``epoch`` per epoch: ``epoch`` (from 1), ``loss`` (this rank's mean), ``samples`` and
  ``steps`` (this rank's), ``epoch_time`` (s, training only), ``accuracy`` (test set) and
  ``order`` (the first 8 indices the sampler gave this rank);
- metric ``saved`` (rank 0, per checkpoint) and ``loaded`` (with ``--resume``: the ``epoch``,
  the ``devices`` the loaded tensors landed on and, on GPUs, ``cuda_memory``: this process's
  ``torch.cuda.max_memory_allocated`` on every GPU);
- metric ``checksum`` at the end: the weights' float64 sum (equal weights, equal sums).

Lessons: 01 (one process: the plain loop, timing), 03 (DDP), 04 (sampler, set_epoch),
05 (save, resume, map_location), 09 (benchmark).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddplab import data, events, models
from ddplab.dist import pick_backend

STOP_EXIT_CODE = 3  # --stop-after-epoch: the exit code of the simulated crash


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.plain_ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=data.DATASETS, default="digits")
    p.add_argument("--data-root", default="data", help="folder of CIFAR-10")
    p.add_argument("--download", action="store_true", help="fetch CIFAR-10 if it is missing")
    p.add_argument("--model", choices=models.MODELS, help="default: cnn, resnet18 for cifar10")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--seed-per-rank", action="store_true", help="different start weights per rank")
    p.add_argument("--no-set-epoch", action="store_true", help="skip sampler.set_epoch (bug)")
    p.add_argument("--checkpoint-dir", help="save checkpoint.pt here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from checkpoint.pt if present")
    p.add_argument("--no-map-location", action="store_true", help="load without it (bug)")
    p.add_argument("--stop-after-epoch", type=int, metavar="N", help="crash after epoch N")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels only, "
                   "so that a GPU run repeats bit for bit (a CPU run does without)")
    args = p.parse_args(argv)
    if (args.resume or args.stop_after_epoch) and not args.checkpoint_dir:
        p.error("--resume and --stop-after-epoch need --checkpoint-dir")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    """One rank's run: setup, data, model, resume, the loop (with saves), cleanup."""
    args = parse_args(argv)
    if args.deterministic:
        make_deterministic()

    # [setup]
    backend = pick_backend()                  # "nccl" if every process here gets a GPU, else "gloo"
    dist.init_process_group(backend)          # meets the others at MASTER_ADDR:MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])      # this process's number on its machine
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # [/setup]

    # [data]
    split = data.load_dataset(args.dataset, root=args.data_root, download=args.download,
                              as_tensors=False)     # digits: a plain TensorDataset
    sampler = DistributedSampler(split.train, seed=args.seed)   # rank and world size: the group's
    loader = DataLoader(split.train, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.num_workers, pin_memory=device.type == "cuda")
    test_loader = DataLoader(split.test, batch_size=512)
    # [/data]

    # [model]
    torch.manual_seed(args.seed + rank if args.seed_per_rank else args.seed)
    name = args.model or models.default_model(args.dataset)
    model = models.build_model(name, split.num_classes, split.in_channels).to(device)
    before = checksum(model)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    events.emit("metric", name="wrap", before=before, after=checksum(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # [/model]

    # [resume]
    path = os.path.join(args.checkpoint_dir or ".", "checkpoint.pt")
    start_epoch = 0
    if args.resume and os.path.exists(path):
        where = None if args.no_map_location else device    # the rank's own device
        start_epoch = load_checkpoint(path, model, optimizer, where)
    # [/resume]

    # [loop]
    for epoch in range(start_epoch, args.epochs):
        if not args.no_set_epoch:
            sampler.set_epoch(epoch)          # a new shuffle each epoch, the same on every rank
        sync(device)
        start = time.perf_counter()
        loss, samples, steps = train_one_epoch(model, loader, optimizer, device)
        sync(device)
        report_epoch(epoch, args.epochs, rank, time.perf_counter() - start, loss, samples,
                     steps, sampler, model, test_loader, device)
        if args.checkpoint_dir:
            save_checkpoint(path, model, optimizer, epoch + 1, rank)
        if args.stop_after_epoch == epoch + 1:
            os._exit(STOP_EXIT_CODE)          # a crash: no clean-up, no goodbye
    # [/loop]

    events.emit("metric", name="checksum", value=checksum(model))
    # [cleanup]
    dist.destroy_process_group()
    # [/cleanup]


def make_deterministic() -> None:
    """Deterministic kernels only (an error where an op has none), so that two GPU runs of the
    same work give the same bits: with them, a resumed run ends with exactly the weights of an
    uninterrupted one (lesson 05). cuBLAS needs a fixed workspace for it, read when CUDA starts;
    cuDNN must not benchmark algorithms (``torch.backends.cudnn.benchmark``, off by default and
    never turned on here). The CPU kernels this course uses are deterministic already."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    events.emit("metric", name="deterministic", value=torch.are_deterministic_algorithms_enabled())


def train_one_epoch(model: torch.nn.Module, loader: DataLoader,
                    optimizer: torch.optim.Optimizer, device: torch.device
                    ) -> tuple[float, int, int]:
    """Train one epoch on this rank's share; return (mean loss, samples, steps)."""
    model.train()
    loss_sum, samples, steps = torch.zeros((), device=device), 0, 0
    # [step]
    for inputs, labels in loader:
        inputs, labels = inputs.to(device), labels.to(device)   # the batch goes to the model
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), labels)             # forward
        loss.backward()                   # gradients; DDP averages them over the ranks here
        optimizer.step()                  # the same update on every rank
        # [/step]
        loss_sum += loss.detach() * len(labels)
        samples, steps = samples + len(labels), steps + 1
    return float(loss_sum) / max(samples, 1), samples, steps


def save_checkpoint(path: str, model: DDP, optimizer: torch.optim.Optimizer, epoch: int,
                    rank: int) -> None:
    """Rank 0 writes the checkpoint atomically; every rank returns once it is complete."""
    # [save]
    if rank == 0:                         # the weights are the same everywhere: one writer
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"model": model.module.state_dict(),     # unwrapped: no "module." prefix
                 "optimizer": optimizer.state_dict(), "epoch": epoch}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)   # atomic: readers see the old file or the new one
        events.emit("metric", name="saved", epoch=epoch, path=path)
    dist.barrier()                        # nobody goes on (to read it) before it is complete
    # [/save]


def load_checkpoint(path: str, model: DDP, optimizer: torch.optim.Optimizer,
                    map_location: Optional[torch.device]) -> int:
    """Load model and optimizer state onto ``map_location``; return the epochs already done."""
    # [load]
    state = torch.load(path, map_location=map_location, weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # [/load]
    memory = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():   # what each GPU now holds
        memory = [torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())]
    events.emit("metric", name="loaded", epoch=state["epoch"], cuda_memory=memory,
                devices=sorted({str(t.device) for t in state["model"].values()}))
    print(f"resumed from {path} after epoch {state['epoch']}", flush=True)
    return state["epoch"]


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work before reading the clock (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checksum(model: torch.nn.Module) -> float:
    """Sum of all weights in float64: equal weights give equal sums."""
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


@torch.no_grad()
def accuracy(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Accuracy on the whole test set (every rank scores all of it: no padding, no collective)."""
    model.eval()
    correct = total = 0
    for inputs, labels in loader:
        predictions = model(inputs.to(device)).argmax(dim=1)
        correct += int((predictions == labels.to(device)).sum())
        total += len(labels)
    return correct / total


def report_epoch(epoch: int, epochs: int, rank: int, epoch_time: float, loss: float,
                 samples: int, steps: int, sampler: DistributedSampler, model: DDP,
                 test_loader: DataLoader, device: torch.device) -> None:
    """Emit this rank's ``epoch`` event (and rank 0's progress for the live view)."""
    score = accuracy(model.module, test_loader, device)
    events.emit("epoch", epoch=epoch + 1, epochs=epochs, loss=loss, samples=samples,
                steps=steps, epoch_time=epoch_time, accuracy=score, order=list(sampler)[:8])
    if rank == 0:
        events.emit("progress", epoch=epoch + 1, epochs=epochs, step=steps, steps=steps,
                    loss=loss)
    print(f"epoch {epoch + 1}: loss {loss:.4f}, accuracy {score:.1%}, {epoch_time:.2f} s",
          flush=True)


if __name__ == "__main__":
    main()
