"""Run the five basic collectives on real processes and report every rank's tensors.

Run it::

    torchrun --nproc-per-node 4 -m ddplab.workers.collectives
    python -m ddplab launch --nproc-per-node 4 ddplab.workers.collectives

Rank r starts from ``x_r = [10r, 10r + 1, ..., 10r + n - 1]`` (n = world size), so every
result can be checked by hand. For each collective every rank emits one ``collective`` event:
``name``, ``rank``, ``before`` and ``after`` (lists of numbers); reduce_scatter also says
``via`` which torch call did it (see ``has_list_reduce_scatter``). The barrier reports
``arrived`` and ``left`` (seconds since a common start): rank r arrives r x ``--stagger``
seconds late, and nobody leaves before the last one arrived.

Point to point (``p2p`` events, seconds since a common start), on a gloo group of CPU tensors
on every machine: rank 0 sends one message to the last rank with the blocking ``send``/``recv``
after ``--stagger`` seconds of work; the last rank answers with ``isend``, ``--stagger``
seconds later, into rank 0's ``irecv``. Rank 0 reports ``sent``, ``posted`` (when ``irecv``
returned), ``done`` (when its ``wait()`` did) and ``reply``; the last rank ``received`` (when
``recv`` returned) and ``message``; both say the group's ``backend``.

A naive ring step (``naive`` events): every rank calls the blocking ``send`` to its right
neighbour, then ``recv`` from its left, a ``--naive-numel``-element tensor, on a gloo group
whose timeout is ``--naive-timeout`` seconds. On gloo a send waits until its receiver has
posted the receive, whatever the size, so every rank waits in its send: ``timed_out`` (True),
``waited`` (seconds). Then the same step posted together with ``batch_isend_irecv``:
``received`` (what the left neighbour sent, its rank) and ``took`` (seconds).

Lesson: 08.
"""

from __future__ import annotations

import argparse
import datetime
import re
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
    p.add_argument("--naive-numel", type=int, default=1,
                   help="elements of the naive ring step's message")
    p.add_argument("--naive-timeout", type=float, default=2.0,
                   help="seconds the naive ring step's gloo group waits before it gives up")
    return p.parse_args(argv)


