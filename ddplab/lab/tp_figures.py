"""Notebook 12's two schematics, labelled with what the run counted: where tensor parallel's
collectives sit in an MLP's forward and backward (column-wise then row-wise), and where sequence
parallel's sit at the edges of its TP region.

Each figure has one row of boxes per rank and one panel per pass; a collective is a bar across
every rank's row, labelled with the collectives the worker counted (``CommDebugMode``) in that
pass.

Lesson: 12.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

#: A step of a pass: a box per rank (text, or a function of the rank), or a collective, drawn
#: across the ranks (("collective", kind), the kind a prefix of torch's op names).
Step = Any


def _counted(counts: Mapping[str, int], kind: str) -> str:
    found = [f"{op} x{n}" for op, n in counts.items() if op.startswith(kind)]
    return "\n".join(found) or f"no {kind}"


def _panel(ax: Any, steps: Sequence[Step], counts: Mapping[str, int], nprocs: int,
           title: str) -> None:
    from matplotlib.patches import FancyBboxPatch

    for x, step in enumerate(steps):
        if isinstance(step, tuple):                     # a collective: one bar over every rank
            ax.add_patch(FancyBboxPatch((x - 0.3, -0.4), 0.6, nprocs - 0.2,
                                        boxstyle="round,pad=0.02", color="tab:red", alpha=0.25))
            ax.text(x, (nprocs - 1) / 2, _counted(counts, step[1]), ha="center", va="center",
                    fontsize=7, color="darkred", rotation=90)
            continue
        for rank in range(nprocs):
            text = step(rank) if callable(step) else step
            ax.add_patch(FancyBboxPatch((x - 0.42, rank - 0.35), 0.84, 0.7,
                                        boxstyle="round,pad=0.02", color="tab:blue", alpha=0.15))
            ax.text(x, rank, text, ha="center", va="center", fontsize=7)
    for x in range(len(steps) - 1):
        ax.annotate("", (x + 0.55, nprocs - 0.7), (x + 0.45, nprocs - 0.7),
                    arrowprops={"arrowstyle": "->", "color": "gray"})
    ax.set(xlim=(-0.6, len(steps) - 0.4), ylim=(nprocs - 0.4, -0.6), title=title)
    ax.set_yticks(range(nprocs), [f"rank {r}" for r in range(nprocs)], fontsize=8)
    ax.set_xticks([])
    for side in ax.spines.values():
        side.set_visible(False)


def _figure(passes: Sequence[tuple[str, Sequence[Step], Mapping[str, int]]], nprocs: int,
            title: str) -> Any:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(passes), figsize=(10, 0.55 * nprocs + 1.1))
    for ax, (name, steps, counts) in zip(axes, passes):
        _panel(ax, steps, counts, nprocs, name)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def colwise_rowwise(forward: Mapping[str, int], backward: Mapping[str, int], nprocs: int) -> Any:
    """``down(relu(up(x)))`` with ``up`` column-wise and ``down`` row-wise: what each rank holds
    at each step, and the run's collectives (``forward``, ``backward``) where they happen."""
    fwd = ["x\nwhole", "up(x): its\nhidden/N", "relu", "down: its\ncolumns\n-> Partial",
           ("collective", "all_reduce"), "y\nwhole"]
    bwd = ["dy\nwhole", "down's grad:\nits columns", "relu'", "up's grad:\nits rows;\ndx Partial",
           ("collective", "all_reduce"), "dx\nwhole"]
    return _figure([("forward", fwd, forward), ("backward (in the order it runs)", bwd, backward)],
                   nprocs, "MLP under ColwiseParallel (up) then RowwiseParallel (down): "
                   "collectives as counted")


def sequence_parallel(forward: Mapping[str, int], backward: Mapping[str, int], nprocs: int,
                      tokens: int) -> Any:
    """``x + mlp(norm(x))`` under sequence parallel: each rank's ``tokens`` outside the TP
    region, all of them inside, and the run's collectives at the region's edges."""
    def mine(what: str) -> Any:
        return lambda rank: f"{what}\ntokens {rank * tokens}-{(rank + 1) * tokens - 1}"

    fwd = [mine("x"), mine("norm"), ("collective", "all_gather"), "up, relu, down\nall tokens",
           ("collective", "reduce_scatter"), mine("x + mlp")]
    bwd = [mine("dy"), ("collective", "all_gather"), "down', relu', up'\nall tokens",
           ("collective", "reduce_scatter"), mine("norm'\ndx")]
    return _figure([("forward", fwd, forward), ("backward (in the order it runs)", bwd, backward)],
                   nprocs, "LayerNorm + MLP under sequence parallel: collectives as counted")
