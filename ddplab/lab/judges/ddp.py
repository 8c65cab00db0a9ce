"""Judges of the coding exercises of lessons 03 (DDP), 04 (DistributedSampler) and 05 (checkpoints).

03 reads every rank's weight checksum before and after the learner's ``train``, how its
forward passes ran and the sampler's epoch at each pass (``exercises/ddp_wrap.py``): DDP makes
the weights equal on every rank, training changes them, and every epoch calls ``set_epoch``; a
rank that wrapped the model but called the unwrapped one is told so, and so is a run that
copied rank 0's weights by hand without any DDP wrapper.

04 reads which indices every rank read in every epoch (``exercises/sampler.py``), whatever
sampler read them: in one epoch no sample is read twice (no padding), every rank reads as many,
fewer samples than ranks are left out and not the same ones every epoch, and every epoch comes
in a new order.

05 reads who wrote the checkpoint, what every rank loaded and what ``resume`` restored
(``exercises/checkpoint.py``): one writer, rank 0, once per save; every rank loaded the epoch
just saved, onto its own device or the CPU, also from a file saved on a GPU it does not have
(any ``map_location`` that does this passes); a fresh model and optimizer resumed from the file
equal the trained ones, and the epoch to start from is the one saved.

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


@judge("03", "ddp_wrap.py", "write the DDP training loop, so that ranks that start from "
       "different weights train as one and end with the same weights")
def judge_ddp_wrap(result: Any) -> Optional[str]:
    missing = _missing(result, "start", "end", "forwards", "sampler_epochs")
    if missing:
        return missing
    start, end = metric(result, "start"), metric(result, "end")
    forwards = metric(result, "forwards")
    if len(_ranks(result)) < 2:
        return "launch at least 2 processes: with one, there is nothing to keep in step."
    through = {rank: f.get("through_ddp", 0) for rank, f in forwards.items()}
    direct = {rank: f.get("direct", 0) for rank, f in forwards.items()}
    if all(through[r] == 0 and direct[r] == 0 for r in forwards):
        return ("the model never ran a forward pass: train() must train it for `epochs` epochs "
                "over the loader (TODO).")
    wrapped = {rank: _wrapped(result, rank) for rank in forwards}
    if not any(wrapped.values()) and _equal_at_first_forward(result):
        return _by_hand(end)
    if any(direct[r] > 0 for r in direct) and len(set(end.values())) > 1:
        rank = min(r for r in direct if direct[r] > 0)
        if through[rank] == 0 and wrapped[rank]:
            return (f"you wrapped the model in DDP but trained the unwrapped one: on rank {rank} "
                    f"all {direct[rank]} forward passes called the model itself, none went "
                    "through the DDP wrapper, so no gradient was all-reduced and the ranks "
                    f"drifted apart (checksums at the end: {_listing(end)}). DDP averages the "
                    "gradients of a backward() only after a forward pass through the wrapper: "
                    "call the wrapper in the loop (its parameters are the model's, so the "
                    "optimizer may take either's).")
        if through[rank] > 0:
            return (f"on rank {rank}, {direct[rank]} forward passes bypassed the DDP wrapper "
                    f"and {through[rank]} went through it; the ranks drifted apart (checksums "
                    f"at the end: {_listing(end)}). Every training forward pass must go "
                    "through the wrapper.")
    if len(set(end.values())) > 1:
        return ("the ranks ended with different weights (checksums at the end: "
                f"{_listing(end)}): nothing connected them. Ranks that start apart train as "
                "one only through the docstring's DistributedDataParallel, which copies rank "
                "0's weights to every rank when it wraps the model and averages the gradients "
                "in every backward() of a forward pass through it.")
    if all(math.isclose(start[r], end[r], rel_tol=0, abs_tol=0) for r in start):
        return ("the weights did not change during training: train() must step an optimizer "
                "over the model's parameters after every backward() (TODO).")
    epochs = metric(result, "sampler_epochs")
    rank = min(epochs)
    if len(set(epochs[rank])) < len(epochs[rank]):
        return (f"every epoch read the data in the same order: on rank {rank} the sampler's "
                f"epoch was {epochs[rank]} at the start of each pass over the loader. Start "
                "each epoch with sampler.set_epoch(epoch), as the docstring says (notebook 04 "
                "shows what it changes).")
    return None


def _wrapped(result: Any, rank: int) -> bool:
    """Whether a DDP wrapper of the model existed on ``rank``: the one ``train()`` returned,
    one still in memory after it, or one alive at the first forward pass."""
    first = metric(result, "forwards").get(rank, {}).get("wrapper_at_first")
    return bool(metric(result, "wrapped").get(rank)) or bool(first)


def _equal_at_first_forward(result: Any) -> bool:
    """Whether ranks that built different weights held equal ones at their first forward."""
    firsts = {r: f.get("first_checksum") for r, f in metric(result, "forwards").items()}
    return len(set(metric(result, "start").values())) > 1 and None not in firsts.values() \
        and len(set(firsts.values())) == 1


def _by_hand(end: dict[int, Any]) -> str:
    """The hint for ranks made equal without any DDP wrapper (weights copied by hand)."""
    if len(set(end.values())) == 1:
        return ("no DistributedDataParallel wrapper of the model existed: every rank held the "
                "same weights at its first forward pass although each built its own, and the "
                "ranks ended equal, so your own code copied or averaged them, not DDP. This "
                "exercise is about the wrapper: wrap the model in DistributedDataParallel and "
                "train the wrapper; it copies rank 0's weights when it wraps and averages the "
                "gradients in every backward().")
    after = ("then every rank stepped on its own gradients and the ranks drifted apart "
             f"(checksums at the end: {_listing(end)})")
    return ("no DistributedDataParallel wrapper of the model existed: every rank held the same "
            "weights at its first forward pass although each built its own, so rank 0's "
            f"weights were copied to the others by hand (a broadcast), {after}. Copying the "
            "weights at the start is only half of what DDP does; the other half averages the "
            "gradients in every backward(). Wrap the model in DistributedDataParallel and train "
            "the wrapper.")


def _listing(values: dict[int, Any]) -> str:
    return ", ".join(f"rank {rank}: {value:.6f}" for rank, value in sorted(values.items()))


# ----------------------------------------------------------------------------- 03b no_sync

ACCUMULATE_FACTS = ("steps", "micro_batches", "optimizer_steps", "allreduce_bytes",
                    "gradient_bytes", "reference_error", "checksum")
#: Largest weight difference from the one-process run that still counts as equal (float64).
ACCUMULATE_TOLERANCE = 1e-9


@judge("03b", "accumulate.py", "accumulate gradients over micro-batches in DDP with one "
       "all-reduce per step (no_sync), equal to one process's step on all the data")
def judge_accumulate(result: Any) -> Optional[str]:
    missing = _missing(result, *ACCUMULATE_FACTS)
    if missing:
        return missing
    facts = {name: metric(result, name) for name in ACCUMULATE_FACTS}
    for rank in sorted(_ranks(result)):
        f = {name: values[rank] for name, values in facts.items()}
        hint = _accumulate_rank(rank, f)
        if hint:
            return hint
    checksums = facts["checksum"]
    if len(set(checksums.values())) > 1:
        return ("the ranks ended with different weights: the all-reduce of a step did not "
                "send the sum of every micro-batch's gradients, and what a backward adds after "
                "it stays on its own rank.")
    error = max(facts["reference_error"].values())
    if error > ACCUMULATE_TOLERANCE:
        return (f"the weights differ from one process's step on all the data (by up to "
                f"{error:.2g}): the accumulated gradient must be the mean over the "
                "micro-batches, not their sum (look at what each backward adds to .grad).")
    return None


def _accumulate_rank(rank: int, f: dict[str, Any]) -> Optional[str]:
    steps, micro = f["steps"], f["micro_batches"]
    if f["optimizer_steps"] != steps:
        return (f"rank {rank} stepped the optimizer {f['optimizer_steps']} times in {steps} "
                "accumulation steps; the docstring asks for one step per call of "
                "accumulation_step, at the end (TODO).")
    syncs = f["allreduce_bytes"] / f["gradient_bytes"] if f["gradient_bytes"] else 0
    if syncs == 0:
        return (f"rank {rank} never all-reduced a gradient: every backward ran inside "
                "no_sync(), so each rank stepped on its own gradients. Once per step the "
                "gradients must be all-reduced.")
    if math.isclose(syncs, steps * micro):
        return (f"rank {rank} all-reduced the gradients {micro} times per step, once per "
                "micro-batch: every backward() of a DDP model all-reduces unless it runs "
                "inside model.no_sync(), and once per step is enough.")
    if not math.isclose(syncs, steps):
        return (f"rank {rank} all-reduced {syncs / steps:g} times the gradients' size per "
                "step; one all-reduce of every gradient per step is enough.")
    return None


# ----------------------------------------------------------------------------- 04 sampler


@judge("04", "sampler.py", "shard every epoch over the ranks: each sample read at most once, "
       "the same number on every rank, a different few left out and a new order every epoch")
def judge_sampler(result: Any) -> Optional[str]:
    missing = _missing(result, "dataset", "read")
    if missing:
        return missing
    size = next(iter(metric(result, "dataset").values()))
    reads = {rank: {e["epoch"]: e["value"] for e in _events(result, "read", rank)}
             for rank in _ranks(result)}
    epochs = sorted(reads[0])
    for epoch in epochs:
        hint = _share_hint([reads[rank].get(epoch, []) for rank in sorted(reads)], size, epoch)
        if hint:
            return hint
    return _order_hint(reads, epochs) or _left_out_hint(reads, epochs, size)


def _events(result: Any, name: str, rank: int) -> list[dict[str, Any]]:
    return [e for e in result.events.get(rank, [])
            if e.get("kind") == "metric" and e.get("name") == name]


def _share_hint(shares: list[list[int]], size: int, epoch: int) -> Optional[str]:
    """What is wrong with one epoch's shares (one list of indices per rank), or None."""
    world, counts = len(shares), [len(share) for share in shares]
    if world > 1 and all(count == size for count in counts):
        return (f"in epoch {epoch} every rank read all {size} samples: the ranks do the same "
                "work N times. Every rank must read a share of its own, no sample twice in an "
                "epoch (TODO 1, goal 1 of the docstring).")
    read = [i for share in shares for i in share]
    twice = len(read) - len(set(read))
    if 0 < twice < world and set(read) == set(range(size)):   # fewer repeats than ranks
        return (f"in epoch {epoch} {twice} sample(s) were read twice: that is padding, the "
                "repeats DistributedSampler adds by default (drop_last=False) so that the shares "
                "come out equal. Here every sample counts once per epoch: leave the remainder "
                f"out instead ({size} % {world} = {size % world} sample(s) per epoch).")
    if twice:
        return (f"in epoch {epoch} the ranks' shares overlap: {twice} of the {len(read)} "
                "indices read were read already (by another rank, or by the same one). "
                "Every rank must cut its share from the same order (the same seed on every "
                "rank), each rank its own part of it.")
    if len(set(counts)) > 1:
        return (f"in epoch {epoch} the ranks read {counts} samples: every rank must read the "
                "same number, or the rank with an extra batch waits in an all-reduce that its "
                f"peers never join, until the group's timeout. With {size} samples on {world} "
                f"ranks that is {size} // {world} = {size // world} each.")
    unread = size - len(set(read))
    if unread >= world:
        return (f"in epoch {epoch} {unread} samples were read by nobody; only what does not "
                f"divide may be left out, fewer than the {world} ranks ({size} % {world} = "
                f"{size % world}). A DataLoader's drop_last=True, for one, drops each rank's "
                "last incomplete batch, not the dataset's remainder.")
    return None


