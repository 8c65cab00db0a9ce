"""Measure what scaling buys: throughput per setup, accuracy per global batch, all-reduce bandwidth.

Notebook 09 and ``python -m ddplab bench`` call the same functions, so both measure the same
way: every setup is one launch of ``ddplab.workers.train`` for ``repeats + 1`` epochs; the first
epoch is the warm-up and is left out; the result is the median samples/s of the others
(each epoch timed between two device synchronisations, as in notebook 01).

Example::

    rows = scaling_table("digits", repeats=3)
    print(markdown_table(rows))
    plot_speedup(rows)

    python -m ddplab bench                       # writes build/bench/bench.md and *.png
    python -m ddplab bench --repeats 5 --skip-accuracy --allreduce

Lessons: 08 (bus bandwidth, parameter server vs ring), 09 (scaling table, accuracy vs batch),
09b (all-reduces beside backward).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .. import env as _env
from ..launcher.api import launch

TRAIN = "ddplab.workers.train"
RING = "ddplab.workers.ring_allreduce"
#: What the source's timing table states about its setup. It never names its GPUs, so neither
#: do we: its rows are "the source's GPUs", whatever they were.
SOURCE_HARDWARE = ("ResNet-50 trained from scratch on CIFAR-10, batch 256 "
                   "(per GPU under DDP), one epoch, on the source's GPUs "
                   "(their model is not stated)")
SOURCE_LABEL = "source's GPUs"
# setup name -> (GPUs the source used, seconds per epoch the source reported)
SOURCE_SECONDS = {"single": (1, 13.2), "DataParallel": (4, 19.1), "DDP x2": (2, 9.8),
                  "DDP xN": (4, 6.1), "DDP xN + AMP": (4, 6.5)}
# Notebook 09's accuracy sweep per workload: the per-process batch times 1, 4 and 16, at an equal
# sample budget (``python -m ddplab bench`` runs the same sweep).
ACCURACY_SWEEP: dict[str, dict[str, Any]] = {
    "digits": dict(batch_size=16, global_batches=(16, 64, 256), lr=0.01, epochs=2),
    "synthetic": dict(batch_size=16, global_batches=(16, 64, 256), lr=0.01, epochs=2),
    "cifar10": dict(batch_size=128, global_batches=(128, 512, 2048), lr=0.05, epochs=4)}
POLICIES = {"same lr": [], "scaled lr": ["--scale-lr"],
            "scaled lr + warm-up": ["--scale-lr", "--warmup-epochs", "0.5"]}
#: Below this relative difference two speeds are not called different (notebook 06's rule).
NOISE = 0.10
#: Epochs of one run that differ by more than this (slowest over fastest - 1): a busy machine.
BUSY = 0.25
#: The row a setup's verdict compares with: its own run without AMP, else the single run.
REFERENCE = {"DDP xN + AMP": "DDP xN"}
#: Other work's load (1-minute load average, in cores) above this share of the cores: the
#: table's processes shared their cores with it, every row slowed alike (``busy_machine``).
BUSY_LOAD = 0.5


@dataclass
class Setup:
    """One row of the source's table: how many processes, which mode, AMP or not."""

    name: str
    nprocs: int
    mode: str
    devices: int
    amp: str = "off"
    same_as: Optional[str] = None  # measured already under another name (N = 2 here)
    repeats: Optional[int] = None  # measured epochs, when not the table's number


@dataclass
class Row:
    """One measured setup (all numbers from rank 0's summary of one launch)."""

    setup: Setup
    samples_per_s: float
    epoch_time: float
    accuracy: float
    global_batch: int
    samples_per_epoch: int
    checksums_equal: bool
    status: str
    wall_time: float
    speedup: float = float("nan")
    epoch_times: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # samples/s of each measured epoch
    loads: tuple[float, ...] = ()  # the 1-minute load average before and after the launch

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def workload_args(workload: str) -> list[str]:
    """Worker arguments of a workload: ``digits`` (default), ``synthetic`` or ``cifar10``."""
    if workload not in ("digits", "synthetic", "cifar10"):
        raise ValueError(f"unknown workload {workload!r}: use digits, synthetic or cifar10.")
    return ["--dataset", workload]


def plan(gpus: Optional[int] = None, cpus: Optional[int] = None) -> list[Setup]:
    """The source's five rows for this machine: N = GPUs, or CPU cores without GPUs.

    Lesson: 09.
    """
    gpus = _env.gpu_count() if gpus is None else gpus
    n = gpus if gpus > 0 else max(2, cpus or os.cpu_count() or 2)
    amp = "fp16" if gpus > 0 else "bf16"  # CPU autocast computes in bfloat16
    same = "DDP x2" if n == 2 else None
    # A CPU without bf16 units emulates every bf16 operation, tens of times slower than
    # float32 (notebook 06): one measured epoch after the warm-up shows it, at a fraction
    # of the time.
    amp_repeats = None if gpus > 0 else 1
    return [
        Setup("single", 1, "single", 1),
        Setup("DataParallel", 1, "dp", max(1, gpus)),
        Setup("DDP x2", 2, "ddp", 2),
        Setup("DDP xN", n, "ddp", n, same_as=same),
        Setup("DDP xN + AMP", n, "ddp", n, amp=amp, repeats=amp_repeats),
    ]


