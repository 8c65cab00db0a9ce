"""The capstone's judge on one unbroken run: the ddp run against the reference job, step by
step, and the fsdp run against the ddp run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from .. import metric
from .facts import _accuracy, _args, _close, _other_lr, rank_steps, summed_squares

CLOSE = 1e-3          # the loss and gradients of the first steps, against the reference
WEIGHTS = 0.02        # summed squares of the final weights, same world size, another style
ACCURACY = 0.03


def _load_hint(result: Any) -> Optional[str]:
    for rank, steps in sorted(rank_steps(result).items()):
        for step in sorted(steps):
            for load in steps[step].get("loads") or []:
                if load["map_location"] is None:
                    return (f"rank {rank} read {load['file']} with torch.load and no "
                            "map_location: its tensors go back to the device that saved them "
                            "(rank 0's GPU, for every rank). Load onto this rank's device.")
    return None


def _strategy_hint(result: Any, strategy: str) -> Optional[str]:
    got = _args(result).get("strategy")
    if got != strategy:
        return f"launch it with --strategy {strategy} (it ran with {got})."
    if result.world_size != 2:
        return f"launch it on 2 processes (it ran on {result.world_size})."
    first = min(rank_steps(result).get(0, {0: None}))
    if first != 0:
        return (f"it started at step {first}: an unbroken run starts from nothing, in a "
                "--checkpoint-dir of its own.")
    return None


def _single_hint(result: Any, reference: Any) -> Optional[str]:
    """The first thing in which one unbroken run differs from the reference's, or None."""
    if not reference.ok:
        return f"the reference run failed here ({reference.error}): report this to the course."
    mine, ref = rank_steps(result), rank_steps(reference)
    if set(mine) != set(ref):
        return (f"ranks {sorted(ref)} should report steps; ranks {sorted(mine)} did: every "
                "rank calls log_step.")
    epochs = max(1, int(_args(result).get("epochs", 1)))
    per_epoch = math.ceil(len(ref[0]) / epochs)
    hint = _inputs_hint(mine, ref, "the reference") or _samples_hint(mine, ref, per_epoch)
    if hint:
        return hint
    for rank in sorted(ref):
        if sorted(mine[rank]) != sorted(ref[rank]):
            return (f"rank {rank} reported steps {_span(mine[rank])}, the reference "
                    f"{_span(ref[rank])}: count optimizer steps from 0 over the whole job.")
    for hint in (_autocast_hint(mine, ref), _scaler_hint(mine, ref),
                 _lr_hint(mine, ref, _args(result), result),
                 _loss_hint(mine, ref, result.world_size),
                 _lr_hint(mine, ref, _args(result), result, skipped=True),
                 _save_hint(result, mine), _eval_hint(result, reference)):
        if hint:
            return hint
    return None


def _span(steps: dict[int, Any]) -> str:
    return f"{min(steps)}..{max(steps)}" if steps else "none"


