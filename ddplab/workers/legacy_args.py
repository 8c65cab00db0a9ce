"""A worker started by the deprecated ``torch.distributed.launch``, whose local rank is an argument.

Run it with the old launcher, with torchrun, or through ddplab (all three work)::

    python -m torch.distributed.launch --nproc-per-node 2 ddplab/workers/legacy_args.py
    torchrun --standalone --nproc-per-node 2 ddplab/workers/legacy_args.py
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.legacy_args

``torch.distributed.launch`` appends ``--local-rank=N`` to the script's arguments (with a
dash since torch 2.0; ``--local_rank=N`` before), torchrun appends nothing and sets
``LOCAL_RANK``. One source's script declares only ``--local_rank``: that parser, kept here as
``parse_args_as_the_source``, rejects what the launcher passes today. Run the script with
``LEGACY_PARSER=source`` in the environment to use it; every rank then exits with
``error: unrecognized arguments: --local-rank=0`` (or 1, ...). ``parse_args`` is the fix.

Every rank emits one ``metric`` event named ``local_rank`` with the value it parsed, the
``LOCAL_RANK`` variable it saw, and the sum of all ranks (an all_reduce: the group works).

Lesson: 07.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

import torch
import torch.distributed as torch_dist

from ddplab import dist, events


# [source-parser]
def parse_args_as_the_source(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The parser as one source writes it: only the underscore spelling is declared."""
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args(argv)
# [/source-parser]


# [fixed-parser]
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Accept both spellings the old launcher has used, and torchrun's LOCAL_RANK."""
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int,
                        default=int(os.environ.get("LOCAL_RANK", "0")))
    return parser.parse_args(argv)
# [/fixed-parser]


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse the local rank, join the group, check it with one all_reduce, report."""
    parse = parse_args_as_the_source if os.environ.get("LEGACY_PARSER") == "source" \
        else parse_args
    args = parse(argv)
    info = dist.setup()
    total = torch.tensor([float(info.rank)], device=info.device)
    if info.world_size > 1:
        torch_dist.all_reduce(total)
    report = events.emit("metric", name="local_rank", value=args.local_rank,
                         env=os.environ.get("LOCAL_RANK"), rank_sum=total.item())
    print(f"rank {info.rank}: --local-rank parsed as {args.local_rank}, LOCAL_RANK="
          f"{os.environ.get('LOCAL_RANK')}", flush=True)
    dist.cleanup()
    return report


if __name__ == "__main__":
    main()
