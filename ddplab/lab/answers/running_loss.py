"""A loss log that DDP's ``Join`` can finish: the course's answer to exercise 10's log.

Notebook 10 shows this file only once the judge has said the learner's run is correct; the
exercise's reference solution (``tests/solutions/uneven_join.py``) imports it. It needs torch
only, so a rank may import it although it lives among the notebooks' helpers.

Lesson: 10.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook


# [running-loss]
class RunningLoss(Joinable):
    """A log's running sum of every rank's losses that finishes with uneven inputs.

    Each step of each rank adds ``[its loss, 1]`` to a sum over the ranks (an all-reduce).
    Handed to ``Join`` with the model, ``with Join([model, running]):``, it lets a rank that has
    run out of batches answer that all-reduce with zeros until every rank is done, as DDP's own
    join hook answers the gradients' all-reduce. Exercise 10's answer for its loss log.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.total = torch.zeros(2)  # [every rank's losses so far, summed; how many batches]

    def add(self, loss: torch.Tensor) -> None:
        Join.notify_join_context(self)  # "I still have batches": Join counts who is left
        both = torch.stack([loss.detach(), torch.ones_like(loss)])
        torch_dist.all_reduce(both)
        self.total += both.cpu()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return AddNothing(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return torch_dist.group.WORLD


class AddNothing(JoinHook):
    """What a rank out of batches does at each step of the ranks still training: add zeros."""

    def __init__(self, running: RunningLoss) -> None:
        self.running = running

    def main_hook(self) -> None:
        nothing = torch.zeros(2, device=self.running.device)
        torch_dist.all_reduce(nothing)  # meets the all-reduce in the others' add()
        self.running.total += nothing.cpu()
# [/running-loss]
