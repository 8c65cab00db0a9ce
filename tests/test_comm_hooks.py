"""DDP communication hooks on real gloo ranks: 16-bit hooks send half the bytes, PowerSGD far
fewer, and the models still learn."""

from __future__ import annotations

import pytest

from ddplab import launch
from ddplab.workers import comm_hooks

pytestmark = pytest.mark.slow


def test_compression_hooks_send_fewer_bytes_and_still_learn():
    result = launch("ddplab.workers.comm_hooks", 2, args=["--epochs", "2"], quiet=True)
    assert result.ok, result.error
    found = {(e["hook"], e["rank"]): e for e in result.events_of("hook")}
    skipped = {e["hook"] for e in result.events_of("skipped")}
    assert {h for h, _ in found} | skipped == set(comm_hooks.HOOKS) and "none" not in skipped
    for rank in (0, 1):
        plain = found["none", rank]
        assert plain["bytes_per_step"] == pytest.approx(plain["grad_bytes"], rel=0.05)
        assert plain["accuracy"] > 0.85
        for hook in {"fp16", "bf16"} - skipped:
            assert found[hook, rank]["bytes_per_step"] == pytest.approx(plain["bytes_per_step"] / 2, rel=0.05)
            assert found[hook, rank]["accuracy"] > plain["accuracy"] - 0.05
        if "powersgd" not in skipped:
            assert found["powersgd", rank]["bytes_per_step"] < 0.4 * plain["bytes_per_step"]
            assert found["powersgd", rank]["accuracy"] > 0.75
