"""Shared by the benchmarks: interleaved repeats, medians, machine facts, result files.

Every benchmark measures its baseline in the same run, interleaved with the candidate
(A B A B ...), and reports the median of each and their ratio: this machine is shared and
noisy, so only same-run ratios mean anything.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PY = sys.executable


def timed(fn: Callable[[], Any]) -> float:
    """Seconds that ``fn()`` took (wall clock)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_cmd(cmd: list[str], **kwargs: Any) -> None:
    """Run a command to completion; raise with its output if it fails."""
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kwargs)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({out.returncode}):\n{out.stdout[-2000:]}"
                           f"\n{out.stderr[-2000:]}")


def interleaved(candidates: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Call each candidate ``repeats`` times, alternating; each call returns its own timing."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            times[name].append(fn())
    return times


def summary(times: dict[str, list[float]], baseline: str) -> dict[str, Any]:
    """Medians of each candidate and their ratio to the baseline's median."""
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "medians": medians,
        "ratios": {name: medians[name] / medians[baseline] for name in medians},
        "samples": times,
        "baseline": baseline,
    }


def machine() -> dict[str, Any]:
    """Date, host facts and versions to print beside every figure."""
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "gpus": 0 if not torch.cuda.is_available() else torch.cuda.device_count(),
    }


def save(name: str, data: dict[str, Any]) -> Path:
    """Write one benchmark's result as JSON under benchmarks/results/."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"machine": machine(), **data}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def figure(width: float, height: float) -> tuple[Any, Any]:
    """A new matplotlib figure and axes, drawn off-screen (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def save_figure(fig: Any, path: Any) -> None:
    """Lay out, write as PNG and close a figure made by ``figure``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
