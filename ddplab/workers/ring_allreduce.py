"""Ring all-reduce written from scratch with isend/irecv, checked and timed against dist.all_reduce.

Run it::

    torchrun --nproc-per-node 4 -m ddplab.workers.ring_allreduce              # check only
    torchrun --nproc-per-node 2 -m ddplab.workers.ring_allreduce --bench      # + bandwidth
    python -m ddplab launch --nproc-per-node 4 ddplab.workers.ring_allreduce

What it reports (events):

- ``compare`` (every rank, one per size): ``numel``, ``ring_error`` and ``ps_error``, the max
  absolute difference from ``dist.all_reduce`` on the same random tensor, for sizes that do and
  do not divide by the world size (``--sizes``).
- ``ring_steps`` (every rank): ``held``, after each of the ring's ``2 (n - 1)`` steps, how many
  ranks' numbers each chunk holds (all start with ones; one element per chunk).
- ``traffic`` (every rank, one per algorithm): ``algorithm`` (ring or parameter_server),
  ``message_bytes``, ``bytes_sent``, ``bytes_received`` and ``peers`` (the ranks it talked to).
- ``bandwidth`` (rank 0, with ``--bench``; one per algorithm and size): ``algorithm`` (ring or
  all_reduce), ``bytes``, ``seconds`` (median over ``--repeats`` after ``--warmup`` runs, of
  the slowest rank; the two algorithms take turns, so a busy moment hits both), ``best`` (the
  fastest of those runs: noise only adds time, so it is the fairest measure of fixed costs),
  ``times`` (every run), ``algbw`` and ``busbw`` in bytes/s, busbw = 2(n-1)/n x bytes / seconds.

Lesson: 08.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as torch_dist

from ddplab import dist, events


@dataclass
class Traffic:
    """What one rank sent and received, and to whom it talked."""

    bytes_sent: int = 0
    bytes_received: int = 0
    peers: set[int] = field(default_factory=set)

    def count(self, sent: torch.Tensor, to: int, received: torch.Tensor, source: int) -> None:
        self.bytes_sent += sent.numel() * sent.element_size()
        self.bytes_received += received.numel() * received.element_size()
        self.peers.update({to, source} if received.numel() else {to})


def exchange(send: torch.Tensor, to: int, recv: torch.Tensor, source: int,
             traffic: Optional[Traffic] = None) -> None:
    """Send ``send`` to rank ``to`` while receiving into ``recv`` from rank ``source``.

    Both directions are posted together (``batch_isend_irecv``), so no rank waits for its
    neighbour to finish sending first; with NCCL, posting them one by one could deadlock.
    Empty chunks (tensors smaller than the world) are skipped on both sides alike.
    """
    ops = []
    if send.numel():
        ops.append(torch_dist.P2POp(torch_dist.isend, send, to))
    if recv.numel():
        ops.append(torch_dist.P2POp(torch_dist.irecv, recv, source))
    for request in torch_dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    if traffic is not None:
        traffic.count(send, to, recv, source)


# [ring]
def ring_allreduce(tensor: torch.Tensor, traffic: Optional[Traffic] = None,
                   watch: Optional[Callable[[list[torch.Tensor]], None]] = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, talking only to the two ring neighbours.

    The tensor is cut into ``world_size`` chunks (``tensor_split``: sizes differ by at most one
    element, so any size works). Phase 1, reduce-scatter: in each of ``n - 1`` steps every rank
    passes one chunk to its right neighbour and adds the chunk arriving from its left; after
    that, rank r holds the complete sum of chunk ``(r + 1) % n``. Phase 2, all-gather: ``n - 1``
    more steps pass the finished chunks around the ring. Each rank sends ``2 (n - 1)`` chunks
    of ``1/n`` of the tensor: ``2 (n - 1) / n`` times its size, whatever ``n`` is. ``watch``,
    if given, sees the chunks after every step.

    Lesson: 08.
    """
    rank, n = torch_dist.get_rank(), torch_dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(torch.tensor_split(tensor.view(-1), n))  # views: updates land in ``tensor``

    for step in range(n - 1):  # phase 1: reduce-scatter
        send, into = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[into])
        exchange(chunks[send], right, incoming, left, traffic)
        chunks[into] += incoming
        if watch:
            watch(chunks)  # for the notebook's table: what each rank holds now

    for step in range(n - 1):  # phase 2: all-gather
        send, into = (rank + 1 - step) % n, (rank - step) % n
        exchange(chunks[send], right, chunks[into], left, traffic)
        if watch:
            watch(chunks)  # for the notebook's table: what each rank holds now
    return tensor
# [/ring]


