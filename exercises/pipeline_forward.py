"""Exercise 11: one training step of a two-stage pipeline, forward and backward, by hand.

Run it (exactly 2 processes, one per stage), from the notebook or a terminal::

    result = ddplab.launch("../exercises/pipeline_forward.py", 2)
    ddplab.check("11", result)

    python -m ddplab launch --nproc-per-node 2 exercises/pipeline_forward.py

The model is cut in two: rank 0 keeps the first half of its layers, rank 1 the second half and
the loss. A batch of 30 samples is cut into 4 micro-batches (8, 8, 8 and 6 samples), and one
step runs them the GPipe way: every micro-batch forward, in order, then every micro-batch
backward, the last one first. Fill the three ``TODO(exercise)`` blocks of ``forward_stage`` and
``backward_stage``; nothing else needs to change. The end of the file checks the step against
the unsplit model and reports what happened (``metric`` events).

What must be true of the run:

1. Rank 1 runs its stage on exactly what rank 0 computed, micro-batch by micro-batch, so its
   outputs equal the unsplit model's.
2. After the step, every parameter's ``.grad`` on both ranks equals the unsplit model's gradient
   of the loss of the whole batch, ``F.cross_entropy(model(batch), targets)`` (the mean over its
   30 samples), and nothing else: one backward per micro-batch, the gradients accumulating.
3. The ranks share no memory: only messages (``send``/``recv``, or ``isend``/``irecv`` and
   ``wait``) cross between them, each naming its peer; what a ``recv`` receives lands in a
   tensor that already exists with the right shape. Per step, each rank sends 4 messages and
   receives 4, and a blocking ``recv`` waits until its partner sends. The process group times
   out after ``--pg-timeout`` seconds (30), so a rank left waiting ends with an error instead of
   hanging.

Lesson: 11.
"""

from __future__ import annotations

import argparse
import copy
import functools
import traceback

import torch
import torch.distributed as torch_dist  # point-to-point messages live here
import torch.nn.functional as F
from torch import nn

from ddplab import dist, events

HIDDEN = 64
BATCH = 30
MICRO_BATCHES = 4          # torch.chunk cuts 30 samples into 8, 8, 8 and 6


# [exercise]
def forward_stage(stage: nn.Module, micro_inputs: list[torch.Tensor], rank: int
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every micro-batch forward through this rank's stage, in order.

    Returns ``(inputs, outputs)``: for each micro-batch, what this stage ran on and what it
    computed (on rank 1, the model's logits). ``backward_stage`` gets both.
    """
    inputs, outputs = [], []
    for x in micro_inputs:
        if rank == 1:
            x = torch.zeros(len(x), HIDDEN, device=x.device)   # rank 0's activation goes here
            # TODO(exercise): rank 1's stage must run on rank 0's activation of this micro-batch.
        y = stage(x)
        # TODO(exercise): what rank 0 computed is rank 1's input.
        inputs.append(x)
        outputs.append(y)
    return inputs, outputs


def backward_stage(inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                   micro_targets: list[torch.Tensor], rank: int) -> None:
    """Every micro-batch backward through this rank's stage, the last micro-batch first.

    Afterwards this stage's parameters hold the unsplit model's gradients of the whole batch's
    mean loss (point 2 of the spec above).
    """
    for micro in reversed(range(len(outputs))):
        output = outputs[micro]
        # TODO(exercise): this micro-batch's backward on this rank, and its message.
# [/exercise]


def checksum(t: torch.Tensor) -> float:
    return float(t.detach().double().sum())


class Messages:
    """Counts this rank's sends and receives (for the judge), and the one under way."""

    def __init__(self) -> None:
        self.counts, self.waiting = {"send": 0, "recv": 0}, None
        for name, kind in (("send", "send"), ("isend", "send"), ("recv", "recv"),
                           ("irecv", "recv")):
            setattr(torch_dist, name, self._counted(getattr(torch_dist, name), kind))

    def _counted(self, call, kind: str):
        @functools.wraps(call)
        def counted(*args, **kwargs):
            self.counts[kind] += 1
            self.waiting = call.__name__
            value = call(*args, **kwargs)
            self.waiting = None
            return value
        return counted


def gradients_error(stage: nn.Module, unsplit: nn.Module, model: nn.Sequential,
                    batch: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """How far this stage's gradients are from the unsplit model's (``unsplit``: its layers of
    this stage) for three losses: the whole batch's mean (``mean``, the one asked for), the sum
    of the micro-batches' means (``sum``) and their plain mean (``mean_of_means``)."""
    grads = [p.grad for p in stage.parameters()]
    if any(g is None for g in grads):
        return {}
    pieces = list(zip(batch.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES)))
    summed = sum(F.cross_entropy(model(x), t) for x, t in pieces)
    losses = {"mean": F.cross_entropy(model(batch), targets), "sum": summed,
              "mean_of_means": summed / MICRO_BATCHES}
    found = {}
    for name, loss in losses.items():
        wanted = torch.autograd.grad(loss, list(unsplit.parameters()), retain_graph=True)
        found[name] = max(float((g - w).abs().max()) for g, w in zip(grads, wanted))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pg-timeout", type=float, default=30.0,
                        help="seconds a send or recv may wait for its partner")
    info = dist.setup(timeout_s=parser.parse_args().pg_timeout)
    if info.world_size != 2:
        raise SystemExit("this pipeline has exactly 2 stages: launch it on 2 processes")
    torch.manual_seed(0)                 # both ranks build the same model and batch ...
    model = nn.Sequential(nn.Linear(16, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                          nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, 10)).to(info.device)
    batch = torch.randn(BATCH, 16).to(info.device)
    targets = torch.randint(0, 10, (BATCH,)).to(info.device)
    unsplit = model[:4] if info.rank == 0 else model[4:]
    stage = copy.deepcopy(unsplit)      # ... and keep half

    seen: list[tuple[float, bool]] = []  # each input the stage ran on: sum, tracked by autograd
    stage.register_forward_pre_hook(
        lambda module, args: seen.append((checksum(args[0]), args[0].requires_grad)))
    messages, phase = Messages(), "forward"
    try:
        inputs, outputs = forward_stage(stage, list(batch.chunk(MICRO_BATCHES)), info.rank)
        # What the judge looks at: what rank 0 computed, what rank 1 ran its stage on, ...
        if info.rank == 0:
            events.emit("metric", name="sent", value=[checksum(y) for y in outputs])
        else:
            events.emit("metric", name="received", value=[total for total, _ in seen])
            events.emit("metric", name="tracked", value=[tracked for _, tracked in seen])
            error = float((torch.cat(outputs) - model(batch)).abs().max().detach()) \
                if outputs else None
            events.emit("metric", name="output_error", value=error)
        phase = "backward"
        backward_stage(inputs, outputs, list(targets.chunk(MICRO_BATCHES)), info.rank)
    except Exception as error:           # a send or recv whose partner never came, or a bug
        traceback.print_exc()
        line = (str(error).splitlines() or [""])[0][:300]
        waiting = messages.waiting if isinstance(error, RuntimeError) else None
        events.emit("metric", name="p2p_error" if waiting else "step_error", value={
            "phase": phase, "waiting": waiting, "type": type(error).__name__, "error": line})
        dist.cleanup()                   # the peer's pending send or recv fails at once
        return

    # ... the messages of the step, and this stage's gradients against the unsplit model's.
    events.emit("metric", name="messages", value=messages.counts)
    events.emit("metric", name="gradients",
                value=gradients_error(stage, unsplit, model, batch, targets))
    dist.cleanup()


if __name__ == "__main__":
    main()
