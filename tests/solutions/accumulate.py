"""Reference solution of exercise 03b (the tests run it; the notebook never shows it).

Exercise 03b: gradient accumulation in DDP, one all-reduce per step. One function to write.

Run it from notebook 03b (about 5 s; a hang is ended after 60 s, and the judge says where each
rank waited), or from the repository root::

    python -m ddplab launch --nproc-per-node 2 --timeout 60 exercises/accumulate.py
    torchrun --standalone --nproc-per-node 2 exercises/accumulate.py

and hand the launch's result to the judge: ``ddplab.check("03b", result)``.

A step that does not fit in memory is split into micro-batches: the gradients of several
backward passes add up in ``.grad``, and the optimizer steps once. With DDP, every
``backward()`` all-reduces the gradients, so K micro-batches would cost K all-reduces where one
is enough: write ``accumulation_step`` from its docstring so that each step communicates once
and still ends with the weights one process would reach on all the data (DDP's documentation
has what you need).

The fixed part counts what DDP all-reduced through a communication hook
(``register_comm_hook``: every bucket of gradients it sends, and its bytes), counts the
optimizer's steps, and trains the same model in one process on every rank's micro-batches
together, to compare the weights (``metric`` events).

Lesson: 03b.
"""

from __future__ import annotations

import copy
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import dist, events

STEPS = 3           # optimizer steps
MICRO_BATCHES = 4   # micro-batches per step and rank
BATCH = 8           # samples per micro-batch


def accumulation_step(model: DDP, optimizer: torch.optim.Optimizer,
                      micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One optimizer step on all of this rank's ``micro_batches``, one backward() per micro-batch.

    What must be true of the run:

    - After the ``STEPS`` calls, the weights equal those of ``one_process`` below: one process
      taking the same steps on the loss it computes over every rank's micro-batches together.
    - DDP all-reduces the gradients once per step, whatever the number of micro-batches.
    - The optimizer steps once per call, at the end, from zero gradients.
    """
    optimizer.zero_grad()
    *first, last = micro_batches
    with model.no_sync():  # gradients add up locally, nothing is sent
        for inputs, targets in first:
            (F.mse_loss(model(inputs), targets) / len(micro_batches)).backward()
    inputs, targets = last
    (F.mse_loss(model(inputs), targets) / len(micro_batches)).backward()  # one all-reduce
    optimizer.step()


def data(rank: int, device: torch.device) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Rank ``rank``'s micro-batches for every step (any rank can make any rank's)."""
    generator = torch.Generator().manual_seed(10 + rank)
    return [[(torch.randn(BATCH, 8, generator=generator, dtype=torch.float64).to(device),
              torch.randn(BATCH, 1, generator=generator, dtype=torch.float64).to(device))
             for _ in range(MICRO_BATCHES)] for _ in range(STEPS)]


def counting_hook(state, bucket):  # no annotations: DDP checks them against real classes
    """DDP's own all-reduce of a bucket of gradients (a ``dist.GradBucket``), counted."""
    state["calls"] += 1
    state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return default_hooks.allreduce_hook(None, bucket)


def one_process(model: nn.Module, everyone: list[list[list[tuple]]], lr: float) -> nn.Module:
    """What one process computes: a step on the mean loss of every rank's micro-batches."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(STEPS):
        optimizer.zero_grad()
        batches = [pair for rank_data in everyone for pair in rank_data[step]]
        loss = sum(F.mse_loss(model(x), y) for x, y in batches) / len(batches)
        loss.backward()
        optimizer.step()
    return model


def main() -> None:
    info = dist.setup()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double().to(info.device)
    start = copy.deepcopy(net)
    model = DDP(net, device_ids=info.device_ids)
    counted = {"calls": 0, "bytes": 0}
    model.register_comm_hook(counted, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer_steps = []
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))

    mine = data(info.rank, info.device)
    for step in range(STEPS):
        accumulation_step(model, optimizer, mine[step])

    reference = one_process(start, [data(r, info.device) for r in range(info.world_size)], 0.1)
    error = max(float((a - b).detach().abs().max()) for a, b in zip(net.parameters(),
                                                                    reference.parameters()))
    gradient_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    checksum = float(sum(p.detach().sum() for p in net.parameters()))
    facts = {"steps": STEPS, "micro_batches": MICRO_BATCHES,
             "optimizer_steps": len(optimizer_steps),
             "allreduce_calls": counted["calls"], "allreduce_bytes": counted["bytes"],
             "gradient_bytes": gradient_bytes, "reference_error": error, "checksum": checksum}
    for name, value in facts.items():
        events.emit("metric", name=name, value=value)
    print(f"rank {info.rank}: {counted['calls']} all-reduces ({counted['bytes']} bytes) in "
          f"{STEPS} steps of {MICRO_BATCHES} micro-batches, {len(optimizer_steps)} optimizer "
          f"steps, largest difference from one process {error:.2e}", flush=True)
    dist.cleanup()


if __name__ == "__main__":
    main()
