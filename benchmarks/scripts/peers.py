"""The trivial gloo job of bench_launch.py as a function, for launchers that fork the caller.

accelerate's ``notebook_launcher`` and a bare ``torch.multiprocessing.start_processes(...,
start_method="fork")`` run a function, not a file: both fork the calling process, which has
torch imported already. ddplab's warm launch runs the same job from a file
(``trivial_gloo.py``) with forked workers too.
"""

from __future__ import annotations

import os
import socket


def trivial_job(*_args: object) -> None:
    """init, one all_reduce, destroy: the body of trivial_gloo.py."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bare_fork(nprocs: int = 2) -> None:
    """The least a forking launcher can do: set the environment, fork, join."""
    import torch.multiprocessing as mp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                      WORLD_SIZE=str(nprocs))

    def rank_job(rank: int) -> None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
        trivial_job()

    mp.start_processes(rank_job, nprocs=nprocs, start_method="fork")


def notebook_launcher(nprocs: int = 2) -> None:
    """accelerate's notebook launcher (elastic_launch with forked workers), output silenced."""
    import contextlib
    import io

    from accelerate import notebook_launcher as launch

    with contextlib.redirect_stdout(io.StringIO()):
        launch(trivial_job, num_processes=nprocs, use_port=str(_free_port()))
