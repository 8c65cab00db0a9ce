"""Launcher command lines, read by PyTorch's own parsers: what a node's agent and a script get.

Kernel side: nothing here starts a training process or touches a GPU. Each function hands a
command line to the code of the installed torch that really handles it, and returns what
that code decided:

- ``torchrun_config(argv)``: the ``LaunchConfig`` torchrun builds from its arguments (what one
  node's agent works with), the arguments its workers get, and the warnings it logs;
- ``torchrun_shutdown_timeout()``: the seconds torchrun waits after a Ctrl-C before SIGKILL;
- ``legacy_script_argv(...)``: the arguments the deprecated ``python -m torch.distributed.launch``
  appends to a training script's own (``--local-rank=N`` since torch 2.0);
- ``parse_outcome(parse, argv)``: what a script's argument parsing makes of them, or its
  error message, instead of exiting;
- ``slurm_dry_run(script)``: run a SLURM batch script with stand-ins for ``scontrol`` and
  ``srun`` and return the command ``srun`` was given.

Example::

    configs = [torchrun_config(["--nnodes", "2", "--node-rank", str(n), "--rdzv-backend",
                                "c10d", "--rdzv-endpoint", "host:29500", "train.py"])
               for n in (0, 1)]
    configs[0]["config"] == configs[1]["config"]     # True: c10d ignores --node-rank

Lessons: 07 (the old launcher's arguments), 07b (torchrun's and SLURM's command lines).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

#: The fields of torchrun's ``LaunchConfig`` that decide what one node's agent does.
CONFIG_FIELDS = ("min_nodes", "max_nodes", "nproc_per_node", "run_id", "rdzv_backend",
                 "rdzv_endpoint", "rdzv_configs", "max_restarts", "start_method", "local_addr")


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    """Undo what torch's launcher code does to ``os.environ`` (it sets OMP_NUM_THREADS)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _config_from(args: argparse.Namespace) -> tuple[Any, list[str], list[str]]:
    """torch's ``config_from_args`` on parsed arguments: config, script args, warnings."""
    from torch.distributed import run

    collect = _Collect()
    logger = logging.getLogger(run.__name__)
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [collect], False  # returned, not printed
    try:
        with _environment_kept():
            config, _cmd, cmd_args = run.config_from_args(args)
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    return config, list(cmd_args), collect.messages


def torchrun_config(argv: Sequence[str]) -> dict[str, Any]:
    """What torchrun (``torch.distributed.run``) makes of the command line ``argv``.

    Args:
        argv: torchrun's arguments, e.g. ``["--nnodes", "2", "--node-rank", "1", ...,
            "train.py", "--epochs", "3"]``.

    Returns:
        ``config``: the ``LaunchConfig`` fields in ``CONFIG_FIELDS`` (what this node's agent
        uses); ``script_args``: the arguments every worker gets after the script's name;
        ``warnings``: what torchrun logged while reading them.

    Lesson: 07b.
    """
    from torch.distributed import run

    config, cmd_args, warnings = _config_from(run.parse_args(list(argv)))
    return {"config": {name: getattr(config, name) for name in CONFIG_FIELDS},
            "script_args": _after_script(cmd_args), "warnings": warnings}


def torchrun_shutdown_timeout(argv: Sequence[str] = ("script.py",)) -> Optional[int]:
    """The seconds torchrun waits, after forwarding a signal to its workers, before SIGKILL.

    Read by torchrun's own parser and ``LaunchConfig``: ``--shutdown-timeout``, else the
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` variable, else 30 (torch/distributed/launcher/api.py).

    Args:
        argv: torchrun's arguments, ending with the script's name.

    Returns:
        The seconds, or None on a torch without the option.

    Lesson: 07.
    """
    from torch.distributed import run

    config, _cmd_args, _warnings = _config_from(run.parse_args(list(argv)))
    return getattr(config, "shutdown_timeout", None)


