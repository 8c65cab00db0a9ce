"""The launcher behind ``ddplab.launch``: one module per process role, read top-down.

::

    caller (notebook kernel)            api, spec, jobs, output, results
      |-- Linux, one node: helper --> agent per launch --> ranks
      |       helper.py (imported torch once)  agent.py (torch's elastic_launch, fork)
      |                                        entry.py (each rank's first frame)
      `-- elsewhere, several nodes, or engine "spawn": a subprocess (fallback.py)
              python -m torch.distributed.run --> ranks (entry.py), or python script.py

One output route on every path: each rank (and the agent) connects its stdout and stderr to
the caller's socket for the job and says who it is. ``procs`` holds the process plumbing all of
them share; why a failed job failed is ``ddplab.failures``'s. Importing this package imports
nothing.
"""
