"""Prints whether this worker could use CUDA: torch's bad-fork flag and CUDA's initialisation.

Run by tests on every launch path: `cuda False False` is the only good answer (forked after
nothing touched CUDA, and nothing initialised it). Under the spawn engine the script calls
mp.spawn itself and every spawned child prints the same line.
"""
import os
import sys

import torch


def report(rank: int) -> None:
    print(f"cuda {torch.cuda._is_in_bad_fork()} {torch.cuda.is_initialized()} rank {rank}",
          flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["spawn"]:  # the spawn engine passes the script's arguments unchanged
        import torch.multiprocessing as mp

        mp.spawn(report, nprocs=int(os.environ.get("DDPLAB_NPROCS", "2")))
    else:
        report(int(os.environ["RANK"]))
