"""What the sharding lessons share: FSDP2's ``fully_shard``, whether it runs here, the bytes a
rank holds, and the collectives a block of code runs.

Worker side, torch imports only. ``ddplab.workers.sharding`` (11), ``distributed_checkpoint``
(11) and ``tensor_parallel`` (12) use it.

Example::

    from ddplab.sharded import collectives, local_bytes
    with collectives() as sent:
        loss = model(x).sum(); loss.backward()
    print(local_bytes(model.parameters()), sent)      # e.g. 4820 {'allgather': 4, ...}

Lessons: 11, 12.
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from torch.distributed.fsdp import fully_shard  # public since torch 2.6, the floor

__all__ = ["collectives", "fsdp_problem", "fully_shard", "local_bytes", "optimizer_bytes"]


def fsdp_problem(device: torch.device) -> Optional[str]:
    """Why ``fully_shard`` cannot run here, or None when it can.

    FSDP2 synchronises through device streams; CPU streams gained the methods it calls in
    torch 2.7 (pytorch/pytorch#145935), so on torch 2.6 it runs on GPUs only.
    """
    if device.type == "cpu" and torch.__version__ < "2.7":
        return (f"fully_shard on the CPU needs torch >= 2.7 (this is {torch.__version__}); "
                "on GPUs it works from 2.6. Upgrade torch to run the FSDP modes here.")
    return None


# [measure]
def local_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes this rank stores for ``tensors``: of a sharded tensor (DTensor), its own shard."""
    total = 0
    for t in tensors:
        if t is not None:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state this rank holds (Adam: exp_avg, exp_avg_sq, step)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return local_bytes(v for state in local.state.values() for v in state.values()
                       if torch.is_tensor(v))
# [/measure]


@contextmanager
def collectives() -> Iterator[dict[str, int]]:
    """Count the collectives run inside the block, by name (``allreduce``, ``allgather``, ...).

    Uses ``torch.distributed.tensor.debug.CommDebugMode``; the counts stay empty on a torch
    without it.
    """
    counts: dict[str, int] = {}
    try:
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:
        yield counts
        return
    with CommDebugMode() as mode, warnings.catch_warnings():
        # Under this debugging mode FSDP2 sees its outputs as views and warns about in-place
        # changes to them, which this loop never makes.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        yield counts
    for op, n in mode.get_comm_counts().items():
        name = re.sub(r"^_+|_+$|_base", "", str(op).split(".")[-1])
        counts[name] = counts.get(name, 0) + n
