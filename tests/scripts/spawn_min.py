"""A minimal mp.spawn script: python spawn_min.py --nprocs 2 [--fail-rank R]."""
import argparse

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddplab.dist import cleanup, setup


def worker(rank: int, world_size: int, fail_rank: int) -> None:
    info = setup(rank=rank, world_size=world_size)
    if rank == fail_rank:
        raise ValueError(f"spawned rank {rank} fails on purpose")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"sum={total.item()}")
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--fail-rank", type=int, default=-1)
    ns = parser.parse_args()
    mp.spawn(worker, args=(ns.nprocs, ns.fail_rank), nprocs=ns.nprocs)
