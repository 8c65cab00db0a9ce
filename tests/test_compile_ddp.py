"""torch.compile with DDP on real gloo ranks: the MLP class is compiled in either order, and the
profiler sees one compiled graph per bucket, forward and backward; every compiled run gives eager
DDP's losses; no C++ compiler, no inductor."""

from __future__ import annotations

import shutil

import pytest

from ddplab import launch
from ddplab.workers import compile_ddp


@pytest.mark.slow
def test_graphs_split_per_bucket_and_the_losses_equal_eager():
    result = launch("ddplab.workers.compile_ddp", 2, args=["--backend", "aot_eager", "--steps", "2"],
                    quiet=True)
    assert result.ok, result.error
    graphs = {e["order"]: e for e in result.events_of("graphs")}
    assert sorted(graphs) == sorted(compile_ddp.ORDERS)
    for e in graphs.values():        # either order: one compiled graph per bucket (DDPOptimizer)
        assert e["buckets"] >= 2 and e["forward"] == e["backward"] == e["buckets"], e
        assert e["backend"] == "aot_eager" and e["frames"] >= 1 and not e["sequential"]
    losses: dict[str, list[float]] = {}
    for e in result.events_of("loss"):
        losses.setdefault(e["run"], []).append(e["loss"])
    assert sorted(losses) == sorted(["eager", *(f"{o}/aot_eager" for o in compile_ddp.ORDERS)])
    for run, values in losses.items():
        assert values == pytest.approx(losses["eager"], abs=1e-5), run


def test_without_a_cxx_compiler_inductor_is_not_attempted(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert compile_ddp.cxx_compiler() is None
    monkeypatch.setenv("CXX", "/opt/bin/g++")
    assert compile_ddp.cxx_compiler() == "/opt/bin/g++"
