"""A worker that reports some progress, says who it is, then sleeps: the long launch to interrupt.

    python -m ddplab launch --nproc-per-node 2 tests/browser/sleeper.py

Rank 0 sends two epochs' losses and a progress event (so the launching cell shows a live
progress widget and a loss plot while the job still runs); each rank prints ``pid=<pid>`` so a
test can check that the process is gone after the interrupt. No process group is needed: an
interrupt must end workers whatever they are doing.
"""

import os
import time

from ddplab import events

if os.environ.get("RANK", "0") == "0":
    for epoch, loss in ((1, 1.0), (2, 0.5)):
        events.emit("epoch", epoch=epoch, loss=loss)
    events.emit("progress", epoch=3, epochs=4, step=3, steps=10, loss=0.4)
print(f"pid={os.getpid()} rank={os.environ.get('RANK', '?')} sleeping 600 s", flush=True)
time.sleep(600)
print("woke up: nobody interrupted me", flush=True)
