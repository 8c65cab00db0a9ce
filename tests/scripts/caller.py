"""Stands in for a notebook kernel: launches a script (faulty.py in sleep mode) and reports.

Run it: ``python tests/scripts/caller.py SCRIPT [ARGS...]`` (ARGS default to ``sleep``).

An interrupt (SIGINT) must end every process of the job, then reach this caller again as a
KeyboardInterrupt carrying the result: the caller reports it and lets it end the program.
"""
import json
import signal
import sys

import ddplab

# A kernel has its own SIGINT handler; a process started in the background by a non-interactive
# shell (a test run, CI) inherits SIGINT as ignored, so this stand-in installs Python's own.
signal.signal(signal.SIGINT, signal.default_int_handler)

try:
    result = ddplab.launch(sys.argv[1], 2, args=sys.argv[2:] or ["sleep"], timeout=120)
except KeyboardInterrupt as interrupt:
    result = interrupt.result
    print("INTERRUPTED " + str(interrupt), flush=True)
    print("RESULT " + json.dumps({"status": result.status, "ok": result.ok}), flush=True)
    raise
print("RESULT " + json.dumps({"status": result.status, "ok": result.ok}), flush=True)
