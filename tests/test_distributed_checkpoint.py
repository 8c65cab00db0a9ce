"""torch.distributed.checkpoint on real gloo ranks: an FSDP2 model and its Adam state saved from
2 ranks load into 4 ranks and into one process, equal to what was saved."""

from __future__ import annotations

import pytest
import torch

from ddplab import launch

pytestmark = pytest.mark.slow
WORKER = "ddplab.workers.distributed_checkpoint"
FSDP_ON_CPU = torch.__version__ >= "2.7"   # a TorchVersion: compares as versions


def test_saved_on_two_ranks_loads_on_four_and_on_one(tmp_path):
    path = str(tmp_path / "dcp")
    saved = launch(WORKER, 2, args=["--save", path], quiet=True)
    assert saved.ok, saved.error
    if not FSDP_ON_CPU:
        reason = saved.events_of("skipped")[0]["reason"]
        assert "2.7" in reason
        pytest.skip(f"torch {torch.__version__}: {reason}")
    files = saved.events_of("files")[0]["names"]
    assert ".metadata" in files and sum(name.endswith(".distcp") for name in files) == 2
    weights = saved.events_of("weights")[0]
    full = sum(len(v) for v in weights["values"]) * 4
    held = [e["param_bytes"] for e in saved.events_of("dcp")]
    assert sum(held) == full and max(held) < full                   # each rank saved its shard
    for nprocs in (4, 1):
        loaded = launch(WORKER, nprocs, args=["--load", path], quiet=True)
        assert loaded.ok, loaded.error
        back = loaded.events_of("weights")[0]
        assert back["values"] == weights["values"]                  # exactly, resharded
        assert back["optimizer_steps"] == weights["optimizer_steps"] == 3
        assert back["exp_avg"] == weights["exp_avg"] and back["exp_avg_sq"] == weights["exp_avg_sq"]
        assert any(v != 0 for m in weights["exp_avg_sq"] for v in m)   # a state worth comparing
        held = [e["param_bytes"] for e in loaded.events_of("dcp")]
        assert len(held) == nprocs and sum(held) == full


def test_loading_a_missing_checkpoint_says_to_save_one(tmp_path):
    result = launch(WORKER, 1, args=["--load", str(tmp_path / "nothing")], quiet=True)
    assert not result.ok and "--save" in result.error
