"""Every worker starts able to use CUDA, on every launch path.

A process forked after its parent touched the CUDA runtime (even ``torch.cuda.is_available()``
or a device count) cannot use CUDA: its first CUDA call raises "Cannot re-initialize CUDA in
forked subprocess". That is a GPU fault, but it is visible on any machine: torch marks such a
child, and ``torch.cuda._is_in_bad_fork()`` says so. So every path is checked here, on CPU:
the cold command, the warm API (forked by the helper), a torchrun subprocess and the spawn
engine. Several nodes take the torchrun-subprocess path too (``fallback.start_torchrun``, one
per node, the same command): ``test_subprocess_fallback`` stands for it. Where each rank is a
fresh interpreter started alike (a torchrun subprocess's, mp.spawn's) one rank stands for all:
each more would only import torch once more; forked ranks run two.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddplab import launch
from ddplab.launcher import agent

PROBE = str(Path(__file__).parent / "scripts" / "cuda_probe.py")
CLEAN = "cuda False False"


def probe_lines(text: str) -> list[str]:
    return sorted(line.split("] ", 1)[-1] for line in text.splitlines() if "cuda " in line)


def assert_clean(lines: list[str], ranks: int) -> None:
    assert len(lines) == ranks, lines
    assert all(line.startswith(CLEAN + " rank ") for line in lines), lines


def test_cold_cli():
    out = subprocess.run([sys.executable, "-m", "ddplab", "launch", "--nproc-per-node", "2",
                          PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert_clean(probe_lines(out.stdout), 2)


def test_warm_api_after_the_training_preload():
    for _ in range(2):  # the second launch reuses the helper that preloaded the training stack
        result = launch(PROBE, 2, quiet=True, timeout=120)
        assert result.ok, result.error
        assert_clean(probe_lines("\n".join(result.log(r) for r in (0, 1))), 2)


def test_subprocess_fallback(monkeypatch):
    monkeypatch.setenv("DDPLAB_LAUNCH_PATH", "subprocess")
    result = launch(PROBE, 1, quiet=True, timeout=120)
    assert result.ok, result.error
    assert_clean(probe_lines(result.log(0)), 1)


def test_spawn_engine():
    result = launch(PROBE, 1, args=["spawn"], engine="spawn", quiet=True, timeout=120)
    assert result.ok, result.error
    text = "\n".join(line for log in result.logs.values() for line in log)
    assert_clean(probe_lines(text), 1)


def logs_in(folder):
    """torch's log folder in ``folder`` (without one, LaunchConfig makes one in /tmp)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return DefaultLogsSpecs(log_dir=str(folder))


def test_launch_config_never_asks_the_accelerator(monkeypatch, tmp_path):
    """The agent builds torch's LaunchConfig in the process that forks the workers."""
    asked: list[str] = []

    def recorder(name):
        def ask(*_args, **_kwargs):
            asked.append(name)
            return 2
        return ask

    for name in ("is_available", "device_count"):
        monkeypatch.setattr(torch.accelerator, name, recorder(f"accelerator.{name}"),
                            raising=False)
        monkeypatch.setattr(torch.cuda, name, recorder(f"cuda.{name}"))
    config = agent.launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="x",
                                 rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                                 start_method="fork", logs_specs=logs_in(tmp_path))
    assert asked == []
    assert getattr(config, "numa_options", None) is None  # no binding, as asked of nobody


def test_launch_config_leaves_out_options_this_torch_does_not_know(tmp_path):
    config = agent.launch_config(min_nodes=1, max_nodes=1, nproc_per_node=1, run_id="x",
                                 rdzv_endpoint="127.0.0.1:0", no_such_option_in_any_torch=1,
                                 logs_specs=logs_in(tmp_path))
    assert not hasattr(config, "no_such_option_in_any_torch") and config.nproc_per_node == 1
