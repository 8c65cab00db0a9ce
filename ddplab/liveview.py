"""What a launch shows while it runs: rank-prefixed output, a progress bar, a live loss plot.

``LiveView`` is driven by ``ddplab.launch`` from the calling thread (the launcher's own view,
kept out of ``ddplab.launcher``'s modules and of ``ddplab.lab``, which the launcher never
imports). In JupyterLab the bar is an
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

    Printed once per kernel (``ddplab: lessons run 2 ranks on CPU with gloo (...) unless a cell
    asks for more``), from the facts ``doctor()`` gathered; not at all once ``doctor()`` printed
    it in this kernel (a course notebook's first cell). Nothing outside Jupyter.
    """
    from . import env

    if _PLAN_SHOWN or env.PLAN_PRINTED or not in_notebook():
        return None

    try:
        line = f"ddplab: lessons run {env.course_plan(env.probe())} unless a cell asks for more"
    except (RuntimeError, OSError, ValueError):  # no torch facts: the launch says what failed
        return None
    _PLAN_SHOWN.append(line)
    print(line, flush=True)
    return line


class LiveView:
    """Rank-prefixed output plus a progress bar and a live loss plot for one launch."""

    def __init__(self, quiet: bool = False, live: bool = True, min_interval: float = 1.0,
                 plan: bool = True):
        if plan and not quiet:   # (a one-process launch has no ranks to say anything of)
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
        """Update the bar and the plot from a worker event (rank 0's only); an event whose
        numbers are not numbers is left out (what a rank prints never breaks the caller)."""
        if not self.live or event.get("rank", 0) != 0:
            return
        try:
            if event["kind"] == "progress":
                self._progress(event)
            elif event["kind"] == "epoch" and "loss" in event and not self.from_progress:
                self.losses.append((float(event["epoch"]), float(event["loss"])))
                self._plot(force=False)
        except (TypeError, ValueError, KeyError):
            pass

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


def loss_figure(points: list[tuple[float, float]], title: Optional[str] = "training loss") -> Any:
    """(epoch, loss) points as a small matplotlib Figure (no pyplot state is touched), its
    epoch axis ticked at whole epochs only."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(4.5, 2.6), dpi=90)
    ax = fig.add_subplot()
    xs, ys = zip(*points)
    ax.plot(xs, ys, marker="o" if len(xs) < 30 else None)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def loss_png(points: list[tuple[float, float]], title: Optional[str] = "training loss") -> bytes:
    """Render (epoch, loss) points as a small PNG (``loss_figure``)."""
    buffer = io.BytesIO()
    loss_figure(points, title).savefig(buffer, format="png")
    return buffer.getvalue()
