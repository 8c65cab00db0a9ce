"""``fallback.torchrun_cmd`` builds a command line that the installed torchrun accepts as meant."""

from __future__ import annotations

import sys

import pytest
from torch.distributed.run import get_args_parser

from ddplab.launcher.fallback import torchrun_cmd


def parse(cmd: list[str]) -> tuple[dict[str, str], object]:
    """Split ``[env NAME=value ...] python -m ddplab.launcher.fallback ARGS`` (torchrun with
    whole lines) and parse ARGS."""
    start = cmd.index(sys.executable)
    assert cmd[start + 1:start + 3] == ["-m", "ddplab.launcher.fallback"], cmd
    env = dict(a.split("=", 1) for a in cmd[1:start]) if start else {}
    return env, get_args_parser().parse_args(cmd[start + 3:])  # exits on an unknown flag


@pytest.mark.parametrize("nnodes, node_rank, endpoint", [(1, 0, "127.0.0.1:29511"),
                                                         (2, 1, "10.0.0.5:29511")])
def test_installed_torchrun_parses_the_command(nnodes, node_rank, endpoint):
    cmd = torchrun_cmd("/lessons/train.py", ["--epochs", "1"], 2, nnodes, node_rank,
                       endpoint, "run-7", max_restarts=1)
    env, args = parse(cmd)
    template = getattr(args, "log_line_prefix_template", None) \
        or env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    assert template == "[rank${rank}]:"
    assert (args.nnodes, str(args.nproc_per_node)) == (str(nnodes), "2")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", endpoint, "run-7")
    assert (args.max_restarts, args.tee) == (1, "3")
    assert args.node_rank == node_rank
    assert (args.local_addr == "127.0.0.1") == endpoint.startswith("127.")
    assert (args.training_script, args.training_script_args) == \
        ("/lessons/train.py", ["--epochs", "1"])


def test_a_module_target_runs_with_dash_m():
    _env, args = parse(torchrun_cmd("ddplab.workers.train", [], 2, 1, 0, "127.0.0.1:0", "r"))
    assert args.module and args.training_script == "ddplab.workers.train"
