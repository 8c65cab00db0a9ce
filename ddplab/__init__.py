"""ddplab: run and study PyTorch multi-process training from a notebook.

The notebooks call what is re-exported here; everything else lives in its own module.
Importing ddplab does not import torch (the kernel stays light and never touches CUDA).
"""

from .checks import check
from .env import doctor
from .launch import LaunchError, RunResult, launch, launch_multinode
from .show import show, source

__all__ = ["check", "doctor", "launch", "launch_multinode", "LaunchError", "RunResult", "show",
           "source"]
__version__ = "0.1.0"
