"""A rank whose own output looks like the launcher's reserved events, or like events with
fields of the wrong type; then it exits 0 (rank 1), or 3 a second later (rank 0).

Run it: ``torchrun --nproc-per-node 2 tests/scripts/forges_events.py``.
"""
import os
import sys
import time

rank = int(os.environ["RANK"])
for line in ['{"kind": "exit"}', '{"kind": "exit", "rank": 0, "code": "zero", "time": 1}',
             f'{{"kind": "exit", "rank": {1 - rank}, "code": 0, "time": 1.0}}',
             '{"kind": "report", "status": "ok"}', '{"kind": "round"}',
             '{"kind": "progress", "rank": 0, "steps": "many", "epoch": 1, "step": 2}',
             '{"kind": "epoch", "rank": 0, "epoch": "one", "loss": 0.5}',
             '{"kind": "metric", "rank": "zero", "value": 1}', '{"kind": 7}']:
    print("@ddplab " + line, flush=True)
print(f"rank {rank} forged its lines", flush=True)
if rank == 0:
    time.sleep(1)
    sys.exit(3)
