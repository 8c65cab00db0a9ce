"""The launcher: ``ddplab.launch`` and ``ddplab.launch_multinode``, one module per role.

Read top-down: ``api`` (the public functions), ``spec`` (one launch, checked once), ``jobs``
(a started launch), ``helper`` (the process that imported torch once), ``agent`` (torchrun's
engine, one per launch), ``stores`` (rendezvous stores outside the agent), ``entry`` (a rank's
first frame), ``output`` (live rank-prefixed streams), ``fallback`` (torchrun without fork,
and mp.spawn scripts), ``outcome`` and ``results`` (exit facts, root cause, ``RunResult``),
``procs`` (process groups, death signals, descriptors).

Importing this package imports nothing: ``ddplab.launch`` (``api.launch``) is what learners call.
"""