# [method]
def measure(setup: Setup, workload: str = "digits", *, repeats: int = 3, batch_size: int = 64,
            quiet: bool = True, timeout: Optional[float] = None) -> Row:
    """Train ``repeats + 1`` epochs of one setup; the first epoch is the warm-up.

    Args:
        setup: processes, mode and AMP of the run.
        workload: ``digits``, ``synthetic`` or ``cifar10``.
        repeats: measured epochs; the row holds their median (``setup.repeats`` wins).
        batch_size: per process (the global batch grows with the processes, as in the source).
        quiet: hide the workers' output.
        timeout: seconds before the launch is ended.

    Returns:
        A ``Row``; ``status`` says whether the launch succeeded.

    Lesson: 09.
    """
    repeats = setup.repeats or repeats
    args = [*workload_args(workload), "--epochs", repeats + 1, "--batch-size", batch_size,
            "--mode", setup.mode, "--amp", setup.amp, "--seed", 0]
    before = machine_load()
    result = launch(TRAIN, setup.nprocs, args=args, quiet=quiet, live=False, timeout=timeout)
    loads = () if before is None else (before, machine_load() or before)
    summary = result.summary or {}
    measured = summary.get("history", [])[1:]  # leave out the warm-up epoch
    nan = float("nan")
    times = [h["epoch_time"] for h in measured]
    return Row(
        setup=setup, status=result.status, wall_time=result.wall_time,
        samples_per_s=statistics.median([h["samples_per_s"] for h in measured]) if times else nan,
        epoch_time=statistics.median(times) if times else nan, epoch_times=times,
        rates=[h["samples_per_s"] for h in measured], loads=loads,
        accuracy=summary.get("final_accuracy", nan), global_batch=summary.get("global_batch", 0),
        samples_per_epoch=int(measured[0]["samples"]) if measured else 0,
        checksums_equal=len(set(summary.get("param_checksums_per_rank", [0, 1]))) == 1,
    )
# [/method]


def scaling_table(workload: str = "digits", *, repeats: int = 3, batch_size: int = 64,
                  setups: Optional[Sequence[Setup]] = None, quiet: bool = True,
                  timeout: Optional[float] = None) -> list[Row]:
    """Measure every setup of ``plan()`` (a repeated setup is measured once) and the speed-ups.

    Returns:
        One ``Row`` per setup, in the source's order; ``speedup`` = samples/s over the single
        run's samples/s.

    Lesson: 09.
    """
    rows: dict[str, Row] = {}
    for setup in setups or plan():
        if setup.same_as in rows:
            rows[setup.name] = Row(**{**asdict_shallow(rows[setup.same_as]), "setup": setup})
            continue
        if not quiet:
            print(f"measuring {setup.name} ({setup.nprocs} process(es), mode {setup.mode}, "
                  f"amp {setup.amp}) ...", flush=True)
        rows[setup.name] = measure(setup, workload, repeats=repeats, batch_size=batch_size,
                                   timeout=timeout)
    base = rows["single"].samples_per_s if "single" in rows else float("nan")
    for row in rows.values():
        row.speedup = row.samples_per_s / base
    return list(rows.values())


def asdict_shallow(row: Row) -> dict[str, Any]:
    """The fields of a row without copying nested dataclasses."""
    return {name: getattr(row, name) for name in Row.__dataclass_fields__}


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def source_model(gpus: Sequence[int] = (1, 2, 4)) -> dict[int, float]:
    """Notebook 09's step model fitted to the source's single and "DDP x2" epochs: the model's
    seconds per epoch for each GPU count (the exercise's expected values).

    Lesson: 09.
    """
    single, pair = SOURCE_SECONDS["single"][1], SOURCE_SECONDS["DDP x2"][1]
    allreduce = 2 * pair - single   # an epoch's all-reduces when each GPU sends the gradient once
    return {n: (single + 2 * (n - 1) / n * allreduce) / n for n in gpus}


def verdict(rates: Sequence[float], reference: Sequence[float], noise: float = NOISE,
            spread: Optional[Callable[[Sequence[float]], tuple[float, float]]] = None) -> str:
    """Say "faster", "slower" or "no clear difference": one run's speeds against another's.

    Notebook 06's rule: a difference is called only when the two spreads (slowest to fastest
    epoch or launch) do not overlap and the medians differ by more than ``noise``. A run of one
    epoch has no spread: its one value is its spread. ``spread`` gives another span of a run's
    values (notebook 02 passes the middle half, ``timing.middle_half``).

    Lesson: 09 (notebooks 06 and 02 apply the same rule to whole launches and to steps).
    """
    if not rates or not reference:
        return "n/a"
    span = spread or (lambda values: (min(values), max(values)))
    (low, high), (ref_low, ref_high) = span(rates), span(reference)
    ratio = statistics.median(rates) / statistics.median(reference)
    apart = low > ref_high or high < ref_low
    if apart and abs(ratio - 1) > noise:
        return "faster" if ratio > 1 else "slower"
    return "no clear difference"


def row_verdict(row: Row, rows: Sequence[Row]) -> str:
    """A row's verdict against its reference row (``REFERENCE``, else "single"), as table text.

    A row measured for one epoch says so: "1 epoch, no spread". DataParallel on one device is
    judged by ``fastest_epochs`` (its two runs were timed apart on a possibly busy machine).

    Lesson: 09.
    """
    by = {r.setup.name: r for r in rows}
    against = REFERENCE.get(row.setup.name, "single")
    if row.setup.name == "single" or against not in by:
        return "reference" if row.setup.name == "single" else "n/a"
    if row.setup.mode == "dp" and row.setup.devices == 1:
        times, other = row.epoch_times, by[against].epoch_times
        if not times or not other:
            return "n/a"
        dp = fastest_epochs(times, other)
        said = {"busy": "too noisy to compare", "within noise": "within noise",
                "a difference": "faster" if dp["ratio"] > 1 else "slower"}[dp["reading"]]
        return f"{said} vs {against} (fastest epochs, one device)"
    text = f"{verdict(row.rates, by[against].rates)} vs {against}"
    return text + ("; 1 epoch, no spread" if len(row.rates) == 1 else "")


