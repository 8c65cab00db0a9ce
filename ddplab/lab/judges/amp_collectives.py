"""Judges of the coding exercises of lessons 06 (AMP) and 08 (collectives).

06 reads what ``exercises/amp.py`` observed while it trained: was every forward pass under
``torch.autocast`` with the dtype the device wants (bfloat16 on a CPU, float16 on CUDA), did
the weights stay float32, was a ``GradScaler`` built on every device, enabled exactly where
float16 needs it, and used at every step (its ``scale``, ``unscale_``, ``step`` and ``update``
calls are counted, so a disabled scaler on a CPU is checked too), were the gradients clipped
to ``max_norm`` as true gradients (in the steps with a scaler on: the order of its calls, and
the norm of the gradients the optimizer stepped with, against ``max_norm`` and the scale), and
did the loss stay finite and go down. PyTorch's rule (``GradScaler.unscale_``'s docstring and
the AMP examples' "Gradient clipping"): ``unscale_`` at most once per step, between backward
and ``step``, and clip after it.

08 reads every rank's input and results from ``exercises/collective.py`` and recomputes the
expected values from the inputs: the mean over ranks (``average``), the left neighbour's
tensor (``ring_shift``) and the sum over ranks (the ring built from ``ring_shift``).

Lessons: 06, 08.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from . import judge, metric

#: The autocast dtype each device type should use (PyTorch's AMP recipes): CPU autocast
#: computes in bfloat16; on CUDA the exercise asks for float16, the format that needs a scaler.
AMP_DTYPE = {"cpu": "bfloat16", "cuda": "float16"}
#: Steps compared at each end of the run to decide whether the loss went down.
LOSS_WINDOW = 5


def _facts(result: Any, names: Sequence[str]) -> tuple[dict[str, dict[int, Any]], Optional[str]]:
    """Every rank's value of each fact, or a hint when a fact is missing."""
    found = {name: metric(result, name) for name in names}
    ranks = set(range(result.world_size)) if result.world_size else {0}
    for name, per_rank in found.items():
        if set(per_rank) != ranks:
            return found, (f"the run did not report {name!r} from every rank: the reporting "
                           "part at the end of the file must run unchanged (restore it from "
                           "the skeleton if you edited it).")
    return found, None


# ----------------------------------------------------------------------------- 06 AMP

AMP_FACTS = ("device_type", "forwards", "forwards_under_autocast", "autocast_dtypes",
             "layer_output_dtypes", "weight_dtype", "grad_dtype", "loss_dtype", "losses",
             "scaler_before", "scaler", "max_norm", "scaled_steps")
#: How far a stepped norm may be from ``max_norm`` (float32 rounding) and still equal it.
NORM_TOL = 0.01


@judge("06", "amp.py", "train in the device's autocast dtype, a GradScaler that scales "
       "exactly where float16 needs it, and the true gradients clipped")
def judge_amp(result: Any) -> Optional[str]:
    facts, missing = _facts(result, AMP_FACTS)
    if missing:
        return missing
    for rank in sorted(facts["device_type"]):
        hint = _amp_rank({name: values[rank] for name, values in facts.items()})
        if hint:
            return f"rank {rank}: {hint}"
    return None


def _amp_rank(f: dict[str, Any]) -> Optional[str]:
    """The first thing wrong in one rank's facts, or None."""
    device, want = f["device_type"], AMP_DTYPE.get(f["device_type"], "bfloat16")
    if f["forwards"] == 0:
        return "the model never ran a forward pass: train_step must call the model (TODO 3)."
    if f["forwards_under_autocast"] < f["forwards"]:
        return (f"{f['forwards'] - f['forwards_under_autocast']} of {f['forwards']} forward "
                "passes ran without autocast, in float32: train_step's docstring wants the "
                "forward pass and the loss computed in amp_dtype, backward and the step outside "
                "autocast (TODO 3).")
    if f["autocast_dtypes"] != [want]:
        return (f"autocast computed in {', '.join(f['autocast_dtypes'])}, but on {device} it "
                f"should be {want} (TODO 1): CPU autocast computes in bfloat16, CUDA autocast "
                "in float16.")
    if f["weight_dtype"] != "float32" or f["grad_dtype"] != "float32":
        return (f"the weights are {f['weight_dtype']} and their gradients {f['grad_dtype']}: "
                "autocast keeps the parameters in float32 and casts copies for each operation, "
                "so do not convert the model (no .half() or .to(dtype)).")
    if want not in f["layer_output_dtypes"]:
        return (f"the first convolution produced {', '.join(f['layer_output_dtypes'])}, not "
                f"{want}: its input or weights were changed by hand; let autocast do the casts.")
    if f["loss_dtype"] != "float32":
        return (f"the loss is {f['loss_dtype']}: it was computed outside autocast, on the "
                "16-bit output; under autocast cross_entropy runs in float32, and the docstring "
                "wants the loss computed there too (TODO 3).")
    return (_scaler_hint(f["scaler_before"], f["scaler"], want)
            or _order_hint(f["scaled_steps"])
            or _calls_hint(f["scaler_before"], f["scaler"], want, len(f["losses"]))
            or _clip_hint(f["scaled_steps"], f["max_norm"])
            or _loss_hint(f["losses"]))


