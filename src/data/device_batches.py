"""Batches cut from a dataset that lives on the training device: no DataLoader, no workers, no host copies.

CIFAR-10 is 150 MB as uint8, so the whole set fits on any GPU. Each batch is one gather on the
device that crops (zero padding), flips and normalises all its images at once, instead of a
Python call per image on the CPU and a host-to-device copy per batch. On a CPU the same code runs
on in-memory tensors.

Each rank takes exactly the shard a ``DistributedSampler(shuffle, seed)`` would give it, reshuffled
every epoch the same way, so a run sees the same images per epoch on any pipeline. Evaluation shards are not
padded (``pad=False``, as Lightning's ``UnrepeatedDistributedSampler``): every image is counted once at any world
size, and ranks may differ by one image, hence by one batch. The random
crop and flip of an image depend only on (seed, epoch, image), so a resumed run repeats them exactly.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F


def shard_indices(
    n: int, rank: int, world_size: int, epoch: int, seed: int, shuffle: bool, skip: int = 0, pad: bool = True
) -> torch.Tensor:
    """The indices ``DistributedSampler(n, world_size, rank, shuffle, seed)`` yields in ``epoch``, as a tensor;
    with ``pad=False`` those of ``UnrepeatedDistributedSampler``: no image repeated to even out the shards.

    ``skip``: images of the epoch's order trained on already, by a world of another size (a run resumed after
    torchrun re-formed its group). The sampler interleaves the order over the ranks, so what any world has
    trained on is a prefix of it; the rest is split over this world the same way.
    """
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(n)
    order = order[min(skip, n) :]
    if len(order) == 0:
        return order
    if not pad:
        return order[rank::world_size]
    total = math.ceil(len(order) / world_size) * world_size
    if total > len(order):  # pad by repeating from the start, as the sampler does, so every rank has as many
        order = torch.cat([order] * math.ceil(total / len(order)))[:total]
    return order[rank:total:world_size]


def crop_and_flip_params(n: int, epoch: int, seed: int, padding: int) -> torch.Tensor:
    """Per image of the dataset: (row offset, column offset, flip) for ``epoch``; offsets in [0, 2*padding]."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 2 + 1)  # a stream apart from the shuffle's
    offsets = torch.randint(0, 2 * padding + 1, (n, 2), generator=g)
    flips = torch.randint(0, 2, (n, 1), generator=g)
    return torch.cat([offsets, flips], dim=1)


