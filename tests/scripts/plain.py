"""A torchrun-style script that knows nothing of ddplab: reads the env, all-reduces, prints."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert int(os.environ["LOCAL_RANK"]) == rank % int(os.environ["LOCAL_WORLD_SIZE"])
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank} of {world}: sum {total.item():.0f}")
dist.destroy_process_group()
