"""Does this torch's gloo backend have ``reduce_scatter`` with a list of chunks? Each rank says.

Run it::

    torchrun --nproc-per-node 2 tests/compat/gloo_reduce_scatter.py

Every rank emits one ``probe`` event: ``works`` (the list form ran and gave the right sum) and
``error`` (what torch raised, if it raised). tests/test_collectives.py compares that with the
version gate in ``ddplab.workers.collectives``.
"""

import torch
import torch.distributed as torch_dist

from ddplab import events

torch_dist.init_process_group("gloo")
rank, n = torch_dist.get_rank(), torch_dist.get_world_size()
x = torch.arange(n, dtype=torch.float32) + 10.0 * rank
mine = torch.empty(1)
try:
    torch_dist.reduce_scatter(mine, list(x.chunk(n)))
    works, error = mine.item() == sum(10.0 * r + rank for r in range(n)), ""
except RuntimeError as exc:  # raised on every rank alike, before any message is sent
    works, error = False, str(exc).splitlines()[0]
events.emit("probe", works=works, error=error)
torch_dist.destroy_process_group()
