"""Rank 0 saves a checkpoint while every other rank loads it: with a barrier, and without.

Run it (2 processes; add ``--no-barrier`` to see the race)::

    python -m ddplab launch --nproc-per-node 2 ddplab.workers.barrier_demo --checkpoint-dir ckpt
    python -m ddplab launch --nproc-per-node 2 ddplab.workers.barrier_demo --checkpoint-dir ckpt \
        --no-barrier

Rank 0 needs ``--delay`` seconds before it writes (a big model on a busy disk). Without the
barrier the other ranks reach ``torch.load`` before rank 0 has written the file. ``--keep``
leaves the file in the folder after the run, and ``--epoch`` sets the epoch stamped in it. So
that the race is lost every time, on any machine however busy, rank 0 of the barrier-less run
also waits until every other rank has read the file (a marker file each leaves once it has
loaded) or the job has failed: no clock decides the outcome.

Every rank emits one ``metric`` event named ``loaded`` with the ``epoch`` stamped in the file
it read and the ``checksum`` of its weights before and after loading.

Lesson: 05.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Optional, Sequence

import torch

from ddplab import checkpoint, dist, events, models


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m ddplab.workers.barrier_demo",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, help="folder of checkpoint.pt")
    p.add_argument("--no-barrier", action="store_true", help="leave out both barriers (bug)")
    p.add_argument("--delay", type=float, default=2.0, help="seconds rank 0 takes to save")
    p.add_argument("--epoch", type=int, default=1, help="the epoch stamped in the checkpoint")
    p.add_argument("--keep", action="store_true", help="leave the file for the next run")
    return p.parse_args(argv)


def checksum(model: torch.nn.Module) -> float:
    """Sum of all weights in float64: equal weights give equal sums."""
    return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def _marker(folder: str, rank: int) -> str:
    """The file rank ``rank`` leaves once it has loaded (named per job: a stale one never
    counts)."""
    job = f"{os.environ.get('MASTER_ADDR', '')}-{os.environ.get('MASTER_PORT', '')}"
    return os.path.join(folder, f".read-by-rank-{rank}-{job}")


def mark_read(folder: str, rank: int) -> None:
    """Tell rank 0 (waiting in ``wait_for_readers``) that this rank has loaded the checkpoint."""
    with open(_marker(folder, rank), "w"):
        pass


def wait_for_readers(folder: str, world_size: int, limit_s: float = 600.0) -> None:
    """Rank 0 of the barrier-less run: wait until every other rank has loaded (its marker).

    A rank that finds no file fails instead, and the launcher then ends this rank too; the limit
    is only a safety net for a run started outside a launcher.
    """
    markers = [_marker(folder, rank) for rank in range(1, world_size)]
    deadline = time.monotonic() + limit_s
    while not all(os.path.exists(m) for m in markers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 waited {limit_s:.0f} s for the other ranks to load "
                               f"{folder}/checkpoint.pt; they never did and never failed")
        time.sleep(0.02)
    for marker in markers:
        os.remove(marker)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Save on rank 0, load on every rank, delete on rank 0; return what this rank loaded."""
    args = parse_args(argv)
    info = dist.setup()
    barrier = not args.no_barrier
    path = os.path.join(args.checkpoint_dir, "checkpoint.pt")
    torch.manual_seed(100 * args.epoch + info.rank)  # weights differ per rank and per epoch
    model = models.build_model("cnn").to(info.device)
    before = checksum(model)
    if info.is_main and not barrier:
        wait_for_readers(args.checkpoint_dir, info.world_size)  # the race, lost every time

    # [save]
    if info.is_main:
        time.sleep(args.delay)  # a slow save: a large model, a busy disk
        state = {"model": model.state_dict(), "epoch": args.epoch}
        checkpoint.atomic_save(state, path)  # temp file + rename: never a half file
    if barrier:
        dist.barrier()  # 1. nobody reads before rank 0 has finished writing
    # [/save]

    # [load]
    state = torch.load(path, map_location=info.device, weights_only=True)
    model.load_state_dict(state["model"])
    # [/load]
    if not barrier and not info.is_main:
        mark_read(args.checkpoint_dir, info.rank)
    report = events.emit("metric", name="loaded", epoch=state["epoch"], before=before,
                         checksum=checksum(model))
    print(f"rank {info.rank} loaded the checkpoint of epoch {state['epoch']}", flush=True)

    # [cleanup]
    if barrier:
        dist.barrier()  # 2. nobody deletes the file while another rank may still read it
    if info.is_main and not args.keep:
        os.remove(path)
    # [/cleanup]
    dist.cleanup()
    return report


if __name__ == "__main__":
    main()
