"""torch.compile with DDP: what each order compiles, seen by the profiler; the same losses.

Run it::

    torchrun --nproc-per-node 2 -m ddplab.workers.compile_ddp
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.compile_ddp --backend aot_eager

Every run trains the same MLP from the same seed on the same batches for a few steps under DDP,
with gradient buckets of 1 MiB (the MLP's weights make several). The MLP is a class of its own
(``MLP``, an ``nn.Module`` subclass); ``--sequential`` builds the same layers as an
``nn.Sequential`` instead (what that changes is notebook 03b's Try it):

- ``eager``: plain DDP, the reference;
- ``wrap_then_compile``: ``torch.compile(DDP(model))``, the order PyTorch's DDP notes show;
- ``compile_then_wrap``: ``DDP(torch.compile(model))``.

What was compiled is read from the last step's ``torch.profiler`` trace, which names every
compiled piece that ran: ``Torch-Compiled Region`` (a Python frame Dynamo compiled),
``CompiledFunction`` / ``CompiledFunctionBackward`` (a graph AOTAutograd compiled, the forward
and the backward; inductor and aot_eager both go through it). When Dynamo compiles a module
inside DDP's forward, its ``DDPOptimizer`` splits the graph at the bucket boundaries, so that
each bucket's all-reduce can start while backward goes on through the earlier layers.

In ``torch.compile(DDP(model))`` Dynamo breaks its graph inside DDP's forward, and the model's
``forward`` starts a new frame, which Dynamo compiles or not by the file it lives in (after a
``--sequential`` run, the ``why`` event says which).

``--backend`` defaults to ``inductor``, which generates C++ on the CPU; without a C++ compiler
the worker uses ``aot_eager`` instead and says so.

Events:

- ``graphs`` (rank 0, per order): ``order``, ``backend``, ``sequential``, ``frames`` (compiled
  regions run in one step), ``regions`` (their labels, ``frame/recompile``: Dynamo numbers the
  frames it starts in order), ``forward``/``backward`` (compiled graphs run in one step),
  ``buckets`` (buckets DDP all-reduced in that step, seen by a comm hook).
- ``why`` (rank 0, ``--sequential`` only, when ``torch.compile(DDP(model))`` ran no compiled
  graph of the model): ``text``, why.
- ``loss`` (rank 0, per run and step): ``run`` (``eager`` or ``ORDER/BACKEND``), ``step``,
  ``loss`` (mean over the ranks).
- ``skipped`` (rank 0): ``backend``, ``reason`` (when inductor could not run).

Lesson: 03b.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from contextlib import nullcontext
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from ddplab import dist, events

ORDERS = ("wrap_then_compile", "compile_then_wrap")
#: Why ``torch.compile(DDP(nn.Sequential(...)))`` ran no compiled graph of the model (the
#: ``why`` event; torch 2.14: ``_run_ddp_forward`` and the context manager
#: ``_inside_ddp_forward`` in torch/nn/parallel/distributed.py, ``check_file`` in
#: torch/_dynamo/trace_rules.py).
SEQUENTIAL_WHY = (
    "Why: DDP calls the model inside a context manager that Dynamo skips (_inside_ddp_forward): "
    "the graph breaks on entering it, so the model's forward must start a frame of its own. "
    "Dynamo starts frames in your files, but in torch's own torch/nn "
    "files only when a frame it is already tracing calls them: nn.Sequential's forward lives "
    "in torch/nn, so nothing compiled it. An MLP class of your own starts its frame in your "
    "file.")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.compile_ddp",
                                description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of the real compile: inductor, aot_eager, eager")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential", action="store_true",
                   help="the same layers in an nn.Sequential instead of the MLP class")
    return p.parse_args(argv)


def cxx_compiler() -> Optional[str]:
    """The C++ compiler inductor would use on the CPU, or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++") \
        or shutil.which("c++")


