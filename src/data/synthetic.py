"""Generated images with class-dependent structure: a model can learn them, and no download is needed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from src.core.errors import UserError
from src.data.in_memory import InMemoryImageDataModule


def make_images(
    count: int, num_classes: int, image_size: int, seed: int, split_seed: int, noise: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` uint8 images: each class a smooth colour pattern (fixed by ``seed``), plus per-image noise."""
    prototypes = F.interpolate(
        torch.rand(num_classes, 3, 4, 4, generator=torch.Generator().manual_seed(seed)),
        size=(image_size, image_size),
        mode="bilinear",
        align_corners=False,
    )
    g = torch.Generator().manual_seed(split_seed)
    labels = torch.arange(count) % num_classes
    labels = labels[torch.randperm(count, generator=g)]
    pixels = prototypes[labels] * (1 - noise) + noise * torch.rand(count, 3, image_size, image_size, generator=g)
    return (pixels * 255).round().to(torch.uint8), labels


class SyntheticDataModule(InMemoryImageDataModule):
    """``data=synthetic``: CIFAR-shaped (by default) images for tests, demos and benchmarks offline."""

    def __init__(
        self, num_train: int = 2560, num_test: int = 512, image_size: int = 32, noise: float = 0.4, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        if num_train < 2 or num_test < 1 or image_size < 8:
            raise UserError("data.num_train >= 2, data.num_test >= 1 and data.image_size >= 8 are needed")
        if not 0.0 <= noise <= 1.0:
            raise UserError(f"data.noise={noise} must be in [0, 1]")
        self.num_train, self.num_test, self.image_size, self.noise = num_train, num_test, image_size, noise

    def load(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        args = (self.num_classes, self.image_size, self.seed)
        train_x, train_y = make_images(self.num_train, *args, split_seed=self.seed + 1, noise=self.noise)
        test_x, test_y = make_images(self.num_test, *args, split_seed=self.seed + 2, noise=self.noise)
        return train_x, train_y, test_x, test_y
