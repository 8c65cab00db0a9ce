"""Exercise 10, reference solution: uneven inputs finish, DDP and the loss log joined.

Run it from notebook 10 (about 5 s; as it stands each collective times out after
``--pg-timeout`` seconds), or from the repository root::

    python -m ddplab launch --nproc-per-node 2 exercises/uneven_join.py --pg-timeout 3
    torchrun --standalone --nproc-per-node 2 exercises/uneven_join.py --pg-timeout 3

and hand the launch's result to the judge: ``ddplab.check("10", result)``.

Every rank trains on its own shard of the data, and the shards are uneven, as when each rank
reads its own files: rank r gets ``4 + (world_size - 1 - r)`` batches, so rank 0 has the most.
After every step the ranks add up their losses (``summed_over_ranks``) for the job's running
mean loss, which rank 0 prints. As it stands, the job hangs once rank 1 runs out of batches.

The fixed part reports what happened (``metric`` events): every rank's ``batches``, its batch
``losses``, which of its batches each forward ran on (``inputs``), the ``mean_loss`` its
``train()`` returned, its final weights' ``checksum``, and ``error`` (with the line it was on)
if a collective timed out.

Lesson: 10.
"""

from __future__ import annotations

import argparse
import traceback

import torch
import torch.distributed as torch_dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import dist, events
from ddplab.lab.answers.running_loss import RunningLoss  # a joinable loss log (notebook 10)


def uneven_batches(rank: int, world_size: int, batch_size: int = 16) -> list[tuple]:
    """This rank's shard: ``4 + (world_size - 1 - rank)`` batches of random regression data."""
    generator = torch.Generator().manual_seed(100 + rank)
    count = 4 + (world_size - 1 - rank)
    return [(torch.randn(batch_size, 8, generator=generator),
             torch.randn(batch_size, 1, generator=generator)) for _ in range(count)]


def summed_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    """``[sum of this step's loss over the ranks, number of ranks that trained a batch]``."""
    both = torch.stack([loss.detach(), torch.ones_like(loss)])
    torch_dist.all_reduce(both)
    return both.cpu()


def train(model: nn.Module, optimizer: torch.optim.Optimizer,
          batches: list[tuple]) -> tuple[list[float], float]:
    """Train on every batch of this rank's shard; return this rank's batch losses and the mean
    loss over every batch of every rank."""
    losses: list[float] = []
    running = RunningLoss(next(model.parameters()).device)
    with Join([model, running]):  # a rank out of batches answers DDP's and the log's collectives
        for inputs, targets in batches:
            loss = F.mse_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            losses.append(loss.item())
            running.add(loss)  # the log: every rank's loss of this step
            total = running.total
            dist.print0(f"step {len(losses)}: mean loss so far {float(total[0] / total[1]):.4f}")
    return losses, float(running.total[0] / running.total[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pg-timeout", type=float, default=30.0,
                        help="seconds a collective waits before it fails")
    args = parser.parse_args()

    # setup: gloo on CPUs, nccl on GPUs; a short timeout turns a hang into an error
    info = dist.setup(timeout_s=args.pg_timeout)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(nn.Linear(8, 1).to(info.device), device_ids=info.device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(x.to(info.device), y.to(info.device))
               for x, y in uneven_batches(info.rank, info.world_size)]
    events.emit("metric", name="batches", value=len(batches))
    inputs: list[int] = []  # the index of the batch each forward ran on (-1: none of them)

    def ran_on(module: nn.Module, args: tuple) -> None:
        inputs.append(next((i for i, (x, _) in enumerate(batches)
                            if x.shape == args[0].shape and torch.equal(x, args[0])), -1))
    model.module.register_forward_pre_hook(ran_on)

    # the training, then the report; a timed-out collective is reported, not raised, so that
    # the judge can explain what happened
    try:
        losses, mean_loss = train(model, optimizer, batches)
        events.emit("metric", name="losses", value=losses)
        events.emit("metric", name="inputs", value=inputs)
        events.emit("metric", name="mean_loss", value=mean_loss)
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
        events.emit("metric", name="checksum", value=checksum)
        dist.print0(f"mean loss over every batch of every rank: {mean_loss:.4f}")
        torch_dist.barrier()  # every rank is done before anyone leaves
    except RuntimeError as error:
        frames = traceback.extract_tb(error.__traceback__)
        here = ([f for f in frames if f.filename == __file__] or frames)[-1]  # this file's line
        events.emit("metric", name="error", value={
            "line": here.lineno, "function": here.name, "code": here.line,
            "message": str(error).splitlines()[0]})
        print(f"rank {info.rank}: a collective failed at line {here.lineno} ({here.line}): "
              f"{error}", flush=True)
        return  # the group is broken: leave without the cleanup's collectives
    dist.cleanup()


if __name__ == "__main__":
    main()
