"""torch.compile with DDP on real gloo ranks: the MLP class is compiled in either order, and the
profiler sees one compiled graph per bucket, forward and backward, and in the outer order two
compiled frames (DDP's, then the model's); every compiled run gives eager DDP's losses; no C++
compiler, no inductor."""

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
    assert graphs["compile_then_wrap"]["regions"] == ["0/0"]        # the model's frame only
    outer = graphs["wrap_then_compile"]["regions"]                  # DDP's frame, then the model's
    assert len(outer) == 2 and outer[0] == "0/0" and int(outer[1].split("/")[0]) >= 1, outer
    assert not result.events_of("why")                              # --sequential only
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


class _Event:
    def __init__(self, name):
        self.name = name


def test_compiled_pieces_counts_regions_and_orders_their_frames_by_number():
    names = ["Torch-Compiled Region: 10/0", "CompiledFunction", "aten::mm",
             "Torch-Compiled Region: 4/0", "CompiledFunctionBackward", "CompiledFunction",
             "Torch-Compiled Region: 4/0"]
    seen = compile_ddp.compiled_pieces([_Event(n) for n in names])
    assert seen == {"frames": 3, "regions": ["4/0", "10/0"], "forward": 2, "backward": 1}
