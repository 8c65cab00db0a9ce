"""The launcher behind ``ddplab.launch``: one module per process role, read top-down.

::

    caller (notebook kernel)              api, spec, jobs, output, results
      |-- Linux, one node: helper --------> agent per launch --------> ranks (entry.py)
      |     helper.py: imported torch once;  agent.py: torch's elastic_launch, fork;
      |     both subreapers: what a rank     the ranks' store served once they are forked
      |     leaves comes back to be ended
      `-- elsewhere, several nodes, or engine "spawn": a subprocess (fallback.py) behind a
          prctl wrapper: python -m torch.distributed.run --> ranks, or python script.py

One output route on every path: each rank (and the agent) connects its stdout and stderr to
the caller's socket for the job and says who it is. ``procs`` holds the process plumbing all of
them share; the platform's facts are ``ddplab.env``'s; why a failed job failed,
``ddplab.failures``'s. Its messages: README, "How a launch runs". Importing this imports nothing.
"""
