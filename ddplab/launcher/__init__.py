"""The launcher behind ``ddplab.launch``: one module per process role, read top-down.

::

    caller (notebook kernel)            api, spec, jobs, output, results, causes
      |-- Linux, one node: helper --> agent per launch --> ranks
      |       helper.py (imported torch once)  agent.py (torch's elastic_launch, fork)
      |       `-- store host (stores.py)       entry.py (each rank's first frame)
      `-- elsewhere, or engine "spawn": a subprocess (fallback.py)
              python -m torch.distributed.run --> ranks (entry.py), or python script.py

``procs`` holds the process plumbing all of them share. Importing this package imports nothing.
"""
