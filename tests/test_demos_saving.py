"""ddplab.lab.demos.saving: what lesson 05 shows about checkpoint files is true."""

from __future__ import annotations

import pickle

import pytest
import torch

from ddplab.lab.demos import error_of, saving


@pytest.fixture
def state_file(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"model": saving.TinyNet().state_dict(), "epoch": 2}, path)
    return path


def test_checkpoint_table_lists_top_level_entries(state_file):
    rows = dict(saving.checkpoint_table(state_file))
    assert rows["epoch"] == "2" and rows["model"].startswith("4 tensors")


def test_a_gpu_tagged_file_needs_map_location(state_file, tmp_path):
    gpu = tmp_path / "gpu.pt"
    saving.as_if_saved_on(state_file, gpu, "cuda:1")
    assert saving.saved_locations(state_file) == {"cpu": 4}
    assert saving.saved_locations(gpu) == {"cuda:1": 4}
    assert saving.tensor_devices(gpu, "cpu") == {"cpu": 4}
    if not torch.cuda.is_available():  # the same file, without map_location: no cuda:1 here
        assert isinstance(error_of(lambda: saving.tensor_devices(gpu)), RuntimeError)


def test_pickled_module_is_refused_by_weights_only_and_breaks_on_rename(tmp_path, state_file):
    path = tmp_path / "module.pt"
    torch.save(saving.TinyNet(), path)
    assert "ddplab.lab.demos.saving.TinyNet" in saving.pickled_globals(path)
    assert not any("TinyNet" in g for g in saving.pickled_globals(state_file))
    error = error_of(lambda: torch.load(path, weights_only=True))
    assert isinstance(error, pickle.UnpicklingError)
    assert isinstance(saving.load_without_class(path), AttributeError)
    assert hasattr(saving, "TinyNet")  # restored afterwards
    # and with the class back, the same file loads: the missing class was the cause
    assert isinstance(torch.load(path, weights_only=False), saving.TinyNet)


def test_truncated_file_does_not_load(state_file, tmp_path):
    half = tmp_path / "half.pt"
    assert saving.truncate(state_file, half) < state_file.stat().st_size
    assert isinstance(error_of(lambda: torch.load(half, weights_only=True)),
                      RuntimeError)


def test_wrapped_state_dict_has_the_module_prefix():
    keys = list(saving.wrapped_state_dict(saving.TinyNet()))
    assert keys and all(k.startswith("module.") for k in keys)
