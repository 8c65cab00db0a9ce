"""What a launch shows while it runs: rank-prefixed output, a progress bar, a live loss plot.

``LiveView`` is driven by ``ddplab.launch`` from the calling thread. In JupyterLab the bar is an
ipywidgets bar (tqdm.auto) and the loss plot is an image that is redrawn in place; in a terminal
or CI the bar is text on stderr and there is no plot.

Lessons: every notebook that launches training (01-09).
"""

from __future__ import annotations

import io
import sys
import time
from typing import Any, Optional


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where widgets and inline images render)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


_PLAN_SHOWN: list[str] = []  # the line show_plan_once printed in this kernel, if any


def show_plan_once() -> Optional[str]:
    """In a notebook, at its first launch: the doctor's one line on how the course runs here.

    Printed once per kernel (``ddplab: the course runs 2 ranks on CPU with gloo (...)``), from
    the facts the hardware cell's ``doctor()`` already gathered. Nothing outside Jupyter.
    """
    if _PLAN_SHOWN or not in_notebook():
        return None
    from .. import env

    try:
        line = f"ddplab: the course runs {env.course_plan(env.probe())}"
    except (RuntimeError, OSError, ValueError):  # no torch facts: the launch says what failed
        return None
    _PLAN_SHOWN.append(line)
    print(line, flush=True)
    return line


class LiveView:
    """Rank-prefixed output plus a progress bar and a live loss plot for one launch."""

    def __init__(self, quiet: bool = False, live: bool = True, min_interval: float = 1.0):
        if not quiet:
            show_plan_once()
        self.quiet = quiet
        self.live = live and not quiet
        self.min_interval = min_interval
        self.bar: Any = None
        self.losses: list[tuple[float, float]] = []
        self.from_progress = False
        self.handle: Any = None
        self.last_draw = 0.0

    def line(self, prefix: str, text: str, err: bool = False) -> None:
        """Print one output line of a rank (or the launcher) with its prefix (``err``: on
        stderr)."""
        if not self.quiet:
            stream = sys.stderr if err else sys.stdout
            if self.bar is not None and not in_notebook():
                self.bar.write(f"[{prefix}] {text}", file=stream)
            else:
                stream.write(f"[{prefix}] {text}\n")
                stream.flush()

    def event(self, event: dict[str, Any]) -> None:
        """Update the bar and the plot from a worker event (rank 0's only)."""
        if not self.live or event.get("rank", 0) != 0:
            return
        if event["kind"] == "progress":
            self._progress(event)
        elif event["kind"] == "epoch" and "loss" in event and not self.from_progress:
            self.losses.append((float(event["epoch"]), float(event["loss"])))
            self._plot(force=False)

    def _progress(self, event: dict[str, Any]) -> None:
        steps = int(event.get("steps") or 0)
        epochs = int(event.get("epochs") or 1)
        if not steps:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            # mininterval=0: progress events are few (a handful per epoch), and a held-back
            # update would leave a stuck job's bar showing stale progress.
            self.bar = tqdm(total=steps * epochs, desc="training", unit="step",
                            file=sys.stderr, leave=True, mininterval=0, miniters=1)
        done = (int(event.get("epoch", 1)) - 1) * steps + int(event.get("step", 0))
        self.bar.update(max(0, done - self.bar.n))
        if "loss" in event:
            self.bar.set_postfix(loss=f"{float(event['loss']):.4f}", refresh=False)
            # The loss curve over fractional epochs: informative even for a one-epoch run.
            self.from_progress = True
            self.losses.append((done / steps, float(event["loss"])))
            self._plot(force=False)

    def _plot(self, force: bool) -> None:
        if not in_notebook() or not self.losses:
            return
        now = time.monotonic()
        if not force and now - self.last_draw < self.min_interval:
            return
        self.last_draw = now
        from IPython.display import Image, display

        image = Image(data=loss_png(self.losses))
        if self.handle is None:
            self.handle = display(image, display_id=True)
        else:
            self.handle.update(image)

    def failure(self, result: Any) -> None:
        """Say clearly why a launch did not succeed."""
        if not self.quiet:
            sys.stderr.write(f"ddplab.launch: {result.error}\n")
            sys.stderr.flush()

    def close(self) -> None:
        """Finish the bar and draw the final plot."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.live:
            self._plot(force=True)


def loss_png(points: list[tuple[float, float]], title: Optional[str] = "training loss") -> bytes:
    """Render (epoch, loss) points as a small PNG (no pyplot state is touched)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 2.6), dpi=90)
    ax = fig.add_subplot()
    xs, ys = zip(*points)
    ax.plot(xs, ys, marker="o" if len(xs) < 30 else None)
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


