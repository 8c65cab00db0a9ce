"""In-kernel demonstrations: small experiments a notebook runs in its own process, by topic.

Kernel side. Nothing here starts a training job or touches a GPU: each function builds a model,
a sampler, a file or a layer on the CPU, runs it, and returns plain facts a notebook prints,
plots and asserts on. These modules never import the worker side (``ddplab.train``, ``data``,
``models``, ``checkpoint``, ``dist``, ``workers``); where a demonstration needs a worker-side
object (a model, the repair function a script uses), the notebook passes it in.

- ``timing``: ``torch.utils.benchmark`` for timing one step in the kernel. Lesson 01.
- ``dataparallel``: what ``nn.DataParallel`` does in one step, done by hand (scatter sizes, the
  gradient against the full batch's, with and without BatchNorm), and the ``module.`` prefix.
  Lesson 02.
- ``spawning``: ``mp.spawn`` on a function defined in a notebook cell, and why it fails.
  Lesson 03.
- ``sampling``: which indices each rank reads from ``DistributedSampler`` (shares, padding,
  epoch orders with and without ``set_epoch``). Lesson 04.
- ``saving``: what a checkpoint file holds, where its tensors land, why a pickled module is
  fragile, what a truncated file does. Lesson 05.
- ``precision``: number formats, what autocast computes in, why fp16 needs a GradScaler, what
  the scaler does with an overflow. Lesson 06.

``error_of`` (here) is shared by all of them: it shows a failure on purpose without stopping
Run All.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


def error_of(fn: Callable[[], Any]) -> Optional[BaseException]:
    """Run ``fn()`` and return the exception it raised, or None if it raised nothing.

    A notebook shows a failure on purpose this way and Run All carries on.

    Example::

        >>> error_of(lambda: 1 / 0)
        ZeroDivisionError('division by zero')

    Lesson: 04, 05.
    """
    try:
        fn()
    except Exception as error:  # the lesson shows whatever PyTorch raises
        return error
    return None
