"""An mp.spawn script whose rank 1 waits at a barrier rank 0 never reaches (it sleeps).

Run it: ``python tests/scripts/spawn_hang.py`` (it hangs: that is the point). A launch that
times out shows where each rank was: rank 0 in ``time.sleep``, rank 1 in ``dist.barrier()``.
Each rank emits the event ``hang`` just before (a launch's ``on_event`` may end it then).
"""
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from ddplab import events
from ddplab.dist import setup


def worker(rank: int, world_size: int) -> None:
    setup(rank=rank, world_size=world_size)
    events.emit("metric", name="hang", rank=rank)
    if rank == 0:
        time.sleep(600)  # rank 0 is busy elsewhere
    dist.barrier()  # rank 1 waits here


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
