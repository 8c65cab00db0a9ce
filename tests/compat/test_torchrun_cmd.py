"""``fallback.torchrun_command`` builds a command line that the installed torchrun accepts
as meant."""

from __future__ import annotations

import sys

import pytest
from torch.distributed.run import get_args_parser

from ddplab.launcher.fallback import torchrun_command


def parse(target: str, args: list[str], nnodes: int = 1, node_rank: int = 0,
          endpoint: str = "127.0.0.1:0", run_id: str = "r", max_restarts: int = 0) -> object:
    """Parse the ARGS of ``python -m ddplab.launcher.fallback ARGS`` (torchrun, then what its
    job left ends) as the installed torchrun does."""
    cmd = torchrun_command(target, args, 2, nnodes, node_rank, endpoint, run_id, max_restarts)
    assert cmd[:3] == [sys.executable, "-m", "ddplab.launcher.fallback"], cmd
    return get_args_parser().parse_args(cmd[3:])  # exits on an unknown flag


@pytest.mark.parametrize("nnodes, node_rank, endpoint", [(1, 0, "127.0.0.1:29511"),
                                                         (2, 1, "10.0.0.5:29511")])
def test_installed_torchrun_parses_the_command(nnodes, node_rank, endpoint):
    args = parse("/lessons/train.py", ["--epochs", "1"], nnodes, node_rank, endpoint, "run-7",
                 max_restarts=1)
    assert (args.nnodes, str(args.nproc_per_node)) == (str(nnodes), "2")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", endpoint, "run-7")
    assert args.max_restarts == 1
    assert args.node_rank == node_rank
    assert (args.local_addr == "127.0.0.1") == endpoint.startswith("127.")
    assert args.module and args.training_script == "ddplab.launcher.entry"  # each rank's entry
    assert args.training_script_args == ["/lessons/train.py", "--epochs", "1"]


def test_a_module_target_reaches_the_entry_by_name():
    args = parse("ddplab.workers.train", [])
    assert args.training_script_args == ["ddplab.workers.train"]
