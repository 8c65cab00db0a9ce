"""A plain mp.spawn script that knows nothing of ddplab, as learners write them.

Run it: ``python tests/scripts/spawn_plain.py [--fail-rank R] [--abort-at-exit R]
[--sleep S] [--backend nccl]``.

The parent prints its arguments and where rank 0 will listen, then spawns as many processes as
``DDPLAB_NPROCS`` says (2 without it); each joins the group, all-reduces its rank + 1 and
prints the sum on a plain line (no rank prefix). ``--fail-rank R``: rank R leaves with exit
code 3 before joining the group. ``--abort-at-exit R``: rank R finishes, then aborts while its
interpreter exits (an atexit handler calls C++'s std::terminate: "terminate called without an
active exception").
``--sleep S``: every rank sleeps S seconds after joining the group (a job to time out).
With ``SPAWN_PLAIN_RUNS_A_PROGRAM=1`` in its environment the parent first runs a short program
of its own (``sleep 0.6``), as ``import torch`` runs ``ldconfig -p``: a child that is no rank.
``SPAWN_PLAIN_START=fork`` (or ``forkserver``) starts the ranks with
``mp.start_processes(..., start_method=...)`` instead.
"""
import argparse
import atexit
import ctypes
import ctypes.util
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world_size: int, fail_rank: int, backend: str, abort_rank: int = -1,
           sleep: float = 0.0) -> None:
    if rank == abort_rank:
        libstdcxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        atexit.register(libstdcxx._ZSt9terminatev)
    if rank == fail_rank:  # before joining: its peers wait at the rendezvous, not in a
        # collective whose broken connection would fail them too, racing it for mp.spawn's report
        print(f"rank {rank} leaves with exit code 3", flush=True)
        sys.exit(3)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    time.sleep(sleep)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"a rank's sum: {total.item():.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--abort-at-exit", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    print(f"argv {sys.argv[1:]}", flush=True)
    print(f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    nprocs = int(os.environ.get("DDPLAB_NPROCS", "2"))
    if os.environ.get("SPAWN_PLAIN_RUNS_A_PROGRAM") == "1":
        subprocess.run(["sleep", "0.6"], check=True)
    mp.start_processes(worker, args=(nprocs, args.fail_rank, args.backend, args.abort_at_exit,
                                     args.sleep), nprocs=nprocs,
                       start_method=os.environ.get("SPAWN_PLAIN_START", "spawn"))