def _order_hint(reads: dict[int, dict[int, list[int]]], epochs: list[int]) -> Optional[str]:
    """The hint when a rank read two epochs in the same order, or None."""
    for rank in sorted(reads):
        orders = [tuple(reads[rank][epoch]) for epoch in epochs]
        if len(set(orders)) == len(orders):
            continue
        if all(list(order) == sorted(order) for order in orders):
            return (f"rank {rank} reads its share in index order: nothing shuffles it. Shuffle "
                    "in the sampler (DistributedSampler's shuffle=True, its default, or a "
                    "permutation in a sampler of your own).")
        same = next((a, b) for a in epochs for b in epochs
                    if a < b and reads[rank][a] == reads[rank][b])
        when = ("in every epoch" if len(set(orders)) == 1
                else f"in epochs {same[0]} and {same[1]}")
        return (f"rank {rank} read its share in the same order {when}: the shuffle must change "
                "with the epoch (TODO 2, goal 4), and the sampler does not know which epoch "
                "this is unless the loop tells it (notebook 04, section 5).")
    return None


def _left_out_hint(reads: dict[int, dict[int, list[int]]], epochs: list[int], size: int
                   ) -> Optional[str]:
    """The hint when the same samples were left out of every epoch, or None."""
    left = {frozenset(range(size)) - {i for r in reads for i in reads[r][e]} for e in epochs}
    if len(epochs) < 2 or len(left) > 1 or not next(iter(left)):
        return None
    out = sorted(next(iter(left)))
    return (f"the same {len(out)} sample(s) {out[:8]} were left out in every epoch: they are "
            "never trained on. Cut the remainder from each epoch's shuffled order, not from "
            "the dataset before shuffling, so that a different few wait each epoch.")


