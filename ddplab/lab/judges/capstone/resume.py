"""The capstone's judge on the killed run, its resume on 2 ranks (bit for bit the unbroken
run) and its resume on 4 (the resharded run, within a stated tolerance)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from .. import metric, metrics
from .facts import _accuracy, _args, _close, _other_lr, default_dtype, rank_steps, summed_squares

RESHARD_LOSS, RESHARD_WEIGHTS, RESHARD_ACCURACY = 0.5, 0.10, 0.15  # 2 -> 4 ranks


def _fault(killed: Any) -> dict[str, Any]:
    """What the killed rank reported as it died: the step, and whether rank 0 was saving."""
    return next(iter(metric(killed, "fault").values()), None) or {}


def _kill_step(killed: Any) -> Optional[int]:
    return _fault(killed).get("step")


def _resume_step(killed: Any) -> int:
    """The step the last checkpoint before the kill holds: every --save-every steps."""
    every = int(_args(killed).get("save_every", 1))
    return (_kill_step(killed) or 0) // every * every


def _killed_hint(killed: Any, ddp: Any) -> Optional[str]:
    step = _kill_step(killed)
    cause = killed.root_cause
    if step is None or killed.ok or cause is None or cause.rank != 1:
        how = cause and (cause.message or cause.signal or (
            "its exit unreported" if cause.exitcode is None else f"exit code {cause.exitcode}"))
        seen = ("it reported no fault" if step is None else "it ended ok" if killed.ok else
                "no rank failed" if cause is None else f"rank {cause.rank} failed first: {how}")
        return (f"the killed run did not die on rank 1 ({seen}): launch it with --kill-rank 1 "
                "--kill-at-step K (mid-epoch, after a checkpoint) and a --checkpoint-dir of "
                "its own.")
    differs = [k for k, v in _args(ddp).items() if _args(killed).get(k) != v]
    if differs or killed.world_size != ddp.world_size:
        return ("launch the killed run like the ddp run (same arguments, 2 processes), "
                f"plus the fault (it differs in {', '.join(differs) or 'world size'}).")
    if min(rank_steps(killed).get(0, {0: None})) != 0:
        return "the killed run must start from nothing: give it a --checkpoint-dir of its own."
    if _fault(killed).get("rank_0_saving"):
        return (f"rank 1 went on to step {step} while rank 0 was still writing the checkpoint "
                "before it: had rank 1's machine failed there, the job would have lost that "
                "checkpoint. No rank may go past a save before the checkpoint is whole (a "
                "barrier after rank 0's torch.save; dcp.save waits by itself).")
    if _resume_step(killed) == 0:
        return ("the kill came before the first checkpoint: kill in a later step "
                "(--kill-at-step beyond --save-every).")
    return None


def _resumed_hint(resumed: Any, killed: Any, ddp: Any) -> Optional[str]:
    want = _resume_step(killed)
    mine, ref = rank_steps(resumed), rank_steps(ddp)
    if _args(resumed).get("strategy") != "ddp" or resumed.world_size != ddp.world_size:
        return "launch the resumed run like the ddp run: --strategy ddp, 2 processes."
    first = min(mine[0])
    if first == 0:
        return (f"the resumed run started again from step 0: find the newest complete "
                f"checkpoint in --checkpoint-dir (step {want}) and load it.")
    if first < want:
        return _early_hint(resumed, killed, ddp, first, want)
    if first > want:
        return (f"the resumed run started at step {first}; the last checkpoint holds step "
                f"{want}: resume from the step the checkpoint holds.")
    for rank in sorted(ref):
        for step in sorted(mine[rank]):
            got, exp = mine[rank][step], ref[rank].get(step, {})
            if got["samples"] != exp.get("samples"):
                return _order_hint(rank, step, got["samples"], ref[rank])
            if step == first and got["loss"] != exp.get("loss"):
                return (f"rank {rank}, step {step}: the loss differs from the unbroken run's "
                        "on the same batch: load the model's weights from the checkpoint.")
            skipped = got["optimizer_steps"] != exp.get("optimizer_steps")  # by one scaler
            if step == first and got["state"] != exp.get("state") and not skipped:
                return (f"rank {rank}, step {step}: the weights are restored but not the "
                        "optimizer's state (SGD's momentum): load the optimizer too (and "
                        "the GradScaler's, where one is enabled).")
            if step == first and got.get("scaler") != exp.get("scaler"):
                return (f"rank {rank}, step {step}: the weights are restored but not the "
                        f"GradScaler: its state after this step is {got.get('scaler')}, the "
                        f"unbroken run's {exp.get('scaler')}. A new scaler restarts at its "
                        "initial scale with its count of unskipped steps at 0: the resumed steps "
                        "equal the unbroken run's only while the two scales agree, and part from "
                        "them once one backs off or grows and the other does not. Point 8: a "
                        "checkpoint holds the scaler too.")
            if got["lr"] != exp.get("lr"):
                return (f"step {step}: the LR was {got['lr']}, the unbroken run's "
                        f"{exp.get('lr')}: the step count comes from the checkpoint.")
            if got["loss"] != exp.get("loss"):
                return (f"rank {rank}, step {step}: the resumed run drifted from the "
                        "unbroken one: the checkpoint must hold everything training depends "
                        "on, and the resume restore all of it.")
    if summed_squares(resumed) != summed_squares(ddp) or _accuracy(resumed) != _accuracy(ddp):
        return (f"the resumed run ended with other weights or accuracy than the unbroken one "
                f"({summed_squares(resumed)}, {_accuracy(resumed)} against {summed_squares(ddp)}, "
                f"{_accuracy(ddp)}): on the same world size a resume is exact.")
    return None


def _saved_after(run: Any) -> list[int]:
    """The steps after which rank 0 wrote a part of a distributed checkpoint (reported with the
    step after them)."""
    return sorted(step - 1 for step, report in rank_steps(run).get(0, {}).items()
                  if any(name.endswith(".distcp") for name in report["written"]))


def _folders(report: dict) -> set[str]:
    return {str(Path(name).parent) for name in report.get("written") or []
            if name.endswith(".distcp")}


def _early_hint(resumed: Any, killed: Any, ddp: Any, first: int, want: int) -> str:
    """Why the resume started before step ``want`` (the killed run's last checkpoint was whole:
    a rank that went past an unfinished save is named with the killed run)."""
    every = int(_args(killed).get("save_every", 1))
    if not _fault(killed).get("rank_0_saved", True):
        after = [s for s in _saved_after(killed) if s < want]
        did = f" (it saved after steps {', '.join(map(str, after))})" if after else ""
        return (f"the resumed run started at step {first}: the killed run saved no checkpoint "
                f"after step {want - 1}, the last --save-every-th step before the kill{did}. "
                f"Save once every --save-every-th step is done (with {every}: after steps "
                f"{every - 1}, {2 * every - 1}, {3 * every - 1}, ...), so that the resume "
                f"begins at step {want}.")
    read = {r["folder"] for values in metrics(resumed, "read").values() for r in values
            if r.get("complete")}
    steps = rank_steps(ddp).get(0, {})
    newest = _folders(steps.get(want, {}))
    known = set().union(*(_folders(report) for report in steps.values()))
    if read and newest and read <= known:
        if read & newest:
            return (f"the resumed run started at step {first}, from {sorted(read & newest)[0]}"
                    f": the complete checkpoint saved once step {want - 1} was done, from which "
                    f"the job goes on at step {want}. The step the checkpoint records (or the "
                    f"one the resume counts from it) is off by {want - first}.")
        return (f"the resumed run loaded {', '.join(sorted(read))}, not the newest complete "
                f"checkpoint ({sorted(newest)[0]}, saved after step {want - 1}): resume from "
                "the newest one whose save finished.")
    return (f"the resumed run started at step {first}; the killed run saved a complete "
            f"checkpoint after step {want - 1} (no rank went past it before it was whole): load "
            f"the newest complete checkpoint and go on at the step after the one it holds "
            f"({want}).")


def _order_hint(rank: int, step: int, batch: list, unbroken: dict) -> str:
    """The resumed run's batch at ``step`` is not the unbroken run's: at another place of the
    unbroken rank's order (a wrong skip or epoch), or nowhere in it (another order)."""
    order = [x for s in sorted(unbroken) for x in unbroken[s]["samples"]]
    n = len(batch)
    if n and any(order[i:i + n] == batch for i in range(len(order) - n + 1)):
        return (f"rank {rank}, step {step}: the resumed run read other samples than the "
                "unbroken one: the checkpoint holds where in the epoch the job was; the "
                "resumed job sets that epoch and skips the batches done.")
    return (f"rank {rank}, step {step}: the resumed run read its samples in another order "
            "than the unbroken job (its batch there is in no epoch of the unbroken rank's "
            "order): the sampler was seeded or shuffled otherwise after the resume. Point 2: "
            "every launch shuffles from the same seed, --seed, so that an epoch replayed after "
            "a restart has the same order.")


