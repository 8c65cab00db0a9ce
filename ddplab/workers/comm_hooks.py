"""DDP communication hooks: compress the gradients' all-reduce (fp16, bf16, PowerSGD), measured.

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.comm_hooks
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.comm_hooks --hooks none fp16 --epochs 1

Every hook trains the same MLP from the same seed on the same batches of the digits, one hook
after the other in one job:

- ``none``: DDP's own all-reduce of float32 gradients;
- ``fp16`` / ``bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``: each
  bucket is cast to 16 bits, all-reduced, and cast back: half the bytes;
- ``powersgd``: ``powerSGD_hook``: each gradient matrix is sent as two thin low-rank factors
  (rank ``--rank``), with error feedback (what the approximation missed is added to the next
  step's gradient); the first ``--powersgd-start`` steps use the plain all-reduce.

The bytes a rank sends are read from the kernel's count of what the process wrote
(``wchar`` in ``/proc/self/io``, Linux), which includes gloo's socket writes.

Events:

- ``hook`` (every rank, per hook): ``hook``, ``bytes_per_step`` (what this rank wrote per step,
  None where ``/proc/self/io`` is missing or the backend is not gloo), ``grad_bytes`` (the
  float32 gradients' size),
  ``accuracy`` (on the test set, after training), ``loss`` (the last step's, mean over ranks).
- ``skipped`` (rank 0): ``hook``, ``reason``, for a hook the installed torch does not ship
  (``missing``). A hook that raises fails the job, with its traceback: never a quiet skip.

Lesson: 08.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import data, dist, events

HOOKS = ("none", "fp16", "bf16", "powersgd")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.comm_hooks",
                                description=__doc__.split("\n")[0])
    p.add_argument("--hooks", nargs="+", choices=HOOKS, default=list(HOOKS))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--rank", type=int, default=2, help="PowerSGD's approximation rank")
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="steps of plain all-reduce before PowerSGD compresses")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def bytes_written() -> Optional[int]:
    """What this process has written so far (files, pipes and sockets), or None off Linux."""
    try:
        with open("/proc/self/io") as io:
            for line in io:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# The function behind each hook, by its module and name in torch.distributed.algorithms.
HOOK_FUNCTIONS = {"fp16": (default_hooks, "fp16_compress_hook"),
                  "bf16": (default_hooks, "bf16_compress_hook"),
                  "powersgd": (powerSGD_hook, "powerSGD_hook")}


def missing(hook: str) -> Optional[str]:
    """Why the installed torch cannot run ``hook`` (it does not ship it), or None."""
    if hook not in HOOK_FUNCTIONS:
        return None
    module, name = HOOK_FUNCTIONS[hook]
    if hasattr(module, name):
        return None
    return f"torch {torch.__version__} has no {module.__name__}.{name}"


# [hooks]
def register(model: DDP, hook: str, args: argparse.Namespace) -> None:
    """Replace DDP's all-reduce of each gradient bucket by ``hook`` (``none``: keep it)."""
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.rank,
            start_powerSGD_iter=args.powersgd_start)   # plain all-reduce while warming up
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
# [/hooks]


def train(hook: str, split: data.DataSplit, info: dist.DistInfo,
          args: argparse.Namespace) -> dict[str, Any]:
    """Train with ``hook`` and report bytes per step and test accuracy."""
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, split.num_classes)).to(info.device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = DDP(model, device_ids=info.device_ids)
    register(ddp, hook, args)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    images, labels = split.train.tensors
    per_step = args.batch_size * info.world_size
    # gloo sends through this process's sockets; NCCL moves GPU memory itself, unseen here.
    steps, start = 0, bytes_written() if info.backend == "gloo" else None
    for epoch in range(args.epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(epoch))
        for first in range(0, len(order) - per_step + 1, per_step):
            mine = order[first + info.rank * args.batch_size:][:args.batch_size]
            x, y = images[mine].to(info.device), labels[mine].to(info.device)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    end = bytes_written()
    with torch.no_grad():
        x, y = (t.to(info.device) for t in split.test.tensors)
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return events.emit("hook", hook=hook, grad_bytes=grad_bytes, accuracy=accuracy,
                       bytes_per_step=None if start is None else (end - start) / steps,
                       loss=dist.all_reduce_mean(loss.item(), info.device))


def main(argv: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """Train with every requested hook in turn; return this rank's ``hook`` events."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("comm_hooks needs 2 or more processes: torchrun --nproc-per-node 2 ...")
    split = data.load_dataset("digits")
    found = []
    for hook in args.hooks:
        reason = missing(hook)
        if reason:   # the same torch on every rank: every rank skips it
            dist.print0(f"skipping {hook}: {reason}")
            if info.is_main:
                events.emit("skipped", hook=hook, reason=reason)
            continue
        found.append(train(hook, split, info, args))   # a hook that raises fails the job
    dist.cleanup()
    return found


if __name__ == "__main__":
    main()