def start_tensor(rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s input: ``[10 rank, 10 rank + 1, ..., 10 rank + world_size - 1]``."""
    return torch.arange(world_size, dtype=torch.float32, device=device) + 10.0 * rank


def report(name: str, before: torch.Tensor, after: Any, **extra: Any) -> None:
    """Emit one ``collective`` event for this rank (``extra`` adds fields, e.g. ``via``)."""
    if isinstance(after, (list, tuple)):
        after = torch.cat([t.reshape(-1) for t in after])
    events.emit("collective", name=name, before=before.tolist(), after=after.tolist(), **extra)


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

    mine = torch.empty(1, device=x.device)         # rank r gets the sum of everyone's chunk r
    if has_list_reduce_scatter():
        torch_dist.reduce_scatter(mine, list(x.chunk(n)))
        report("reduce_scatter", x, mine, via="reduce_scatter")
    else:                                           # gloo before torch 2.8: the one-tensor form
        torch_dist.reduce_scatter_tensor(mine, x)
        report("reduce_scatter", x, mine, via="reduce_scatter_tensor")
    # [/collectives]


# The first torch release whose gloo backend has the list form of reduce_scatter (2.6 and 2.7
# raise "ProcessGroupGloo does not support reduce_scatter"); nccl has always had it.
GLOO_REDUCE_SCATTER_SINCE = (2, 8)


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor), e.g. (2, 6) for ``2.6.0+cu124``."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


def has_list_reduce_scatter() -> bool:
    """True when the group's backend has ``reduce_scatter`` with a list of chunks.

    gloo has it since torch 2.8; before, the same collective runs as ``reduce_scatter_tensor``
    (the chunks back to back in one tensor), which gloo has on every torch we support. nccl has
    both everywhere.

    Lesson: 08.
    """
    return torch_dist.get_backend() != "gloo" or torch_release() >= GLOO_REDUCE_SCATTER_SINCE


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


def run_point_to_point(info: dist.DistInfo, delay: float) -> None:
    """One message from rank 0 to the last rank, blocking; the answer back, non-blocking.

    Runs on a gloo group of its own (CPU tensors) on every machine: gloo's ``wait()`` holds the
    calling thread until the message is out or in, so the times it reports are the messages'.
    NCCL's ``wait()`` would only make the GPU's stream wait, and the CPU clock would see nothing.

    Lesson: 08.
    """
    last = info.world_size - 1
    # [p2p]
    p2p = torch_dist.new_group(backend="gloo")      # on GPUs too: gloo's wait() holds the CPU
    torch_dist.barrier(group=p2p)                   # a common start, one clock
    start = time.time()
    if info.rank == 0:
        time.sleep(delay)                                   # busy a moment before it sends
        torch_dist.send(torch.tensor([3.0, 1.0, 4.0]), dst=last, group=p2p)
        sent = time.time() - start                          # send (gloo): once it was taken
        reply = torch.zeros(3)
        request = torch_dist.irecv(reply, src=last, group=p2p)  # returns a request at once ...
        posted = time.time() - start
        request.wait()                                      # ... the wait is here
        done = time.time() - start
        events.emit("p2p", sent=sent, posted=posted, done=done, reply=reply.tolist(),
                    backend=torch_dist.get_backend(p2p))
    elif info.rank == last:
        message = torch.zeros(3)
        torch_dist.recv(message, src=0, group=p2p)          # recv (gloo): returns once it arrived
        received = time.time() - start
        time.sleep(delay)
        answer = 2 * message
        request = torch_dist.isend(answer, dst=0, group=p2p)    # leave `answer` alone ...
        request.wait()                                      # ... until wait() returns
        events.emit("p2p", received=received, message=message.tolist(),
                    backend=torch_dist.get_backend(p2p))
    # [/p2p]


def run_naive_ring(info: dist.DistInfo, numel: int, timeout: float) -> None:
    """Blocking send, then recv, on every rank at once: it times out; then the batched step.

    Runs on a gloo group of its own (CPU tensors, any machine) with a short timeout, so the
    wait ends in ``timeout`` seconds; that group is not used again.

    Lesson: 08.
    """
    n = info.world_size
    right, left = (info.rank + 1) % n, (info.rank - 1) % n
    naive = torch_dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    message, incoming = torch.full((numel,), float(info.rank)), torch.zeros(numel)
    start = time.time()
    # [naive]
    try:
        torch_dist.send(message, dst=right, group=naive)     # every rank sends first ...
        torch_dist.recv(incoming, src=left, group=naive)     # ... and would receive after
        timed_out = False
    except RuntimeError:                                     # the group's timeout ran out
        timed_out = True
    # [/naive]
    waited = time.time() - start
    start = time.time()                                      # the same step, posted together
    message, incoming = message.to(info.device), incoming.to(info.device)
    ops = [torch_dist.P2POp(torch_dist.isend, message, right),
           torch_dist.P2POp(torch_dist.irecv, incoming, left)]
    for request in torch_dist.batch_isend_irecv(ops):
        request.wait()
    events.emit("naive", numel=numel, timeout=timeout, timed_out=timed_out, waited=waited,
                received=incoming[0].item(), took=time.time() - start)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Join the group, run every collective, run the barrier, leave."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("collectives need at least 2 processes: launch with --nproc-per-node 4")
    run_collectives(info)
    run_barrier(info, args.stagger)
    run_point_to_point(info, args.stagger)
    run_naive_ring(info, args.naive_numel, args.naive_timeout)
    dist.print0(f"ran broadcast, all_reduce, all_gather, reduce_scatter, barrier, send/recv and "
                f"isend/irecv on "
                f"{info.world_size} processes ({info.backend})")
    dist.cleanup()


if __name__ == "__main__":
    main()
