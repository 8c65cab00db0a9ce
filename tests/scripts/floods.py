"""A rank that starts ``yes spam`` in a session of its own, writing to the rank's stdout for
ever, says the child's pid on stderr, and exits 0 (or, with ``hold``, sleeps first).

Run it: ``torchrun --nproc-per-node 2 tests/scripts/floods.py [hold]``.
"""
import subprocess
import sys
import time

child = subprocess.Popen(["yes", "spam"], start_new_session=True)
print(f"child {child.pid}", file=sys.stderr, flush=True)
if sys.argv[1:] == ["hold"]:
    time.sleep(300)
