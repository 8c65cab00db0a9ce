"""The training worker with benchmark-only variations (bench_ddp_cpu.py --ablation).

- ``DDPLAB_DDP_OPTIONS``: extra DistributedDataParallel keyword arguments as JSON,
  e.g. '{"static_graph": true}'.
- ``DDPLAB_BENCH_CORE``: keep this process on that one core (for the pinned independent pair).

Every command-line flag goes to ``ddplab.workers.train`` unchanged.
"""
import json
import os
import sys

from torch import nn

OPTIONS = json.loads(os.environ.get("DDPLAB_DDP_OPTIONS", "{}"))


class TunedDDP(nn.parallel.DistributedDataParallel):
    """DDP whose constructor adds OPTIONS (a subclass, so unwrapping still recognises it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, **OPTIONS})


if OPTIONS:
    nn.parallel.DistributedDataParallel = TunedDDP
if os.environ.get("DDPLAB_BENCH_CORE"):
    os.sched_setaffinity(0, {int(os.environ["DDPLAB_BENCH_CORE"])})

from ddplab.workers import train  # noqa: E402  (after the patch: wrap_model looks DDP up late)

train.main(sys.argv[1:])
