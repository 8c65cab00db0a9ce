"""Rank 1 misbehaves as asked (raise | exit | refuse | signal | hang); every rank may sys.exit(0) or
os._exit(0) (sysexit0 | osexit0) or sleep. Every rank prints its pid.

A plain torchrun script (no ddplab import), choosing its backend as ddplab does: DDPLAB_BACKEND
when set, else nccl when every local rank has a GPU of its own, else gloo on CPU.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

mode = sys.argv[1]
local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
backend = os.environ.get("DDPLAB_BACKEND") or "auto"
if backend == "auto":
    backend = "nccl" if gpus >= local_world else "gloo"
device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
# Every rank returns from init once all have made their connections (a store barrier): a rank
# that leaves at once (osexit0) must not cut a slower peer's while it still makes them.
os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
dist.init_process_group(backend)
rank = dist.get_rank()
print(f"pid {os.getpid()}", flush=True)
if mode == "sleep":
    time.sleep(600)
if rank == 1:
    if mode == "raise":
        raise ValueError("boom on rank 1")
    if mode == "exit":
        sys.exit(3)
    if mode == "refuse":  # a refusal in words, as argparse or a script's own check does
        print("checking the arguments", file=sys.stderr, flush=True)
        sys.exit("--size 3 does not divide by 2: pick an even size")
    if mode == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        time.sleep(600)
if mode == "sysexit0":
    sys.exit(0)
if mode == "osexit0":
    os._exit(0)
time.sleep(0.2)
value = torch.ones(1, device=device)
dist.all_reduce(value)
print("done", flush=True)
dist.destroy_process_group()