def _samples_hint(mine: dict, ref: dict, per_epoch: int) -> Optional[str]:
    def read(steps: dict[int, Any], first: int, last: int) -> list[float]:
        return [x for s in range(first, last) for x in steps.get(s, {}).get("samples", [])]

    ranks = sorted(ref)
    if mine == {} or all(mine[r].get(s, {}).get("samples") == ref[r][s]["samples"]
                         for r in ranks for s in ref[r]):
        return None
    hint = _epoch_hint(mine, ref, per_epoch)
    if hint:
        return hint
    share = read(ref[0], 0, per_epoch)
    epoch0 = {r: read(mine[r], 0, per_epoch) for r in ranks}
    if len(ranks) > 1 and all(epoch0[r] == epoch0[0] for r in ranks):
        return ("every rank read the same samples in the same order: give each rank its own "
                "share with a DistributedSampler (num_replicas = world size, rank = this rank).")
    if len(ranks) > 1 and len(epoch0[0]) >= 2 * len(share) - len(ranks):
        return (f"rank 0 read {len(epoch0[0])} samples in the first epoch, its share is "
                f"{len(share)}: give the DataLoader the DistributedSampler as sampler=.")
    seen: dict[float, int] = {}
    for r in ranks:
        for x in set(epoch0[r]):
            seen[x] = seen.get(x, 0) + 1
    overlap = sum(1 for n in seen.values() if n > 1)
    if overlap > len(ranks):
        if epoch0[0] == read(ref[0], 0, per_epoch):
            return (f"in the first epoch {overlap} samples were read by more than one rank, "
                    "though rank 0 read its share right: every rank's DistributedSampler must "
                    "use the same seed. With seed + rank, each rank shuffles its own "
                    "permutation and the shares overlap (and other samples are never read).")
        return (f"in the first epoch {overlap} samples were read by more than one rank: the "
                "ranks' shares must not overlap (one DistributedSampler per rank, the same "
                "seed everywhere).")
    if all(epoch0[r] == read(ref[r], 0, per_epoch) for r in ranks):
        for r in ranks:
            if read(mine[r], per_epoch, 2 * per_epoch) == epoch0[r]:
                return (f"rank {r} read its share in the same order in every epoch: point 2 "
                        "wants another order every epoch, and a DistributedSampler knows the "
                        "epoch only when the loop tells it (notebook 04, section 5).")
    return ("the ranks read other samples, or in another order, than the reference: point 2 "
            "wants DistributedSampler's shares, shuffled from --seed, a new order every epoch, "
            "--batch-size samples per rank and step.")


def _epoch_hint(mine: dict, ref: dict, per_epoch: int) -> Optional[str]:
    """Epochs of another length than the reference's (a tail dropped), before any comparison of
    samples that counts on the reference's epochs."""
    pads = ("each rank reads its share of the whole training set, padded to equal length (the "
            "DistributedSampler's drop_last=False), in batches of --batch-size, the last one "
            "short (the DataLoader's drop_last=False)")
    for r in sorted(ref):
        if mine.get(r) and sorted(mine[r]) == list(range(len(mine[r]))) and \
                len(mine[r]) != len(ref[r]):
            return (f"rank {r} reported {len(mine[r])} steps, the reference {len(ref[r])} "
                    f"({per_epoch} an epoch): every epoch {pads}.")
    short = [(r, s) for r in sorted(ref) for s in ref[r]
             if mine[r].get(s, {}).get("samples") != ref[r][s]["samples"]]
    if short and all(s in mine[r] and
                     0 < len(mine[r][s]["samples"]) < len(ref[r][s]["samples"]) and
                     ref[r][s]["samples"][:len(mine[r][s]["samples"])] == mine[r][s]["samples"]
                     for r, s in short):
        r, s = short[0]
        held = len(mine[r][s]["samples"])
        return (f"rank {r}, step {s}: the last batch of the epoch held {held} "
                f"sample{'s' * (held != 1)}, the reference's {len(ref[r][s]['samples'])}: "
                f"every epoch {pads}.")
    return None


def _inputs_hint(mine: dict, ref: dict, whose: str) -> Optional[str]:
    """Inputs that reached the model in another dtype than in ``ref`` (a MixedPrecisionPolicy
    casts them before the model's forward; the data set gives float32)."""
    for rank in sorted(ref):
        for step in sorted(ref[rank]):
            got = mine.get(rank, {}).get(step, {}).get("inputs")
            want = ref[rank][step].get("inputs")
            if got and want and got != want:
                return (f"rank {rank}, step {step}: the model received its inputs in "
                        f"{', '.join(got)}, {whose}'s in {', '.join(want)} (as the data set "
                        "gives them): a MixedPrecisionPolicy (its param_dtype) casts the "
                        "inputs, with the weights, before the model's forward (or the job cast "
                        "them itself). Keep the inputs as they are and run the forward pass and "
                        "the loss under torch.autocast in --amp-dtype, with either strategy.")
    return None


