"""Judge of exercise 11: the send/recv of a two-stage pipeline's forward pass.

The skeleton (``exercises/pipeline_forward.py``) reports, as ``metric`` events, the checksum of
every activation rank 0 computed (``sent``), of every input rank 1 ran its stage on
(``received``), how far rank 1's output is from the unsplit model's (``output_error``), and,
when a send or recv found no partner, the error it raised (``p2p_error``).

Lesson: 11.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from . import judge, metric

#: Largest difference from the unsplit model's output that still counts as equal.
TOLERANCE = 1e-5


@judge("11", "pipeline_forward.py",
       "send each micro-batch's activation from rank 0 to rank 1, so that the two-stage "
       "pipeline's output equals the unsplit model's")
def pipeline_forward(result: Any) -> Optional[str]:
    sent, received = metric(result, "sent").get(0), metric(result, "received").get(1)
    error = metric(result, "output_error").get(1)
    failed = metric(result, "p2p_error")
    if 1 in failed:
        return ("rank 1 waited in recv for an activation that never came (its error is printed "
                "above): every recv on rank 1 needs a matching send on rank 0, one per "
                "micro-batch, to dst=1.")
    if 0 in failed:
        return ("rank 0's send was never received (its error is printed above): rank 1 must "
                "receive every activation rank 0 sends, one per micro-batch, from src=0.")
    if sent is None or received is None:
        return ("the run reported no checksums: launch exercises/pipeline_forward.py on 2 "
                "processes and change only the TODO(exercise) blocks.")
    if len(received) != len(sent):
        return (f"rank 1 ran its stage {len(received)} times for {len(sent)} micro-batches: "
                "receive one activation per micro-batch, inside the loop of forward_stage.")
    if not any(received):
        return ("rank 1 ran its stage on zeros: nothing arrived. In forward_stage, rank 0 "
                "must send each activation to rank 1, and rank 1 must receive it into "
                "`received` before computing on it (torch.distributed.send and recv, as in "
                "the pipeline worker's forward shown above).")
    for micro, (a, b) in enumerate(zip(sent, received)):
        if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6):
            return (f"micro-batch {micro}: rank 1 computed on something other than the "
                    "activation rank 0 computed for it. Send each activation once, in order, "
                    "and receive into `received` right before rank 1 uses it.")
    if error is None or error > TOLERANCE:
        return (f"the activations arrived, but the output differs from the unsplit model's "
                f"by {error}: rank 1 must run its stage on the received activation.")
    return None
