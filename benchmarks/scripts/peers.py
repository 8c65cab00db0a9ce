"""The trivial gloo job of bench_launch.py as a function, for launchers that fork the caller.

accelerate's ``notebook_launcher``, torch's ``elastic_launch`` and a bare
``torch.multiprocessing.start_processes(..., start_method="fork")`` run a function, not a file:
each forks the calling process, which has torch imported already. ddplab's warm launch runs the
same job from a file (``trivial_gloo.py``) with forked workers too.
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


def elastic_agent(nprocs: int = 2) -> None:
    """torch's ``elastic_launch`` run in the caller, forking the workers and looking at them
    every 10 ms as ddplab's agent does: the cost of torch's agent alone, without ddplab's
    processes around it (notebook_launcher's agent looks every 100 ms)."""
    import logging
    import tempfile

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import elastic_launch

    from ddplab.launcher.agent import launch_config  # (LaunchConfig, asking CUDA nothing)

    logging.disable(logging.ERROR)  # (as ddplab's agent: torch's own log lines, silenced)
    try:
        with tempfile.TemporaryDirectory() as logs:
            config = launch_config(
                min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id="bench",
                rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                rdzv_configs={"rank": 0}, monitor_interval=0.01, start_method="fork",
                logs_specs=DefaultLogsSpecs(log_dir=logs))
            elastic_launch(config, trivial_job)()
    finally:
        logging.disable(logging.NOTSET)


def notebook_launcher(nprocs: int = 2) -> None:
    """accelerate's notebook launcher (elastic_launch with forked workers), output silenced."""
    import contextlib
    import io

    from accelerate import notebook_launcher as launch

    with contextlib.redirect_stdout(io.StringIO()):
        launch(trivial_job, num_processes=nprocs, use_port=str(_free_port()))
