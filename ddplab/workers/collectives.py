"""Run the five basic collectives on real processes and report every rank's tensors.

Run it::

    torchrun --nproc-per-node 4 -m ddplab.workers.collectives
    python -m ddplab launch --nproc-per-node 4 ddplab.workers.collectives

Rank r starts from ``x_r = [10r, 10r + 1, ..., 10r + n - 1]`` (n = world size), so every
result can be checked by hand. For each collective every rank emits one ``collective`` event:
``name``, ``rank``, ``before`` and ``after`` (lists of numbers). The barrier reports
``arrived`` and ``left`` (seconds since a common start): rank r arrives r x ``--stagger``
seconds late, and nobody leaves before the last one arrived.

Lesson: 08.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as torch_dist

from ddplab import dist, events


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.collectives",
                                description=__doc__.split("\n")[0])
    p.add_argument("--stagger", type=float, default=0.2,
                   help="seconds between the ranks' arrivals at the barrier")
    return p.parse_args(argv)


def start_tensor(rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s input: ``[10 rank, 10 rank + 1, ..., 10 rank + world_size - 1]``."""
    return torch.arange(world_size, dtype=torch.float32, device=device) + 10.0 * rank


def report(name: str, before: torch.Tensor, after: Any) -> None:
    """Emit one ``collective`` event for this rank."""
    if isinstance(after, (list, tuple)):
        after = torch.cat([t.reshape(-1) for t in after])
    events.emit("collective", name=name, before=before.tolist(), after=after.tolist())


def run_collectives(info: dist.DistInfo) -> None:
    """broadcast, all_reduce, all_gather, reduce_scatter: each on a fresh copy of ``x_rank``.

    Lesson: 08.
    """
    x = start_tensor(info.rank, info.world_size, info.device)
    n = info.world_size
    # [collectives]
    t = x.clone()
    torch_dist.broadcast(t, src=0)                  # everyone gets rank 0's tensor
    report("broadcast", x, t)

    t = x.clone()
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)  # everyone gets the element-wise sum
    report("all_reduce", x, t)

    gathered = [torch.empty_like(x) for _ in range(n)]
    torch_dist.all_gather(gathered, x)              # everyone gets every rank's tensor, in order
    report("all_gather", x, gathered)

    mine = torch.empty(1, device=x.device)
    torch_dist.reduce_scatter(mine, list(x.chunk(n)))  # rank r gets the sum of everyone's chunk r
    report("reduce_scatter", x, mine)
    # [/collectives]


def run_barrier(info: dist.DistInfo, stagger: float) -> None:
    """Arrive at a barrier ``rank x stagger`` seconds late; report arrival and departure times.

    Lesson: 08.
    """
    torch_dist.barrier()                  # a common start ...
    start = time.time()                   # ... and one clock: all ranks are on this machine
    # [barrier]
    time.sleep(info.rank * stagger)       # rank r is busy a little longer than rank r - 1
    arrived = time.time() - start
    torch_dist.barrier()                  # nobody passes until the last rank has arrived
    left = time.time() - start
    # [/barrier]
    events.emit("collective", name="barrier", arrived=arrived, left=left)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Join the group, run every collective, run the barrier, leave."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("collectives need at least 2 processes: launch with --nproc-per-node 4")
    run_collectives(info)
    run_barrier(info, args.stagger)
    dist.print0(f"ran broadcast, all_reduce, all_gather, reduce_scatter and barrier on "
                f"{info.world_size} processes ({info.backend})")
    dist.cleanup()


if __name__ == "__main__":
    main()
