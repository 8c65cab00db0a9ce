"""Judge of the capstone (lesson 13): one DDP run with every lesson, killed and resumed exactly.

The learner fills the nine functions of ``exercises/capstone.py``; its fixed part
(``ddplab.capstone``) runs them and reports what they did. The judge takes the
three launches of the capstone::

    ddplab.check("13", {"unbroken": unbroken, "killed": killed, "resumed": resumed})

and checks, in the order the run calls the functions: the shares and orders each rank read
(``make_loader``, ``set_epoch``), the DDP wrapper, autocast's dtype and the GradScaler, the LR
of every step (scaled, warmed up), who wrote the checkpoint and how (rank 0, renamed into
place, every rank waiting for it), where ``read_checkpoint`` puts tensors and whether it
refuses pickles, ``evaluate`` on rank 0 over the whole test set, equal weights on every rank;
then that the killed run died on the rank it was told to, the resumed run started from its
checkpoint, and ended with exactly the unbroken run's weights and accuracy. One run alone is
judged too, and the verdict then asks for the other two.

Lesson: 13.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any, Mapping, Optional

from . import is_run_result, judge, metric, metrics, run_failed

#: The functions the learner writes, in the order the run first calls them.
FUNCTIONS = ("make_loader", "wrap_model", "mixed_precision", "learning_rate",
             "read_checkpoint", "resume", "train_epoch", "save_checkpoint", "evaluate")
RUNS = ("unbroken", "killed", "resumed")
AMP_DTYPE = {"cpu": "bfloat16", "cuda": "float16"}
SKELETON = "exercises/capstone.py"


def unanswered(path: Any) -> list[str]:
    """The functions of a capstone file that are still empty (their body only raises
    ``NotImplementedError``), in the order the run calls them.

    Lesson: 13 (the notebook runs the reference while the learner's file is still empty).
    """
    tree = ast.parse(Path(path).read_text())
    empty = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(
                getattr(s, "value", None), ast.Constant))]  # the docstring
            if not body or (len(body) == 1 and isinstance(body[0], ast.Raise) and
                            "NotImplementedError" in ast.unparse(body[0])):
                empty.add(node.name)
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    return [name for name in FUNCTIONS if name in empty or name not in defined]


@judge("13", "capstone.py", "one DDP run with a DistributedSampler and set_epoch, AMP, a "
       "scaled and warmed-up LR, a rank-0 atomic checkpoint, rank-0 evaluation; killed and "
       "resumed to exactly the unbroken run's weights")
def judge_capstone(answer: Any) -> Optional[str]:
    runs = {"unbroken": answer} if is_run_result(answer) else dict(answer)
    unknown = set(runs) - set(RUNS)
    if unknown or not runs or not all(is_run_result(r) for r in runs.values()):
        return ("hand in the three launches as a dict: {'unbroken': ..., 'killed': ..., "
                f"'resumed': ...}} (got {sorted(runs)}).")
    for name in RUNS:
        if name in runs:
            todo = metric(runs[name], "todo")
            if todo:
                function = next(iter(todo.values()))
                return (f"`{function}` in {SKELETON} is still empty: write it as its docstring "
                        "says, then launch again.")
    for name in ("unbroken", "resumed"):
        if name in runs:
            failed = run_failed(runs[name])
            if failed:
                return f"the {name} run: {failed}"
    for name in RUNS:
        if name in runs:
            hint = _run_hint(runs[name], killed=name == "killed")
            if hint:
                return f"the {name} run: {hint}"
    missing = [name for name in RUNS if name not in runs]
    if missing:
        return ("what the run did is right. Now the fault: hand in all three launches, "
                "{'unbroken': ..., 'killed': ..., 'resumed': ...} (missing: "
                f"{', '.join(missing)}).")
    return _resume_hint(runs["unbroken"], runs["killed"], runs["resumed"])


# ------------------------------------------------------------------ one run


def _ranks(result: Any) -> list[int]:
    return list(range(result.world_size)) if result.world_size else [0]


def _run_hint(result: Any, killed: bool) -> Optional[str]:
    """The first thing wrong with what one launch did, or None."""
    setup = metric(result, "setup")
    if set(setup) != set(_ranks(result)):
        return ("not every rank reported its setup: keep the last lines of the file "
                "(`capstone.run(...)`) as the skeleton has them.")
    facts = setup[0]
    epochs = {rank: {f["epoch"]: f for f in values}
              for rank, values in metrics(result, "epoch_facts").items()}
    if not killed and set(epochs) != set(_ranks(result)):
        return "not every rank reported its epochs: keep the fixed part of the file as it is."
    for hint in (_wrap_hint(facts), _precision_hint(facts), _weights_only_hint(facts)):
        if hint:
            return hint
    for epoch in sorted(epochs.get(0, {})):
        per_rank = {rank: epochs[rank][epoch] for rank in epochs if epoch in epochs[rank]}
        for check in (_share_hint, _autocast_hint, _lr_hint, _save_hint, _read_hint,
                      _eval_hint):
            hint = check(per_rank, facts)
            if hint:
                return f"epoch {epoch}: {hint}"
    hint = _order_hint(epochs)
    if hint:
        return hint
    if not killed:
        checksums = (result.summary or {}).get("param_checksums_per_rank") or []
        if len(set(checksums)) > 1:
            return (f"the ranks ended with different weights ({checksums}): DDP must average "
                    "every step's gradients; train the model `wrap_model` returned.")
    return None


def _wrap_hint(facts: Mapping[str, Any]) -> Optional[str]:
    if facts["wrapper"] != "DistributedDataParallel":
        return (f"`wrap_model` returned a {facts['wrapper']}: wrap the model in "
                "DistributedDataParallel (device_ids=[local_rank] on a GPU, None on a CPU).")
    return None


def _precision_hint(facts: Mapping[str, Any]) -> Optional[str]:
    device = facts["device_type"]
    want = AMP_DTYPE.get(device, "bfloat16")
    if facts["amp_dtype"] != want:
        return (f"`mixed_precision` chose {facts['amp_dtype']} on {device}; autocast there "
                f"should compute in {want}.")
    scaler = facts["scaler"]
    if scaler["type"] != "GradScaler":
        return (f"`mixed_precision` returned a {scaler['type']} as the scaler: return a "
                "torch.amp.GradScaler (disabled where it is not needed).")
    if scaler["enabled"] != (want == "float16"):
        return (f"the GradScaler is {'enabled' if scaler['enabled'] else 'disabled'} with "
                f"{want}: float16 gradients need loss scaling, bfloat16 ones do not "
                "(GradScaler(device.type, enabled=dtype == torch.float16)).")
    return None


def _weights_only_hint(facts: Mapping[str, Any]) -> Optional[str]:
    if facts["weights_only_refuses"] is False:
        return ("`read_checkpoint` loaded a file holding a pickled Python object: load with "
                "torch.load(..., weights_only=True), which refuses anything but tensors and "
                "plain containers (a stranger's pickle can run code).")
    return None


def _share_hint(per_rank: dict[int, Any], facts: Mapping[str, Any]) -> Optional[str]:
    size, world = facts["train_size"], facts["world_size"]
    share = math.ceil(size / world)
    counts = {rank: f["samples"] for rank, f in per_rank.items()}
    if world > 1 and all(n == size for n in counts.values()):
        return (f"every rank read all {size} training samples: in `make_loader`, give the "
                "DataLoader a DistributedSampler (sampler=..., and no shuffle=True).")
    if any(n != share for n in counts.values()):
        return (f"the ranks read {counts} samples; with {size} samples on {world} ranks each "
                f"should read {share} (`make_loader`: DistributedSampler with num_replicas = "
                "the world size and this rank).")
    orders = [f["order"] for f in per_rank.values()]
    if len(set(orders)) < len(orders):
        return ("two ranks read the same samples in the same order: give each rank's "
                "DistributedSampler its own rank and the same seed (`make_loader`).")
    return None


def _order_hint(epochs: dict[int, dict[int, Any]]) -> Optional[str]:
    for rank, per_epoch in sorted(epochs.items()):
        orders = [per_epoch[e]["order"] for e in sorted(per_epoch)]
        if len(orders) > 1 and len(set(orders)) == 1:
            return (f"rank {rank} read its share in the same order in every epoch: call "
                    "set_epoch(epoch) on the sampler at the start of `train_epoch`.")
    return None


def _autocast_hint(per_rank: dict[int, Any], facts: Mapping[str, Any]) -> Optional[str]:
    for rank, f in sorted(per_rank.items()):
        if f["forwards"] == 0:
            return f"rank {rank} trained on nothing: `train_epoch` must run the loader."
        if f["under_autocast"] < f["forwards"]:
            return (f"rank {rank} ran {f['forwards'] - f['under_autocast']} of "
                    f"{f['forwards']} forward passes without autocast: in `train_epoch`, "
                    "compute the output and the loss inside torch.autocast(device.type, "
                    "dtype=amp_dtype).")
        if f["autocast_dtypes"] != [facts["amp_dtype"]]:
            return (f"rank {rank}'s autocast computed in {f['autocast_dtypes']}, not the "
                    f"{facts['amp_dtype']} `mixed_precision` chose: pass dtype=amp_dtype.")
    return None


def _lr_hint(per_rank: dict[int, Any], facts: Mapping[str, Any]) -> Optional[str]:
    base, world, warmup = facts["base_lr"], facts["world_size"], facts["warmup_steps"]
    peak = base * world
    for rank, f in sorted(per_rank.items()):
        for step, lr in f["lrs"]:
            want = peak * min(1.0, (step + 1) / warmup) if warmup > 0 else peak
            if math.isclose(lr, want, rel_tol=1e-6):
                continue
            said = f"rank {rank}, step {step}: the LR was {lr:.6g}, the rule gives {want:.6g}"
            if math.isclose(lr, base, rel_tol=1e-6) and world > 1:
                return (f"{said}: the LR is never scaled or warmed up. Write "
                        "`learning_rate` and set it on every param group before each step "
                        "in `train_epoch`.")
            if math.isclose(lr, peak, rel_tol=1e-6):
                return (f"{said}: no warm-up. The LR climbs linearly to base_lr x world_size "
                        "over warmup_steps steps: peak x min(1, (step + 1) / warmup_steps).")
            if world > 1 and math.isclose(lr * world, want, rel_tol=1e-6):
                return (f"{said}: the LR is not scaled with the world size (linear scaling "
                        "rule: base_lr x world_size).")
            return (f"{said}. Count steps across epochs (epoch x len(loader) + i) and use "
                    "`learning_rate` for every step.")
    return None


def _save_hint(per_rank: dict[int, Any], facts: Mapping[str, Any]) -> Optional[str]:
    epoch = next(iter(per_rank.values()))["epoch"]
    for rank, f in sorted(per_rank.items()):
        s = f["save"]
        wrote = bool(s["opened"]) or s["renamed"] or (
            s["bytes"] is not None and s["size"] and s["bytes"] >= s["size"] // 2)
        if rank != 0 and wrote:
            return (f"rank {rank} wrote the checkpoint too: every rank holds the same weights, "
                    "so only rank 0 writes (`if rank == 0:` in `save_checkpoint`); the others "
                    "only wait at the barrier.")
        if rank == 0 and not s["renamed"]:
            return ("rank 0 did not write the checkpoint atomically: torch.save to a "
                    "temporary file in the same folder, then os.replace it onto the "
                    "checkpoint, so a crash mid-write never leaves half a file.")
        if s["seen"] != epoch:
            found = ("no file" if s["seen"] == "missing" else "a half-written file"
                     if s["seen"] == "unreadable" else f"epoch {s['seen']}")
            return (f"rank {rank} returned from `save_checkpoint` before the file of epoch "
                    f"{epoch} was there (it found {found}): every rank must wait at "
                    "dist.barrier() after rank 0's write.")
    return None


def _read_hint(per_rank: dict[int, Any], facts: Mapping[str, Any]) -> Optional[str]:
    for rank, f in sorted(per_rank.items()):
        read = f.get("read")
        if read is None:
            continue
        for asked, got in ((read["device"], read["own"]), ("meta", read["meta"])):
            if isinstance(got, str):
                return (f"rank {rank}: `read_checkpoint(path, {asked!r})` raised {got}. It "
                        "must return the saved dictionary, with a 'model' state_dict.")
            if got != [asked]:
                return (f"rank {rank}: `read_checkpoint` asked for {asked} put the model's "
                        f"tensors on {got}: pass map_location=device to torch.load, or every "
                        "rank loads onto the device that saved the file (rank 0's GPU).")
    return None


def _eval_hint(per_rank: dict[int, Any], facts: Mapping[str, Any]) -> Optional[str]:
    size = facts["test_size"]
    for rank, f in sorted(per_rank.items()):
        e = f["eval"]
        if rank != 0 and (e["value"] is not None or e["samples"]):
            return (f"rank {rank} evaluated too: only rank 0 evaluates, the others return "
                    "None at once (`evaluate`).")
        if rank != 0:
            continue
        if e["wrapper_forwards"]:
            return ("`evaluate` ran the DDP-wrapped model on rank 0 alone: DDP's forward may "
                    "wait for the other ranks (buffers, hooks). Evaluate model.module.")
        if e["samples"] != size:
            return (f"rank 0 evaluated {e['samples']} samples; the test set has {size}: "
                    "evaluate all of it, in order, with no sampler.")
        if e["with_grad"]:
            return "`evaluate` built autograd graphs: run it under torch.no_grad()."
        if not e["training_after"]:
            return ("the model stayed in eval mode after `evaluate`: call model.train() "
                    "before returning.")
        if e["value"] is None or not math.isclose(float(e["value"]), e["expected"],
                                                  abs_tol=0.01):
            return (f"rank 0's `evaluate` returned {e['value']}, but the model gets "
                    f"{e['expected']:.4f} of the test set right: return correct / total.")
    return None


# ------------------------------------------------------------------ killed, then resumed


def _resume_hint(unbroken: Any, killed: Any, resumed: Any) -> Optional[str]:
    setups = {name: metric(run, "setup")[0] for name, run in
              (("unbroken", unbroken), ("killed", killed), ("resumed", resumed))}
    same = ("world_size", "base_lr", "batch_size", "epochs", "train_size", "warmup_steps")
    for name in ("killed", "resumed"):
        differs = [k for k in same if setups[name][k] != setups["unbroken"][k]]
        if differs:
            return (f"the {name} run differs from the unbroken one in {', '.join(differs)}: "
                    "launch all three with the same arguments and number of processes.")
    kill = setups["killed"]["kill"]
    if kill is None or killed.ok:
        return ("the killed run finished: launch it with --kill-rank 1 --kill-epoch N "
                "(an epoch after the first) and its own --checkpoint-dir.")
    cause = killed.root_cause
    if cause is None or cause.rank != kill[0]:
        return (f"the killed run did not fail on rank {kill[0]}, the rank told to die "
                f"({cause}): read its output above and launch it again.")
    if setups["unbroken"]["on_disk"] != "missing" or setups["killed"]["on_disk"] != "missing":
        return ("the unbroken and the killed runs must start without a checkpoint: give each "
                "a new --checkpoint-dir.")
    saved = max((f["epoch"] for f in metrics(killed, "epoch_facts").get(0, [])), default=0)
    resumed_facts = setups["resumed"]
    if saved == 0:
        return "the killed run died before its first checkpoint: kill it in a later epoch."
    if resumed_facts["on_disk"] != saved:
        return (f"the resumed run found {resumed_facts['on_disk']} on disk, not the killed "
                f"run's checkpoint of epoch {saved}: launch it with the killed run's "
                "--checkpoint-dir.")
    if resumed_facts["start_epoch"] != saved:
        return (f"`resume` returned {resumed_facts['start_epoch']} although the checkpoint "
                f"holds {saved} epochs: it must load the file and return its epoch, so that "
                "training goes on where it stopped (it trained again what was done).")
    restored = resumed_facts["restored"] or {}
    for part in ("model", "optimizer"):
        if not restored.get(part):
            return (f"after `resume` the {part}'s state is not the checkpoint's: load "
                    f"state['{part}'] into it (the model: into model.module).")
    first = {r: {f["epoch"]: f["order"] for f in v}
             for r, v in metrics(unbroken, "epoch_facts").items()}
    for rank, values in sorted(metrics(resumed, "epoch_facts").items()):
        for f in values:
            if f["order"] != first[rank][f["epoch"]]:
                return (f"in epoch {f['epoch']} rank {rank} of the resumed run read other "
                        "samples than in the unbroken run: set_epoch(epoch) with the real "
                        "epoch number, counted from the start of the job.")
    ends = {name: metric(run, "end").get(0) or {} for name, run in
            (("unbroken", unbroken), ("resumed", resumed))}
    if ends["resumed"].get("checksum") != ends["unbroken"].get("checksum"):
        return ("the resumed run ended with other weights than the unbroken one "
                f"({ends['resumed'].get('checksum')} vs {ends['unbroken'].get('checksum')}): "
                "the checkpoint must hold everything training depends on (model, optimizer, "
                "scaler, epoch) and `resume` restore all of it.")
    if ends["resumed"].get("accuracy") != ends["unbroken"].get("accuracy"):
        return ("the same weights but another final accuracy: `evaluate` must depend on the "
                "weights only.")
    return None
