"""Judges of the coding exercises of lessons 03 (DDP), 04 (DistributedSampler) and 05 (checkpoints).

03 reads every rank's weight checksum after the learner's block and after training
(``exercises/ddp_wrap.py``): DDP makes them equal on every rank, and training changes them.

04 reads which indices every rank read in every epoch (``exercises/sampler.py``): the shares of
one epoch are disjoint apart from the sampler's padding and together cover the dataset, and
every epoch comes in a new order.

05 reads who wrote the checkpoint and what every rank loaded (``exercises/checkpoint.py``): one
writer, rank 0, once per save; every rank loaded the epoch just saved, onto its own device,
and the learner's ``load`` puts tensors on whatever device it is given.

Lessons: 03, 04, 05.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from . import judge, metric, metrics


def _ranks(result: Any) -> set[int]:
    return set(range(result.world_size)) if result.world_size else {0}


def _missing(result: Any, *names: str) -> Optional[str]:
    """A hint when a fact was not reported by every rank, else None."""
    for name in names:
        if set(metric(result, name)) != _ranks(result):
            return (f"the run did not report {name!r} from every rank: the reporting lines of "
                    "the file must run unchanged (restore them from the skeleton if you edited "
                    "them).")
    return None


# ----------------------------------------------------------------------------- 03 DDP


@judge("03", "ddp_wrap.py", "wrap the model in DistributedDataParallel so that every rank "
       "ends with the same weights")
def judge_ddp_wrap(result: Any) -> Optional[str]:
    missing = _missing(result, "start", "end")
    if missing:
        return missing
    start, end = metric(result, "start"), metric(result, "end")
    if len(_ranks(result)) < 2:
        return "launch at least 2 processes: with one, there is nothing to keep in step."
    if len(set(end.values())) > 1:
        if len(set(start.values())) > 1:
            return ("the ranks started from different weights and ended with different "
                    f"weights (checksums at the end: {_listing(end)}): nothing connected them. "
                    "At the TODO, move the model to `device` and wrap it, `model = DDP(model, "
                    "device_ids=...)`: DDP copies rank 0's weights to every rank when it wraps "
                    "the model and averages the gradients in backward().")
        return ("the ranks started equal but drifted apart during training (checksums at the "
                f"end: {_listing(end)}): their gradients were not averaged. Copying the weights "
                "once is not enough; wrap the model in DDP at the TODO, so that every "
                "backward() all-reduces the gradients.")
    if all(math.isclose(start[r], end[r], rel_tol=0, abs_tol=0) for r in start):
        return ("the weights did not change during training: keep the loop as it is and "
                "let the optimizer step the wrapped model's parameters.")
    return None


def _listing(values: dict[int, Any]) -> str:
    return ", ".join(f"rank {rank}: {value:.6f}" for rank, value in sorted(values.items()))


# ----------------------------------------------------------------------------- 04 sampler


@judge("04", "sampler.py", "give every rank its own share of the data with a "
       "DistributedSampler, in a new order every epoch (set_epoch)")
def judge_sampler(result: Any) -> Optional[str]:
    missing = _missing(result, "dataset", "read")
    if missing:
        return missing
    size = next(iter(metric(result, "dataset").values()))
    reads = {rank: {e["epoch"]: e["value"] for e in _events(result, "read", rank)}
             for rank in _ranks(result)}
    world = len(reads)
    epochs = sorted(reads[0])
    per_rank = math.ceil(size / world)
    for epoch in epochs:
        shares = [reads[rank][epoch] for rank in sorted(reads)]
        hint = _share_hint(shares, size, per_rank, epoch)
        if hint:
            return hint
    for rank in sorted(reads):
        orders = [tuple(reads[rank][epoch]) for epoch in epochs]
        if len(epochs) > 1 and len(set(orders)) == 1:
            head = list(orders[0][:size // world])   # the padding at the end starts over
            if head == sorted(head):
                return ("every rank reads its share in index order: the sampler does not "
                        "shuffle. Leave DistributedSampler's shuffle=True (its default).")
            return (f"rank {rank} read its share in the same order in every epoch: call "
                    "sampler.set_epoch(epoch) at the start of each epoch (TODO 2); the "
                    "sampler seeds its shuffle with seed + epoch, and the epoch stays 0 "
                    "until you set it.")
    return None


def _events(result: Any, name: str, rank: int) -> list[dict[str, Any]]:
    return [e for e in result.events.get(rank, [])
            if e.get("kind") == "metric" and e.get("name") == name]


def _share_hint(shares: list[list[int]], size: int, per_rank: int, epoch: int
                ) -> Optional[str]:
    """What is wrong with one epoch's shares (one list of indices per rank), or None."""
    world = len(shares)
    if all(len(share) == size for share in shares) and world > 1:
        return (f"in epoch {epoch} every rank read all {size} samples: the ranks do the same "
                "work N times. Build a DistributedSampler(train_set) and pass it to the "
                "DataLoader as sampler= instead of shuffle=True (TODO 1).")
    if any(len(share) != per_rank for share in shares):
        return (f"in epoch {epoch} the ranks read {[len(s) for s in shares]} samples; with "
                f"{size} samples on {world} ranks each should read ceil({size} / {world}) = "
                f"{per_rank}. Let DistributedSampler take num_replicas and rank from the "
                "process group (or pass the world size and this rank).")
    read = [i for share in shares for i in share]
    overlap = len(read) - len(set(read))
    padding = per_rank * world - size
    if set(read) != set(range(size)) or overlap > padding:
        return (f"in epoch {epoch} the ranks' shares overlap ({overlap} indices read twice, "
                f"only {padding} would be padding) and {size - len(set(read))} samples were "
                "read by nobody: every rank must build its sampler with the same seed, and "
                "its own rank.")
    return None


