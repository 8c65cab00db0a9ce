"""DDP's buckets, seen from inside: how many all-reduces one backward() makes, and when.

Run it::

    torchrun --standalone --nproc-per-node 2 -m ddplab.workers.buckets
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.buckets --bucket-cap-mb 0.25
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.buckets --bucket-cap-mb default

DDP groups the gradients into buckets of about ``--bucket-cap-mb`` megabytes, in the reverse
order of the parameters (the last layer's gradients are computed first), and all-reduces each
bucket as soon as all of its gradients are ready, while backward goes on computing the earlier
layers' gradients. A communication hook (``register_comm_hook``) sees every bucket DDP sends:
this worker's hook counts them and, at each one, how many of the model's parameters have no
gradient yet (``zero_grad(set_to_none=True)`` empties them before every step), then lets DDP's
own all-reduce run. ``--bucket-cap-mb default`` leaves ``bucket_cap_mb`` unset, DDP's default.

Events (every rank): metric ``buckets`` with ``value``: one entry per bucket of the last step,
in the order DDP sent them: ``index`` (``bucket.index()``), ``parameters`` (how many it holds),
``bytes``, ``largest`` (bytes of its largest gradient), and ``waiting`` (parameters of the
model whose gradient backward had not computed yet when it was sent); metric ``steps``: the
same list for every step; metric ``parameters``: the model's parameter count; metric
``bucket_cap_mb`` (None for DDP's default).

Lesson: 03b.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import dist, events


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.buckets",
                                description=__doc__.split("\n")[0])
    p.add_argument("--bucket-cap-mb", type=_cap, default=0.25,
                   help="DDP's bucket size in MB, or 'default' to leave DDP's own")
    p.add_argument("--layers", type=int, default=6, help="Linear layers of 256 x 256")
    p.add_argument("--steps", type=int, default=3)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train a few steps of an MLP under DDP and report every bucket of the last step."""
    args = parse_args(argv)
    info = dist.setup()
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU())
                          for _ in range(args.layers)]).to(info.device)
    cap = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = DDP(net, device_ids=info.device_ids, **cap)
    parameters = list(net.parameters())
    seen: list[dict[str, Any]] = []
    steps: list[list[dict[str, Any]]] = []

    # [hook]
    def watch(state: Any, bucket):  # no annotations: DDP checks them against real classes
        """Record this bucket, and how many gradients backward still has to compute."""
        seen.append({"index": bucket.index(), "parameters": len(bucket.parameters()),
                     "bytes": bucket.buffer().numel() * bucket.buffer().element_size(),
                     "largest": max(p.numel() * p.element_size() for p in bucket.parameters()),
                     "waiting": sum(p.grad is None for p in parameters)})
        return default_hooks.allreduce_hook(state, bucket)     # DDP's own all-reduce

    model.register_comm_hook(None, watch)
    # [/hook]

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.steps):                  # DDP settles its buckets after the first step
        seen = []
        steps.append(seen)
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(64, 256, device=info.device)
        F.mse_loss(model(x), torch.zeros_like(x)).backward()
        optimizer.step()
    events.emit("metric", name="buckets", value=seen)
    events.emit("metric", name="steps", value=steps)
    events.emit("metric", name="parameters", value=len(parameters))
    events.emit("metric", name="bucket_cap_mb", value=args.bucket_cap_mb)
    dist.print0(f"{len(seen)} buckets in the last backward(); gradients still to compute when "
                f"each was sent: {[b['waiting'] for b in seen]}")
    dist.cleanup()


def _cap(text: str) -> Optional[float]:
    """``--bucket-cap-mb``: a number of MB, or ``default`` (None: DDP's own default)."""
    return None if text == "default" else float(text)


if __name__ == "__main__":
    main()
