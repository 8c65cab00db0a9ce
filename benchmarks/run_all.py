"""Run every benchmark (each in its own process), then write benchmarks/RESULTS.md from the JSON.

    python benchmarks/run_all.py                 # everything (``make bench``), about 30 minutes
    python benchmarks/run_all.py --quick         # fewer repeats, shorter runs
    python benchmarks/run_all.py --only ddp_cpu  # one benchmark (repeat --only for more)
    python benchmarks/run_all.py --render        # no runs: rewrite RESULTS.md and plots

RESULTS.md is rendered from ``results/*.json`` alone, so a benchmark that was not re-run keeps
its last figures (each section shows the date it was measured).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from common import HERE, PY, RESULTS, ROOT, figure, save_figure

# name -> (script, extra arguments in --quick mode)
BENCHES = {
    "launch": ("bench_launch.py", ["-n", "3"]),
    "ddp_cpu": ("bench_ddp_cpu.py", ["--quick"]),
    "data": ("bench_data.py", ["--quick"]),
    "course": ("bench_course.py", ["--quick"]),
}
# name -> (section title, what the target says)
SECTIONS = {
    "launch": ("Targets 1 and 2: launch cost",
               "Cold: `python -m ddplab launch --nproc-per-node 2 script.py` at most 0.50x plain "
               "`python -m torch.distributed.run --standalone --nproc-per-node 2 script.py` on a "
               "trivial gloo job. Warm: the second and later `ddplab.launch(...)` calls from one "
               "process at most 0.10x that torchrun, and in the same run at most 1.00x accelerate's "
               "`notebook_launcher` and 1.50x a bare fork of the same two processes."),
    "ddp_cpu": ("Target 3: DDP on CPU",
                "2 processes x 1 thread reach at least 0.90x the combined samples/s of two "
                "independent 1-thread processes running at the same time (the machine's own "
                "ceiling for two processes), on a CIFAR-shaped workload."),
    "data": ("Target 4: waiting for data",
             "With the tensor-resident loader, time waiting for data is at most 5% of step time; "
             "the torchvision-style per-sample DataLoader is measured beside it."),
    "course": ("Target 5: the whole course",
               "All notebooks through nbval in at most 5 minutes on this machine."),
}
# setups whose target number differs from their section's
TARGET_LABELS = {"ddplab launch CLI (cold)": "1", "ddplab.launch (warm)": "2"}


def run_bench(name: str, quick: bool) -> bool:
    """Run one benchmark script as a subprocess, streaming its output; True if it succeeded."""
    script, quick_args = BENCHES[name]
    cmd = [PY, str(HERE / script), *(quick_args if quick else [])]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    code = subprocess.call(cmd, cwd=ROOT)
    print(f"== {name}: exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
    return code == 0


# --------------------------------------------------------------------------------- rendering


def fmt(value: Optional[float], unit: str) -> str:
    """A measured value in its unit (fractions of step time as percentages)."""
    if value is None:
        return "-"
    if unit == "fraction of step time":
        return f"{100 * value:.1f}%"
    if unit == "samples/s":
        return f"{value:.0f} samples/s"
    return f"{value:.2f} {unit}" if value < 100 else f"{value:.0f} {unit}"


def normalise_target(spec: Any, higher_is_better: bool) -> dict[str, Any]:
    """A target as ``{limit, on: ratio|value, direction: max|min}`` (a bare number: a ratio)."""
    if not isinstance(spec, dict):
        spec = {"limit": float(spec), "on": "ratio"}
    direction = spec.get("direction") or ("min" if higher_is_better else "max")
    return {"limit": float(spec["limit"]), "on": spec.get("on", "ratio"), "direction": direction}


def verdict(data: dict[str, Any], name: str) -> tuple[str, str, Optional[bool]]:
    """``(target text, result text, met)`` of one measured setup ('' when it has no target)."""
    spec = data.get("targets", {}).get(name)
    if spec is None:
        return "", "", None
    target = normalise_target(spec, data.get("higher_is_better", False))
    unit = data.get("unit", "s")
    on_ratio = target["on"] == "ratio"
    value = data["ratios"][name] if on_ratio else data["medians"][name]
    limit = target["limit"]
    show = (lambda v: f"{v:.2f}x") if on_ratio else (lambda v: fmt(v, unit))
    sign = "<=" if target["direction"] == "max" else ">="
    met = value <= limit if target["direction"] == "max" else value >= limit
    gap = abs(limit - value)
    relative = f"{100 * gap / limit:.0f}%" if limit else ""
    if on_ratio:
        word = f"{gap:.2f}x ({relative} of the target)"
    else:
        word = show(gap) if unit != "fraction of step time" else f"{100 * gap:.1f} points"
    result = f"**met**, {word} to spare" if met else f"**missed** by {word}"
    return f"{sign} {show(limit)}", result, met


def table(data: dict[str, Any]) -> list[str]:
    """The baseline in one line, then a table: every setup's median, ratio and verdict."""
    unit = data.get("unit", "s")
    base = data.get("baseline")
    base_value = data["medians"][base] if base else data.get("baseline_value")
    base_label = base or data.get("baseline_label", "-")
    lines = [f"Baseline: {base_label}, median {fmt(base_value, unit)}"
             + (" (measured in the same run, interleaved)." if base else "."), "",
             "| setup | runs | median | ratio to baseline | target | result |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, median in data["medians"].items():
        target, result, _ = verdict(data, name)
        runs = len(data.get("samples", {}).get(name, []))
        label = f"{name} (baseline)" if name == base else name
        lines.append(f"| {label} | {runs} | {fmt(median, unit)} | {data['ratios'][name]:.2f}x | "
                     f"{target} | {result} |")
    return lines


def spread(data: dict[str, Any], name: str) -> Optional[str]:
    """Run by run, the ratio of ``name`` to the baseline run beside it (or its value, for an
    absolute target), and how many met.

    A median that is met by a hair and runs that scatter widely around it tell a different
    story than the median alone.
    """
    spec, base = data.get("targets", {}).get(name), data.get("baseline")
    samples = data.get("samples", {})
    if spec is None or not base or len(samples.get(name, [])) != len(samples.get(base, [1])):
        return None
    target = normalise_target(spec, data.get("higher_is_better", False))
    if target["on"] != "ratio":  # an absolute figure: each run against it
        values = sorted(samples[name])
        met = sum((v <= target["limit"]) if target["direction"] == "max"
                  else (v >= target["limit"]) for v in values)
        unit = data.get("unit", "s")
        return (f"{name}, run by run: {fmt(values[0], unit)} to {fmt(values[-1], unit)}; "
                f"{met} of {len(values)} runs met the target.")
    ratios = sorted(c / b for c, b in zip(samples[name], samples[base]) if b)
    met = sum((r <= target["limit"]) if target["direction"] == "max" else (r >= target["limit"])
              for r in ratios)
    return (f"{name}, run by run (each against the baseline run beside it): "
            f"{ratios[0]:.2f}x to {ratios[-1]:.2f}x; {met} of {len(ratios)} runs met the target.")


def facts(data: dict[str, Any]) -> str:
    """One line: when and where it was measured."""
    m = data.get("machine", {})
    load = data.get("load_median")
    extra = f", median 1-min load average {load:.1f}" if load is not None else ""
    return (f"Measured {m.get('date', '?')} on {m.get('cores', '?')} cores ({m.get('cpu', '?')}), "
            f"{m.get('gpus', 0)} GPUs, Python {m.get('python', '?')}, torch "
            f"{m.get('torch', '?')}{extra}.")


def section(name: str, title: str, text: str, data: Optional[dict[str, Any]]) -> list[str]:
    """The RESULTS.md section of one benchmark."""
    lines = [f"## {title}", "", text, ""]
    if data is None:
        return lines + [f"Not measured yet: run `python benchmarks/run_all.py --only {name}`.", ""]
    lines += [facts(data), ""]
    if data.get("workload"):
        lines += [f"Workload: {data['workload']}.", ""]
    lines += table(data) + [""]
    spreads = [text for text in (spread(data, n) for n in data["medians"]) if text]
    lines += [f"- {text}" for text in spreads] + ([""] if spreads else [])
    if data.get("note"):
        lines += [f"Note: {data['note']}.", ""]
    if data.get("findings"):
        lines += [f"- {finding}" for finding in data["findings"]] + [""]
    missed = [n for n in data["medians"] if verdict(data, n)[2] is False]
    for setup in missed:
        why = data.get("why", {}).get(setup, "no explanation was recorded by the benchmark.")
        lines += [f"Why {setup} missed: {why}", ""]
    extras = {"step_ms": "ms per step", "samples_per_s": "samples/s"}
    for key, label in extras.items():
        if isinstance(data.get(key), dict):
            cells = ", ".join(f"{n}: {v:.1f}" for n, v in data[key].items())
            lines += [f"Median {label}: {cells}.", ""]
    if isinstance(data.get("notebooks"), dict) and data["notebooks"]:
        lines += ["| notebook | seconds (sum of its cells) |", "| --- | --- |"]
        lines += [f"| {n} | {s:.1f} |" for n, s in data["notebooks"].items()] + [""]
    picture = HERE / f"{name}.png"
    if picture.exists():
        lines += [f"![{title}]({picture.name})", ""]
    return lines


def plot_launch(data: dict[str, Any], path: Path) -> None:
    """Bar chart of the launch benchmark (its script writes only JSON)."""

    names = list(data["medians"])
    fig, ax = figure(7, 0.8 + 0.3 * len(names))
    ax.barh(range(len(names)), [data["medians"][n] for n in names],
            color=["#999"] + ["#4c72b0"] * (len(names) - 1))
    for y, name in enumerate(names):
        ax.text(data["medians"][name], y, f"  {data['ratios'][name]:.2f}x", va="center")
    base = data["medians"][data["baseline"]]
    for name, spec in data.get("targets", {}).items():
        target = normalise_target(spec, False)
        limit = target["limit"] if target["on"] == "value" else target["limit"] * base
        ax.plot([limit] * 2, [names.index(name) - 0.4, names.index(name) + 0.4],
                color="#c44e52", ls="--")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per launch (median; red: target)")
    ax.set_title(f"Launch cost on a trivial gloo job ({data['machine']['date'][:10]})")
    save_figure(fig, path)


def render() -> Path:
    """Write benchmarks/RESULTS.md from every results/*.json."""
    loaded = {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}
    if "launch" in loaded:
        plot_launch(loaded["launch"], HERE / "launch.png")
    lines = ["# Benchmark results", "",
             "Written by `make bench` (`python benchmarks/run_all.py`) from "
             "`benchmarks/results/*.json`. Every figure is the median of interleaved runs with "
             "its baseline measured in the same run (this machine is shared, so only same-run "
             "ratios mean much); the date, machine and torch version head each section.", "",
             "| target | setup | measured | target | result |", "| --- | --- | --- | --- | --- |"]
    for name, (title, _) in SECTIONS.items():
        data = loaded.get(name)
        label = title.split(":")[0].replace("Targets", "").replace("Target", "").strip()
        if data is None:
            lines.append(f"| {label} | not measured | | | |")
            continue
        for setup in data["medians"]:
            target, result, met = verdict(data, setup)
            number = TARGET_LABELS.get(setup, label)
            if met is not None:
                on_ratio = normalise_target(data["targets"][setup], False)["on"] == "ratio"
                value = (f"{data['ratios'][setup]:.2f}x" if on_ratio
                         else fmt(data["medians"][setup], data.get("unit", "s")))
                lines.append(f"| {number} | {setup} | {value} | {target} | {result} |")
    lines.append("")
    for name, (title, text) in SECTIONS.items():
        lines += section(name, title, text, loaded.get(name))
        # measurements beside the target's own run: results/<name>_*.json carry their titles
        for extra in sorted(stem for stem in loaded if stem.startswith(name + "_")):
            data = loaded[extra]
            lines += section(extra, data.get("title", extra), data.get("description", ""), data)
    path = HERE / "RESULTS.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(BENCHES), metavar="NAME",
                        help=f"run only this benchmark ({', '.join(BENCHES)}); repeatable")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter runs")
    parser.add_argument("--render", action="store_true", help="only rewrite RESULTS.md")
    ns = parser.parse_args()
    failed = []
    if not ns.render:
        for name in ns.only or list(BENCHES):
            if not run_bench(name, ns.quick):
                failed.append(name)
    print(f"wrote {render()}")
    if failed:
        print(f"failed: {', '.join(failed)} (their sections keep the previous figures)",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
