"""torchvision ResNets, with the CIFAR stem for 32x32 images."""

from __future__ import annotations

import torch
from torch import nn
from torchvision import models

from src.core.errors import UserError

STEMS = ("cifar", "imagenet")


class GlobalAveragePool(nn.Module):
    """torchvision's ``AdaptiveAvgPool2d((1, 1))`` as a mean over height and width: the same values, and a backward
    that CUDA runs deterministically (``adaptive_avg_pool2d_backward_cuda`` has no deterministic kernel)."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.mean(dim=(-2, -1), keepdim=True)


def resnet_names() -> list[str]:
    """Every ResNet-family architecture torchvision builds (resnet*, resnext*, wide_resnet*)."""
    return sorted(n for n in models.list_models(module=models) if "resnet" in n or "resnext" in n)


def build_resnet(arch: str = "resnet50", num_classes: int = 10, stem: str = "cifar") -> nn.Module:
    """A randomly initialised torchvision ResNet; ``stem="cifar"`` swaps in a 3x3 stride-1 conv and drops the max-pool.

    The ImageNet stem shrinks a 32x32 image to 8x8 before the first block and costs several points
    of accuracy on CIFAR-10; the CIFAR stem keeps the full 32x32 resolution into layer1.
    """
    names = resnet_names()
    if arch not in names:
        raise UserError(f"model.arch={arch} is not a torchvision ResNet: choose one of {', '.join(names)}")
    if stem not in STEMS:
        raise UserError(f"model.stem={stem} is not known: choose one of {', '.join(STEMS)}")
    net = models.get_model(arch, weights=None, num_classes=num_classes)
    net.avgpool = GlobalAveragePool()  # else trainer.deterministic=true fails on CUDA; no state: the same checkpoints
    if stem == "cifar":
        net.conv1 = nn.Conv2d(3, net.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits convs
        net.maxpool = nn.Identity()
    return net
