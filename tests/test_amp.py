"""ddplab.amp: what --amp means on each device, and when a GradScaler is needed (CUDA faked)."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

from ddplab import amp


# What would ask the CUDA driver (and so initialise CUDA in a real kernel): ddplab's decisions
# must call none of them. Recorded, so the check can fail on a machine without a GPU too.
CUDA_QUERIES = ("init", "current_device", "set_device", "get_device_properties",
                "get_device_capability", "is_bf16_supported", "synchronize")


def gpus(count: int):
    """Make torch report ``count`` GPUs without touching CUDA; every CUDA query is a Mock."""
    return mock.patch.multiple(torch.cuda, is_available=mock.Mock(return_value=count > 0),
                               device_count=mock.Mock(return_value=count),
                               **{name: mock.Mock(name=name) for name in CUDA_QUERIES})


def test_autocast_dtype_per_device() -> None:
    assert amp.autocast_dtype("off", "cuda") is None
    assert amp.autocast_dtype("off", "cpu") is None
    assert amp.autocast_dtype("bf16", "cuda") is torch.bfloat16
    assert amp.autocast_dtype("bf16", "cpu") is torch.bfloat16
    assert amp.autocast_dtype("fp16", "cuda") is torch.float16
    with pytest.raises(ValueError, match="bf16"):
        amp.autocast_dtype("fp8", "cuda")


def test_fp16_on_cpu_falls_back_to_bf16_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="--amp bf16"):
        assert amp.autocast_dtype("fp16", "cpu") is torch.bfloat16


def test_grad_scaler_only_for_fp16_on_gpu() -> None:
    assert amp.grad_scaler_enabled("fp16", "cuda")
    assert not amp.grad_scaler_enabled("bf16", "cuda")
    assert not amp.grad_scaler_enabled("off", "cuda")
    assert not amp.grad_scaler_enabled("fp16", "cpu")  # it became bf16
    assert not amp.make_grad_scaler("fp16", torch.device("cpu")).is_enabled()


def test_grad_scaler_on_a_gpu_is_enabled_for_fp16_only() -> None:
    with gpus(2), warnings.catch_warnings():
        warnings.simplefilter("error")  # fp16 on a GPU is no fallback: nothing to warn about
        assert amp.autocast_dtype("fp16", "cuda") is torch.float16
        assert amp.make_grad_scaler("fp16", torch.device("cuda", 1)).is_enabled()
        assert not amp.make_grad_scaler("bf16", torch.device("cuda", 1)).is_enabled()
        assert not amp.make_grad_scaler("off", torch.device("cuda", 1)).is_enabled()
        queried = [name for name in CUDA_QUERIES if getattr(torch.cuda, name).called]
    assert queried == []  # decided from the device alone, without asking the driver


def test_without_a_gpu_the_same_decisions_come_from_the_device_alone() -> None:
    """No GPU reported: a CPU device still gets bf16 and no scaler, with no CUDA query."""
    with gpus(0):
        with pytest.warns(UserWarning, match="--amp bf16"):
            assert amp.autocast_dtype("fp16", "cpu") is torch.bfloat16
        assert not amp.make_grad_scaler("fp16", torch.device("cpu")).is_enabled()
        assert amp.grad_scaler_enabled("fp16", "cuda")   # the rule, whatever this machine has
        queried = [name for name in CUDA_QUERIES if getattr(torch.cuda, name).called]
    assert queried == []


def test_dtype_name_for_json_summaries() -> None:
    assert amp.dtype_name(amp.autocast_dtype("bf16", "cpu")) == "bfloat16"
    assert amp.dtype_name(amp.autocast_dtype("fp16", "cuda")) == "float16"
    assert amp.dtype_name(None) is None