def _scaler_hint(before: dict[str, Any], after: dict[str, Any], dtype: str) -> Optional[str]:
    """What is wrong with the GradScaler built for an autocast ``dtype``, or None.

    A scaler is required on every device: on a CPU (bfloat16) it is built disabled and still
    used, so the same training step is right on a GPU with float16.
    """
    if not before.get("exists") or before.get("type") is None or "calls" not in after:
        return (f"make_scaler() returned {before.get('type', 'nothing')}, not a "
                "torch.amp.GradScaler (TODO 2). Build one on every device: disabled where "
                f"{dtype} needs no loss scaling, so that the same train_step is right on a GPU "
                "with float16, where gradients underflow without it.")
    if dtype == "float16" and not before.get("enabled"):
        return ("float16 gradients underflow without loss scaling, and this GradScaler is "
                "switched off: it must scale wherever the dtype is float16 (make_scaler, "
                "TODO 2).")
    if dtype != "float16" and before.get("enabled"):
        return (f"the GradScaler is enabled with {dtype}, which has float32's range and needs "
                "no loss scaling: enable it only for float16 (make_scaler, TODO 2).")
    return None


def _order_hint(steps: Sequence[dict[str, Any]]) -> Optional[str]:
    """A hint when a step called the scaler's ``unscale_`` twice, after ``step`` or before
    backward, else None. With the scaler on, the first two raise a RuntimeError in PyTorch (the
    fixed part of the exercise then ends that step and reports it)."""
    for number, step in enumerate(steps, 1):
        order = step["order"]
        if "unscale_" not in order:
            continue
        first = order.index("unscale_")
        if order.count("unscale_") > 1:
            return (f"step {number} called scaler.unscale_(optimizer) twice: PyTorch allows "
                    "one unscale_ between two update()s (a second raises): the gradients are "
                    "already true after the first (TODO 3).")
        if "step" in order and first > order.index("step"):
            return (f"step {number} called scaler.unscale_(optimizer) after scaler.step(): the "
                    "optimizer had already stepped (the scaler unscaled the gradients itself), "
                    "so nothing done to them now changes this step (TODO 3).")
        if "scale" not in order or first < order.index("scale"):
            return (f"step {number} called scaler.unscale_(optimizer) before backward of the "
                    "scaled loss: it unscaled gradients that were not there yet, and the "
                    "scaler.step() that followed did not unscale the new ones (TODO 3).")
    return None


def _calls_hint(before: dict[str, Any], after: dict[str, Any], dtype: str, steps: int
                ) -> Optional[str]:
    """A hint when a step bypassed the scaler or it never updated its scale, else None."""
    calls = after.get("calls", {})
    unused = [name for name in ("scale", "step", "update") if calls.get(name, 0) < steps]
    if unused:
        counts = ", ".join(f"{name}() {calls.get(name, 0)} times" for name in
                           ("scale", "step", "update"))
        return (f"over {steps} steps train_step called the scaler's {counts}: every step must "
                "backward the scaled loss, step the optimizer through the scaler and update "
                "the scale (TODO 3). On this device the scaler is disabled and changes "
                "nothing, but on a GPU with float16 a step that bypasses it trains on "
                "underflowed (or unscaled, 65536 times too large) gradients.")
    if dtype == "float16":
        stepped = (after.get("growth_tracker") or 0) > 0 or after.get("scale") != before.get(
            "scale")
        if not stepped:
            return ("the scaler is enabled but its scale never changed: nothing updated it, "
                    "and the docstring wants the scale updated every step (TODO 3).")
    return None


def _clip_hint(steps: Sequence[dict[str, Any]], max_norm: float) -> Optional[str]:
    """A hint when, in a step with a scaler on, the optimizer stepped with gradients that were
    not clipped to ``max_norm`` as true gradients, else None.

    Clipped before ``unscale_``, the gradients are clipped while multiplied by the scale: the
    optimizer then steps with a norm of ``max_norm / scale``. Unclipped (or clipped after the
    step) it steps with their true norm, above ``max_norm`` in this exercise's run.
    """
    if not steps:
        return ("no step ran with a GradScaler switched on, so the clipping could not be "
                "judged: restore the fixed part of the file from the skeleton.")
    for number, step in enumerate(steps, 1):
        used, scale, after = step["stepped_norm"], step["scale"], step["norm_after"]
        if used is None:   # an overflow: the scaler skipped this step
            continue
        if used > max_norm * (1 + NORM_TOL):
            if after is not None and after <= max_norm * (1 + NORM_TOL):
                return (f"in step {number} the optimizer stepped with gradients of norm "
                        f"{used:.3g}, above max_norm={max_norm:g}: they were clipped after "
                        "scaler.step(), too late to change the step. The optimizer must step "
                        "with clipped true gradients (TODO 3).")
            return (f"in step {number} the optimizer stepped with gradients of norm {used:.3g}, "
                    f"above max_norm={max_norm:g}: they were not clipped. The optimizer must "
                    "step with gradients whose total norm is at most max_norm (TODO 3).")
        if scale > 2 and used < max_norm / 2 and \
                abs(used * scale - max_norm) <= NORM_TOL * max_norm:
            return (f"in step {number} the optimizer stepped with gradients of norm {used:.3g}, "
                    f"max_norm={max_norm:g} divided by the scale {scale:g}: the clip saw the "
                    f"scaled gradients, so max_norm applied to gradients {scale:g} times too "
                    "large, then the scaler divided them. The clip must see the true gradients "
                    "(the AMP examples' \"Working with Unscaled Gradients\", TODO 3).")
    return None