def _autocast_hint(mine: dict, ref: dict) -> Optional[str]:
    for rank in sorted(ref):
        for step in sorted(ref[rank]):
            got, want = mine[rank][step]["autocast"], ref[rank][step]["autocast"]
            if got != want:
                return (f"rank {rank}, step {step}: the forward passes ran with autocast "
                        f"{got}, the reference with {want} (None: no autocast). Compute the "
                        "output and the loss under torch.autocast in --amp-dtype (by "
                        "default bfloat16 on a CPU, float16 on a GPU).")
    return None


def _scaler_hint(mine: dict, ref: dict) -> Optional[str]:
    """A float16 job that never scales its loss (the reference's GradScaler stepped, no
    enabled scaler stepped this job's optimizer)."""
    for rank in sorted(ref):
        scaled = [s for s in ref[rank] if ref[rank][s].get("scaler") is not None]
        if scaled and all(mine[rank][s].get("scaler") is None for s in scaled):
            return (f"rank {rank} trained in float16 without a GradScaler: float16 needs a "
                    "GradScaler (its narrow range rounds small gradients to zero). Scale the "
                    "loss with torch.amp.GradScaler, enabled whenever the dtype is float16.")
    return None


def _lr_hint(mine: dict, ref: dict, args: dict, result: Any, skipped: bool = False
             ) -> Optional[str]:
    """Another LR than the reference's in a step both stepped; with ``skipped``, a step that
    only one of them stepped (the GradScaler skipped it in the other): judged after the losses,
    whose mistakes change where float16 gradients overflow."""
    base, world = args.get("lr"), result.world_size
    for rank in sorted(ref):
        for step in sorted(ref[rank]):
            got, want = mine[rank][step]["lr"], ref[rank][step]["lr"]
            if got == want or _close(got, want, 1e-6):   # None, None: both steps skipped
                continue
            if (got is None or want is None) != skipped:
                continue
            if got is None or want is None:
                return (f"step {step}: {'no' if got is None else 'an'} optimizer step ran "
                        f"before log_step, {'one' if got is None else 'none'} in the "
                        "reference's (a GradScaler skips a step whose float16 gradients "
                        "overflow; the same job overflows in the same steps).")
            said = f"step {step}: the LR was {got:.6g}, it should be {want:.6g}"
            if _close(got, base, 1e-6):
                return (f"{said}: the LR is never scaled nor warmed up (it stays --lr). Set it "
                        "before every optimizer step.")
            if world > 1 and _close(got * world, want, 1e-6):
                return (f"{said}: the LR is not scaled with the world size (the linear "
                        "scaling rule: the global batch is world size times larger).")
            if step == 0 and _close(got, ref[rank][max(ref[rank])]["lr"], 1e-6):
                return (f"{said}: no warm-up; the LR climbs linearly to its peak over "
                        "--warmup-steps steps.")
            return (f"{said}. Count steps over the whole job and warm up over "
                    "--warmup-steps steps to --lr x world size.")
    return None


def _logged_hint(mine: dict, ref: dict) -> Optional[str]:
    """Every rank logged one loss in each of the first steps, the mean (or sum) over the ranks
    of the reference's own losses: the loss was all-reduced before ``log_step``."""
    ranks, first = sorted(ref), sorted(ref[0])[:3]
    if len(ranks) < 2 or not first:
        return None
    for how, combine in (("mean", lambda xs: sum(xs) / len(xs)), ("sum", sum)):
        said = []
        for step in first:
            got = [mine[r][step]["loss"] for r in ranks]
            want = [ref[r][step]["loss"] for r in ranks]
            if max(want) - min(want) <= CLOSE * abs(max(want)) or not all(
                    _close(g, got[0], 1e-6) for g in got) or not _close(got[0], combine(want),
                                                                            CLOSE):
                break
            said.append((step, got[0], want))
        else:
            step, got, want = said[0]
            return (f"step {step}: every rank logged the loss {got:.5g}, the {how} of the "
                    f"ranks' own losses ({', '.join(f'{w:.5g}' for w in want)} in the "
                    f"reference): each rank calls log_step with its own loss, the loss of its "
                    f"batch, not the {how} over the ranks (DDP and FSDP average the gradients, "
                    "not the loss).")
    return None


