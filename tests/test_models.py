"""The model factory: shapes, BatchNorm only where asked, ResNets without downloads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddplab import models


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name, batchnorm", [("cnn", False), ("cnn_bn", True)])
def test_small_cnn_shapes_and_batchnorm(name: str, batchnorm: bool) -> None:
    model = models.build_model(name, num_classes=10, in_channels=1)
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert _has_batchnorm(model) is batchnorm
    assert 20_000 < models.count_parameters(model) < 200_000


def test_small_cnn_takes_cifar_sized_images() -> None:
    model = models.build_model("cnn", num_classes=7, in_channels=3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_same_seed_same_weights() -> None:
    torch.manual_seed(3)
    a = models.build_model("cnn")
    torch.manual_seed(3)
    b = models.build_model("cnn")
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("in_channels", [3, 1])
def test_resnet18_for_cifar(in_channels: int) -> None:
    model = models.build_model("resnet18", num_classes=10, in_channels=in_channels)
    assert model.fc.out_features == 10 and model.conv1.in_channels == in_channels
    assert model(torch.randn(2, in_channels, 32, 32)).shape == (2, 10)


def test_resnet50_is_built_from_scratch() -> None:
    model = models.build_model("resnet50", num_classes=10, in_channels=3)
    assert model.fc.in_features == 2048 and model.fc.out_features == 10


def test_default_model_and_unknown_name() -> None:
    assert models.default_model("cifar10") == "resnet18"
    assert models.default_model("digits") == "cnn"
    with pytest.raises(ValueError, match="cnn"):
        models.build_model("vgg")
