"""Command line: ``python -m ddplab {doctor,launch,course,bench}``.

Examples::

    python -m ddplab doctor
    python -m ddplab launch --nproc-per-node 2 -m ddplab.workers.train --epochs 2
    python -m ddplab launch --nproc-per-node 2 my_script.py --lr 0.1
    python -m ddplab course          # execute every notebook into build/
    python -m ddplab bench           # the scaling benchmark of notebook 09

Lessons: 07 (launching from a terminal), 09 (bench).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence


def _launch(ns: argparse.Namespace) -> int:
    import os

    from .launcher import LaunchError, launch

    # One launch per process: preload the training stack only for ddplab's training workers.
    os.environ.setdefault("DDPLAB_PRELOAD_TRAINING", "auto")
    try:
        result = launch(ns.target, ns.nproc_per_node, args=ns.args, engine=ns.engine,
                        timeout=ns.timeout, quiet=ns.quiet, backend=ns.backend,
                        nnodes=ns.nnodes, node_rank=ns.node_rank,
                        rdzv_endpoint=ns.rdzv_endpoint, master_addr=ns.master_addr,
                        master_port=ns.master_port, threads=ns.threads,
                        max_restarts=ns.max_restarts)
    except LaunchError as err:
        print(f"ddplab launch: {err}", file=sys.stderr)
        return 2
    if not result.ok and ns.quiet:
        print(f"ddplab launch: {result.status}: {result.error}", file=sys.stderr)
    return result.returncode


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddplab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="report devices, backends and problems with their fixes")
    run = sub.add_parser("launch", help="run a script or module on N processes (like torchrun)")
    run.add_argument("--nproc-per-node", "--nprocs", type=int, default=2)
    run.add_argument("--engine", choices=["torchrun", "spawn"], default="torchrun")
    run.add_argument("--timeout", type=float, default=None, help="seconds (default 3600)")
    run.add_argument("--backend", choices=["gloo", "nccl", "mpi"], default=None)
    run.add_argument("--threads", type=int, default=1, help="torch threads per process")
    run.add_argument("--nnodes", type=int, default=1)
    run.add_argument("--node-rank", type=int, default=0)
    run.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 (multi-node)")
    run.add_argument("--master-addr", default=None)
    run.add_argument("--master-port", type=int, default=None)
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restart every worker up to this many times after a failure "
                          "(torchrun's --max-restarts)")
    run.add_argument("--quiet", action="store_true", help="print only the final error")
    run.add_argument("-m", dest="module", action="store_true",
                     help="TARGET is a module name (accepted for torchrun compatibility)")
    run.add_argument("target", help="a .py file or a module name")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    sub.add_parser("course", help="execute every notebook into build/ (--help for options)")
    sub.add_parser("bench", help="the scaling benchmark of 09 (--help for options)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m ddplab`` and the ``ddplab`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("course", "bench"):  # their own parsers take the options
        return int(importlib.import_module(f"ddplab.{argv[0]}").main(argv[1:]) or 0)
    ns = _parser().parse_args(argv)
    if ns.command == "doctor":
        from .env import doctor

        report = doctor()
        return 1 if report["problems"] and report["gpu_count"] == 0 and not \
            report["backends"]["gloo"] else 0
    return _launch(ns)


if __name__ == "__main__":
    sys.exit(main())
