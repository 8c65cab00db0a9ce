"""Rank 0 leaves at once (exit code 0); every other rank waits for it to join the group.

Run it: ``torchrun --nproc-per-node 2 tests/scripts/missing_rank.py`` (it hangs: that is the
point). A launch that times out must keep rank 0's exit code, name the ranks still running,
and show where each one waits: the ``init_process_group`` line below. Each waiting rank emits
the event ``hang`` just before (a launch's ``on_event`` may end it then).
"""
import os
import sys

import torch.distributed as dist

from ddplab import events

print(f"pid {os.getpid()}", flush=True)
if os.environ["RANK"] == "0":
    sys.exit(0)
events.emit("metric", name="hang")
dist.init_process_group("gloo")  # waits for rank 0, which never comes
dist.barrier()
