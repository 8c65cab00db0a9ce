"""One training step of an MLP under torch.profiler: the memory it holds, and when DDP communicates.

Run it on the CPU (one process, or several on gloo: then the model is wrapped in DDP)::

    python -m ddplab.workers.step_profile --checkpoint
    python -m ddplab.workers.step_profile --layers 8 --checkpoint 2
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.step_profile --trace-dir traces

The model is ``--layers`` blocks of ``Linear(width, width)`` + GELU and a ``Linear(width, 10)``
head, trained with Adam on a random batch of ``--batch-size``. After ``--warmup`` steps, one step
runs under ``torch.profiler.profile(profile_memory=True)``, its phases marked with
``record_function("forward" | "backward" | "step")``. The profiler counts, for each phase, the
bytes the CPU allocator handed out minus those given back: for ``forward`` that is what autograd
keeps for backward (the activations). With ``--checkpoint`` every block runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: forward keeps each block's input and,
by default (``preserve_rng_state=True``), the CPU generator's state (``torch.get_rng_state()``,
a uint8 tensor of ``torch.get_rng_state().numel()`` bytes) so that a random op in the block
draws the same numbers when backward computes the block again. ``--checkpoint K`` checkpoints
only blocks 0, K, 2K, ... (the others run plainly).
Then ``--timed`` more steps run without the profiler, timed phase by phase; with
``--checkpoint`` each is followed by a step with no block checkpointed, so that the two are timed
alternately in one process, on the same weights, under the same load.

Events (every rank): metric ``bytes``: ``parameters``, ``gradients`` and ``optimizer_state``
(Adam's two moments and step counts), ``moments`` (the two moments alone) and ``tensors`` (how
many parameter tensors), counted from the tensors themselves; metric ``profiled``:
bytes kept at the end of each phase (``forward``, ``backward``, ``step``), from the profiler, and
each phase's median milliseconds over the timed steps (``forward_ms``, ...; with
``--checkpoint`` also ``plain_forward_ms``, ... of the steps without it); metric ``trace``:
the Chrome trace file this rank wrote under ``--trace-dir`` (or None), which names every
all-reduce DDP ran (``gloo:all_reduce``) beside the ``backward`` span.

Lesson: 09b.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

from ddplab import dist, events

PHASES = ("forward", "backward", "step")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.step_profile",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="blocks of Linear(width, width) + GELU")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=256, help="per process")
    p.add_argument("--checkpoint", type=int, nargs="?", const=1, default=0, metavar="EVERY",
                   help="recompute blocks 0, EVERY, 2 EVERY, ... in backward (alone: every block)")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0, help="DDP's bucket size (2+ ranks)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the profiled one")
    p.add_argument("--timed", type=int, default=5, help="steps timed after it (medians)")
    p.add_argument("--trace-dir", help="write this rank's Chrome trace here")
    return p.parse_args(argv)


class Blocks(nn.Module):
    """``layers`` blocks of Linear + GELU, then a 10-way head; every ``recompute``-th block
    checkpointed, from the first (0: none)."""

    def __init__(self, layers: int, width: int, recompute: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU())
                                    for _ in range(layers))
        self.head = nn.Linear(width, 10)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            again = self.recompute and i % self.recompute == 0
            x = checkpoint(block, x, use_reentrant=False) if again else block(x)
        return self.head(x)


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def timed_steps(model, optimizer, inputs, labels, steps: int,
                net: Optional[Blocks] = None) -> dict[str, list[float]]:
    """Milliseconds of each phase over ``steps`` more steps, without the profiler.

    With ``net`` (the checkpointed ``Blocks`` inside ``model``), every step is followed by one
    with no block checkpointed, its phases timed as ``plain_forward``, ``plain_backward``, ...
    """
    times: dict[str, list[float]] = {}
    recompute = net.recompute if net is not None else 0
    settings = [("", recompute)] + ([("plain_", 0)] if net is not None else [])
    for _ in range(max(1, steps)):
        for prefix, every in settings:
            if net is not None:
                net.recompute = every
            optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss = F.cross_entropy(model(inputs), labels)
            forward = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            optimizer.step()
            end = time.perf_counter()
            for name, ms in zip(PHASES, (forward - start, backward - forward, end - backward)):
                times.setdefault(prefix + name, []).append(ms * 1000)
    if net is not None:
        net.recompute = recompute
    return times


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Warm up, profile one step, report its memory and write its trace."""
    args = parse_args(argv)
    info = dist.setup(backend="gloo")  # on the CPU: the profiler counts the CPU allocator's bytes
    torch.set_num_threads(1)  # one core per process, as every CPU rank of the course

    # [model]
    torch.manual_seed(0)
    net = Blocks(args.layers, args.width, args.checkpoint)
    model = DDP(net, bucket_cap_mb=args.bucket_cap_mb) if info.world_size > 1 else net
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    inputs = torch.randn(args.batch_size, args.width)
    labels = torch.randint(0, 10, (args.batch_size,))
    # [/model]

    # [profiled-step]
    for step in range(args.warmup + 1):
        optimizer.zero_grad(set_to_none=True)
        if step < args.warmup:
            F.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
            optimizer.state.clear()  # the profiled step allocates Adam's state afresh
            continue
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function("forward"):
                loss = F.cross_entropy(model(inputs), labels)
            with record_function("backward"):
                loss.backward()
            with record_function("step"):
                optimizer.step()
    # [/profiled-step]

    spans = {e.name: e for e in prof.events() if e.name in PHASES}
    profiled = {name: spans[name].cpu_memory_usage for name in PHASES}
    profiled.update({f"{name}_ms": statistics.median(times) for name, times in
                     timed_steps(model, optimizer, inputs, labels, args.timed,
                                         net if args.checkpoint else None).items()})
    state = [(name, t) for s in optimizer.state.values() for name, t in s.items()]
    events.emit("metric", name="bytes", value={
        "parameters": tensor_bytes(net.parameters()),
        "gradients": tensor_bytes(p.grad for p in net.parameters()),
        "optimizer_state": tensor_bytes(t for _, t in state),
        "moments": tensor_bytes(t for name, t in state if name in ("exp_avg", "exp_avg_sq")),
        "tensors": len(list(net.parameters()))})
    events.emit("metric", name="profiled", value=profiled)
    trace = None
    if args.trace_dir:
        trace = str(Path(args.trace_dir) / f"trace_rank{info.rank}.json")
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
    events.emit("metric", name="trace", value=trace)
    dist.cleanup()


if __name__ == "__main__":
    main()
