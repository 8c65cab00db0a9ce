"""Lesson 07b's one loop in three libraries: plain DDP trains and saves on real gloo ranks; the
Accelerate and Fabric versions do too where the library is installed, and say what to install
where it is not."""

from __future__ import annotations

import importlib.util

import pytest

from ddplab import launch

pytestmark = pytest.mark.slow
INSTALLED = {"loop_accelerate": importlib.util.find_spec("accelerate") is not None,
             "loop_fabric": importlib.util.find_spec("lightning_fabric") is not None
             or importlib.util.find_spec("lightning") is not None}


def test_plain_ddp_loop_trains_and_saves_once(tmp_path):
    result = launch("ddplab.workers.loop_ddp", 2, args=["--checkpoint-dir", str(tmp_path)],
                    quiet=True)
    assert result.ok, result.error
    (found,) = result.events_of("result")
    assert found["rank"] == 0 and found["saved"] and found["accuracy"] > 0.8
    assert (tmp_path / "model.pt").is_file()
    assert {e["rank"] for e in result.events_of("epoch")} == {0, 1}


@pytest.mark.parametrize("worker", sorted(INSTALLED))
def test_library_loops_train_where_installed_and_explain_where_not(worker, tmp_path):
    result = launch(f"ddplab.workers.{worker}", 2, args=["--checkpoint-dir", str(tmp_path)],
                    quiet=True)
    if not INSTALLED[worker]:
        assert not result.ok and "pip install" in result.error
    else:
        assert result.ok, result.error
        (found,) = result.events_of("result")              # one main process: really distributed
        assert found["rank"] == 0 and found["saved"] and found["accuracy"] > 0.8


def test_a_missing_checkpoint_dir_is_refused(tmp_path):
    result = launch("ddplab.workers.loop_ddp", 2, args=["--checkpoint-dir", str(tmp_path / "no")],
                    quiet=True)
    assert not result.ok and "create it first" in result.error