class DeviceBatches:
    """An iterable of ``(images, labels)`` batches for one rank, augmented and normalised on ``device``.

    ``epoch_of`` tells which epoch an iteration is (the trainer's). :meth:`position` and :meth:`resume_from`
    let a checkpoint carry the place inside an epoch, so a run resumed mid-epoch continues with the next batch.

    The place is three numbers. ``consumed``: the epoch's batches trained on, counted as the trainer counts them,
    one count across every world the epoch ran on. ``base``: the images of the epoch's order trained on before this
    world (its size, its batch) took over; the trainer's count then stood at ``base // global batch``. The invariant:
    the images of the epoch's order trained on are ``base + (consumed - base // global batch) * global batch``,
    a prefix of the order (the shards interleave it), so a world of another size goes on with the rest.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        *,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = False,
        drop_last: bool = False,
        augment: bool = False,
        pad_shards: bool = True,
        padding: int = 4,
        mean: tuple[float, ...] = (0.0, 0.0, 0.0),
        std: tuple[float, ...] = (1.0, 1.0, 1.0),
        epoch_of: Callable[[], int] = lambda: 0,
    ) -> None:
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.shuffle, self.drop_last, self.augment, self.padding = shuffle, drop_last, augment, padding
        self.epoch_of, self.device, self.pad_shards = epoch_of, device, pad_shards
        self.num_images = len(labels)
        self.image_size = images.shape[-2:]
        # Stored channels-last (N, H, W, C): one gather then yields channels-last batches, the layout
        # tensor cores want; the model converts if it runs in the classic layout.
        stored = F.pad(images, [padding] * 4) if augment else images
        self.images = stored.permute(0, 2, 3, 1).contiguous().to(device)
        self.labels = labels.to(device)
        mean, std = torch.tensor(mean), torch.tensor(std)
        self.scale = (1.0 / (255.0 * std)).to(device)  # (x / 255 - mean) / std == x * scale + shift
        self.shift = (-mean / std).to(device)
        self.per_rank = (
            math.ceil(self.num_images / world_size) if pad_shards else len(range(rank, self.num_images, world_size))
        )
        self.epoch, self.consumed, self.base = -1, 0, 0
        self._resume_at: dict[str, int] | None = None

    def __len__(self) -> int:
        return self._batches(self.per_rank)

    def _batches(self, images: int) -> int:
        return images // self.batch_size if self.drop_last else math.ceil(images / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch = self.epoch_of()
        base, start = 0, 0  # images of the epoch trained on before this pass; the batch count it starts at
        at, self._resume_at = self._resume_at, None
        if at is not None and at["epoch"] == epoch:
            base, start = self._continue_from(at)
        self.epoch, self.consumed, self.base = epoch, start, base
        indices = shard_indices(
            self.num_images, self.rank, self.world_size, epoch, self.seed, self.shuffle, skip=base, pad=self.pad_shards
        ).to(self.device)
        params = None
        if self.augment:
            params = crop_and_flip_params(self.num_images, epoch, self.seed, self.padding).to(self.device)
        took_over_at = base // (self.batch_size * self.world_size)  # the trainer's count when this world took over
        # this world's own batches of the rest of the order, numbered from 0, up to the epoch's length in batches
        for b in range(start - took_over_at, min(self._batches(len(indices)), len(self) - took_over_at)):
            batch = indices[b * self.batch_size : (b + 1) * self.batch_size]
            yield self._gather(batch, params), self.labels[batch]

    def _continue_from(self, at: dict[str, int]) -> tuple[int, int]:
        """(base, first batch count) for resuming at ``at``: the same batches at the same world size and batch;
        else the images not yet trained on, split over this world (the global batch count goes on)."""
        world, batch, base = (
            at.get("world_size", self.world_size),
            at.get("batch_size", self.batch_size),
            at.get("base", 0),
        )
        if (world, batch) == (self.world_size, self.batch_size):
            return base, at["consumed"]
        trained = base + (at["consumed"] - base // (batch * world)) * batch * world  # the class's invariant
        return trained, trained // (self.batch_size * self.world_size)

    def _gather(self, batch: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        h, w = self.image_size
        rows = torch.arange(h, device=self.device).expand(len(batch), h)
        cols = torch.arange(w, device=self.device).expand(len(batch), w)
        if params is not None:
            p = params[batch]
            rows = rows + p[:, :1]
            cols = torch.where(p[:, 2:3].bool(), cols.flip(1), cols) + p[:, 1:2]
        # one advanced-indexing gather: (B, H, W, C) of the (cropped, flipped) images
        pixels = self.images[batch[:, None, None], rows[:, :, None], cols[:, None, :]]
        images = pixels.permute(0, 3, 1, 2)  # NCHW shape, channels-last strides
        return images.float() * self.scale[:, None, None] + self.shift[:, None, None]

    def mark_consumed(self) -> None:
        """Count one batch as trained on (called by the datamodule as a batch reaches the model, not as it is
        prefetched), so a checkpoint records where training, not the prefetcher, has got to."""
        self.consumed += 1

    def position(self) -> dict[str, int]:
        """Epoch, batches trained on in it (the trainer's count), and what they mean: the world size and batch
        they were cut for, and the images trained on before this world took over (``base``)."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "base": self.base,
        }

    def resume_from(self, position: dict[str, int]) -> None:
        """Make the next pass over ``position["epoch"]`` continue after what ``position`` says was trained on."""
        self._resume_at = dict(position)
