"""A torchrun-style script that knows nothing of ddplab: reads the env, all-reduces, prints.

The backend is chosen as a script of one's own would (and as ddplab does): DDPLAB_BACKEND when
set (``ddplab.launch(backend=...)`` passes it), else nccl when every local rank has a GPU of its
own, else gloo on CPU.
"""
import os

import torch
import torch.distributed as dist

local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
backend = os.environ.get("DDPLAB_BACKEND") or "auto"
if backend == "auto":
    backend = "nccl" if gpus >= local_world else "gloo"
device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(backend)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert local_rank == rank % local_world
total = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(total)
print(f"rank {rank} of {world}: sum {total.item():.0f}")
dist.destroy_process_group()
