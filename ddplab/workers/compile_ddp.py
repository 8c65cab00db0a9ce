"""torch.compile with DDP: which order compiles what, graphs split at bucket boundaries, same loss.

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.compile_ddp
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.compile_ddp --backend aot_eager

Every run trains the same MLP from the same seed on the same batches for a few steps under DDP,
with gradient buckets of 1 MB (the MLP's weights make several):

- ``eager``: plain DDP, the reference;
- ``wrap_then_compile``: ``torch.compile(DDP(model))``;
- ``compile_then_wrap``: ``DDP(torch.compile(model))``; compiling inside DDP's forward,
  Dynamo's ``DDPOptimizer`` splits the graph at the bucket boundaries, so that each bucket's
  all-reduce can start while backward goes on through the earlier layers.

The two compiled runs first use a counting backend (a function that records each graph it is
given and runs it as it is: no compiler needed), then ``--backend`` (default ``inductor``,
which generates C++ on the CPU: it needs a C++ compiler, and is skipped with a message without
one) with DDP's default 25 MB buckets (one graph: compiling takes seconds per graph here).

Events:

- ``graphs`` (rank 0, per order): ``order``, ``graphs`` (how many graphs the backend got),
  ``nodes`` (their sizes), ``buckets`` (how many buckets DDP all-reduced, seen by a comm hook).
- ``loss`` (rank 0, per run and step): ``run`` (``eager`` or ``ORDER/BACKEND``), ``step``,
  ``loss`` (mean over the ranks).
- ``skipped`` (rank 0): ``backend``, ``reason``.

Lesson: 06.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import dist, events

ORDERS = ("wrap_then_compile", "compile_then_wrap")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.compile_ddp",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of the real compile: inductor, aot_eager, eager")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def cxx_compiler() -> Optional[str]:
    """The C++ compiler inductor would use on the CPU, or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++") \
        or shutil.which("c++")


def build() -> nn.Sequential:
    """An MLP whose weights fill several 1 MB buckets (two 512 x 512 layers are 1 MB each)."""
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


class Counting:
    """A ``torch.compile`` backend that records the graphs it gets and runs them unchanged."""

    def __init__(self) -> None:
        self.nodes: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.nodes.append(len(gm.graph.nodes))
        return gm.forward


# [orders]
def wrap(order: str, backend: Any, info: dist.DistInfo,
         bucket_cap_mb: float = 1) -> tuple[nn.Module, DDP]:
    """The MLP from the seed, under DDP, compiled in ``order`` (or not, for ``eager``).

    Returns the module to call and the DDP wrapper inside it.
    """
    torch.manual_seed(0)
    model = build().to(info.device)
    if order == "compile_then_wrap":
        ddp = DDP(torch.compile(model, backend=backend), device_ids=info.device_ids,
                  bucket_cap_mb=bucket_cap_mb)
        return ddp, ddp
    ddp = DDP(model, device_ids=info.device_ids, bucket_cap_mb=bucket_cap_mb)
    if order == "wrap_then_compile":
        return torch.compile(ddp, backend=backend), ddp
    return ddp, ddp
# [/orders]


def count_buckets(ddp: DDP) -> set[int]:
    """Register a comm hook that all-reduces as DDP does and records the buckets' indices."""
    seen: set[int] = set()

    def hook(state, bucket):  # DDP checks a hook's annotations: none, or GradBucket and Future
        seen.add(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return seen


def train(model: nn.Module, info: dist.DistInfo, args: argparse.Namespace, run: str) -> None:
    """A few SGD steps on this rank's random batch; rank 0 reports the mean loss per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(args.seed + info.rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(16, 64, generator=generator).to(info.device)
        y = torch.randint(0, 10, (16,), generator=generator).to(info.device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = dist.all_reduce_mean(loss.item(), info.device)
        if info.is_main:
            events.emit("loss", run=run, step=step, loss=mean)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Eager DDP, then both orders with the counting backend and with ``--backend``."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("compile_ddp needs 2 or more processes: torchrun --nproc-per-node 2 ...")
    train(wrap("eager", None, info)[0], info, args, "eager")
    for order in ORDERS:
        counting = Counting()
        model, ddp = wrap(order, counting, info)
        buckets = count_buckets(ddp)
        train(model, info, args, f"{order}/counting")
        if info.is_main:
            events.emit("graphs", order=order, graphs=len(counting.nodes), nodes=counting.nodes,
                        buckets=len(buckets))
    problem = None
    if args.backend == "inductor" and info.device.type == "cpu" and not cxx_compiler():
        problem = ("inductor generates C++ for the CPU and no C++ compiler was found (g++, "
                   "clang++ or $CXX): install one (apt install g++), or pass --backend aot_eager")
    if problem:
        dist.print0(f"skipping --backend {args.backend}: {problem}")
        if info.is_main:
            events.emit("skipped", backend=args.backend, reason=problem)
    else:
        for order in ORDERS:   # DDP's default 25 MB buckets: one graph, compiled once
            model = wrap(order, args.backend, info, bucket_cap_mb=25)[0]
            train(model, info, args, f"{order}/{args.backend}")
    dist.cleanup()


if __name__ == "__main__":
    main()