# ----------------------------------------------------------------------------- 05 checkpoint


@judge("05", "checkpoint.py", "save the checkpoint once, on rank 0, behind a barrier, and load "
       "it with map_location onto each rank's own device")
def judge_checkpoint(result: Any) -> Optional[str]:
    missing = _missing(result, "loaded")
    if missing:
        return missing
    loaded = {rank: [e for e in _events(result, "loaded", rank)] for rank in _ranks(result)}
    saves = len(loaded[0])
    writers = {rank: len(values) for rank, values in metrics(result, "wrote").items()}
    if set(writers) - {0}:
        others = ", ".join(str(r) for r in sorted(set(writers) - {0}))
        return (f"rank(s) {others} wrote the checkpoint too: every rank holds the same weights, "
                "so the same file was written once per rank. In save() (TODO 1), call "
                "write_file only on rank 0 (`if rank == 0:`), then dist.barrier() on every "
                "rank.")
    if writers.get(0, 0) != saves:
        return (f"rank 0 wrote {writers.get(0, 0)} checkpoint(s) for {saves} saves: in save() "
                "(TODO 1), rank 0 must call write_file(state, path) every time.")
    for rank in sorted(loaded):
        for event in loaded[rank]:
            if event.get("epoch") != event.get("expected"):
                found = ("found no file at all" if event.get("epoch") is None
                         else f"loaded the old checkpoint of epoch {event['epoch']}")
                return (f"rank {rank} {found} while rank 0 was still writing epoch "
                        f"{event['expected']}: it read too early. In save() (TODO 1), call "
                        "dist.barrier() on every rank after rank 0's write_file, so no rank "
                        "returns (and reads) before the file is complete.")
    for rank in sorted(loaded):
        for event in loaded[rank]:
            if event.get("devices") != [event.get("device")]:
                return (f"rank {rank}'s tensors landed on {', '.join(event['devices'])}, not on "
                        f"its own device {event['device']}: in load() (TODO 2), pass "
                        "map_location=device to torch.load.")
    probes = metrics(result, "probe")
    if any(value != ["meta"] for values in probes.values() for value in values):
        return ("load() ignores the device it is given: asked for the 'meta' device, it "
                "returned tensors on the device they were saved from. On a GPU every rank would "
                "load onto rank 0's GPU. In load() (TODO 2), pass map_location=device to "
                "torch.load.")
    return None