# ----------------------------------------------------------------------------- 05 checkpoint


@judge("05", "checkpoint.py", "save the checkpoint once, from rank 0, with no rank reading it "
       "early; load it onto each rank's own device; resume a fresh model and optimizer from it")
def judge_checkpoint(result: Any) -> Optional[str]:
    missing = _missing(result, "loaded", "resumed")
    if missing:
        return missing
    return (_writers_hint(result) or _loaded_hint(result) or _probe_hint(result)
            or _resume_hint(result))


def _writers_hint(result: Any) -> Optional[str]:
    saves = len(_events(result, "loaded", 0))
    writers = {rank: len(values) for rank, values in metrics(result, "wrote").items()}
    if set(writers) - {0}:
        others = ", ".join(str(r) for r in sorted(set(writers) - {0}))
        return (f"rank(s) {others} wrote the checkpoint too: every rank holds the same weights, "
                "so the same file was written once per rank. One copy per save is the "
                "requirement (save()'s docstring, TODO 1): rank 0's.")
    if writers.get(0, 0) != saves:
        loaded = [e for r in _ranks(result) for e in _events(result, "loaded", r)]
        if not writers and loaded and all(e.get("epoch") == e.get("expected") for e in loaded):
            return ("the checkpoint was written, but not with write_file, the writer save()'s "
                    "docstring requires (TODO 1): it writes a temporary file and renames it, so "
                    "that no rank ever reads half a file, and it tells the judge who wrote.")
        return (f"rank 0 wrote {writers.get(0, 0)} checkpoint(s) for {saves} saves: every "
                "save must leave exactly one checkpoint, rank 0's (save()'s docstring, TODO 1).")
    return None


