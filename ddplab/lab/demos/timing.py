"""Timing tools for the notebook kernel (lesson 01).

Kernel side (see ``ddplab.lab.demos``): nothing here touches a GPU.

- ``benchmark``: ``torch.utils.benchmark``, imported without the notice its import of
  ``torch.utils.cpp_extension`` logs when no CUDA toolkit is installed (``CUDA_HOME``), a notice
  about compiling C++ extensions that has nothing to do with timing.

Lesson: 01.
"""

from __future__ import annotations

import logging
from types import ModuleType


def benchmark() -> ModuleType:
    """Return ``torch.utils.benchmark``, its import's ``CUDA_HOME`` notice silenced.

    Example::

        >>> benchmark().Timer.__name__
        'Timer'

    Lesson: 01.
    """
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import benchmark as module

    return module
