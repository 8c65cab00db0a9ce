"""The training worker with benchmark-only variations (bench_ddp_cpu.py).

- ``DDPLAB_DDP_OPTIONS``: extra DistributedDataParallel keyword arguments as JSON,
  e.g. '{"static_graph": true}'.
- ``DDPLAB_BENCH_CORE``: keep this process on that one core (for the pinned independent pair).
- ``DDPLAB_BENCH_STATS=1``: before leaving, each rank emits a ``metric`` event named
  ``ddp_stats``: DDP's own timings (forward, backward compute, backward communication, in ns,
  averaged over its sampled steps) and how much of the training time this rank's main thread
  spent on a core (the rest it waited: for the other rank, or for a core).

Every command-line flag goes to ``ddplab.workers.train`` unchanged.
"""
import json
import os
import sys
import time

from torch import nn

from ddplab import dist, events, train

OPTIONS = json.loads(os.environ.get("DDPLAB_DDP_OPTIONS", "{}"))
STATS = os.environ.get("DDPLAB_BENCH_STATS") == "1"
WRAPPED: list[nn.Module] = []
BUSY = {"cpu": 0.0, "wall": 0.0}


class TunedDDP(nn.parallel.DistributedDataParallel):
    """DDP whose constructor adds OPTIONS (a subclass, so unwrapping still recognises it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, **OPTIONS})
        WRAPPED.append(self)


def timed_train_epoch(*args, _train_epoch=train.train_epoch, **kwargs):
    """``train.train_epoch``, adding up this thread's CPU time and the wall time it took."""
    cpu, wall = time.thread_time(), time.perf_counter()
    result = _train_epoch(*args, **kwargs)
    BUSY["cpu"] += time.thread_time() - cpu
    BUSY["wall"] += time.perf_counter() - wall
    return result


def emit_stats(_cleanup=dist.cleanup):
    """Emit this rank's DDP timings, then leave the process group as the worker would."""
    if WRAPPED:
        data = WRAPPED[0]._get_ddp_logging_data()
        events.emit("metric", name="ddp_stats", cpu_s=BUSY["cpu"], train_s=BUSY["wall"],
                    **{k: data.get(k) for k in ("avg_forward_compute_time",
                                                "avg_backward_compute_time",
                                                "avg_backward_comm_time")})
    _cleanup()


if OPTIONS or STATS:
    nn.parallel.DistributedDataParallel = TunedDDP
if STATS:
    train.train_epoch = timed_train_epoch  # fit_epoch looks it up at call time
    dist.cleanup = emit_stats
if os.environ.get("DDPLAB_BENCH_CORE"):
    os.sched_setaffinity(0, {int(os.environ["DDPLAB_BENCH_CORE"])})

from ddplab.workers import train as worker  # noqa: E402  (after the patches: looked up late)

worker.main(sys.argv[1:])
