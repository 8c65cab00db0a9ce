"""Keep each CPU rank of a DDP job on cores of its own (Linux; a no-op elsewhere and on GPUs).

Worker side. A worker that wants it calls it once, right after joining the process group::

    info = dist.setup()
    pin_cpu_rank(info)        # CPU ranks only; DDPLAB_PIN_CPU=0 turns it off

Why, and when it does nothing: see ``pin_cpu_rank``.

Lesson: 09 (how fast DDP runs on CPUs).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Optional

import torch

from ddplab import dist


def cpu_cores_for(local_rank: int, local_world_size: int, threads: int,
                  available: Iterable[int]) -> Optional[list[int]]:
    """Return the cores a CPU rank should keep to, or None to leave placement to the OS.

    Rank ``r`` gets the ``threads`` cores ``r * threads ... (r + 1) * threads - 1`` of the
    ``available`` ones, when every rank of the node fits on cores of its own; otherwise (more
    threads than cores, or a single rank) None.

    Lesson: 09.
    """
    cores = sorted(available)
    if local_world_size < 2 or threads < 1 or local_world_size * threads > len(cores):
        return None
    return cores[local_rank * threads:(local_rank + 1) * threads]


def ranks_pinned(nprocs: int, gpus: int = 0) -> bool:
    """Would ``pin_cpu_rank`` pin the CPU ranks of an ``nprocs``-process launch on this machine?

    Lesson: 09 (the canonical script beside the table's worker, which pins).
    """
    return bool(not gpus and nprocs >= 2 and hasattr(os, "sched_getaffinity")
                and os.environ.get("DDPLAB_PIN_CPU", "1") != "0"
                and cpu_cores_for(0, nprocs, 1, os.sched_getaffinity(0)) is not None)


def pin_cpu_rank(info: dist.DistInfo) -> Optional[list[int]]:
    """Keep this CPU rank (every thread of it) on cores of its own; return them, or None.

    Why: DDP ranks wake each other at every gradient all-reduce, and Linux tends to move a
    woken process next to the one that woke it, so on a busy 2-core machine both ranks often
    share one core while the other core runs someone else's work. Measured with one other busy
    process (benchmarks/RESULTS.md): DDP at 0.67x of two independent processes unpinned, 0.91x
    pinned; on a quiet machine it makes no difference. Only CPU ranks are pinned, only when the
    whole world is on this machine (torchrun's ``LOCAL_WORLD_SIZE`` equals the world size:
    fake "nodes" on one machine would share local ranks) and its ranks fit on separate cores.
    ``DDPLAB_PIN_CPU=0`` turns it off.

    Lesson: 09.
    """
    if (info.device.type != "cpu" or info.world_size < 2 or not hasattr(os, "sched_setaffinity")
            or os.environ.get("DDPLAB_PIN_CPU", "1") == "0"
            or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) != info.world_size):
        return None
    cores = cpu_cores_for(info.local_rank, info.world_size, torch.get_num_threads(),
                          os.sched_getaffinity(0))
    if cores is None:
        return None
    # Every thread that exists now (gloo's included); threads started later inherit it.
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cores)
    return cores
