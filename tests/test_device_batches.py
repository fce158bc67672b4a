"""The device-resident pipeline: DistributedSampler's shards, augmentation at the expected rates, exact resume."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from src.data.device_batches import DeviceBatches, shard_indices
from src.data.in_memory import CIFAR10_MEAN, CIFAR10_STD
from src.data.synthetic import SyntheticDataModule

CPU = torch.device("cpu")


def unnormalise(images: torch.Tensor) -> torch.Tensor:
    mean, std = torch.tensor(CIFAR10_MEAN)[:, None, None], torch.tensor(CIFAR10_STD)[:, None, None]
    return ((images * std + mean) * 255).round().to(torch.uint8)


@pytest.mark.parametrize("n,world,shuffle", [(100, 1, True), (100, 3, True), (101, 4, False), (5, 8, True)])
def test_each_rank_gets_exactly_the_distributed_samplers_shard_every_epoch(n, world, shuffle):
    for epoch, rank in itertools.product(range(3), range(world)):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=7)
        sampler.set_epoch(epoch)
        assert shard_indices(n, rank, world, epoch, seed=7, shuffle=shuffle).tolist() == list(sampler)


def test_ranks_see_disjoint_shards_that_cover_the_dataset_and_reshuffle_each_epoch():
    labels = torch.arange(96)
    images = torch.zeros(96, 3, 8, 8, dtype=torch.uint8)
    seen = {}
    for epoch in range(2):
        for rank in range(2):
            batches = DeviceBatches(
                images,
                labels,
                8,
                device=CPU,
                rank=rank,
                world_size=2,
                seed=3,
                shuffle=True,
                drop_last=True,
                epoch_of=lambda e=epoch: e,
            )
            seen[epoch, rank] = torch.cat([y for _, y in batches]).tolist()
        assert not set(seen[epoch, 0]) & set(seen[epoch, 1])
        assert sorted(seen[epoch, 0] + seen[epoch, 1]) == list(range(96))
    assert seen[0, 0] != seen[1, 0]


def test_batches_are_normalised_uint8_images_without_augmentation():
    data = SyntheticDataModule(num_train=40, num_test=8, image_size=16, seed=0)
    data.setup("fit")
    batches = DeviceBatches(data.val_set.images, data.val_set.labels, 3, device=CPU, mean=CIFAR10_MEAN, std=CIFAR10_STD)
    got = torch.cat([x for x, _ in batches])
    expected = torch.stack([data.val_set.transform(img) for img in data.val_set.images])
    assert len(batches) == 2 and got.shape == (4, 3, 16, 16)  # 4 images: batches of 3 and 1 (no drop_last)
    assert torch.allclose(got, expected, atol=1e-5)


def views(image: torch.Tensor, padding: int = 4) -> dict[tuple[int, int, bool], torch.Tensor]:
    """Every crop (row offset, column offset) of the zero-padded image, flipped or not."""
    padded = F.pad(image, [padding] * 4)
    size = image.shape[-1]
    out = {}
    for dy, dx in itertools.product(range(2 * padding + 1), repeat=2):
        crop = padded[:, dy : dy + size, dx : dx + size]
        out[dy, dx, False], out[dy, dx, True] = crop, crop.flip(-1)
    return out


def test_crops_and_flips_happen_at_the_expected_rates_and_labels_stay_with_their_images():
    n, size = 400, 12
    g = torch.Generator().manual_seed(0)
    images = torch.randint(1, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)  # no zero: padding shows
    labels = torch.randint(0, 10, (n,), generator=g)
    batches = DeviceBatches(
        images, labels, 32, device=CPU, seed=1, shuffle=True, augment=True, mean=CIFAR10_MEAN, std=CIFAR10_STD
    )
    found = []
    for x, y in batches:
        for view, label in zip(unnormalise(x), y):
            # the source image is identified by its pixels: the uncropped middle of every view matches it
            source = next(
                i
                for i in range(n)
                if labels[i] == label and any(torch.equal(view, v) for v in views(images[i]).values())
            )
            key = next(k for k, v in views(images[source]).items() if torch.equal(view, v))
            found.append((source, key))
    assert sorted(s for s, _ in found) == list(range(n))  # every image once per epoch, with its own label
    flips = sum(k[2] for _, k in found) / n
    assert 0.4 < flips < 0.6
    for axis in (0, 1):  # offsets uniform over 0..8: each about 1/9 of the images, centre included
        counts = torch.bincount(torch.tensor([k[axis] for _, k in found]), minlength=9).float() / n
        assert counts.min() > 0.05 and counts.max() < 0.18, counts
    padded = sum(k[0] != 4 or k[1] != 4 for _, k in found) / n
    assert padded > 0.9  # 80 of 81 offsets move the image


def test_augmentation_depends_on_epoch_and_seed_only_so_it_repeats_exactly():
    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(64)

    def epoch_batches(epoch: int, seed: int = 5) -> list[torch.Tensor]:
        return [
            x
            for x, _ in DeviceBatches(
                images, labels, 16, device=CPU, seed=seed, shuffle=True, augment=True, epoch_of=lambda: epoch
            )
        ]

    assert all(torch.equal(a, b) for a, b in zip(epoch_batches(0), epoch_batches(0)))
    assert not torch.equal(epoch_batches(0)[0], epoch_batches(1)[0])
    assert not torch.equal(epoch_batches(0, seed=6)[0], epoch_batches(0)[0])


def test_a_restored_position_continues_with_the_next_batch_of_the_same_epoch():
    images = torch.randint(0, 256, (80, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(80)

    def make() -> DeviceBatches:
        return DeviceBatches(
            images, labels, 8, device=CPU, seed=2, shuffle=True, augment=True, drop_last=True, epoch_of=lambda: 1
        )

    full = list(make())
    first = make()
    it = iter(first)
    for _ in range(4):  # a prefetcher pulls one batch more than training has used
        next(it)
    for _ in range(3):
        first.mark_consumed()
    resumed = make()
    resumed.resume_from(first.position())
    rest = list(resumed)
    assert len(rest) == len(full) - 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, full[3:]))
    assert len(list(resumed)) == len(full)  # the next pass is a whole epoch again


@pytest.mark.parametrize("before, after", [((2, 4), (1, 8)), ((1, 8), (2, 4)), ((2, 4), (1, 4))])
def test_resumed_at_another_world_size_the_epoch_goes_on_with_the_images_not_yet_trained_on(before, after):
    """torchrun --nnodes=MIN:MAX: an epoch begun by one world and finished by another trains every image once."""
    images = torch.randint(0, 256, (96, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(96)  # the label names the image

    def world(size: int, batch: int) -> list[DeviceBatches]:
        return [
            DeviceBatches(
                images,
                labels,
                batch,
                device=CPU,
                rank=r,
                world_size=size,
                seed=3,
                shuffle=True,
                drop_last=True,
                epoch_of=lambda: 0,
            )
            for r in range(size)
        ]

    (old_size, old_batch), (new_size, new_batch) = before, after
    old, steps = world(old_size, old_batch), 5
    trained = []
    for ranks in old:
        for _, (_, batch_labels) in zip(range(steps), ranks):
            ranks.mark_consumed()
            trained += batch_labels.tolist()
    new = world(new_size, new_batch)
    for ranks in new:
        ranks.resume_from(old[0].position())  # every rank resumes from rank zero's checkpoint
    rest = [list(ranks) for ranks in new]
    assert len({len(r) for r in rest}) == 1  # the new ranks step together
    trained += [label for r in rest for _, batch_labels in r for label in batch_labels.tolist()]
    assert sorted(trained) == list(range(96))  # every image of the epoch once, none twice
    if old_size * old_batch == new_size * new_batch:  # the global batch kept: the trainer's batch count goes on
        assert new[0].consumed == steps and steps + len(rest[0]) == len(new[0])
        position = new[0].position()
        again = world(new_size, new_batch)[0]
        again.resume_from(position)  # resumed once more, at the same world: the same continuation
        assert [b.tolist() for _, b in again] == [b.tolist() for _, b in rest[0]]