def legacy_script_argv(script_args: Sequence[str] = (), *, local_rank: int = 0,
                       nproc_per_node: int = 2, script: str = "train.py") -> list[str]:
    """The arguments ``python -m torch.distributed.launch`` gives ``script`` on one local rank.

    Computed by the installed torch's own launcher code (its parser, ``config_from_args``, and
    the macro it replaces with each worker's local rank), not written down here.

    Returns:
        The script's ``sys.argv[1:]``: ``--local-rank=<local_rank>`` (torch >= 2.0; older
        torch wrote ``--local_rank``) followed by ``script_args``.

    Lesson: 07.
    """
    from torch.distributed import launch
    from torch.distributed.elastic.utils.api import macros

    args = launch.parse_args(["--nproc-per-node", str(nproc_per_node), script,
                              *map(str, script_args)])
    _config, cmd_args, _warnings = _config_from(args)
    return _after_script(macros.substitute(cmd_args, str(local_rank)), script)


def _after_script(cmd_args: Sequence[str], script: Optional[str] = None) -> list[str]:
    """The arguments after the script (or module) name in a worker's command."""
    args = list(cmd_args)
    if script is not None and script in args:
        return args[args.index(script) + 1:]
    while args and args[0] in ("-u", "-m"):  # python's own flags before the script
        args.pop(0)
    return args[1:]


def parse_outcome(parse: Callable[[list[str]], argparse.Namespace], argv: Sequence[str]
                  ) -> tuple[Optional[argparse.Namespace], str]:
    """Run a script's argument parsing on ``argv``; return ``(namespace, "")`` or ``(None, error)``.

    ``parse`` is the script's own function (``parse_args(argv)``) or a parser's ``parse_args``.
    ``argparse`` prints its error and exits the process; here the message is returned instead,
    so a notebook can show it and go on.

    Lesson: 07.
    """
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse(list(argv)), ""
    except SystemExit:
        lines = stderr.getvalue().strip().splitlines()
        return None, lines[-1] if lines else "exited while parsing its arguments"


_FAKE_SRUN = """#!/bin/sh
{python} -c 'import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "omp": os.environ.get("OMP_NUM_THREADS")}}))' "$@" > "{out}"
"""
_FAKE_SCONTROL = """#!/bin/sh
seq -f 'node%03g' 1 "$SLURM_NNODES"
"""


def slurm_dry_run(script: str, *, nodes: int, cpus_per_task: int = 16, job_id: int = 4242,
                  timeout: float = 30.0) -> dict[str, Any]:
    """Run a SLURM batch script with bash, ``scontrol`` and ``srun`` replaced by stand-ins.

    The allocation is ``node001`` ... ``node<nodes>``; ``srun`` records the command it was
    asked to run on every node (and the ``OMP_NUM_THREADS`` it would pass) instead of running
    it. What the script computes (the head node, the thread count) is computed by bash.

    Returns:
        ``returncode``, ``stdout`` (the script's own output), ``command`` (what srun got, e.g.
        ``["torchrun", "--nnodes", "4", ...]``), ``omp_num_threads`` and ``job_id`` (the
        ``SLURM_JOB_ID`` it ran under).

    Lesson: 07b.
    """
    with tempfile.TemporaryDirectory(prefix="ddplab-slurm-") as tmp:
        folder = Path(tmp)
        record = folder / "srun.json"
        for name, text in (("srun", _FAKE_SRUN.format(python=sys.executable, out=record)),
                           ("scontrol", _FAKE_SCONTROL)):
            (folder / name).write_text(text)
            (folder / name).chmod(0o755)
        (folder / "job.sbatch").write_text(script)
        env = {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}",
               "SLURM_NNODES": str(nodes), "SLURM_JOB_ID": str(job_id),
               "SLURM_JOB_NODELIST": f"node[001-{nodes:03d}]",
               "SLURM_CPUS_PER_TASK": str(cpus_per_task)}
        env.pop("OMP_NUM_THREADS", None)
        done = subprocess.run(["bash", str(folder / "job.sbatch")], env=env, cwd=folder,
                              capture_output=True, text=True, timeout=timeout)
        called = json.loads(record.read_text()) if record.exists() else {}
    return {"returncode": done.returncode, "stdout": done.stdout + done.stderr,
            "command": called.get("argv", []), "omp_num_threads": called.get("omp"),
            "job_id": str(job_id)}
