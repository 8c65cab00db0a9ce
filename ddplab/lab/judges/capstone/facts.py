"""What the capstone's judge reads from a run's reports: its arguments, every rank's step
reports, the final weights' summed squares, the accuracy; and how two numbers compare."""

from __future__ import annotations

import math
from typing import Any, Optional

from .... import env
from .. import metric, metrics


def _args(result: Any) -> dict[str, Any]:
    return metric(result, "args").get(0) or {}


def rank_steps(result: Any) -> dict[int, dict[int, Any]]:
    """Every rank's step reports, by step number: ``rank_steps(run)[0][5]["loss"]`` is rank 0's
    loss at step 5 (the notebook's plots and the judge read the same)."""
    return {rank: {s["step"]: s for s in values}
            for rank, values in metrics(result, "step").items()}


def summed_squares(result: Any) -> Optional[float]:
    """The summed squares of the final weights (summed over ranks' shards under FSDP): equal for
    two runs that end with the same weights, whatever their strategy or world size."""
    weights = metric(result, "weights")
    if not weights:
        return None
    if _args(result).get("strategy") == "fsdp":
        return sum(sum(w["squares"]) for w in weights.values())
    return sum(weights[min(weights)]["squares"])


def _accuracy(result: Any) -> Optional[float]:
    return metric(result, "accuracy").get(0)


def _close(a: Optional[float], b: Optional[float], rel: float) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _other_lr(a: Optional[float], b: Optional[float]) -> bool:
    """Two LRs that differ; None is a step the GradScaler skipped (overflowing float16
    gradients): it ran with no LR to compare."""
    return a is not None and b is not None and not _close(a, b, 1e-6)


def default_dtype(args: dict[str, Any], nprocs: int) -> str:
    """Autocast's dtype of a run: ``--amp-dtype``, else float16 where the ranks get a GPU each
    (as the jobs place them) and bfloat16 on CPU ranks."""
    return args.get("amp_dtype") or (
        "float16" if env.probe()["gpu_count"] >= nprocs else "bfloat16")
