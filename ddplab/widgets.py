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


class LiveView:
    """Rank-prefixed output plus a progress bar and a live loss plot for one launch."""

    def __init__(self, quiet: bool = False, live: bool = True, min_interval: float = 1.0):
        self.quiet = quiet
        self.live = live and not quiet
        self.min_interval = min_interval
        self.bar: Any = None
        self.losses: list[tuple[float, float]] = []
        self.handle: Any = None
        self.last_draw = 0.0

    def line(self, prefix: str, text: str) -> None:
        """Print one output line of a rank (or the launcher) with its prefix."""
        if not self.quiet:
            out = f"[{prefix}] {text}\n"
            if self.bar is not None and not in_notebook():
                self.bar.write(out.rstrip("\n"), file=sys.stdout)
            else:
                sys.stdout.write(out)
                sys.stdout.flush()

    def event(self, event: dict[str, Any]) -> None:
        """Update the bar and the plot from a worker event."""
        if not self.live or event.get("rank", 0) != 0:
            return
        if event["kind"] == "progress":
            self._progress(event)
        if event["kind"] == "epoch" and "loss" in event:
            self.losses.append((float(event["epoch"]), float(event["loss"])))
            self._plot(force=False)

    def _progress(self, event: dict[str, Any]) -> None:
        steps = int(event.get("steps") or 0)
        epochs = int(event.get("epochs") or 1)
        if not steps:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=steps * epochs, desc="training", unit="step",
                            file=sys.stderr, leave=True)
        done = (int(event.get("epoch", 1)) - 1) * steps + int(event.get("step", 0))
        self.bar.update(max(0, done - self.bar.n))
        if "loss" in event:
            self.bar.set_postfix(loss=f"{float(event['loss']):.4f}", refresh=False)
            self.losses_partial = (done / steps, float(event["loss"]))

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
            sys.stderr.write(f"ddplab.launch: {result.status}: {result.error}\n")
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
    ax.plot(xs, ys, marker="o")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
