"""The whole course: every notebook executed through nbval, as ``make test-notebooks`` does.

Target: at most 5 minutes on this 2-core machine: the median of 5 runs (``-n``; 1 with
``--quick``), against the budget (a fixed limit, so there is no baseline to interleave with).
The result records the machine's load before and after each run, and the time of every
notebook (from pytest's JUnit report, one test per cell; the median over the runs) beside
the total. Run: ``python benchmarks/bench_course.py [-n 5] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any

from common import HERE, PY, ROOT, figure, save, save_figure

BUDGET = 300.0  # seconds
CELL_TIMEOUT = 600  # as in the Makefile's test-notebooks


def notebook_times(junit: Path) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds and failed cells per notebook, from a pytest JUnit XML report."""
    seconds: dict[str, float] = defaultdict(float)
    failed: dict[str, int] = defaultdict(int)
    for case in ET.parse(junit).getroot().iter("testcase"):
        where = case.get("file") or case.get("classname") or "?"
        found = re.findall(r"([^/\\.]+)\.ipynb", where)
        name = f"{found[-1]}.ipynb" if found else where
        seconds[name] += float(case.get("time", 0.0))
        if case.find("failure") is not None or case.find("error") is not None:
            failed[name] += 1
    return dict(sorted(seconds.items())), dict(failed)


def run_course(notebooks: list[str]) -> dict[str, Any]:
    """Run nbval over ``notebooks`` once; return wall time, per-notebook times, outcome."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "course.xml"
        cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
               "--nbval-current-env", f"--nbval-cell-timeout={CELL_TIMEOUT}",
               f"--junitxml={junit}", *notebooks]
        env = {**os.environ, "MPLBACKEND": "Agg"}
        load = os.getloadavg()[0]
        start = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        seconds, failed = notebook_times(junit) if junit.exists() else ({}, {})
    return {"wall": wall, "notebooks": seconds, "failed_cells": failed,
            "returncode": out.returncode, "tail": out.stdout[-1500:],
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--repeats", type=int, help="default: 5, or 1 with --quick")
    parser.add_argument("--quick", action="store_true", help="one run")
    parser.add_argument("notebooks", nargs="*", help="default: every notebooks/*.ipynb")
    ns = parser.parse_args()
    repeats = ns.repeats or (1 if ns.quick else 5)
    notebooks = ns.notebooks or sorted(str(p.relative_to(ROOT))
                                       for p in (ROOT / "notebooks").glob("*.ipynb"))
    runs = [run_course(notebooks) for _ in range(repeats)]
    walls = [r["wall"] for r in runs]
    run = {
        "wall": statistics.median(walls),
        "notebooks": {nb: statistics.median(r["notebooks"].get(nb, 0.0) for r in runs)
                      for nb in runs[0]["notebooks"]},
        "failed_cells": {nb: n for r in runs for nb, n in r["failed_cells"].items()},
        "returncode": max((r["returncode"] for r in runs), key=abs),
        "tail": runs[-1]["tail"],
        "load_before": statistics.median(r["load_before"] for r in runs),
        "load_after": statistics.median(r["load_after"] for r in runs),
        "loads": [(r["load_before"], r["load_after"]) for r in runs],
    }
    name = f"course ({len(notebooks)} notebooks, nbval)"
    result = {
        "medians": {name: run["wall"]}, "samples": {name: walls},
        "baseline": None, "baseline_value": BUDGET, "baseline_label": "budget: 5 minutes",
        "ratios": {name: run["wall"] / BUDGET}, "unit": "s",
        "targets": {name: {"limit": BUDGET, "on": "value"}}, "repeats": repeats, **run,
        "note": f"median of {repeats} run(s), one after another; the load average before and "
                "after each run is recorded beside it",
    }
    if run["returncode"] != 0:
        result["note"] += f"; nbval FAILED (exit {run['returncode']}): {run['failed_cells']}"
    if run["wall"] > BUDGET:
        slowest = sorted(run["notebooks"].items(), key=lambda kv: -kv[1])[:3]
        result["why"] = {name: (
            f"the course took {run['wall']:.0f} s, {run['wall'] - BUDGET:.0f} s over budget, "
            f"with the machine's load average at {run['load_before']:.1f} -> "
            f"{run['load_after']:.1f} on {os.cpu_count()} cores; slowest notebooks: "
            + ", ".join(f"{n} {s:.0f} s" for n, s in slowest))}
    path = save("course", result)
    plot(result, HERE / "course.png")
    for notebook, seconds in run["notebooks"].items():
        print(f"{notebook:40s} {seconds:6.1f} s")
    print(f"{name:40s} {run['wall']:6.1f} s (budget {BUDGET:.0f} s), exit {run['returncode']}")
    print(f"wrote {path}")
    return result


def plot(result: dict[str, Any], path: Any) -> None:
    """Horizontal bars: seconds per notebook, stacked into the total, against the budget."""

    notebooks = result["notebooks"]
    fig, ax = figure(8, 0.35 * len(notebooks) + 2)
    names = list(notebooks) + ["whole course (wall)"]
    values = list(notebooks.values()) + [result["wall"]]
    colors = ["#4c72b0"] * len(notebooks) + ["#55a868"]
    ax.barh(range(len(names)), values, color=colors)
    for y, value in enumerate(values):
        ax.text(value, y, f" {value:.0f} s", va="center")
    ax.axvline(BUDGET, color="#c44e52", ls="--", label="budget: 300 s")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds (median of {result['repeats']} nbval run(s))")
    ax.set_title(f"Course run time ({time.strftime('%Y-%m-%d')})")
    ax.legend(loc="lower right")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
