"""torchvision ResNets, with the CIFAR stem for 32x32 images, at torchvision's width or narrower."""

from __future__ import annotations

import torch
from torch import nn
from torchvision import models

from src.core.errors import UserError

STEMS = ("cifar", "imagenet")
WIDTH = 64  # the channels of torchvision's stem and first stage; each later stage doubles them


class NarrowResNet(models.ResNet):
    """torchvision's ResNet with ``width`` channels in its stem and first stage instead of 64, each stage doubling
    them as torchvision's do: the same blocks, depths, groups and initialisation, ``(width / 64) ** 2`` of the
    parameters (``model.width``)."""

    def __init__(self, block: type[nn.Module], layers: list[int], width: int, **kwargs) -> None:
        self.width = width
        super().__init__(block, layers, **kwargs)
        # torchvision builds the stem with 64 channels and the head for 512 of them: both at this width instead,
        # initialised as torchvision initialises its own (a conv: Kaiming normal; BatchNorm: 1 and 0; fc: Linear's)
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")
        self.bn1 = self._norm_layer(width)
        self.fc = nn.Linear(8 * width * block.expansion, self.fc.out_features)

    def _make_layer(self, block, planes, blocks, stride=1, dilate=False):  # noqa: ANN001, ANN202 - torchvision's
        if planes == WIDTH:  # the first stage: its input is the stem's output, at this width too
            self.inplanes = self.width
        return super()._make_layer(block, planes * self.width // WIDTH, blocks, stride, dilate)


class GlobalAveragePool(nn.Module):
    """torchvision's ``AdaptiveAvgPool2d((1, 1))`` as a mean over height and width: the same values, and a backward
    that CUDA runs deterministically (``adaptive_avg_pool2d_backward_cuda`` has no deterministic kernel)."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.mean(dim=(-2, -1), keepdim=True)


def resnet_names() -> list[str]:
    """Every ResNet-family architecture torchvision builds (resnet*, resnext*, wide_resnet*)."""
    return sorted(n for n in models.list_models(module=models) if "resnet" in n or "resnext" in n)


def build_resnet(arch: str = "resnet50", num_classes: int = 10, stem: str = "cifar", width: int = WIDTH) -> nn.Module:
    """A randomly initialised torchvision ResNet; ``stem="cifar"`` swaps in a 3x3 stride-1 conv and drops the max-pool;
    ``width`` below 64 narrows every stage alike (``NarrowResNet``).

    The ImageNet stem shrinks a 32x32 image to 8x8 before the first block and costs several points
    of accuracy on CIFAR-10; the CIFAR stem keeps the full 32x32 resolution into layer1.
    """
    names = resnet_names()
    if arch not in names:
        raise UserError(f"model.arch={arch} is not a torchvision ResNet: choose one of {', '.join(names)}")
    if stem not in STEMS:
        raise UserError(f"model.stem={stem} is not known: choose one of {', '.join(STEMS)}")
    check_width(width)
    if width == WIDTH:
        net = models.get_model(arch, weights=None, num_classes=num_classes)
    else:
        with torch.device("meta"):  # torchvision's own network, as the plan: its blocks, depths and groups; no memory
            plan = models.get_model(arch, weights=None, num_classes=num_classes)
        block = type(plan.layer1[0])
        depths = [len(layer) for layer in (plan.layer1, plan.layer2, plan.layer3, plan.layer4)]
        if block is models.resnet.Bottleneck and width * plan.base_width // WIDTH < 1:  # torchvision rounds down
            raise UserError(
                f"model.width={width} is too narrow for {arch}: its first blocks would have no channels "
                f"(width x {plan.base_width} / {WIDTH} rounds down to 0); take {-(-WIDTH // plan.base_width)} or more"
            )
        net = NarrowResNet(
            block, depths, width, num_classes=num_classes, groups=plan.groups, width_per_group=plan.base_width
        )
    net.avgpool = GlobalAveragePool()  # else trainer.deterministic=true fails on CUDA; no state: the same checkpoints
    if stem == "cifar":
        net.conv1 = nn.Conv2d(3, net.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision inits convs
        net.maxpool = nn.Identity()
    return net


def check_width(width: object) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= WIDTH:
        raise UserError(
            f"model.width={width} is not a width this project builds: an integer from 1 to {WIDTH} (the channels of "
            f"the first stage; {WIDTH}: torchvision's networks)"
        )
