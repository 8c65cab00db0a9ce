"""Writes to stdout and to stderr, then a last stdout line without a newline (an unfinished
progress line), and optionally an event right after it. Every rank prints its pid.

Run it: ``torchrun --nproc-per-node 2 tests/scripts/streams.py [event]``.
"""
import os
import sys

rank = os.environ.get("RANK", "0")
print(f"pid {os.getpid()}", flush=True)
print(f"out line of rank {rank}", flush=True)
print(f"err line of rank {rank}", file=sys.stderr, flush=True)
sys.stdout.write("progress 99%")
sys.stdout.flush()
if "event" in sys.argv[1:]:
    from ddplab import events

    events.emit("metric", name="after_partial", value=int(rank))