def _loaded_hint(result: Any) -> Optional[str]:
    for rank in sorted(_ranks(result)):
        for event in _events(result, "loaded", rank):
            if event.get("epoch") == event.get("expected"):
                continue
            if event.get("error") not in (None, "no checkpoint"):
                return (f"load() returned a {event['error']} on rank {rank}, not the "
                        "checkpoint: it must return the dict the file holds (TODO 2).")
            if event.get("epoch") is None and event.get("error") == "no checkpoint" and \
                    any(e.get("epoch") is None for e in _events(result, "loaded", 0)):
                return ("load() returned nothing (None) on rank 0, where the file surely "
                        "exists: it must return the checkpoint it read (TODO 2).")
            found = ("found no file at all" if event.get("epoch") is None
                     else f"loaded the old checkpoint of epoch {event['epoch']}")
            return (f"rank {rank} {found} while rank 0 was still writing epoch "
                    f"{event['expected']}: it read too early. No rank may return from save() "
                    "before rank 0's file is complete (save()'s docstring, TODO 1; notebook "
                    "05 shows how ranks wait for one another).")
    for rank in sorted(_ranks(result)):
        for event in _events(result, "loaded", rank):
            if not set(event.get("devices", [])) <= {event.get("device"), "cpu"}:
                return (f"rank {rank}'s tensors landed on {', '.join(event['devices'])}, not on "
                        f"its own device {event['device']}: load() must put them on the device "
                        "it is given, whatever device saved them (TODO 2).")
    return None


def _probe_hint(result: Any) -> Optional[str]:
    for rank, values in sorted(metrics(result, "probe").items()):
        for value in values:
            error = value.get("error")
            devices = value.get("devices", [])
            device = next(e.get("device") for e in _events(result, "loaded", rank))
            if error is None and set(devices) <= {device, "cpu"}:
                continue
            what = f"it failed ({error})" if error else f"its tensors landed on {devices}"
            return (f"given a checkpoint saved on a GPU that rank {rank} does not have, load() "
                    f"did not bring it to {device}: {what}. Unless told otherwise, reading a "
                    "checkpoint puts every tensor back on the device that saved it: on a GPU "
                    "machine every rank would load onto rank 0's GPU, and on a machine without "
                    "that GPU the load fails. load() must put the tensors on the device it is "
                    "given (TODO 2; notebook 05 on where a load puts them).")
    return None


def _resume_hint(result: Any) -> Optional[str]:
    for rank, values in sorted(metrics(result, "resumed").items()):
        for facts in values:
            if facts["when"] == "start" and facts["epoch"] != 0:
                return (f"rank {rank}: with no checkpoint yet, resume() returned "
                        f"{facts['epoch']!r}; it should return 0 (start from the first epoch) "
                        "and leave the model as it is (TODO 3).")
            if facts["when"] != "restart":
                continue
            if facts["epoch"] != facts["expected"]:
                return (f"rank {rank}: after 2 saved epochs, resume() returned "
                        f"{facts['epoch']!r}, not 2: return the epoch stored in the checkpoint, "
                        "so that training goes on with the next one (TODO 3).")
            if not facts.get("weights"):
                return (f"rank {rank}: after resume() the fresh model's weights differ from "
                        "the trained ones: resume() must restore the model from the checkpoint "
                        "(TODO 3).")
            if not facts.get("optimizer"):
                return (f"rank {rank}: resume() restored the weights but not the optimizer: "
                        "SGD's momentum buffers start from zero again, so the resumed run "
                        "differs from an uninterrupted one. resume() must restore the "
                        "optimizer's state too (TODO 3).")
    return None