def fastest_epochs(times: Sequence[float], other: Sequence[float],
                   noise: float = NOISE, busy: float = BUSY) -> dict[str, Any]:
    """Compare two runs by their fastest epochs, against how much each run's epochs spread.

    Other work on the machine can only slow an epoch down, so a run's fastest epoch is its
    best measurement, and the spread of its epochs is its noise.

    Returns:
        ``{"ratio": other's fastest epoch time over this one's (above 1: ``times`` ran
        faster), "widths": each run's slowest over fastest epoch - 1, "reading": "busy"
        (a run's epochs spread by more than ``busy``: too noisy to compare), "within noise"
        (the fastest epochs differ by no more than ``noise`` or than the wider spread), or
        "a difference"}``.

    Lesson: 09.
    """
    widths = tuple(max(t) / min(t) - 1 for t in (times, other))
    ratio = min(other) / min(times)
    if max(widths) > busy:
        reading = "busy"
    elif abs(ratio - 1) <= max(noise, *widths):
        reading = "within noise"
    else:
        reading = "a difference"
    return {"ratio": ratio, "widths": widths, "reading": reading}


def table_notes(rows: Sequence[Row], predicted: Optional[float] = None, gpus: int = 0) -> str:
    """What to read in the table, as text: the prediction, a busy machine, odd ratios.

    On a busy machine (``busy_machine``) the measured ratio flagged as unreliable, the
    prediction and one line saying so, nothing more.

    Lesson: 09.
    """
    by = {r.setup.name: r for r in rows}
    speedup = by["DDP x2"].samples_per_s / by["single"].samples_per_s
    load = busy_machine(rows)
    said = ("you did not predict" if predicted is None else f"you predicted {predicted}x: " + (
        "compare after a re-run" if load["busy"] else "right, within 0.25x"
        if abs(predicted - speedup) <= 0.25 else f"off by {abs(predicted - speedup):.2f}x"))
    lines = [f"DDP x2: measured {speedup:.2f}x, unreliable: machine busy; {said}" if load["busy"]
             else f"DDP x2: {speedup:.2f}x the single run; {said}"]
    if load["busy"]:  # the readings below would not hold: one line
        lines.append(f"machine busy: other processes kept about {load['others']:.1f} cores'"
                     f" worth of work on {load['cores']} cores (1-minute load average): re-run"
                     " the table when the machine is quiet")
        return "\n".join(lines)
    if load["others"] is not None:
        lines.append(f"other processes kept about {load['others']:.1f} cores' worth of work"
                     " running or waiting for a core (the 1-minute load average around the"
                     f" table, at least), on {load['cores']} cores")
    if speedup > 2:  # 2 processes: more than a second device can add
        lines.append("above 2x: more than a second process can add; the machine's load changed"
                     " between the runs, slowing the single run more (run the table again)")
    amp = by.get("DDP xN + AMP")
    if amp is not None and amp.speedup > amp.setup.nprocs:
        n = amp.setup.nprocs
        lines.append(f"DDP xN + AMP: {amp.speedup:.2f}x the single run from"
                     f" {len(amp.epoch_times)} epoch(s), above {n}x on {n} processes: the gain"
                     f" beyond DDP xN is autocast's {amp.setup.amp} compute here, not scaling")
    dp_row = by.get("DataParallel")
    if gpus == 0 and dp_row is not None and dp_row.epoch_times and by["single"].epoch_times:
        dp = fastest_epochs(dp_row.epoch_times, by["single"].epoch_times)
        lines.append(f"DataParallel (the single run's work, on one device): {dp_row.speedup:.2f}x"
                     f" the single run's median speed, fastest epoch {dp['ratio']:.2f}x as fast")
        for name, width in zip(("DataParallel", "single"), dp["widths"]):
            times = by[name].epoch_times
            lines.append(f"  {name} epochs {min(times):.3f}-{max(times):.3f} s: "
                         f"spread {width:.0%}")
        lines.append({
            "within noise": "the fastest epochs differ by no more than 10% or than a run's own"
                            " spread: within noise",
            "busy": f"a run's epochs spread by more than {BUSY:.0%}: the machine was busy, too"
                    " noisy to compare the two (run the table again)",
            "a difference": "the fastest epochs differ by more than 10% and more than either"
                            " run's spread: the same work timed at two moments, so the"
                            " machine's load changed in between (run the table again)"}
            [dp["reading"]])
    return "\n".join(lines)


def machine_text(rows: Sequence[Row], workload: str, gpus: int) -> str:
    """The two machines of the table, the epochs measured, and the CPU's bf16 instructions.

    Lesson: 09.
    """
    lines = [f"Benchmark post (notebook 01, section 5): {SOURCE_HARDWARE}.",
             f"Ours: {workload}, {gpus} GPU(s)" if gpus else
             f"Ours: {workload}, {os.cpu_count()}-core CPU, no GPU, gloo, one thread per process.",
             "measured epochs after the warm-up: "
             + ", ".join(f"{r.setup.name} {len(r.epoch_times)}" for r in rows)]
    if not gpus:
        lines.append(cpu_bf16_text())
    return "\n".join(lines)


def cpu_bf16_text(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """torch's widest CPU kernels, and the bf16 instructions the CPU lists (Linux:
    ``env.cpu_flags``; unknown elsewhere).

    Lesson: 09 (AMP's row on a CPU).
    """
    from torch.backends.cpu import get_cpu_capability

    flags = _env.cpu_flags(cpuinfo)
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in (flags or ())]
    listed = ", ".join(bf16) if bf16 else "none" if flags is not None else "unknown"
    return (f"torch.backends.cpu.get_cpu_capability() = {get_cpu_capability()}; "
            f"bf16 instructions listed by the CPU: {listed}")


def launch_rates(result: Any) -> dict[str, Any]:
    """A launch's epochs read as ``fit_epoch`` reports them: every rank's samples over rank 0's
    epoch time, the warm-up epoch left out.

    Returns:
        ``{"rates": samples/s per measured epoch, "samples_per_epoch", "accuracy" (the last
        epoch's), "epochs"}``.

    Lesson: 09 (the canonical script beside the table's worker).
    """
    epochs: dict[int, list[dict[str, Any]]] = {}
    for e in result.events_of("epoch"):
        epochs.setdefault(e["epoch"], []).append(e)
    rates = [sum(e["samples"] for e in es) / next(e["epoch_time"] for e in es if e["rank"] == 0)
             for epoch, es in sorted(epochs.items()) if epoch > 1]
    last = epochs[max(epochs)]
    return {"rates": rates, "samples_per_epoch": sum(e["samples"] for e in last),
            "accuracy": last[0]["accuracy"], "epochs": max(epochs)}


