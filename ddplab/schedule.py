"""The learning-rate schedule: linear scaling with the global batch, then a linear warm-up.

Worker side. Both are functions of numbers only (no optimizer state), so a resumed run picks up
the schedule exactly where it stopped::

    lr = effective_lr(args.lr, world_size, grad_accum, scale_lr=True)   # peak LR
    for step, batch in enumerate(loader, start=first_step):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr, warmup_steps)

Why: with N processes each step averages N times as many samples, so an epoch has N times fewer
steps; without a larger LR the model learns less per epoch (lesson 03 shows the drop and this
fix, after Goyal et al. 2017, "Accurate, Large Minibatch SGD").

Lesson: 03.
"""

from __future__ import annotations


def effective_lr(base_lr: float, world_size: int, grad_accum: int, scale_lr: bool) -> float:
    """Return the learning rate to train with: scaled linearly with the global batch if asked.

    The linear scaling rule (Goyal et al. 2017): k times the samples per step, k times the LR,
    here k = world_size x grad_accum relative to one process with one micro-batch.

    Lesson: 03.
    """
    return base_lr * world_size * grad_accum if scale_lr else base_lr


def lr_at(step: int, lr: float, warmup_steps: int) -> float:
    """Return the LR of optimizer step ``step`` (0-based) under a linear warm-up.

    The LR climbs from ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps`` steps and
    then stays there. Being a function of the step alone, it needs no state to resume.

    Lesson: 03.
    """
    return lr if warmup_steps <= 0 else lr * min(1.0, (step + 1) / warmup_steps)
