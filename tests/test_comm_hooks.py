"""DDP communication hooks on real gloo ranks: 16-bit hooks send half the bytes, PowerSGD far
fewer, and the models still learn."""

from __future__ import annotations

import pytest
import torch

from ddplab import launch
from ddplab.workers import comm_hooks

pytestmark = pytest.mark.slow


def test_compression_hooks_send_fewer_bytes_and_still_learn():
    result = launch("ddplab.workers.comm_hooks", 2, args=["--epochs", "2"], quiet=True)
    assert result.ok, result.error   # a hook that raises fails the launch
    found = {(e["hook"], e["rank"]): e for e in result.events_of("hook")}
    skipped = {e["hook"]: e["reason"] for e in result.events_of("skipped")}
    absent = {hook for hook in comm_hooks.HOOKS if comm_hooks.missing(hook)}
    assert set(skipped) == absent, f"skipped {skipped}, but this torch lacks only {absent}"
    if absent:
        pytest.skip(f"torch {torch.__version__} lacks {sorted(absent)}: {skipped}")
    assert set(found) == {(hook, rank) for hook in comm_hooks.HOOKS for rank in (0, 1)}
    for rank in (0, 1):
        plain = found["none", rank]
        assert plain["bytes_per_step"] == pytest.approx(plain["grad_bytes"], rel=0.05)
        assert plain["accuracy"] > 0.85
        for hook in ("fp16", "bf16"):
            half = plain["bytes_per_step"] / 2
            assert found[hook, rank]["bytes_per_step"] == pytest.approx(half, rel=0.05)
            assert found[hook, rank]["accuracy"] > plain["accuracy"] - 0.05
        assert found["powersgd", rank]["bytes_per_step"] < 0.4 * plain["bytes_per_step"]
        assert found["powersgd", rank]["accuracy"] > 0.75


def test_a_hook_the_installed_torch_lacks_is_named_and_every_other_is_there(monkeypatch):
    """The one reason to skip a hook is checked against torch itself, not caught from an error."""
    assert all(comm_hooks.missing(hook) is None for hook in comm_hooks.HOOKS)
    module, name = comm_hooks.HOOK_FUNCTIONS["bf16"]
    monkeypatch.setitem(comm_hooks.HOOK_FUNCTIONS, "bf16", (module, name + "_of_the_future"))
    reason = comm_hooks.missing("bf16")
    assert reason and torch.__version__ in reason and name + "_of_the_future" in reason


def test_a_hook_that_raises_fails_the_job(tmp_path):
    """A broken hook is a failed launch with its traceback, not a "skipped" event."""
    script = tmp_path / "raising_hook.py"
    script.write_text(
        "from ddplab.workers import comm_hooks\n"
        "def broken(state, bucket):\n"
        "    raise RuntimeError('this hook is broken')\n"
        "def register(model, hook, args):  # fp16 registers a hook that raises\n"
        "    if hook != 'fp16':\n"
        "        return original(model, hook, args)\n"
        "    model.register_comm_hook(None, broken)\n"
        "original, comm_hooks.register = comm_hooks.register, register\n"
        "comm_hooks.main(['--hooks', 'none', 'fp16', '--epochs', '1'])\n")
    result = launch(str(script), 2, quiet=True, timeout=300)
    assert not result.ok and not result.events_of("skipped")
    assert {e["hook"] for e in result.events_of("hook")} == {"none"}
    assert "this hook is broken" in result.error