def loader_text(canonical: dict[str, Any], row: Row, pinned: bool = False,
                busy: bool = False) -> str:
    """The canonical script (``launch_rates``) beside the table's row, by notebook 06's rule;
    ``busy`` (``busy_machine``'s reading): no verdict, a re-run.

    Lesson: 09.
    """
    rate = statistics.median(canonical["rates"])
    said = "machine busy: re-run" if busy else verdict(row.rates, canonical["rates"])
    return "\n".join([
        f"DataLoader + DistributedSampler (plain_ddp.py): {rate:>7.0f} samples/s",
        f"tensor-resident loader (train worker, {row.setup.name}):  {row.samples_per_s:>7.0f}"
        " samples/s" + ("  (and its ranks pinned to cores)" if pinned else ""),
        f"the train worker against plain_ddp.py: {row.samples_per_s / rate:.2f}x, "
        f"{said} (notebook 06's rule)",
        f"test accuracy after {canonical['epochs']} epochs: plain_ddp.py "
        f"{canonical['accuracy']:.3f}, train worker {row.accuracy:.3f}"])


def machine_load() -> Optional[float]:
    """The 1-minute load average (runnable processes, in cores), None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_machine(rows: Sequence[Row], cores: Optional[int] = None) -> dict[str, Any]:
    """Did other work share the cores during the table? A slowdown of every row shows here.

    Each row's verdict compares it with another row, so a machine that slowed every row alike
    goes unnoticed there. The load average does not: before the first launch it holds no row of
    this table (but, being a 1-minute average, the notebook's own launches of the last minutes,
    such as a previous table's); after the last it also holds the table's own processes, at
    most the largest row's.

    Returns:
        ``{"before", "after": the 1-minute load average around the table (None: unknown),
        "others": other work's load, at least, "cores", "busy": others > BUSY_LOAD x cores}``.

    Lesson: 09.
    """
    cores = cores or os.cpu_count() or 1
    measured = [r.loads for r in rows if r.loads]
    if not measured:
        return {"before": None, "after": None, "others": None, "cores": cores, "busy": False}
    before, after = measured[0][0], measured[-1][1]
    own = max(r.setup.nprocs for r in rows)
    others = max(before, after - own)
    return {"before": before, "after": after, "others": others, "cores": cores,
            "busy": others > BUSY_LOAD * cores}


def markdown_table(rows: Sequence[Row]) -> str:
    """The source's table with our measurements beside its numbers, and each row's verdict.

    Our parallel efficiency is the speed-up over the ideal (our devices).

    A row that repeats another here ("DDP xN" with N = 2) has no measurement of its own: the
    source's N GPUs have no counterpart on this machine. On a busy machine (``busy_machine``)
    every verdict says so, and every speed-up and efficiency but the reference's reads "busy".

    Lesson: 09.
    """
    busy = busy_machine(rows)["busy"]
    lines = ["| setup | processes | our epoch (s) | our samples/s | our speed-up | our verdict | "
             "our ideal | our efficiency | source GPUs | source epoch (s) | source speed-up |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        gpus, seconds = SOURCE_SECONDS.get(row.setup.name, (None, float("nan")))
        amp = f", {row.setup.amp}" if row.setup.amp != "off" else ""
        said = row_verdict(row, rows)
        speedup = _fmt(row.speedup, ".2f")
        efficiency = _fmt(row.speedup / row.setup.devices, ".0%")
        if busy and said != "reference":  # a ratio of two moments' loads, not of the setups
            said, speedup, efficiency = "machine busy: re-run", "busy", "busy"
        ours = (f"{_fmt(row.epoch_time, '.2f')} | {_fmt(row.samples_per_s, '.0f')} | "
                f"{speedup} | {said}")
        if row.setup.same_as:
            ours = (f"n/a on this machine | n/a | n/a | N = {row.setup.nprocs}: "
                    f"the {row.setup.same_as} row")
            efficiency = "n/a"
        lines.append(
            f"| {row.setup.name} | {row.setup.nprocs}{amp} | {ours} | {row.setup.devices} "
            f"| {efficiency} | {gpus or ''} | "
            f"{_fmt(seconds, '.1f')} | "
            f"{_fmt(SOURCE_SECONDS['single'][1] / seconds, '.2f')} |")
    return "\n".join(lines)


def plot_speedup(rows: Sequence[Row], ax: Any = None) -> Any:
    """Speed-up against devices, ours and the source's, with the ideal line. Returns the figure.

    Lesson: 09.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _fig, ax = plt.subplots(figsize=(6, 4))
    ours = {r.setup.name: (r.setup.devices, r.speedup) for r in rows}
    source = {name: (gpus, SOURCE_SECONDS["single"][1] / seconds)
              for name, (gpus, seconds) in SOURCE_SECONDS.items()}
    most = max(d for d, _s in [*ours.values(), *source.values()])
    ax.plot([1, most], [1, most], "k--", lw=1, label="ideal: speed-up = devices")
    for points, who, color in ((ours, "ours", "C0"), (source, SOURCE_LABEL, "gray")):
        line = [points[n] for n in ("single", "DDP x2", "DDP xN") if n in points]
        ax.plot(*zip(*sorted(set(line))), "-o", color=color, label=f"{who}: single, DDP")
        for name, marker in (("DataParallel", "s"), ("DDP xN + AMP", "^")):
            if name in points:
                ax.plot(*points[name], marker, color=color, linestyle="none",
                        label=f"{who}: {name.replace('DDP xN + AMP', 'DDP + AMP')}")
    ax.set(xlabel="devices (GPUs, or CPU processes here)", ylabel="speed-up over one device",
           title="throughput speed-up against the ideal line")
    ax.legend(fontsize=7, loc="upper left")
    return ax.figure


# ------------------------------------------------------------------ accuracy vs global batch


def batch_runs(global_batches: Sequence[int], batch_size: int, max_procs: int = 2
               ) -> list[tuple[int, int, int]]:
    """How to reach each global batch: ``(global_batch, processes, grad_accum)``.

    Processes first (up to ``max_procs``), then gradient accumulation, which computes the same
    step as more processes would (notebook 03). Each global batch must be a multiple of
    ``batch_size``.
    """
    plan_ = []
    for global_batch in global_batches:
        if global_batch % batch_size:
            raise ValueError(f"global batch {global_batch} is not a multiple of the per-process "
                             f"batch {batch_size}: choose multiples (e.g. 16, 32, 64).")
        k = global_batch // batch_size
        procs = max(p for p in range(1, max_procs + 1) if k % p == 0)
        plan_.append((global_batch, procs, k // procs))
    return plan_


def accuracy_vs_batch(workload: str = "digits", *, global_batches: Sequence[int] = (16, 64, 256),
                      batch_size: int = 16, epochs: int = 2, lr: float = 0.01,
                      policies: Optional[dict[str, list[str]]] = None, max_procs: int = 2,
                      quiet: bool = True, timeout: Optional[float] = None
                      ) -> list[dict[str, Any]]:
    """Final test accuracy for each global batch and LR policy, at an equal sample budget.

    Every run sees the same samples (``epochs`` passes over the data); a larger global batch
    means fewer, larger steps. ``lr`` is tuned for ``batch_size``; "scaled lr" multiplies it by
    global batch / ``batch_size`` (the linear scaling rule); warm-up ramps it up over half an
    epoch. The smallest global batch has nothing to scale, so its one run serves every policy.

    Returns:
        One dict per (policy, global batch): ``policy``, ``global_batch``, ``nprocs``,
        ``grad_accum``, ``steps`` (optimizer steps of the run), ``lr`` (effective),
        ``accuracy``, ``losses`` (the training loss of each epoch), ``status``.

    Lesson: 09.
    """
    policies = POLICIES if policies is None else policies
    base: dict[str, Any] = {}
    found = []
    for global_batch, procs, accum in batch_runs(global_batches, batch_size, max_procs):
        for policy, extra in policies.items():
            if global_batch == batch_size and base:
                found.append({**base, "policy": policy})
                continue
            args = [*workload_args(workload), "--epochs", epochs, "--batch-size", batch_size,
                    "--grad-accum", accum, "--lr", lr, "--seed", 0, *extra,
                    *(["--mode", "single"] if procs == 1 else [])]
            result = launch(TRAIN, procs, args=args, quiet=quiet, live=False, timeout=timeout)
            summary = result.summary or {}
            history = summary.get("history", [])
            # optimizer steps, as fit_epoch counts them: ceil(loader batches / grad_accum)
            batches = math.ceil(history[0]["samples"] / procs / batch_size) if history else 0
            record = {"policy": policy, "global_batch": global_batch, "nprocs": procs,
                      "steps": len(history) * math.ceil(batches / accum),
                      "grad_accum": accum, "lr": summary.get("lr", float("nan")),
                      "accuracy": summary.get("final_accuracy", float("nan")),
                      "losses": [epoch["loss"] for epoch in summary.get("history", [])],
                      "status": result.status}
            found.append(record)
            if global_batch == batch_size:
                base = record
    return found


def accuracy_text(runs: Sequence[dict[str, Any]], rule: str = "rule", control: str = "same lr",
                  predicted: Optional[dict[int, Optional[bool]]] = None, margin: float = 0.05
                  ) -> str:
    """The runs of ``accuracy_vs_batch`` as a table, and why each larger batch fell short.

    A run of policy ``rule`` (the linear scaling rule) within ``margin`` of the smallest batch
    "carries". Otherwise its training loss tells why: it rose (the scaled rate made training
    unstable), or it fell and the run ended no more than ``margin`` above the ``control``
    policy at the same batch (the unchanged rate, as many steps): too few steps, which the
    scaled rate did not make up.

    Args:
        predicted: times the smallest batch -> the learner's guess that ``rule`` carries there.

    Lesson: 09.
    """
    small = min(r["global_batch"] for r in runs)
    base = next(r for r in runs if r["global_batch"] == small)
    lines = [f"{'run':<14}{'batch':>6}{'x':>4}{'procs':>6}{'accum':>6}{'steps':>6}{'lr':>7}"
             f"{'accuracy':>9}  training loss per epoch"]
    for r in [base, *[r for r in runs if r["global_batch"] > small]]:
        name = "small batch" if r is base else r["policy"]   # the smallest: one run
        losses = " -> ".join(f"{loss:.2f}" for loss in r["losses"])
        lines.append(f"{name:<14}{r['global_batch']:>6}{r['global_batch'] // small:>4}"
                     f"{r['nprocs']:>6}{r['grad_accum']:>6}{r['steps']:>6}{r['lr']:>7.3f}"
                     f"{r['accuracy']:>9.3f}  {losses}")
    lines.append("")
    same = {r["global_batch"]: r for r in runs if r["policy"] == control}
    carried = {}
    for r in runs:
        if r["global_batch"] == small or not r["policy"].startswith(rule):
            continue
        below = base["accuracy"] - r["accuracy"]
        times = r["global_batch"] // small
        said = f"{r['policy']} at {times}x: {100 * below:.1f} points below the small batch"
        if r["policy"] == rule:
            carried[times] = below <= margin
        if below <= margin:
            said += ": the rule carries"
        elif r["losses"][-1] > r["losses"][0]:
            said += ", training loss rose: unstable at the scaled rate" + (
                ", near chance" if r["accuracy"] < 0.2 else "")
        elif r["global_batch"] in same:
            gain = r["accuracy"] - same[r["global_batch"]]["accuracy"]
            said += (f", training loss fell; {100 * gain:+.1f} points against the unchanged rate"
                     f" in as many steps: " + ("too few steps, not made up by the scaled rate"
                                               if gain <= margin else "short, but the rule helped"))
        else:
            said += ", training loss fell: short"
        lines.append(said)
    for r in same.values():
        lines.append(f"{control} at {r['global_batch'] // small}x: "
                     f"{100 * (base['accuracy'] - r['accuracy']):.1f} points below, training loss "
                     + ("rose" if r["losses"][-1] > r["losses"][0] else "fell")
                     + f", {r['steps']} steps: what the fewer steps cost without the rule")
    for times, guess in (predicted or {}).items():
        if times in carried:
            lines.append(f"the rule carries at {times}x: {carried[times]}; " + (
                "you did not predict" if guess is None else
                f"you predicted {guess}: " + ("right" if guess == carried[times] else "not so")))
    return "\n".join(lines)


def plot_accuracy(runs: Sequence[dict[str, Any]], ax: Any = None) -> Any:
    """Accuracy against global batch, one line per LR policy. Returns the figure.

    Lesson: 09.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = sorted((r["global_batch"], r["accuracy"]) for r in runs if r["policy"] == policy)
        ax.plot(*zip(*mine), marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="global batch (per-process batch x processes x accumulation)",
           ylabel="test accuracy", title="same samples seen, growing global batch", ylim=(0, 1))
    ax.legend(fontsize=8)
    return ax.figure


# ------------------------------------------------------------------ all-reduce bandwidth


def bandwidth(nprocs: int = 2, *, max_bytes: int = 1 << 22, repeats: int = 5,
              backend: Optional[str] = None, quiet: bool = True,
              timeout: Optional[float] = None) -> list[dict[str, Any]]:
    """Bus bandwidth of ``dist.all_reduce`` and the from-scratch ring, per message size.

    Args:
        nprocs: processes (one per GPU with nccl).
        max_bytes: largest message; sizes grow by 4x from 1 KiB.
        repeats: timed runs per size (after one warm-up); the median counts.
        backend: None (nccl with enough GPUs, else gloo) or force one.
        quiet: hide the workers' output.
        timeout: seconds before the launch is ended.

    Returns:
        The workers' ``bandwidth`` events: ``algorithm``, ``bytes``, ``seconds``, ``algbw``,
        ``busbw`` (bytes/s); empty when the launch failed.

    Lesson: 08.
    """
    args = ["--bench", "--max-bytes", max_bytes, "--repeats", repeats, "--sizes", 1]
    result = launch(RING, nprocs, args=args, quiet=quiet, live=False, timeout=timeout,
                    backend=backend)
    return result.events_of("bandwidth")


def plot_bandwidth(rows: Sequence[dict[str, Any]], ax: Any = None) -> Any:
    """Bus bandwidth (MB/s) against message size, one line per algorithm. Returns the figure.

    Lesson: 08.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"all_reduce": "dist.all_reduce (library)", "ring": "ring from scratch"}
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        mine = sorted((r["bytes"], r["busbw"] / 1e6) for r in rows if r["algorithm"] == algorithm)
        ax.plot(*zip(*mine), marker="o", label=labels.get(algorithm, algorithm))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (MB/s)",
           title="all-reduce bus bandwidth = 2(n-1)/n x bytes / time")
    ax.legend(fontsize=8)
    return ax.figure


def traffic_model(world_sizes: Sequence[int], message_bytes: float = 1.0
                  ) -> list[dict[str, float]]:
    """Bytes sent + received per all-reduce: the busiest process of each scheme, and the ring's.

    Parameter server: the server receives ``n - 1`` gradients and sends ``n - 1`` results,
    ``2 (n - 1) M``; each worker moves ``2 M``. Ring: every process sends and receives
    ``2 (n - 1) / n M`` each, ``4 (n - 1) / n M`` in all: bounded by ``4 M`` whatever ``n``.

    Lesson: 08.
    """
    return [{"world_size": n, "server": 2 * (n - 1) * message_bytes,
             "ps_worker": 2 * message_bytes, "ring": 4 * (n - 1) / n * message_bytes}
            for n in world_sizes]


def plot_traffic(max_world: int = 32, measured: Sequence[dict[str, Any]] = (),
                 ax: Any = None) -> Any:
    """Traffic of the busiest process per all-reduce, in units of the message size.

    Args:
        max_world: the model's largest world size.
        measured: ``traffic`` events of the ring worker, drawn as points (bytes sent +
            received over the message size).

    Lesson: 08.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _fig, ax = plt.subplots(figsize=(6, 4))
    model = traffic_model(range(2, max_world + 1))
    sizes = [m["world_size"] for m in model]
    ax.plot(sizes, [m["server"] for m in model], label="parameter server: the server")
    ax.plot(sizes, [m["ps_worker"] for m in model], ":", label="parameter server: a worker")
    ax.plot(sizes, [m["ring"] for m in model], label="ring: every process")
    for event in measured:
        ratio = (event["bytes_sent"] + event["bytes_received"]) / event["message_bytes"]
        ax.scatter(len({e["rank"] for e in measured}), ratio, color="k", marker="x", zorder=3)
    ax.set(xlabel="processes n", ylabel="bytes sent + received / message size",
           title="all-reduce traffic per process (x: measured here)")
    ax.legend(fontsize=8)
    return ax.figure


# ------------------------------------------------------------------ command line


#: Names in a torch.profiler Chrome trace: autograd's work on one gradient; DDP's launch of a
#: bucket's all-reduce, on the main thread inside the gradient op whose hook filled the bucket;
#: gloo's all-reduce itself, on gloo's own threads.
# ------------------------------------------------------------------ one step's input (09b)


def option(args: Sequence[Any], name: str) -> float:
    """The value of ``name`` in a worker's argument list, 0 if it is not given."""
    args = list(args)
    return float(args[args.index(name) + 1]) if name in args else 0.0


def pipeline_steps(runs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rank 0's ``steps`` metric of its last epoch, per run of ``input_pipeline``.

    Lesson: 09b.
    """
    found = {}
    for name, run in runs.items():
        epochs = [e for e in run.events_of("metric") if e["name"] == "steps" and e["rank"] == 0]
        found[name] = epochs[-1]
    return found


def supply_ms(pipelines: dict[str, Sequence[Any]], batch: int) -> dict[str, float]:
    """ms to load one batch, ``batch x --decode-ms``, spread over the loader workers (none:
    the rank loads it itself).

    Lesson: 09b.
    """
    return {name: batch * option(args, "--decode-ms") / max(1.0, option(args, "--num-workers"))
            for name, args in pipelines.items()}


def pipeline_text(steps: dict[str, dict[str, Any]], supply: dict[str, float],
                  wait_only: Sequence[str] = ()) -> str:
    """One table of the runs' last epochs: supply, waits, compute, step, share waited.

    ``wait_only`` rows show their waits only (their compute was timed in another run).

    Lesson: 09b.
    """
    lines = ["rank 0's last epoch, ms per step. supply: BATCH x DECODE_MS / workers; wait and",
             "compute: medians; mean step: mean wait + mean compute; first: the first batch's",
             "wait; waited: the share of the epoch spent waiting",
             f"{'pipeline':<34}{'supply':>7}{'wait':>7}{'compute':>8}{'mean step':>10}"
             f"{'first':>7}{'waited':>7}"]
    for name, e in steps.items():
        compute, step = ("-", "-") if name in wait_only else (
            f"{e['compute_ms']:.1f}", f"{e['mean_wait_ms'] + e['mean_compute_ms']:.1f}")
        lines.append(f"{name:<34}{supply[name]:>7.1f}{e['wait_ms']:>7.1f}{compute:>8}{step:>10}"
                     f"{e['first_wait_ms']:>7.1f}{e['wait_share']:>7.0%}")
    return "\n".join(lines)


def forward_flops(model: Any, image: tuple[int, ...] = (1, 8, 8)) -> int:
    """Floating-point operations of one sample's forward through ``model`` (an input of shape
    ``image``), counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Lesson: 09b (how much more a wider CNN computes).
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, *image))
    return counter.get_total_flops()