class MLP(nn.Module):
    """The MLP as a model of your own: a subclass of ``nn.Module`` with its own ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 512), nn.Linear(512, 512),
                                     nn.Linear(512, 512), nn.Linear(512, 10)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def build(sequential: bool = False) -> nn.Module:
    """An MLP whose weights fill several 1 MB buckets (two 512 x 512 layers are 1 MB each).

    ``sequential``: the same layers in an ``nn.Sequential``, a container of torch's own.
    """
    if sequential:
        return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return MLP()


# [orders]
def wrap(order: str, backend: Any, info: dist.DistInfo, bucket_cap_mb: float = 1,
         sequential: bool = False) -> tuple[nn.Module, DDP]:
    """The MLP from the seed, under DDP, compiled in ``order`` (or not, for ``eager``).

    Returns the module to call and the DDP wrapper inside it.
    """
    torch.manual_seed(0)
    model = build(sequential).to(info.device)
    if order == "compile_then_wrap":
        ddp = DDP(torch.compile(model, backend=backend), device_ids=info.device_ids,
                  bucket_cap_mb=bucket_cap_mb)
        return ddp, ddp
    ddp = DDP(model, device_ids=info.device_ids, bucket_cap_mb=bucket_cap_mb)
    if order == "wrap_then_compile":
        return torch.compile(ddp, backend=backend), ddp
    return ddp, ddp
# [/orders]


def count_buckets(ddp: DDP) -> list[int]:
    """Register a comm hook that all-reduces as DDP does and records the buckets' indices."""
    seen: list[int] = []

    def hook(state, bucket):  # DDP checks a hook's annotations: none, or GradBucket and Future
        seen.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return seen


# [profile]
def compiled_pieces(events: Any) -> dict[str, int]:
    """Count the compiled pieces a profiler trace saw run (see the module doc)."""
    names = [e.name for e in events]
    regions = [n.split(": ")[-1] for n in names if n.startswith("Torch-Compiled Region")]
    by_number = sorted(set(regions), key=lambda r: [int(d) for d in re.findall(r"\d+", r)])
    return {"frames": len(regions), "regions": by_number,   # "4/0": Dynamo's frame 4, first build
            "forward": names.count("CompiledFunction"),
            "backward": names.count("CompiledFunctionBackward")}
# [/profile]


def train(model: nn.Module, info: dist.DistInfo, args: argparse.Namespace, run: str,
          buckets: Optional[list[int]] = None) -> Optional[dict[str, int]]:
    """A few SGD steps on this rank's random batch; rank 0 reports the mean loss per step.

    Returns what the profiler saw compiled in the last step (None for eager).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(args.seed + info.rank)
    seen = None
    for step in range(1, args.steps + 1):
        x = torch.randn(16, 64, generator=generator).to(info.device)
        y = torch.randint(0, 10, (16,), generator=generator).to(info.device)
        last = step == args.steps and buckets is not None
        if last:
            buckets.clear()
        with profile(activities=[ProfilerActivity.CPU]) if last else nullcontext() as trace:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        if last:
            seen = {**compiled_pieces(trace.events()), "buckets": len(buckets)}
        optimizer.step()
        optimizer.zero_grad()
        mean = dist.all_reduce_mean(loss.item(), info.device)
        if info.is_main:
            events.emit("loss", run=run, step=step, loss=mean)
    return seen


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Eager DDP, then both orders compiled with ``--backend``, profiled."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("compile_ddp needs 2 or more processes: torchrun --nproc-per-node 2 ...")
    backend = args.backend
    if backend == "inductor" and info.device.type == "cpu" and not cxx_compiler():
        reason = ("inductor generates C++ for the CPU and no C++ compiler was found (g++, "
                  "clang++ or $CXX): install one (apt install g++); aot_eager used instead")
        dist.print0(f"skipping --backend inductor: {reason}")
        if info.is_main:
            events.emit("skipped", backend=backend, reason=reason)
        backend = "aot_eager"
    train(wrap("eager", None, info, sequential=args.sequential)[0], info, args, "eager")
    for order in ORDERS:
        torch.compiler.reset()
        model, ddp = wrap(order, backend, info, sequential=args.sequential)
        seen = train(model, info, args, f"{order}/{backend}", count_buckets(ddp))
        if info.is_main:
            events.emit("graphs", order=order, backend=backend, sequential=args.sequential,
                        **seen)
            if order == "wrap_then_compile" and args.sequential and not seen["forward"]:
                events.emit("why", text=SEQUENTIAL_WHY)
    dist.cleanup()


if __name__ == "__main__":
    main()
