"""The launch works without any of its adjustments to torch internals.

The helper adjusts a few private parts of torch for speed (the rendezvous's idle waits, the
exit codes of every rank) and to keep stores on the loopback address. Each is optional: when
its target is missing or shaped differently (another torch version), or when
``DDPLAB_TORCH_PATCHES=0``, it is skipped and the launch goes on as plain torchrun would. Here
the fault suite runs with every adjustment off, and each must still give the same answers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ddplab
from ddplab import agent, launch

SCRIPTS = Path(__file__).parent / "scripts"
FAULTY = str(SCRIPTS / "faulty.py")
OFF = {"DDPLAB_TORCH_PATCHES": "0"}


def test_an_adjustment_that_does_not_fit_is_skipped_and_said(capsys, monkeypatch):
    def _missing_target():
        raise AttributeError("module has no attribute '_delay'")

    assert agent._optional(_missing_target) is False
    assert "skipped missing_target" in capsys.readouterr().err
    monkeypatch.setenv("DDPLAB_TORCH_PATCHES", "0")
    assert agent._optional(lambda: None) is False  # switched off: not even tried


def test_success_without_adjustments():
    result = launch(SCRIPTS / "plain.py", 2, env=OFF, quiet=True, timeout=120)
    assert result.ok, result.error
    assert sorted(result.log(0).splitlines() + result.log(1).splitlines()) == [
        "rank 0 of 2: sum 3", "rank 1 of 2: sum 3"]


@pytest.mark.parametrize("mode, rank, text", [
    ("raise", 1, "ValueError: boom on rank 1"),
    ("exit", 1, "rank 1 exited with code 3"),
    ("signal", 1, "killed by SIGKILL"),
])
def test_failures_name_the_rank_without_adjustments(mode, rank, text):
    result = launch(FAULTY, 2, args=[mode], env=OFF, quiet=True, timeout=120)
    assert result.status == "failed" and not result.ok
    assert result.root_cause.rank == rank, result.error
    assert text in result.error


def test_timeout_ends_every_worker_without_adjustments():
    from test_launch import printed_pids, wait_gone

    result = launch(FAULTY, 2, args=["hang"], env=OFF, timeout=5, quiet=True)
    assert result.status == "timeout"
    pids = printed_pids(result.log(0) + "\n" + result.log(1))
    assert len(pids) == 2 and not wait_gone(pids, 5)


def test_two_nodes_without_adjustments():
    results = ddplab.launch_multinode(SCRIPTS / "plain.py", nnodes=2, nproc_per_node=1,
                                      env=OFF, quiet=True, timeout=120)
    assert [r.ok for r in results] == [True, True], [r.error for r in results]
    assert all(re.search(r"sum 3", "\n".join(r.log(rank) for rank in r.logs))
               for r in results)


def test_a_job_sees_the_debug_level_its_environment_asks_for(tmp_path):
    """torch reads TORCH_DISTRIBUTED_DEBUG at import, in the helper: a worker must read it anew."""
    script = tmp_path / "level.py"
    script.write_text("import torch.distributed as dist\n"
                      "print('debug', dist.get_debug_level(), flush=True)\n")
    detail = launch(script, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, quiet=True, timeout=120)
    plain = launch(script, 2, quiet=True, timeout=120)
    assert detail.log(0) == detail.log(1) == "debug DebugLevel.DETAIL", detail.error
    assert plain.log(1) == "debug DebugLevel.OFF", plain.error
