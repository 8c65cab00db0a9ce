"""Lesson 04's sampler picture, drawn once or live (ipywidgets); what a launch shows while it
runs is ``ddplab.liveview`` (re-exported here).

Lessons: 04 (the sampler), every notebook that launches training (the live view).
"""

from __future__ import annotations

import io
from typing import Any

from ..liveview import LiveView, in_notebook, loss_png, show_plan_once  # noqa: F401


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
