"""ddplab: run and study PyTorch multi-process training from a notebook.

The notebooks call what is re-exported here; everything else lives in its own module. Names
are loaded on first use, so ``import ddplab`` imports neither torch nor the launcher: worker
processes that import ``ddplab.dist`` stay light, and the kernel never touches CUDA.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "check": "lab.checks", "doctor": "env", "launch": "launcher.api",
    "launch_multinode": "launcher.api", "LaunchError": "launcher.spec",
    "RunResult": "launcher.results", "show": "lab.showcode", "source": "lab.showcode",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddplab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
