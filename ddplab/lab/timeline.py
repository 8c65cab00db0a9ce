"""Pipeline timelines: who computed what when, how much of the time each stage sat idle.

The pipeline worker (``ddplab.workers.pipeline``) sends one ``span`` event per micro-batch and
phase: ``rank``, ``micro_batches``, ``micro``, ``phase`` (``forward`` or ``backward``),
``start`` and ``end`` in seconds since the step began. This module turns them into the
"bubble" (the share of time the stages sat idle) and a picture (kernel side, matplotlib only)::

    result = ddplab.launch("ddplab.workers.pipeline", 2, args=["--micro-batches", "1", "4"])
    runs = timeline.spans_by_run(result.events_of("span"))   # {1: [...], 4: [...]}
    timeline.bubble(runs[4]), timeline.ideal_bubble(stages=2, micro_batches=4)
    timeline.busy_shares(runs[4]), timeline.overlap(runs[4])   # {rank: busy / step}, seconds
    timeline.with_gaps(runs[4])          # the ideal step plus its hand-off gaps: {gap, work, idle}
    timeline.plot(runs)

Lesson: 11.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Mapping, Optional, Sequence

Span = Mapping[str, Any]
COLORS = {"forward": "tab:blue", "backward": "tab:orange"}


def spans_by_run(spans: Sequence[Span]) -> dict[int, list[Span]]:
    """Group ``span`` events by their run's micro-batch count (in increasing order)."""
    runs: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        runs[int(span["micro_batches"])].append(span)
    return {m: runs[m] for m in sorted(runs)}


def bubble(spans: Sequence[Span], stages: Optional[int] = None) -> float:
    """The idle share of a pipelined step: 1 - busy time / (stages x the step's duration).

    The step lasts from the first start to the last end over all ranks; a stage is busy while
    one of its spans runs (its own spans never overlap). Communication and waiting count as
    idle: that is the bubble.

    Args:
        spans: one step's spans, of every rank.
        stages: the number of stages (default: the ranks seen in ``spans``).
    """
    if not spans:
        raise ValueError("no spans: pass the span events of one run (see spans_by_run)")
    stages = stages or len({s["rank"] for s in spans})
    duration = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    busy = sum(s["end"] - s["start"] for s in spans)
    return 1.0 - busy / (stages * duration) if duration > 0 else 0.0


def busy_shares(spans: Sequence[Span]) -> dict[int, float]:
    """Each rank's busy time over the step's duration: ``{rank: share}``, in rank order.

    A slowdown that stretches every span alike (a busy machine) leaves the shares as they are;
    the bubble is ``1 - mean(shares)``.
    """
    if not spans:
        raise ValueError("no spans: pass the span events of one run (see spans_by_run)")
    duration = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    busy: dict[int, float] = defaultdict(float)
    for s in spans:
        busy[int(s["rank"])] += s["end"] - s["start"]
    return {r: (busy[r] / duration if duration > 0 else 0.0) for r in sorted(busy)}


def overlap(spans: Sequence[Span]) -> float:
    """Seconds during which two or more ranks were busy at once (0 when they took turns)."""
    edges = sorted([(s["start"], 1) for s in spans] + [(s["end"], -1) for s in spans])
    running, since, both = 0, 0.0, 0.0
    for time, step in edges:          # an end sorts before a start at the same instant
        if running >= 2:
            both += time - since
        running, since = running + step, time
    return both


def handoff_gaps(spans: Sequence[Span], rank: int, phase: str) -> list[float]:
    """Seconds between two ``phase`` spans in a row of ``rank``: its hand-off gaps.

    Rank 0 between two forwards, the last rank between two backwards, computes nothing: it
    sends one message with a blocking ``send``, which on gloo also waits until the receiving
    rank has posted its ``recv`` (notebook 08, section 2). A gap is that send plus that wait,
    not a send's cost alone.
    """
    own = sorted((s for s in spans if (s["rank"], s["phase"]) == (rank, phase)),
                 key=lambda s: s["start"])
    return [b["start"] - a["end"] for a, b in zip(own, own[1:])]


def with_gaps(spans: Sequence[Span], stages: Optional[int] = None) -> dict[str, float]:
    """GPipe's ideal step plus ``2 (M + S - 2)`` hand-off gaps on its path, from one run's spans.

    Returns:
        ``gap``: the median hand-off gap (see ``handoff_gaps``) of the first rank's forwards
        and the last rank's backwards (0 with one micro-batch); ``work``: compute per stage;
        ``idle``: the idle share of that step (seconds, except ``idle``).
    """
    if not spans:
        raise ValueError("no spans: pass the span events of one run (see spans_by_run)")
    stages = stages or len({s["rank"] for s in spans})
    m = int(spans[0]["micro_batches"])
    gaps = handoff_gaps(spans, 0, "forward") + handoff_gaps(spans, stages - 1, "backward")
    gap = statistics.median(gaps) if gaps else 0.0
    work = sum(s["end"] - s["start"] for s in spans) / stages
    step = (m + stages - 1) / m * work + 2 * (m + stages - 2) * gap
    return {"gap": gap, "work": work, "idle": 1 - work / step if step > 0 else 0.0}


def ideal_bubble(stages: int, micro_batches: int) -> float:
    """GPipe's bubble when every stage takes equal time and messages are free:
    ``(stages - 1) / (micro_batches + stages - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def plot(runs: Mapping[int, Sequence[Span]], title: Optional[str] = None) -> Any:
    """One timeline per micro-batch count: a row per rank, a bar per forward or backward.

    Bars are labelled with their micro-batch number; each panel's title gives the measured
    bubble beside the ideal one. All panels share the time axis (milliseconds).

    Returns:
        The matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(8, 1.0 + 1.1 * len(runs)))
    for ax, (micro_batches, spans) in zip(axes[:, 0], runs.items()):
        stages = len({s["rank"] for s in spans})
        t0 = min(s["start"] for s in spans)
        for s in spans:
            start, width = 1e3 * (s["start"] - t0), 1e3 * (s["end"] - s["start"])
            ax.broken_barh([(start, width)], (s["rank"] - 0.4, 0.8),
                           facecolors=COLORS.get(s["phase"], "grey"), edgecolor="white")
            if micro_batches <= 8:
                ax.text(start + width / 2, s["rank"], str(s["micro"]), ha="center",
                        va="center", fontsize=7, color="white")
        ax.set_yticks(range(stages), [f"rank {r}" for r in range(stages)])
        ax.set_ylim(stages - 0.5, -0.5)
        ax.set_title(f"{micro_batches} micro-batch{'es' if micro_batches > 1 else ''}: "
                     f"idle {bubble(spans, stages):.0%} (ideal "
                     f"{ideal_bubble(stages, micro_batches):.0%})", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time since the step began (ms)")
    fig.legend(handles=[Patch(color=c, label=p) for p, c in COLORS.items()],
               loc="upper right", ncol=2, fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout()
    return fig