def draws_text(runs: dict[str, Any], names: Sequence[str]) -> str:
    """Which processes loaded each rank's epochs 1 and 2, and each rank's first draws.

    Lesson: 09b.
    """
    lines = []
    for name in names:
        draws = loader_draws(runs[name])
        lines.append(name)
        for rank in (0, 1):
            first = [round(x, 3) for x in draws[rank, 0]["value"][:4]]
            lines.append(f"  rank {rank}: worker pids epoch 1 {draws[rank, 0]['workers']}, "
                         f"epoch 2 {draws[rank, 1]['workers']}; first draws {first}")
    return "\n".join(lines)


def loader_draws(run: Any) -> dict[tuple[int, int], dict[str, Any]]:
    """A run's ``draws`` metrics by ``(rank, epoch)``: the loading pids and the draws.

    Lesson: 09b.
    """
    return {(e["rank"], e["epoch"]): e for e in run.events_of("metric") if e["name"] == "draws"}


GRADIENT_OP = "autograd::engine::evaluate_function"
LAUNCH_OP = "c10d::allreduce_"
ALL_REDUCE_OP = "gloo:all_reduce"


def backward_overlap(trace: str | Path) -> dict[str, Any]:
    """When the all-reduces of one DDP step ran, beside the computation of the gradients.

    Reads a Chrome trace written by ``torch.profiler`` (``ddplab.workers.step_profile
    --trace-dir``): autograd's gradient ops, the ``record_function("backward")`` span around
    ``loss.backward()``, and every ``gloo:all_reduce``, in milliseconds from backward's first
    gradient op. A gradient op whose hook launched an all-reduce (``c10d::allreduce_`` inside
    it) computed only until that launch: the rest of its span is DDP handing the bucket over,
    which can last until gloo's thread has run, so it counts as communication, not computation.

    Returns:
        ``{"gradients_ms": when the last gradient op finished computing, "backward_ms": end of
        the ``backward`` span (None if the trace has none), "launches_ms": when DDP launched
        each bucket's all-reduce from inside a gradient op, in order (one before gradients_ms
        is a bucket handed to gloo while gradients were still to compute, whatever the
        machine's load), "all_reduces": [(start_ms, end_ms, thread), ...] in start order,
        "overlapped": how many started before gradients_ms (gloo's thread needs a free core
        for that: on a busy machine it can wait),
        "computing": [(start_ms, end_ms), ...] when a gradient op computed (their union),
        "busy_ms": the time at least one all-reduce ran (their union: on two threads they
        overlap), "hidden_ms": the part of it while a gradient op computed}``.

    Lesson: 09b.
    """
    spans = [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X"]
    grads = [e for e in spans if e["name"].startswith(GRADIENT_OP)]
    if not grads:
        raise ValueError(f"{trace}: no backward in this trace; "
                         "profile a step that calls backward()")
    start = min(e["ts"] for e in grads)
    launches = [e for e in spans if e["name"] == LAUNCH_OP]

    def computed(op: dict[str, Any]) -> tuple[float, float, Any]:
        end = op["ts"] + op["dur"]
        inside = [e["ts"] for e in launches
                  if e["tid"] == op["tid"] and op["ts"] <= e["ts"] < end]
        return (op["ts"] - start) / 1000, (min([end, *inside]) - start) / 1000, op["tid"]

    computing = sorted(computed(e) for e in grads)
    end = max(finish for _, finish, _ in computing)
    handed = sorted((e["ts"] - start) / 1000 for e in launches if any(
        g["tid"] == e["tid"] and g["ts"] <= e["ts"] < g["ts"] + g["dur"] for g in grads))
    backward = [(e["ts"] + e["dur"] - start) / 1000 for e in spans if e["name"] == "backward"]
    reduces = sorted(((e["ts"] - start) / 1000, (e["ts"] + e["dur"] - start) / 1000, e["tid"])
                     for e in spans if e["name"] == ALL_REDUCE_OP)
    return {"gradients_ms": end, "backward_ms": max(backward) if backward else None,
            "computing": [(a, b) for a, b in _merged(computing)],
            "launches_ms": handed, "all_reduces": reduces,
            "overlapped": sum(begin < end for begin, _, _ in reduces),
            "busy_ms": _length(_merged(reduces)),
            "hidden_ms": _length(_common(_merged(reduces), _merged(computing)))}


def _merged(intervals: Sequence[tuple[float, float, Any]]) -> list[tuple[float, float]]:
    """The union of ``(start, end, _)`` intervals (sorted by start), as disjoint intervals."""
    out: list[tuple[float, float]] = []
    for begin, finish, _ in intervals:
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], finish))
        elif finish > begin:
            out.append((begin, finish))
    return out


