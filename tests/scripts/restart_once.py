"""Fails on its first attempt, succeeds when restarted (elastic restarts).

Run it: ``torchrun --nproc-per-node 2 --max-restarts 1 tests/scripts/restart_once.py``.
Rank 1 exits with code 5 while ``TORCHELASTIC_RESTART_COUNT`` is 0; on a restart every rank
all-reduces and prints the attempt it is in.
"""
import os
import sys

import torch
import torch.distributed as dist

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
rank = dist.get_rank()
if attempt == 0 and rank == 1:
    print("rank 1 fails on attempt 0", flush=True)
    sys.exit(5)
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"attempt {attempt}: rank {rank} sum {total.item():.0f}", flush=True)
dist.destroy_process_group()
