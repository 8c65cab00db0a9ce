"""Models: a small CNN for the 8x8 digits and torchvision ResNets for CIFAR-10.

    model = build_model("cnn", num_classes=10, in_channels=1)       # the default workload
    model = build_model("cnn_bn", num_classes=10, in_channels=1)    # same with BatchNorm
    model = build_model("resnet18", num_classes=10, in_channels=3)  # the GPU workload

The plain CNN has no BatchNorm on purpose: without it, the gradient of a batch equals the mean
of the gradients of its chunks, which is what lets DataParallel, DDP and gradient accumulation
be checked against each other to float tolerance. ``cnn_bn`` breaks that equality (statistics
are per chunk), which lessons 02 and 03 show, and SyncBatchNorm restores across ranks.

Lessons: 01 (baseline), 02 (BatchNorm under DataParallel), 03 (SyncBatchNorm), 09 (ResNets).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

MODELS = ("cnn", "cnn_bn", "resnet18", "resnet50")


class AvgPoolTo2x2(nn.Module):
    """Average-pool each feature map down to 2x2, the output of ``nn.AdaptiveAvgPool2d(2)``.

    When height and width are even (digits: 4x4, CIFAR: 16x16 after the max-pool) it is a plain
    ``avg_pool2d`` with a kernel of half the size, which gives the same values and gradients
    bit for bit and, unlike the adaptive pool, has a deterministic CUDA backward: PyTorch's
    ``torch.use_deterministic_algorithms(True)`` raises on ``AdaptiveAvgPool2d``'s backward on
    a GPU (lesson 05's bit-exact resume turns it on). Odd sizes fall back to the adaptive pool.

    Lesson: 05 (determinism on GPUs).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2:]
        if height % 2 == 0 and width % 2 == 0:
            return F.avg_pool2d(x, (height // 2, width // 2))
        return F.adaptive_avg_pool2d(x, 2)


class SmallCNN(nn.Sequential):
    """Three 3x3 convolutions, one max-pool, a 2x2 average pool and a linear classifier.

    Works for any image size of at least 2x2 (digits are 8x8, CIFAR is 32x32); about 60k
    parameters at the default width.

    Args:
        in_channels: channels of the input images.
        num_classes: number of outputs.
        batch_norm: put a BatchNorm2d after each convolution.
        width: channels of the first convolution (the others use twice as many).

    Lesson: 01.
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, batch_norm: bool = False,
        width: int = 32,
    ) -> None:
        def block(c_in: int, c_out: int) -> list[nn.Module]:
            norm = [nn.BatchNorm2d(c_out)] if batch_norm else []
            return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=not batch_norm), *norm,
                    nn.ReLU(inplace=True)]

        super().__init__(
            *block(in_channels, width),
            *block(width, 2 * width),
            nn.MaxPool2d(2),
            *block(2 * width, 2 * width),
            AvgPoolTo2x2(),
            nn.Flatten(),
            nn.Linear(2 * width * 4, num_classes),
        )
        # He initialisation suits ReLU without BatchNorm: PyTorch's default conv init is
        # smaller, and this net then needs an extra epoch or two before it starts learning.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)


def resnet(name: str, num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """Build torchvision's ``resnet18`` or ``resnet50`` from scratch (no pretrained weights).

    Args:
        name: ``"resnet18"`` or ``"resnet50"``.
        num_classes: outputs of the final layer (10 for CIFAR-10).
        in_channels: input channels; the first convolution is replaced when it is not 3.

    Returns:
        The model, randomly initialised (``weights=None``: nothing is downloaded).

    Lesson: 01 and 09 with the GPU workload.
    """
    import torchvision  # imported here: the digits workload never pays for it

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return model


def build_model(name: str = "cnn", num_classes: int = 10, in_channels: int = 1) -> nn.Module:
    """Return a fresh model by name: ``cnn``, ``cnn_bn``, ``resnet18`` or ``resnet50``.

    Seed torch (``torch.manual_seed``) before calling it for the same weights on every run.

    Args:
        name: one of ``MODELS``.
        num_classes: number of classes of the dataset.
        in_channels: channels of the input images.

    Returns:
        The model on the CPU (move it to the rank's device before wrapping it).

    Lesson: every lesson that builds a model.
    """
    if name in ("cnn", "cnn_bn"):
        return SmallCNN(in_channels, num_classes, batch_norm=name == "cnn_bn")
    if name in ("resnet18", "resnet50"):
        return resnet(name, num_classes, in_channels)
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}.")


def default_model(dataset: str) -> str:
    """Return the model a dataset is taught with: ``resnet18`` for CIFAR-10, else ``cnn``.

    Lesson: 01.
    """
    return "resnet18" if dataset == "cifar10" else "cnn"


def count_parameters(model: nn.Module) -> int:
    """Return the number of trainable parameters.

    Lesson: 01.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
