"""The in-kernel demonstrations of lessons 05 and 06 state true facts about PyTorch."""

from __future__ import annotations

import pickle

import pytest
import torch

from ddplab import lessons


# ------------------------------------------------------------------------ 05


@pytest.fixture
def state_file(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"model": lessons.TinyNet().state_dict(), "epoch": 2}, path)
    return path


def test_checkpoint_table_lists_top_level_entries(state_file):
    rows = dict(lessons.checkpoint_table(state_file))
    assert rows["epoch"] == "2" and rows["model"].startswith("4 tensors")


def test_a_gpu_tagged_file_needs_map_location(state_file, tmp_path):
    gpu = tmp_path / "gpu.pt"
    lessons.as_if_saved_on(state_file, gpu, "cuda:1")
    assert lessons.saved_locations(state_file) == {"cpu": 4}
    assert lessons.saved_locations(gpu) == {"cuda:1": 4}
    assert lessons.tensor_devices(gpu, "cpu") == {"cpu": 4}
    if not torch.cuda.is_available():
        error = lessons.error_of(lambda: lessons.tensor_devices(gpu))
        assert isinstance(error, RuntimeError) and "map_location" in str(error)


def test_pickled_module_is_refused_by_weights_only_and_breaks_on_rename(tmp_path, state_file):
    path = tmp_path / "module.pt"
    torch.save(lessons.TinyNet(), path)
    assert "ddplab.lessons.TinyNet" in lessons.pickled_globals(path)
    assert not any("TinyNet" in g for g in lessons.pickled_globals(state_file))
    error = lessons.error_of(lambda: torch.load(path, weights_only=True))
    assert isinstance(error, pickle.UnpicklingError)
    error = lessons.load_without_class(path)
    assert isinstance(error, AttributeError) and "TinyNet" in str(error)
    assert hasattr(lessons, "TinyNet")  # restored afterwards


def test_truncated_file_does_not_load(state_file, tmp_path):
    half = tmp_path / "half.pt"
    assert lessons.truncate(state_file, half) < state_file.stat().st_size
    assert isinstance(lessons.error_of(lambda: torch.load(half, weights_only=True)),
                      RuntimeError)


def test_wrapped_state_dict_has_the_module_prefix():
    keys = list(lessons.wrapped_state_dict(lessons.TinyNet()))
    assert keys and all(k.startswith("module.") for k in keys)


# ------------------------------------------------------------------------ 06


def test_autocast_on_cpu_computes_in_bf16_and_keeps_fp32_weights():
    facts = lessons.autocast_facts("cpu")
    assert facts["default"] == torch.bfloat16
    assert facts["matmul"] == facts["linear_output"] == torch.bfloat16
    assert facts["weight"] == facts["grad"] == facts["outside"] == torch.float32
    assert facts["loss"] == torch.float32


def test_number_formats():
    rows = {r["dtype"]: r for r in lessons.number_formats()}
    assert rows["float16"]["1e-8"] == 0.0 and rows["float16"]["70000"] == float("inf")
    assert rows["bfloat16"]["1e-8"] > 0 and rows["bfloat16"]["max"] > 1e38


def test_fp16_gradients_underflow_without_a_scaler_and_bf16_ones_do_not():
    assert lessons.tiny_gradient(torch.float16, use_scaler=False) == 0.0
    scaled = lessons.tiny_gradient(torch.float16, use_scaler=True)
    bf16 = lessons.tiny_gradient(torch.bfloat16, use_scaler=False)
    assert scaled == pytest.approx(3e-8, rel=0.01) and bf16 == pytest.approx(3e-8, rel=0.01)


def test_scaler_skips_an_overflowing_step_and_halves_the_scale():
    facts = lessons.scaler_overflow_step()
    assert facts["scale_after"] == facts["scale_before"] / 2
    assert not facts["weights_changed"] and facts["then_changed"]


def test_old_amp_names_warn():
    messages = lessons.deprecated_amp_names()
    assert any("FutureWarning" in m and "torch.amp.autocast" in m for m in messages)


def test_matmul_speed_reports_both_precisions_and_restores_threads():
    threads = torch.get_num_threads()
    rows = lessons.matmul_speed((16, 32), repeats=1, inner=1)
    assert [r["size"] for r in rows] == [16, 32]
    assert all(r["fp32_ms"] > 0 and r["bf16_ms"] > 0 and r["speedup"] > 0 for r in rows)
    assert torch.get_num_threads() == threads
