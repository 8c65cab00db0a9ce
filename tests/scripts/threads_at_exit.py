"""Runs a ddplab worker, then reports the threads still running in each rank as it is about to
exit (a ``metric`` event named ``threads_at_exit``): a process group that outlives
``destroy_process_group()`` shows as gloo's threads (``pt_gloo_runloop``, ``gloo_tcp_loop``)
and its store's (``pt_tcpstore_uv``), which can abort the interpreter's exit.

Run it::

    python tests/scripts/threads_at_exit.py spawn --epochs 1          # spawn_ddp's ranks
    torchrun --nproc-per-node 2 tests/scripts/threads_at_exit.py train --epochs 1
"""
import gc
import os
import sys

import torch.multiprocessing as mp

from ddplab import events


def threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            pass
    return sorted(names)


def report(rank: int) -> None:
    gc.collect()
    events.emit("metric", rank=rank, name="threads_at_exit", value=threads())


def spawned(rank: int, world_size: int, args) -> None:
    from ddplab.workers import spawn_ddp

    spawn_ddp.main(rank, world_size, args)
    report(rank)


if __name__ == "__main__":
    which, argv = sys.argv[1], sys.argv[2:]
    if which == "spawn":
        from ddplab.workers import spawn_ddp

        args = spawn_ddp.parse_args(argv)
        mp.spawn(spawned, args=(args.nprocs, args), nprocs=args.nprocs)
    else:
        from ddplab.workers import train

        train.main(argv)
        report(int(os.environ.get("RANK", "0")))