def _loss_hint(mine: dict, ref: dict, world: int) -> Optional[str]:
    hint = _logged_hint(mine, ref)
    if hint:
        return hint
    for step in sorted(ref[0])[:3]:
        for rank in sorted(ref):
            got, want = mine[rank][step], ref[rank][step]
            if _close(got["loss"], want["loss"], CLOSE) and (
                    None in (got["grad"], want["grad"]) or got["grad"] == want["grad"] or
                    _close(got["grad"], want["grad"], 0.05)):
                continue   # (a grad of None: a step the GradScaler skipped, judged after)
            if world > 1 and (_close(got["loss"] * world, want["loss"], CLOSE) or (
                    got["grad"] is not None and
                    _close(got["grad"] * world * world, want["grad"], 0.05))):
                return (f"step {step}: the loss (or its gradient) is 1/{world} of the "
                        "reference's: do not divide the loss by the world size; DDP (and "
                        "FSDP) already average the gradients over the ranks.")
            if step > 0 and _close(got["loss"], want["loss"], CLOSE) and None not in (
                    got["grad"], want["grad"]):
                return (f"step {step}: the loss is right but the gradient is not "
                        f"({got['grad']:.4g} against {want['grad']:.4g} summed squares): the "
                        "gradients of the previous steps are still in it: backward adds to "
                        "the gradients there, and point 4 lets nothing of one step's gradient "
                        "leak into the next.")
            return (f"rank {rank}, step {step}: the loss was {got['loss']:.5g}, the "
                    f"reference's {want['loss']:.5g}: cross-entropy of the model's output "
                    "on the batch, one optimizer step per batch.")
    return None


