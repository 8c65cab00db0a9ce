"""A plain mp.spawn script that knows nothing of ddplab, as learners write them.

Run it: ``python tests/scripts/spawn_plain.py [--fail-rank R] [--backend nccl]``.

The parent prints its arguments and where rank 0 will listen, then spawns as many processes as
``DDPLAB_NPROCS`` says (2 without it); each joins the group, all-reduces its rank + 1 and
prints the sum on a plain line (no rank prefix). Rank R leaves with exit code 3 instead.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world_size: int, fail_rank: int, backend: str) -> None:
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    if rank == fail_rank:
        print(f"rank {rank} leaves with exit code 3", flush=True)
        sys.exit(3)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"a rank's sum: {total.item():.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    print(f"argv {sys.argv[1:]}", flush=True)
    print(f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    nprocs = int(os.environ.get("DDPLAB_NPROCS", "2"))
    mp.spawn(worker, args=(nprocs, args.fail_rank, args.backend), nprocs=nprocs)
