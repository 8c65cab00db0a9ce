"""The launcher: ``ddplab.launch`` and ``ddplab.launch_multinode``, one module per role.

Read top-down: ``api`` (the public functions), ``spec`` (one launch, checked once), ``jobs``
(a started launch), ``helper`` (the process that imported torch once), ``agent`` (torchrun's
engine, one per launch), ``stores`` (rendezvous stores outside the agent), ``entry`` (a rank's
first frame), ``output`` (live rank-prefixed streams), ``fallback`` (subprocess torchrun and
mp.spawn scripts), ``outcome`` and ``results`` (exit facts, root cause, ``RunResult``),
``procs`` (process groups, death signals, descriptors).

Importing this package imports neither torch nor any of its modules; names load on first use.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {"launch": "api", "launch_multinode": "api", "LaunchError": "spec",
            "LaunchSpec": "spec", "MAX_NPROCS": "spec", "RunResult": "results",
            "RankFailure": "results"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddplab.launcher' has no attribute {name!r}")