def _save_hint(result: Any, mine: dict) -> Optional[str]:
    weights = metric(result, "weights")
    if not any(w.get("files") for w in weights.values()):
        return ("no checkpoint was written under --checkpoint-dir: save one every "
                "--save-every steps.")
    # a whole checkpoint: half the model's bytes at least, in a file that is not DCP's part
    floor = max(1, (weights.get(0) or {}).get("model_bytes", 0) // 2)
    for step in sorted(mine[0]):
        reports = {r: mine[r].get(step) or {} for r in mine}
        whole = any(size >= floor for report in reports.values()
                    for size in (report.get("changed") or {}).values())
        wrote = {r: report.get("bytes") or 0 for r, report in reports.items()}
        for rank in sorted(mine):
            if rank != 0 and whole and wrote[0] >= floor and wrote[rank] >= floor:
                return (f"step {step}: rank {rank} wrote a checkpoint as big as rank 0's: "
                        "with torch.save only rank 0 writes (every rank holds the same "
                        "weights); with torch.distributed.checkpoint every rank calls "
                        "dcp.save and writes only its own part.")
    for rank in sorted(mine):
        if not any(name.endswith(".distcp") for s in mine[rank].values() for name in s["written"]):
            return (f"rank {rank} wrote no part of a distributed checkpoint: save with "
                    "torch.distributed.checkpoint, where every rank calls dcp.save and writes "
                    "its own part (a checkpoint that then loads onto any world size).")
    saves = {step: {str(Path(name).parent) for name in report["written"] if
                    name.endswith(".distcp")} for step, report in mine[0].items()}
    seen: dict[str, int] = {}
    for step, folders in sorted(saves.items()):
        for folder in folders:
            if folder in seen:
                return (f"step {step}: rank 0 wrote its part into {folder} again (first written "
                        f"in step {seen[folder]}): a save that overwrites the last complete "
                        "checkpoint leaves nothing to resume from if it dies half-way. Save "
                        "each checkpoint in a folder of its own.")
            seen[folder] = step
    return None


def _eval_hint(result: Any, reference: Any) -> Optional[str]:
    weights = metric(result, "weights")
    if any(w["wrapper_evals"] for w in weights.values()):
        return ("the evaluation ran the DDP-wrapped model on rank 0 alone: the wrapper's "
                "forward belongs to every rank (it may wait for the others). Evaluate a plain "
                "model on rank 0: the one inside the wrapper, or a copy holding the full "
                "weights.")
    got, want = _accuracy(result), _accuracy(reference)
    if got is None:
        return "no accuracy was reported: rank 0 evaluates and calls log_accuracy(accuracy)."
    scored = (weights.get(0) or {}).get("eval_samples", 0)
    whole = (metric(reference, "weights").get(0) or {}).get("eval_samples", 0)
    if 0 < scored < whole:   # (0: a model the given part does not see, never judged so)
        return (f"rank 0 scored {scored} test samples, the reference {whole}: rank 0 scores "
                "the whole test set (a loader of its own, without the training's "
                "DistributedSampler).")
    if want is not None and abs(got - want) > ACCURACY:
        return (f"rank 0 reported an accuracy of {got:.4f}, the reference {want:.4f}: score "
                "the trained model on the whole test set, in eval mode.")
    mine, theirs = summed_squares(result), summed_squares(reference)
    if not _close(mine, theirs, WEIGHTS):
        return (f"the final weights differ from the reference's (summed squares {mine} "
                f"against {theirs}).")
    return None


def _fsdp_hint(fsdp: Any, ddp: Any, sharded: bool = True) -> Optional[str]:
    """What the fsdp run did wrong; ``sharded=False``: a DDP run where FSDP2 cannot run."""
    mine, ref = rank_steps(fsdp), rank_steps(ddp)
    hint = _inputs_hint(mine, ref, "the ddp run")
    if hint:
        return hint
    for rank in sorted(ref):
        for step in sorted(ref[rank]):
            got, want = mine.get(rank, {}).get(step), ref[rank][step]
            if got is None or got["samples"] != want["samples"] or _other_lr(got["lr"],
                                                                             want["lr"]):
                return (f"rank {rank}, step {step}: other samples or another LR than in the "
                        "ddp run; --strategy changes the wrapping only.")
            if got["autocast"] != want["autocast"]:
                return (f"rank {rank}, step {step}: the forward passes ran with autocast "
                        f"{got['autocast']}, the ddp run's with {want['autocast']} (None: no "
                        "autocast): --strategy changes the wrapping only. Run the forward pass "
                        "and the loss under torch.autocast in --amp-dtype with FSDP2 too.")
        scaled = [s for s in ref[rank] if ref[rank][s].get("scaler") is not None]
        if scaled and all(mine[rank][s].get("scaler") is None for s in scaled):
            return (f"rank {rank} trained in float16 without a GradScaler, the ddp run with "
                    "one: float16 needs a GradScaler with either strategy.")
    weights = metric(fsdp, "weights")
    if sharded and len({tuple(w["sums"]) for w in weights.values()}) < len(weights):
        return ("every rank holds the same weights: with --strategy fsdp, shard the model "
                "with fully_shard (each block, then the root), so that each rank holds a part.")
    units = min(w.get("sharded_units", 0) for w in weights.values())
    if sharded and units < 2:
        return (f"fully_shard made {units} unit(s) of the model: shard each block that holds "
                "parameters, then the root, so that a rank gathers one block's weights at a "
                "time (the whole model at once is DDP's memory again).")
    if not _close(summed_squares(fsdp), summed_squares(ddp), WEIGHTS):
        return (f"the final weights differ from the ddp run's (summed squares "
                f"{summed_squares(fsdp)} against {summed_squares(ddp)}).")
    if _accuracy(fsdp) is None or abs(_accuracy(fsdp) - _accuracy(ddp)) > ACCURACY:
        return (f"rank 0 reported an accuracy of {_accuracy(fsdp)}, the ddp run "
                f"{_accuracy(ddp)}: evaluate the full weights (gathered from the shards).")
    return None