def _unfinished_hint(run: Any) -> Optional[str]:
    """A run that read a checkpoint folder without DCP's ``.metadata`` (and then failed)."""
    bad = sorted({r["folder"] for values in metrics(run, "read").values() for r in values
                  if not r.get("complete")})
    if not bad:
        return None
    return (f"it read {bad[0]}, a checkpoint folder without DCP's .metadata: an unfinished "
            "save (DCP writes .metadata last, once every part is on disk; a kill during a "
            "save leaves such a folder, and the launches left one beside the killed run's "
            "newest checkpoint). Resume from the newest complete checkpoint, one whose "
            ".metadata exists.")


def _resharded_hint(resharded: Any, killed: Any, ddp: Any, strategy: str = "fsdp"
                    ) -> Optional[str]:
    if _args(resharded).get("strategy") != strategy or resharded.world_size != 4:
        return (f"launch the resharded run on 4 processes with --strategy {strategy}, on a "
                "copy of the killed run's folder.")
    want = _resume_step(killed)
    mine, ref = rank_steps(resharded), rank_steps(ddp)
    dtype = default_dtype(_args(resharded), resharded.world_size)
    for rank, steps in sorted(mine.items()):
        for step, report in sorted(steps.items()):
            if report["autocast"] != [dtype]:
                return (f"on 4 ranks, step {step}: rank {rank}'s forward passes ran with "
                        f"autocast {report['autocast']}, expected {dtype} (None: no "
                        "autocast): --amp-dtype, else float16 on a GPU and bfloat16 on a "
                        "CPU, whatever dtype the checkpoint was saved in.")
    first = min(mine[0])
    if first != want:
        return (f"the resharded run started at step {first}, the killed run's last "
                f"checkpoint holds step {want}: load it (torch.distributed.checkpoint "
                "reshards it onto 4 ranks).")
    args = _args(resharded)
    peak, warmup = args["lr"] * resharded.world_size, args["warmup_steps"]
    for step, report in sorted(mine[0].items()):
        rule = peak * min(1.0, (step + 1) / warmup) if warmup else peak
        if _other_lr(report["lr"], rule):
            return (f"on 4 ranks step {step} ran with the LR {report['lr']}, the rule gives "
                    f"{rule:.6g}: the peak follows the world size of this launch, not the "
                    "one the checkpoint was saved with.")
    epochs = max(1, int(_args(ddp).get("epochs", 1)))
    per_epoch = math.ceil(len(ref[0]) / epochs)
    end = (want // per_epoch + 1) * per_epoch
    wanted = sorted(x for r in ref.values() for s in range(want, end) for x in r[s]["samples"])
    steps = math.ceil((end - want) * ddp.world_size / resharded.world_size)
    got = sorted(x for r in mine.values() for s, v in r.items() if first <= s < first + steps
                 for x in v["samples"])
    if len(set(got) ^ set(wanted)) > 4:
        return ("on 4 ranks the resumed epoch did not go on with the samples the killed job "
                "had not yet trained on: record in the checkpoint how far into the epoch the "
                "job was in samples, not in steps of one world size.")
    losses = [v["loss"] for r in mine.values() for v in r.values()]
    base = [v["loss"] for r in ref.values() for s, v in r.items() if s >= want]
    if abs(sum(losses) / len(losses) - sum(base) / len(base)) > RESHARD_LOSS:
        return (f"on 4 ranks the mean loss was {sum(losses) / len(losses):.3f}, the unbroken "
                f"run's over the same part of the job {sum(base) / len(base):.3f}: load the "
                "model and the optimizer from the checkpoint.")
    if not _close(summed_squares(resharded), summed_squares(ddp), RESHARD_WEIGHTS):
        return (f"on 4 ranks the final weights are far from the unbroken run's (summed "
                f"squares {summed_squares(resharded)} against {summed_squares(ddp)}).")
    accuracy = _accuracy(resharded)
    if accuracy is None or abs(accuracy - _accuracy(ddp)) > RESHARD_ACCURACY:
        return (f"on 4 ranks the accuracy was {accuracy}, the unbroken run's "
                f"{_accuracy(ddp)}.")
    return None