# [parameter-server]
def parameter_server_allreduce(tensor: torch.Tensor,
                               traffic: Optional[Traffic] = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks through rank 0, the "server": gather, add, send back.

    The server receives ``n - 1`` whole tensors and sends ``n - 1`` back, so its link carries
    ``2 (n - 1)`` times the tensor while the other ranks carry 2 times: the load concentrates
    on one node and grows with ``n``.

    Lesson: 08.
    """
    rank, n = torch_dist.get_rank(), torch_dist.get_world_size()
    nothing = tensor.new_empty(0)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for worker in range(1, n):
            exchange(nothing, worker, incoming, worker, traffic)
            tensor += incoming
        for worker in range(1, n):
            exchange(tensor, worker, nothing, worker, traffic)
    else:
        exchange(tensor, 0, nothing, 0, traffic)
        exchange(nothing, 0, tensor, 0, traffic)
    return tensor
# [/parameter-server]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.ring_allreduce",
                                description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 5, 1000, 1001, 4099, 65537],
                   help="tensor sizes (elements) to compare with dist.all_reduce")
    p.add_argument("--traffic-numel", type=int, default=12 * 1024,
                   help="tensor size (elements) whose traffic is counted")
    p.add_argument("--bench", action="store_true", help="measure bus bandwidth too")
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=1 << 22)
    p.add_argument("--factor", type=int, default=4, help="size step of the bandwidth sweep")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def compare(sizes: Sequence[int], info: dist.DistInfo, seed: int) -> None:
    """Emit ``compare`` events: both hand-written all-reduces against ``dist.all_reduce``."""
    for numel in sizes:
        torch.manual_seed(seed + 1000 * numel + info.rank)  # different data on every rank
        x = torch.randn(numel, device=info.device)
        # [compare]
        expected = x.clone()
        torch_dist.all_reduce(expected)
        ring = ring_allreduce(x.clone())
        server = parameter_server_allreduce(x.clone())
        # [/compare]
        events.emit("compare", numel=numel, ring_error=(ring - expected).abs().max().item(),
                    ps_error=(server - expected).abs().max().item())


def count_traffic(numel: int, info: dist.DistInfo) -> None:
    """Emit ``traffic`` events: bytes and peers of each algorithm on one tensor; and
    ``ring_steps``: every rank starts with ones, so after each step of the ring each chunk's
    value counts the ranks whose numbers it holds."""
    held: list[list[int]] = []
    ring_allreduce(torch.ones(info.world_size, device=info.device),
                   watch=lambda chunks: held.append([int(c.sum().item()) for c in chunks]))
    events.emit("ring_steps", held=held)
    for name, algorithm in (("ring", ring_allreduce),
                            ("parameter_server", parameter_server_allreduce)):
        traffic = Traffic()
        algorithm(torch.ones(numel, device=info.device), traffic)
        events.emit("traffic", algorithm=name, message_bytes=numel * 4,
                    bytes_sent=traffic.bytes_sent, bytes_received=traffic.bytes_received,
                    peers=sorted(traffic.peers))


def time_once(op: Callable[[torch.Tensor], object], tensor: torch.Tensor,
              info: dist.DistInfo) -> float:
    """Seconds one all-reduce took on the slowest rank (all start together at a barrier)."""
    torch_dist.barrier()
    dist_sync(info.device)
    start = time.perf_counter()
    op(tensor)
    dist_sync(info.device)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=info.device)
    torch_dist.all_reduce(took, op=torch_dist.ReduceOp.MAX)
    return float(took.item())


def dist_sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Message sizes in bytes: ``min_bytes``, x ``factor``, ... up to ``max_bytes``."""
    sizes, size = [], max(4, min_bytes)
    while size <= max_bytes:
        sizes.append(size)
        size *= max(2, factor)
    return sizes


def bench(args: argparse.Namespace, info: dist.DistInfo) -> None:
    """Emit ``bandwidth`` events (rank 0): median time and bus bandwidth per size and algorithm."""
    n = info.world_size
    # [bandwidth]
    algorithms = {"all_reduce": torch_dist.all_reduce, "ring": ring_allreduce}
    for size in sweep_sizes(args.min_bytes, args.max_bytes, args.factor):
        tensor = torch.ones(size // 4, device=info.device)  # float32: 4 bytes per element
        times = {name: [] for name in algorithms}
        for _ in range(args.warmup + args.repeats):   # take turns: a busy moment hits both
            for name, op in algorithms.items():
                times[name].append(time_once(op, tensor, info))
        for name, measured in times.items():
            measured = measured[args.warmup:]
            seconds = statistics.median(measured)
            algbw = size / seconds                   # bytes of the message per second
            busbw = algbw * 2 * (n - 1) / n          # bytes each link carried per second
            if info.is_main:
                events.emit("bandwidth", algorithm=name, bytes=size, seconds=seconds,
                            best=min(measured), algbw=algbw, busbw=busbw, world_size=n,
                            times=measured)
    # [/bandwidth]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Check both hand-written all-reduces, count their traffic, optionally measure bandwidth."""
    args = parse_args(argv)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("an all-reduce needs at least 2 processes: use --nproc-per-node 4")
    compare(args.sizes, info, args.seed)
    count_traffic(args.traffic_numel, info)
    dist.print0(f"ring and parameter-server all-reduce checked on {info.world_size} processes "
                f"for sizes {args.sizes}")
    if args.bench:
        bench(args, info)
    dist.cleanup()


if __name__ == "__main__":
    main()