def _common(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
            ) -> list[tuple[float, float, None]]:
    """Where two sets of disjoint intervals overlap."""
    return [(max(x0, y0), min(x1, y1), None) for x0, x1 in a for y0, y1 in b
            if max(x0, y0) < min(x1, y1)]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of disjoint intervals."""
    return sum((finish - begin for begin, finish, *_ in intervals), 0.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddplab bench", description=__doc__.split("\n")[0])
    p.add_argument("--workload", "--dataset", dest="workload", default=os.environ.get(
        "DDPLAB_WORKLOAD", "digits"), choices=["digits", "synthetic", "cifar10"])
    p.add_argument("--repeats", type=int, default=3, help="measured epochs per setup")
    p.add_argument("--batch-size", type=int, default=64, help="per process, throughput runs")
    p.add_argument("--out", default="build/bench", help="folder for bench.md, *.png, *.json")
    p.add_argument("--skip-scaling", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--global-batches", type=int, nargs="+", default=None,
                   help="default: notebook 09's sweep for the workload (ACCURACY_SWEEP)")
    p.add_argument("--allreduce", action="store_true", help="also measure all-reduce bandwidth")
    p.add_argument("--timeout", type=float, default=None, help="seconds per launch")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ddplab bench``: measure, write bench.md, the plots and results.json.

    Returns:
        0 when every launch succeeded, 1 otherwise.
    """
    argv = list(argv or [])
    ns = _parser().parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    import matplotlib

    matplotlib.use("Agg")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    report = [f"# ddplab bench ({ns.workload})", ""]
    results: dict[str, Any] = {"workload": ns.workload, "repeats": ns.repeats}
    ok = True
    if not ns.skip_scaling:
        rows = scaling_table(ns.workload, repeats=ns.repeats, batch_size=ns.batch_size,
                             quiet=False, timeout=ns.timeout)
        ok &= all(r.ok for r in rows)
        plot_speedup(rows).savefig(out / "speedup.png", dpi=120, bbox_inches="tight")
        report += ["## Throughput", "", markdown_table(rows), "", f"Source: {SOURCE_HARDWARE}.",
                   f"Ours: {_machine()}, per-process batch {ns.batch_size}, median of "
                   f"{ns.repeats} epochs after one warm-up epoch.", "", "![](speedup.png)", ""]
        results["scaling"] = [{**asdict(r), "ok": r.ok} for r in rows]
    if not ns.skip_accuracy:
        sweep = dict(ACCURACY_SWEEP[ns.workload])
        if ns.global_batches:
            sweep["global_batches"] = tuple(ns.global_batches)
        runs = accuracy_vs_batch(ns.workload, timeout=ns.timeout, **sweep)
        ok &= all(r["status"] == "ok" for r in runs)
        plot_accuracy(runs).savefig(out / "accuracy.png", dpi=120, bbox_inches="tight")
        report += _section("Accuracy against global batch",
                           ["policy", "global batch", "lr", "accuracy"],
                           [[r["policy"], r["global_batch"], _fmt(r["lr"], ".3f"),
                             _fmt(r["accuracy"], ".3f")] for r in runs], "accuracy.png")
        results["accuracy"] = runs
    if ns.allreduce:
        rows_bw = bandwidth(timeout=ns.timeout)
        ok &= bool(rows_bw)
        if rows_bw:
            plot_bandwidth(rows_bw).savefig(out / "bandwidth.png", dpi=120, bbox_inches="tight")
        report += _section("All-reduce bus bandwidth (2 processes)",
                           ["algorithm", "bytes", "seconds", "busbw (MB/s)"],
                           [[r["algorithm"], r["bytes"], f"{r['seconds']:.6f}",
                             f"{r['busbw'] / 1e6:.1f}"] for r in rows_bw], "bandwidth.png")
        results["bandwidth"] = rows_bw
    (out / "bench.md").write_text("\n".join(report))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print("\n".join(report))
    print(f"\nwrote {out / 'bench.md'}")
    return 0 if ok else 1


def _section(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
             picture: str) -> list[str]:
    """Lines of one bench.md section: title, table (numbers right-aligned), picture."""
    lines = [f"## {title}", "", "| " + " | ".join(columns) + " |",
             "|---|" + "---:|" * (len(columns) - 1)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines + ["", f"![]({picture})", ""]


def _machine() -> str:
    facts = _env.probe()
    gpus = ", ".join(g["name"] for g in facts["gpus"])
    return f"{facts['gpu_count']} GPU(s) ({gpus})" if gpus else \
        f"{os.cpu_count()}-core CPU, no GPU, gloo, 1 thread per process"
