"""Figures and tables the notebooks draw from run results (kernel side, matplotlib only).

Every figure function builds its figure with pyplot and returns it, so a notebook shows it
inline (JupyterLab) and a test can inspect it (``MPLBACKEND=Agg``). Tables are fixed-width text,
printed and returned. ``save_result`` / ``load_result`` keep small JSON results (a baseline)
in ``results/`` beside the notebooks (or ``$DDPLAB_RESULTS``) for later notebooks, which must
also work when the file is missing.

    history = result.summary["history"]                  # from ddplab.launch(...)
    plots.table([{"run": "single", "accuracy": 0.95}])
    plots.curves({"single": history})

Lessons: 01, 02, 03 (and later notebooks that append their own figures below).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..workspace import results_dir
History = Sequence[Mapping[str, Any]]


# ------------------------------------------------------------------ tables


def _cell(value: Any) -> str:
    """Format one table cell: floats with 4 significant digits, the rest as text."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def table(rows: Sequence[Mapping[str, Any]], columns: Optional[Sequence[str]] = None,
          title: Optional[str] = None, quiet: bool = False) -> str:
    """Print rows of dicts as a fixed-width table and return its text.

    Args:
        rows: one dict per row; missing keys leave the cell empty.
        columns: column order (default: keys in order of first appearance).
        title: a line printed above the table.
        quiet: return the text without printing it.

    Returns:
        The table as text.

    Lesson: 01, 02, 03.
    """
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = [("  ".join(c.ljust(w) for c, w in zip(columns, widths))).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += [("  ".join(v.ljust(w) for v, w in zip(r, widths))).rstrip() for r in cells]
    text = "\n".join(([title] if title else []) + lines)
    if not quiet:
        print(text)
    return _Printed(text) if not quiet else text


class _Printed(str):
    """Text already printed: a notebook cell ending in ``table(...)`` does not echo it again."""

    def _ipython_display_(self) -> None:
        pass


# ------------------------------------------------------------------ figures


def curves(runs: Mapping[str, History], title: Optional[str] = None) -> Any:
    """Plot training loss and test accuracy per epoch for one or more runs, side by side.

    Args:
        runs: run name -> ``summary["history"]`` (dicts with epoch, loss, accuracy).
        title: the figure's title.

    Returns:
        The matplotlib Figure.

    Lesson: 01, 03.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    for name, history in runs.items():
        epochs = [h["epoch"] for h in history]
        left.plot(epochs, [h["loss"] for h in history], marker="o", label=name)
        right.plot(epochs, [h["accuracy"] for h in history], marker="o", label=name)
    left.set(xlabel="epoch", ylabel="training loss", yscale="log")
    right.set(xlabel="epoch", ylabel="test accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    right.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def epoch_times(history: History, warmup: int = 1, title: Optional[str] = None) -> Any:
    """Bar chart of each epoch's time: warm-up epochs in grey, the median of the rest as a line.

    Args:
        history: ``summary["history"]`` (dicts with epoch and epoch_time).
        warmup: how many leading epochs are warm-up (left out of the median).
        title: the axes' title (default says what the median is).

    Returns:
        The matplotlib Figure.

    Lesson: 01.
    """
    import matplotlib.pyplot as plt

    times = [h["epoch_time"] for h in history]
    timed = times[warmup:] or times
    median = statistics.median(timed)
    fig, ax = plt.subplots(figsize=(5.5, 3))
    colours = ["lightgrey" if i < warmup else "tab:blue" for i in range(len(times))]
    ax.bar([h["epoch"] for h in history], times, color=colours)
    ax.axhline(median, color="tab:red", linestyle="--",
               label=f"median of {len(timed)} timed epochs: {median:.3g} s")
    ax.set(xlabel="epoch (grey: warm-up, not timed)", ylabel="seconds",
           title=title or "time per epoch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bars(values: Mapping[str, float], ylabel: str, title: Optional[str] = None,
         reference: Optional[float] = None, reference_label: str = "") -> Any:
    """One bar per named value, labelled with the value; optionally a horizontal reference line.

    Args:
        values: bar name -> value.
        ylabel: what the values are.
        title: the axes' title.
        reference: draw a dashed line at this value (e.g. chance level, or the baseline).
        reference_label: the legend text of that line.

    Returns:
        The matplotlib Figure.

    Lesson: 02, 03.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(values), 3.2))
    drawn = ax.bar(list(values), list(values.values()), color="tab:blue")
    ax.bar_label(drawn, labels=[_cell(float(v)) for v in values.values()], fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="tab:red", linestyle="--", label=reference_label or None)
        if reference_label:
            ax.legend(fontsize=8)
    ax.set(ylabel=ylabel, title=title or "")
    ax.set_ylim(0, 1.3 * max([*values.values(), reference or 0, 1e-12]))  # room for labels
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def grouped_bars(groups: Mapping[str, Mapping[str, float]], ylabel: str,
                 title: Optional[str] = None) -> Any:
    """Bars grouped by label, one colour per series (e.g. the source's numbers beside ours).

    Args:
        groups: series name -> {bar label -> value}; labels missing from a series are skipped.
        ylabel: what the values are.
        title: the axes' title.

    Returns:
        The matplotlib Figure.

    Lesson: 02, 03.
    """
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for series in groups.values() for label in series))
    width = 0.8 / max(1, len(groups))
    fig, ax = plt.subplots(figsize=(2 + 1.4 * len(labels), 3.2))
    for i, (name, series) in enumerate(groups.items()):
        xs = [j + (i - (len(groups) - 1) / 2) * width for j, label in enumerate(labels)
              if label in series]
        ys = [series[label] for label in labels if label in series]
        drawn = ax.bar(xs, ys, width=width, label=name)
        ax.bar_label(drawn, labels=[_cell(float(y)) for y in ys], fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set(ylabel=ylabel, title=title or "")
    top = max([v for series in groups.values() for v in series.values()] + [1e-12])
    ax.set_ylim(0, 1.35 * top)  # room for the value labels and the legend
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def share_grid(panels: Mapping[str, Sequence[Sequence[float]]], rows: Sequence[str],
               columns: Sequence[str], title: Optional[str] = None) -> Any:
    """One small grid per panel, each cell shaded and labelled with a share (0 to 1).

    Args:
        panels: panel title -> one list per row of ``rows``, one share per column.
        rows: the rows' labels (e.g. ranks).
        columns: the columns' labels (e.g. what is held).
        title: the figure's title.

    Returns:
        The matplotlib Figure.

    Lesson: 11.
    """
    import matplotlib.pyplot as plt

    size = (1.0 + 0.8 * len(columns) * len(panels), 2.0 + 0.4 * len(rows))
    fig, axes = plt.subplots(1, len(panels), squeeze=False, figsize=size)
    for ax, (name, grid) in zip(axes[0], panels.items()):
        ax.imshow([list(row) for row in grid], cmap="Blues", vmin=0, vmax=1.4, aspect="auto")
        for i, row in enumerate(grid):
            for j, share in enumerate(row):
                ax.text(j, i, f"{share:.0%}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right", fontsize=7)
        ax.set_yticks(range(len(rows)), rows if ax is axes[0][0] else [""] * len(rows),
                      fontsize=8)
        ax.set_title(name, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ results between notebooks


def save_result(name: str, values: Mapping[str, Any]) -> Path:
    """Write ``values`` as ``<results_dir>/<name>.json`` and return the path.

    Lesson: 01 (the baseline later notebooks compare against).
    """
    path = results_dir() / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(values), indent=1, default=str) + "\n")
    return path


def load_result(name: str) -> Optional[dict[str, Any]]:
    """Read a result written by ``save_result``, or None when it does not exist (yet).

    Lesson: 02, 03, 09 (compare with notebook 01's baseline when it was run).
    """
    path = results_dir() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
