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


def _with_adaptive_pool(model: nn.Sequential) -> nn.Sequential:
    """The same layers and weights with the pool the model used to have."""
    layers = [nn.AdaptiveAvgPool2d(2) if isinstance(m, models.AvgPoolTo2x2) else m
              for m in model]
    assert len(layers) == len(model) and any(isinstance(m, nn.AdaptiveAvgPool2d) for m in layers)
    return nn.Sequential(*layers)


@pytest.mark.parametrize("name, channels, size", [
    ("cnn", 1, 8), ("cnn_bn", 1, 8),    # digits
    ("cnn", 3, 32), ("cnn_bn", 3, 32),  # CIFAR-10 with --model cnn
    ("cnn", 1, 7),                      # odd sizes take the adaptive pool
])
def test_pool_gives_the_adaptive_pools_outputs_and_gradients(name: str, channels: int,
                                                             size: int) -> None:
    torch.manual_seed(0)
    model = models.build_model(name, num_classes=10, in_channels=channels)
    old = _with_adaptive_pool(model)
    x = torch.randn(6, channels, size, size)
    outs, grads = [], []
    for net in (model, old):
        net.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = net(xi)
        out.square().sum().backward()
        outs.append(out)
        grads.append([xi.grad] + [p.grad for p in net.parameters()])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
