"""Run a script as ``torch.distributed.launch`` did: with ``--local_rank=N`` before its arguments.

torchrun passes a rank's local rank only in ``LOCAL_RANK``; scripts written for the old
launcher expect it as an argument. ``ddplab.launch(..., local_rank_arg=True)`` starts each rank
through this module when it goes through a torchrun subprocess (the preloaded helper builds the
same argv itself)::

    DDPLAB_LOCAL_RANK_ARG=underscore torchrun --nproc-per-node 2 -m ddplab.local_rank_arg \\
        my_script.py --lr 0.1
    # each rank runs: my_script.py --local_rank=<LOCAL_RANK> --lr 0.1

``DDPLAB_LOCAL_RANK_ARG`` is ``underscore`` (``--local_rank``, before torch 2.0) or ``dash``
(``--local-rank``, since). The target is a ``.py`` path or a module name, run as ``__main__``.

Lesson: 07 (the sources' ``--local_rank`` scripts).
"""

from __future__ import annotations

import os
import runpy
import sys

SPELLING = {"underscore": "--local_rank", "dash": "--local-rank"}


def argv_for(target: str, args: list[str]) -> list[str]:
    """The rank's ``sys.argv``: the target, ``--local_rank=N`` as asked, then its arguments."""
    option = SPELLING.get(os.environ.get("DDPLAB_LOCAL_RANK_ARG", ""), "")
    extra = [f"{option}={os.environ['LOCAL_RANK']}"] if option else []
    return [target, *extra, *args]


def main() -> None:
    """``python -m ddplab.local_rank_arg TARGET [ARGS...]``."""
    if len(sys.argv) < 2:
        sys.exit("usage: python -m ddplab.local_rank_arg TARGET [ARGS...]")
    target, args = sys.argv[1], sys.argv[2:]
    sys.argv = argv_for(target, args)
    if target.endswith(".py") or os.sep in target:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    else:
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
