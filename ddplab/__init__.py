"""ddplab: run and study PyTorch multi-process training from a notebook.

The notebooks call what is re-exported here; everything else lives in its own module.
"""

from .env import doctor
from .launch import LaunchError, RunResult, launch, launch_multinode

__all__ = ["doctor", "launch", "launch_multinode", "LaunchError", "RunResult"]
__version__ = "0.1.0"