# ------------------------------------------------------------------ lesson 04: sampler picture


def sampler_picture(dataset_len: int = 10, world_size: int = 3, epochs: int = 3, *,
                    shuffle: bool = True, drop_last: bool = False, seed: int = 0) -> Any:
    """Draw which indices each rank reads in each epoch, with and without ``set_epoch``.

    Two panels side by side: on the left the loop calls ``sampler.set_epoch(epoch)``, on the
    right it never does. One row per (epoch, rank), one cell per index in the order the rank
    reads it, coloured by index; padding repeats have a red frame.

    Args:
        dataset_len: number of samples.
        world_size: number of ranks.
        epochs: how many epochs to draw (rows per panel: ``epochs * world_size``).
        shuffle: the sampler's ``shuffle``.
        drop_last: the sampler's ``drop_last``.
        seed: the sampler's ``seed``.

    Returns:
        The matplotlib Figure (made with pyplot, so a notebook shows it inline).

    Lesson: 04.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    from .demos import sampling

    facts = sampling.padding(dataset_len, world_size, drop_last)
    cols, rows = facts["per_rank"], epochs * world_size
    width = min(16.0, max(8.0, 2.2 + 2 * (0.45 * cols + 0.3)))
    fig, axes = plt.subplots(1, 2, figsize=(width, 1.6 + 0.3 * rows), sharey=True,
                             squeeze=False)
    for ax, set_epoch in zip(axes[0], (True, False)):
        orders = sampling.epoch_orders(dataset_len, world_size, epochs, set_epoch=set_epoch,
                                       shuffle=shuffle, seed=seed, drop_last=drop_last)
        grid = np.array([share for epoch in orders for share in epoch], dtype=float).reshape(
            rows, cols)
        ax.imshow(grid, cmap="viridis", vmin=0, vmax=max(dataset_len - 1, 1), aspect="auto")
        for row in range(rows):
            rank = row % world_size
            for col in range(cols):
                if cols <= 24:
                    value = int(grid[row, col])
                    ax.text(col, row, str(value), ha="center", va="center", fontsize=8,
                            color="white" if value < 0.6 * dataset_len else "black")
                if not drop_last and sampling.is_padding(col, rank, dataset_len, world_size):
                    ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False,
                                           edgecolor="red", linewidth=2))
        for epoch in range(1, epochs):
            ax.axhline(epoch * world_size - 0.5, color="white", linewidth=3)
        ax.set_yticks(range(rows), [f"epoch {r // world_size} · rank {r % world_size}"
                                    for r in range(rows)])
        ax.set_xticks([])
        ax.set_xlabel("position in the rank's order")
        ax.set_title("with sampler.set_epoch(epoch)" if set_epoch else "without set_epoch",
                     fontsize=10)
    note = (f"{facts['unread']} sample(s) unread per epoch (drop_last)" if drop_last else
            f"{facts['repeats']} repeat(s) per epoch as padding (red frames)")
    fig.suptitle(f"{dataset_len} samples on {world_size} ranks, shuffle={shuffle}\n"
                 f"each rank reads {cols} indices; {note}", fontsize=10)
    fig.tight_layout()
    return fig


def figure_png(fig: Any) -> bytes:
    """Render a matplotlib Figure to PNG bytes and close it (so it is not shown twice)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    return buffer.getvalue()


def sampler_explorer(dataset_len: int = 10, world_size: int = 3, epochs: int = 3, *,
                     shuffle: bool = True, drop_last: bool = False) -> Any:
    """Sliders and checkboxes that redraw ``sampler_picture`` live (in JupyterLab).

    Args:
        dataset_len, world_size, epochs, shuffle, drop_last: the starting values.

    Returns:
        An ipywidgets ``VBox``: a row of controls (``.controls``, a dict by name) above the
        picture (an ``Image`` widget, ``.image``). Display it as the last line of a cell.

    Lesson: 04.
    """
    import ipywidgets as w

    controls = {
        "world_size": w.IntSlider(world_size, min=1, max=8, description="world size"),
        "dataset_len": w.IntSlider(dataset_len, min=1, max=48, description="dataset length"),
        "epochs": w.IntSlider(epochs, min=1, max=4, description="epochs"),
        "shuffle": w.Checkbox(shuffle, description="shuffle"),
        "drop_last": w.Checkbox(drop_last, description="drop_last"),
    }
    image = w.Image(format="png")

    def redraw(_: Any = None) -> None:
        values = {name: control.value for name, control in controls.items()}
        image.value = figure_png(sampler_picture(**values))

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    box = w.VBox([w.HBox(list(controls.values())[:3]), w.HBox(list(controls.values())[3:]),
                  image])
    box.controls, box.image = controls, image
    return box
