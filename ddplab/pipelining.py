"""A pipeline's two passes by hand, for the pipeline worker (``ddplab.workers.pipeline``):
every micro-batch forward through a stage (receive from the left, compute, send right), then
every micro-batch backward, last first (receive from the right, compute, send left), each pass
timed per micro-batch.

Kept apart from the worker because notebook 11 shows the worker's file before its exercise (one
step of a two-stage pipeline, both passes, by hand) and these two functions after the verdict::

    timeline = Timeline(info.device)
    inputs, outputs = forward(stage, list(x.chunk(4)), hidden, info, timeline)
    backward(inputs, outputs, list(y.chunk(4)), info, timeline)

Lesson: 11.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

from ddplab import dist


class Timeline:
    """Start and end of every forward and backward of a step, in seconds since ``t0``."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.t0, self.spans = device, time.perf_counter(), []

    @contextmanager
    def span(self, micro: int, phase: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter() - self.t0
        yield
        self._sync()  # on a GPU, wait for the kernels: their time is the work
        self.spans.append({"micro": micro, "phase": phase, "start": start,
                           "end": time.perf_counter() - self.t0})

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# [forward]
def forward(stage: nn.Module, micro_inputs: list[torch.Tensor], hidden: int,
            info: dist.DistInfo, timeline: Timeline) -> tuple[list, list]:
    """Every micro-batch through this stage: receive from the left, compute, send right."""
    first, last = info.rank == 0, info.rank == info.world_size - 1
    inputs, outputs = [], []
    for micro, x in enumerate(micro_inputs):
        if not first:
            x = torch.empty(len(x), hidden, device=info.device)
            torch_dist.recv(x, src=info.rank - 1)   # the previous stage's activation
            x.requires_grad_()                      # backward must send d loss / d x back
        with timeline.span(micro, "forward"):
            y = stage(x)
        if not last:
            torch_dist.send(y.detach(), dst=info.rank + 1)
        inputs.append(x)
        outputs.append(y)
    return inputs, outputs
# [/forward]


# [backward]
def backward(inputs: list, outputs: list, micro_targets: list[torch.Tensor],
             info: dist.DistInfo, timeline: Timeline) -> None:
    """Every micro-batch backward, last first: receive from the right, compute, send left."""
    first, last = info.rank == 0, info.rank == info.world_size - 1
    batch_size = sum(len(t) for t in micro_targets)
    for micro in reversed(range(len(outputs))):
        if last:   # each micro-batch's mean loss, weighted to give the whole batch's mean
            weight = len(micro_targets[micro]) / batch_size
            with timeline.span(micro, "backward"):
                (F.cross_entropy(outputs[micro], micro_targets[micro]) * weight).backward()
        else:
            grad = torch.empty_like(outputs[micro])
            torch_dist.recv(grad, src=info.rank + 1)   # d loss / d (our output)
            with timeline.span(micro, "backward"):
                outputs[micro].backward(grad)
        if not first:
            torch_dist.send(inputs[micro].grad, dst=info.rank - 1)
# [/backward]
