"""Rank 0 closes its stdout (``os.close(1)``) and goes on; both ranks then all-reduce.

Run it: ``torchrun --nproc-per-node 2 tests/scripts/closes_stdout.py``. A closed stdout is the
script's business: it is no failure, and rank 1 must not be stopped for it.
"""
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} starts", flush=True)
if rank == 0:
    sys.stdout.flush()
    os.close(1)
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} sum {total.item():.0f}", file=sys.stderr, flush=True)
dist.destroy_process_group()