def _loss_hint(losses: Sequence[float]) -> Optional[str]:
    """A hint when the loss is not finite or did not go down, else None."""
    if not losses or not all(math.isfinite(x) for x in losses):
        return ("the loss became inf or NaN: check that backward runs on the scaled loss and "
                "the step goes through the scaler's step(), which unscales first (TODO 3).")
    window = min(LOSS_WINDOW, max(1, len(losses) // 2))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    if not last < first:
        return (f"the loss did not go down (first steps {first:.3f}, last steps {last:.3f}): "
                "the model is not learning; make sure every step calls backward and the "
                "optimizer step (TODO 3).")
    return None


# ----------------------------------------------------------------------------- 08 collectives

COLLECTIVE_FACTS = ("input", "average", "shifted", "ring_sum")


@judge("08", "collective.py", "average a tensor over ranks with all_reduce, and pass tensors "
       "round a ring with isend/irecv")
def judge_collective(result: Any) -> Optional[str]:
    facts, missing = _facts(result, COLLECTIVE_FACTS)
    if missing:
        return missing
    inputs = facts["input"]
    n = len(inputs)
    total = [sum(column) for column in zip(*(inputs[r] for r in range(n)))]
    mean = [value / n for value in total]
    hint = _average_hint(facts["average"], inputs, total, mean)
    if hint:
        return hint
    hint = _shift_hint(facts["shifted"], inputs)
    if hint:
        return hint
    for rank, got in sorted(facts["ring_sum"].items()):
        if not _close(got, total):
            return (f"rank {rank}: passing tensors {n - 1} times round the ring with your "
                    f"ring_shift gave {_short(got)}, not the sum {_short(total)}.")
    return None


def _close(got: Any, want: Sequence[float], tol: float = 1e-4) -> bool:
    try:
        values = [float(v) for v in got]
    except (TypeError, ValueError):
        return False
    return len(values) == len(want) and all(
        math.isclose(a, b, rel_tol=tol, abs_tol=tol) for a, b in zip(values, want))


def _short(values: Any) -> str:
    try:
        return "[" + ", ".join(f"{float(v):.3g}" for v in values) + "]"
    except (TypeError, ValueError):
        return repr(values)


def _average_hint(averages: dict[int, Any], inputs: dict[int, Any], total: Sequence[float],
                  mean: Sequence[float]) -> Optional[str]:
    """What each rank's average() returned against the mean it should have: a hint names the
    mistake (nothing exchanged, the sum instead of the mean) and the requirement, not the code."""
    n = len(inputs)
    for rank, got in sorted(averages.items()):
        if _close(got, mean):
            continue
        if _close(got, inputs[rank]):
            return (f"rank {rank}: average() returned the rank's own tensor {_short(got)}: "
                    f"nothing was exchanged, so each rank still holds only its own values. "
                    f"Every rank should return the element-wise mean of all {n} ranks' "
                    f"tensors, here {_short(mean)} (TODO 1).")
        if _close(got, total):
            return (f"rank {rank}: average() returned the sum over ranks {_short(got)}, {n} "
                    f"times the mean {_short(mean)}: the ranks did exchange and add, but a mean "
                    f"divides that sum by the number of ranks (TODO 1).")
        return (f"rank {rank}: average() returned {_short(got)}, but the mean of every rank's "
                f"input is {_short(mean)} (TODO 1).")
    return None


def _shift_hint(shifted: dict[int, Any], inputs: dict[int, Any]) -> Optional[str]:
    """What each rank's ring_shift() returned against its left neighbour's tensor."""
    n = len(inputs)
    for rank, got in sorted(shifted.items()):
        left, right = (rank - 1) % n, (rank + 1) % n
        if _close(got, inputs[left]):
            continue
        if _close(got, inputs[rank]):
            return (f"rank {rank}: ring_shift() returned the rank's own tensor: nothing "
                    f"arrived. It should return rank {left}'s tensor {_short(inputs[left])}, "
                    f"sent from its left while it sends its own to rank {right}, every rank at "
                    f"the same moment (TODO 2).")
        if n > 2 and _close(got, inputs[right]):
            return (f"rank {rank}: ring_shift() returned the tensor of its right neighbour "
                    f"(rank {right}); the ring turns the other way: each rank's tensor should "
                    f"travel to rank + 1, so rank {rank} gets rank {left}'s (TODO 2).")
        return (f"rank {rank}: ring_shift() returned {_short(got)}, but rank {left}'s tensor "
                f"{_short(inputs[left])} should have arrived from the left (TODO 2).")
    return None
