"""Exercise 08: write two collectives yourself, from their specs. Two functions to write.

Run it from notebook 08 (about 5 s; a hang is ended after 60 s, and the judge says where each
rank waited), or from the repository root::

    python -m ddplab launch --nproc-per-node 4 --timeout 60 exercises/collective.py
    torchrun --standalone --nproc-per-node 4 exercises/collective.py

and hand the launch's result to the judge: ``ddplab.check("08", result)``.

What to write, each from its docstring (look up in ``torch.distributed`` what you need: notebook
08 showed its collectives in section 1 and its point-to-point operations, blocking and not, in
section 2):

1. ``average(tensor)``: every rank ends with the element-wise mean of all ranks' tensors
   (what DDP does to gradients);
2. ``ring_shift(tensor)``: one step of a ring, the building block of notebook 08's ring
   all-reduce: every rank passes its tensor to its right neighbour at the same time.

The fixed part calls them and reports every rank's input and results (``metric`` events).
With a working ``ring_shift`` it also builds an all-reduce out of it: pass the message on
``world_size - 1`` times, adding what arrives. (That simple ring sends the whole tensor each
step; notebook 08's ring sends one chunk per step, which is why it scales.)

Lesson: 08.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist  # noqa: F401  (you will need it)

from ddplab import dist, events


def average(tensor: torch.Tensor) -> torch.Tensor:
    """Return the element-wise mean of ``tensor`` over every rank (on every rank)."""
    # TODO(exercise) 1: write this function from its docstring.
    return tensor


def ring_shift(tensor: torch.Tensor) -> torch.Tensor:
    """Send ``tensor`` to the right neighbour, rank + 1, and return the tensor the left one,
    rank - 1, sent (both modulo the world size, so the ranks form a ring).

    Every rank calls this at the same moment. On gloo a blocking send waits until its receiver
    has posted the receive, whatever the size, so ranks that all send first wait for each other
    forever (notebook 08, section 2, watched it time out).
    """
    # TODO(exercise) 2: write this function from its docstring.
    return tensor.clone()


def main() -> None:
    # setup: gloo on CPUs, nccl on GPUs (one process per GPU)
    info = dist.setup()
    if info.world_size < 2:
        raise SystemExit("launch at least 2 processes: a collective needs company.")

    # every rank starts from its own tensor
    generator = torch.Generator().manual_seed(1000 + info.rank)
    x = torch.randn(6, generator=generator).to(info.device)
    events.emit("metric", name="input", value=x.tolist())

    # 1. the mean over ranks
    events.emit("metric", name="average", value=average(x.clone()).tolist())

    # 2. one step round the ring, then an all-reduce made of world_size - 1 steps
    shifted = ring_shift(x.clone())
    events.emit("metric", name="shifted", value=shifted.tolist())
    total, message = x.clone(), x.clone()
    for _ in range(info.world_size - 1):
        message = ring_shift(message)
        total += message
    events.emit("metric", name="ring_sum", value=total.tolist())
    unwritten = " (ring_shift not written yet)" if torch.equal(shifted, x) else ""
    print(f"rank {info.rank}: input {x.tolist()[:2]}..., ring sum {total.tolist()[:2]}..."
          f"{unwritten}", flush=True)

    # cleanup
    dist.cleanup()


if __name__ == "__main__":
    main()
