"""Does its work, then rank 1 aborts while the interpreter exits, as a process group's leftover
threads can make it do: an ``atexit`` handler calls C++'s ``std::terminate`` ("terminate
called without an active exception", SIGABRT).

Run it: ``torchrun --nproc-per-node 2 tests/scripts/exit_abort.py``.
"""
import atexit
import ctypes
import ctypes.util

import torch
import torch.distributed as dist

from ddplab import events

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.ones(1)
dist.all_reduce(total)
events.emit("metric", name="sum", value=total.item())
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
if rank == 1:
    libstdcxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    atexit.register(libstdcxx._ZSt9terminatev)
