"""A rank that starts ``yes spam`` in a session of its own, writing to the rank's stdout for
ever, writes the child's pid to FOLDER/child-RANK, and exits 0 (or, with ``hold``, sleeps
first). (Its pid is not printed: the flood may push any line out of the result's kept log.)

Run it: ``torchrun --nproc-per-node 2 tests/scripts/floods.py FOLDER [hold]``.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

child = subprocess.Popen(["yes", "spam"], start_new_session=True)
Path(sys.argv[1], f"child-{os.environ['RANK']}").write_text(str(child.pid))
if sys.argv[2:] == ["hold"]:
    time.sleep(300)
