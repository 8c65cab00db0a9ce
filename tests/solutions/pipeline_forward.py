"""Solution of exercise 11: the forward pass of a two-stage pipeline, with send and recv.

Run it (exactly 2 processes, one per stage), from the notebook or a terminal::

    result = ddplab.launch("../exercises/pipeline_forward.py", 2)
    ddplab.check("11", result)

    python -m ddplab launch --nproc-per-node 2 exercises/pipeline_forward.py

The model is cut in two: rank 0 keeps the first half of its layers, rank 1 the second half.
The batch is cut into micro-batches. For each micro-batch, rank 0 computes its half and must
hand the activation to rank 1, which computes the second half on it. Fill the two
``TODO(exercise)`` blocks in ``forward_stage``; nothing else needs to change. The end of the file
checks the result against the unsplit model and reports what happened (``metric`` events).

What must be true of the run: rank 1 runs its stage on exactly what rank 0 computed, micro-batch
by micro-batch, in the same order, so its outputs equal the unsplit model's. The two ranks share
no memory: only a message between them carries the activation, and a message has a sender and a
receiver, each naming the other. A blocking exchange waits until both sides are there, so every
message rank 0 starts must be met by rank 1, one for one. What rank 1 receives lands in a tensor
that already exists with the right shape. The process group times out after 30 s, so a side
left waiting for its partner ends with an error instead of hanging.

Lesson: 11.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as torch_dist  # point-to-point messages live here
from torch import nn

from ddplab import dist, events

HIDDEN = 64
MICRO_BATCHES = 4


# [exercise]
def forward_stage(stage: nn.Module, micro_batches: list[torch.Tensor], rank: int
                  ) -> list[torch.Tensor]:
    """Run every micro-batch through this rank's stage; return what this rank computed.

    Rank 0 returns its activations (one per micro-batch), rank 1 the model's outputs.
    """
    results = []
    for x in micro_batches:
        if rank == 0:
            activation = stage(x)
            torch_dist.send(activation, dst=1)

            results.append(activation)
        else:
            received = torch.zeros(len(x), HIDDEN, device=x.device)  # rank 0's goes here
            torch_dist.recv(received, src=0)

            results.append(stage(received))
    return results
# [/exercise]


def checksum(t: torch.Tensor) -> float:
    return float(t.detach().double().sum())


def main() -> None:
    info = dist.setup(timeout_s=30)
    if info.world_size != 2:
        raise SystemExit("this pipeline has exactly 2 stages: launch it on 2 processes")
    torch.manual_seed(0)                 # both ranks build the same model and batch ...
    model = nn.Sequential(nn.Linear(16, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                          nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, 10)).to(info.device)
    batch = torch.randn(32, 16).to(info.device)
    stage = copy.deepcopy(model[:4] if info.rank == 0 else model[4:])   # ... and keep half

    seen: list[torch.Tensor] = []       # every input the stage was run on, recorded for the check
    stage.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    try:
        with torch.no_grad():
            results = forward_stage(stage, list(batch.chunk(MICRO_BATCHES)), info.rank)
            expected = model(batch)
    except RuntimeError as error:        # a send or recv whose partner never came
        print(f"rank {info.rank}: {str(error).splitlines()[0]}", flush=True)
        events.emit("metric", name="p2p_error", value=str(error).splitlines()[0][:300])
        return                           # (the process group is gone with the peer)

    # What the judge looks at: what rank 0 computed, what rank 1 ran its stage on, the output.
    if info.rank == 0:
        events.emit("metric", name="sent", value=[checksum(a) for a in results])
    else:
        events.emit("metric", name="received", value=[checksum(x) for x in seen])
        error = float((torch.cat(results) - expected).abs().max()) if results else None
        events.emit("metric", name="output_error", value=error)
    dist.cleanup()


if __name__ == "__main__":
    main()
