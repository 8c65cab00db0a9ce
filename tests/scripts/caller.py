"""Stands in for a notebook kernel: launches faulty.py in sleep mode and reports the result."""
import json
import sys

import ddplab

result = ddplab.launch(sys.argv[1], 2, args=["sleep"], timeout=120)
print("RESULT " + json.dumps({"status": result.status, "ok": result.ok}), flush=True)
