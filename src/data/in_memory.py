"""The part every image datamodule here shares: uint8 tensors in memory, a seeded split, augmentation, loaders."""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from src.core.errors import UserError, check_number, whole
from src.data.device_batches import DeviceBatches
from src.data.workers import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    FORK_SAFE_FROM,
    ImageTensors,
    eval_transform,
    fork_can_hang,
    start_worker,
    train_transform,
    worker_context,
)
from src.launch import ranks

PIPELINES = ("auto", "device", "dataloader")
WORKER_STARTS = ("auto", "fork", "forkserver", "spawn")


class EpochOfTrainer(DistributedSampler):
    """A ``DistributedSampler`` whose epoch is read (``epoch_of``) as its indices are drawn, not only set from
    outside (the loader's iterator is made before the loop sets it); ``epoch`` is the one it drew last."""

    def __init__(self, *args: Any, epoch_of: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_of = epoch_of

    def __iter__(self):  # noqa: ANN204 - DistributedSampler's own
        self.set_epoch(self.epoch_of())
        return super().__iter__()


class FirstEpochOrder(L.Callback):
    """The first epoch of a resumed fit draws in its own epoch's order (the DataLoader pipeline).

    Lightning makes the training iterator before a checkpoint's epoch is restored (here as early as
    ``configure_optimizers``, whose schedule asks for the run's steps), and since Lightning 2.5.3 it keeps that
    iterator for the first epoch of a resumed run: a loader with workers had drawn epoch 0's indices into it
    (Lightning #21938). Once the fit has restored its epoch, an iterator drawn for another is made again.
    """

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loop = trainer.fit_loop
        loaders = loop._combined_loader.flattened if loop._combined_loader is not None else []
        if any(
            isinstance(getattr(dl, "sampler", None), EpochOfTrainer)
            and dl.sampler.epoch != loop.epoch_progress.current.processed
            for dl in loaders
        ):
            iter(loop._data_fetcher)  # draws again, the epoch read now


def shard_problems(
    world: int, batch_size: Any, train: int | None = None, val: int | None = None, test: int | None = None
) -> list[str]:
    """What ``world`` processes cannot do with the split (the counts given): at least one training step per epoch
    (batches are whole; shards padded to equal length), and at least one validation and one test image per process
    (those shards are not padded: a rank without a batch would skip the metrics' reduction)."""
    problems = []
    per_rank = None if train is None else -(-train // world)
    if per_rank is not None and isinstance(batch_size, int) and per_rank < batch_size:
        problems.append(
            f"{train} training images over {world} processes are {per_rank} per process, fewer than "
            f"data.batch_size={batch_size}: not one training step per epoch (batches are whole); use "
            f"data.batch_size={per_rank} or less, fewer processes, or more training images"
            if world > 1
            else f"{train} training images are fewer than data.batch_size={batch_size}: not one training step per "
            f"epoch (batches are whole); use data.batch_size={per_rank} or less, or more training images"
        )
    for count, what, key in ((val, "validation", "data.val_size"), (test, "test", "the test set")):
        if count is not None and count < world:
            problems.append(
                f"{count} {what} images for {world} processes: every process needs at least one; "
                f"enlarge {key} or use fewer processes"
            )
    return problems


def check_shards(
    world: int, batch_size: Any, train: int | None = None, val: int | None = None, test: int | None = None
) -> None:
    """:func:`shard_problems`' first, as a UserError: every rank checks before any trains."""
    problems = shard_problems(world, batch_size, train, val, test)
    if problems:
        raise UserError(problems[0])


class InMemoryImageDataModule(L.LightningDataModule):
    """Subclasses provide :meth:`load`; this class splits, augments and serves the batches.

    Two pipelines serve the same shards, order and augmentation: ``device`` (the default) keeps the
    images on the training device and augments whole batches there (src/data/device_batches.py);
    ``dataloader`` is the classic DataLoader with per-image transforms, where Lightning swaps in a
    DistributedSampler under DDP for training. Validation and test count every image once at any world size:
    their shards are not padded with repeated images, so ranks may differ by one batch.
    """

    def __init__(
        self,
        batch_size: int | str = 128,
        num_workers: int | str = "auto",
        val_size: float = 0.1,
        augment: bool = True,
        seed: int = 0,
        pin_memory: bool | str = "auto",
        num_classes: int = 10,
        pipeline: str = "auto",
        max_batch_size: int = 1024,
        multiprocessing_context: str = "auto",
    ) -> None:
        super().__init__()
        if batch_size != "auto":
            check_number(
                "data.batch_size",
                batch_size,
                whole(1),
                "a whole number >= 1 (it is per process), or auto (the largest that fits the GPU)",
            )
        check_number("data.max_batch_size", max_batch_size, whole(1), "a whole number >= 1")
        if num_workers != "auto":
            check_number("data.num_workers", num_workers, whole(0), "auto or a whole number >= 0")
        if not isinstance(augment, bool):  # before: any value taken as its truth (augment=maybe: on)
            raise UserError(f"data.augment={augment} must be true or false")
        if pin_memory != "auto" and not isinstance(pin_memory, bool):
            raise UserError(f"data.pin_memory={pin_memory} must be true, false or auto")
        if pipeline not in PIPELINES:
            raise UserError(f"data.pipeline={pipeline} is not known: choose one of {', '.join(PIPELINES)}")
        if multiprocessing_context not in WORKER_STARTS:
            raise UserError(
                f"data.multiprocessing_context={multiprocessing_context} is not known: choose one of "
                f"{', '.join(WORKER_STARTS)}"
            )
        fraction = isinstance(val_size, float) and 0 < val_size < 1
        count = isinstance(val_size, int) and not isinstance(val_size, bool) and val_size >= 1
        if not (fraction or count):
            raise UserError(
                f"data.val_size={val_size} must be a fraction in (0, 1) or a whole number of images >= 1 "
                "(e.g. 0.1 or 5000)"
            )
        # auto becomes a number once the trainer has its device (src/models/batch_size.py, from the model's setup)
        self.batch_size, self.num_workers, self.val_size = batch_size, num_workers, val_size
        self.max_batch_size, self.multiprocessing_context = max_batch_size, multiprocessing_context
        self.augment, self.seed, self.pin_memory, self.num_classes = augment, seed, pin_memory, num_classes
        # auto: the images of an in-memory dataset fit on any device, so they go there
        self.pipeline = "device" if pipeline == "auto" else pipeline
        self.train_set: ImageTensors | None = None
        self.val_set: ImageTensors | None = None
        self.test_set: ImageTensors | None = None
        self._train_batches: DeviceBatches | None = None
        self._resume_position: dict[str, int] | None = None
        self.test_after_fit = False  # src.train sets it: the test set's shards are then checked before fitting

    @property
    def image_shape(self) -> tuple[int, ...] | None:
        """(channels, height, width) of an image, once ``setup`` has loaded them."""
        return tuple(self.train_set.images.shape[1:]) if self.train_set is not None else None

    def load(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return train images, train labels, test images, test labels (uint8 NCHW, int64)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self._split()
        if self.trainer is None:  # not a run (a look at the data): nothing to check against
            return
        if self.pipeline == "dataloader" and not any(isinstance(c, FirstEpochOrder) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(FirstEpochOrder())
        world = self.trainer.world_size
        fit = stage in ("fit", None)
        check_shards(
            world,
            self.batch_size,
            train=len(self.train_set) if fit else None,
            val=len(self.val_set) if fit or stage == "validate" else None,
            test=len(self.test_set) if stage == "test" or (fit and self.test_after_fit) else None,
        )

    def _split(self) -> None:
        train_x, train_y, test_x, test_y = self.load()
        n_val = self._val_count(len(train_y))
        order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(self.seed))
        val_idx, train_idx = order[:n_val], order[n_val:]
        size = train_x.shape[-1]
        self.train_set = ImageTensors(train_x[train_idx], train_y[train_idx], train_transform(size, self.augment))
        self.val_set = ImageTensors(train_x[val_idx], train_y[val_idx], eval_transform())
        self.test_set = ImageTensors(test_x, test_y, eval_transform())

    def _val_count(self, n_train: int) -> int:
        count = round(self.val_size * n_train) if isinstance(self.val_size, float) else self.val_size
        if not 0 < count < n_train:
            raise UserError(
                f"data.val_size={self.val_size} leaves {n_train - count} training and {count} validation images "
                f"out of {n_train}: use a fraction in (0, 1) or a count below {n_train}"
            )
        return count

    def train_dataloader(self) -> DataLoader | DeviceBatches:
        # drop_last: a last batch of one image breaks BatchNorm and skews the step time.
        shuffle = not (self.trainer is not None and self.trainer.overfit_batches > 0)  # overfit: the same batches
        if self.pipeline == "device":
            self._train_batches = self._device_batches(
                self.train_set, shuffle=shuffle, drop_last=True, augment=self.augment
            )
            if self._resume_position is not None:
                self._train_batches.resume_from(self._resume_position)
            return self._train_batches
        return self._loader(self.train_set, drop_last=True, sampler=self._training_sampler(shuffle))

    def _training_sampler(self, shuffle: bool) -> DistributedSampler:
        """The DataLoader pipeline's training order: a ``DistributedSampler`` of this datamodule's own (one replica on
        one process) that takes the epoch from the trainer each time an epoch's indices are drawn.

        Lightning injects its own and sets its epoch only once the first epoch's iterator exists; a loader with
        workers has drawn its first indices by then, so a run resumed from an epoch's end trained that epoch in
        epoch 0's order (Lightning #21938). Lightning leaves a DistributedSampler of the loader's own in place.
        """
        trainer = self.trainer
        world = trainer.world_size if trainer is not None else 1
        return EpochOfTrainer(
            self.train_set,
            num_replicas=world,
            rank=trainer.global_rank if world > 1 else 0,
            shuffle=shuffle,
            seed=self.seed,
            epoch_of=lambda: trainer.fit_loop.epoch_progress.current.processed if trainer else 0,
        )

    @property
    def class_names(self) -> list[str]:
        """What each label means, in label order."""
        return [f"class {i}" for i in range(self.num_classes)]

    def val_dataloader(self) -> DataLoader | DeviceBatches:
        return self._evaluation_batches(self.val_set)

    def test_dataloader(self) -> DataLoader | DeviceBatches:
        return self._evaluation_batches(self.test_set)

    def _evaluation_batches(self, dataset: ImageTensors | None) -> DataLoader | DeviceBatches:
        """Each image once across the ranks. Lightning's DistributedSampler pads the shards to equal length with
        repeated images, so an evaluation's figures would depend on the number of processes."""
        world = self.trainer.world_size if self.trainer is not None else 1
        if self.pipeline == "device":
            return self._device_batches(dataset, pad_shards=False)
        sampler = None
        if world > 1:  # a DistributedSampler of its own: Lightning leaves it in place
            sampler = UnrepeatedDistributedSampler(
                dataset, num_replicas=world, rank=self.trainer.global_rank, shuffle=False
            )
        return self._loader(dataset, sampler=sampler)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning prefetches a batch ahead; this hook runs as a batch reaches the model, so the position a
        # checkpoint records is that of training, and a resumed run continues with the right batch. The model
        # summary's example image (one tensor, at the fit's start, src/models/classifier.py) is no batch.
        if (
            isinstance(batch, (tuple, list))
            and self._train_batches is not None
            and self.trainer is not None
            and self.trainer.training
        ):
            self._train_batches.mark_consumed()
        return batch

    # The place inside the epoch travels in the checkpoint as this datamodule's state (not as a stateful
    # loader: Lightning 2.6 skips restoring those when the train loader was built early, e.g. for
    # estimated_stepping_batches in configure_optimizers).
    def state_dict(self) -> dict[str, Any]:
        return {"train_position": self._train_batches.position()} if self._train_batches is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_position = state.get("train_position")
        if self._train_batches is not None and self._resume_position is not None:
            self._train_batches.resume_from(self._resume_position)

    def _device_batches(
        self,
        dataset: ImageTensors | None,
        shuffle: bool = False,
        drop_last: bool = False,
        augment: bool = False,
        pad_shards: bool = True,
    ) -> DeviceBatches:
        if dataset is None:
            raise RuntimeError("setup() must run before the dataloaders are asked for")
        trainer = self.trainer
        return DeviceBatches(
            dataset.images,
            dataset.labels,
            self.batch_size,
            device=trainer.strategy.root_device if trainer is not None else torch.device("cpu"),
            rank=trainer.global_rank if trainer is not None else 0,
            world_size=trainer.world_size if trainer is not None else 1,
            seed=self.seed,
            shuffle=shuffle,
            drop_last=drop_last,
            augment=augment,
            pad_shards=pad_shards,
            mean=CIFAR10_MEAN,
            std=CIFAR10_STD,
            epoch_of=(lambda: trainer.current_epoch) if trainer is not None else (lambda: 0),
        )

    def _loader(
        self,
        dataset: ImageTensors | None,
        shuffle: bool = False,
        drop_last: bool = False,
        sampler: DistributedSampler | None = None,
    ) -> DataLoader:
        if dataset is None:
            raise RuntimeError("setup() must run before the dataloaders are asked for")
        workers = self._workers()
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=self._pin(),
            multiprocessing_context=worker_context(self.worker_start()[0]) if workers > 0 else None,
            worker_init_fn=start_worker if workers > 0 else None,
        )

    def worker_start(self) -> tuple[str, str | None]:
        """How the loader's workers start, and why where ``auto`` chose: ``fork`` (a copy of this process, at once),
        or ``forkserver`` where this Python's fork can hang beside the process group's threads (:func:`fork_can_hang`;
        one process started per rank imports the data code once, and forks each worker from itself, without
        threads). ``forkserver`` and ``spawn`` hand each worker the dataset's tensors through shared memory."""
        if self.multiprocessing_context != "auto":
            return self.multiprocessing_context, None
        world = self.trainer.world_size if self.trainer is not None else 1
        if world > 1 and fork_can_hang():
            version = ".".join(map(str, sys.version_info[:3]))
            fixed = ".".join(map(str, FORK_SAFE_FROM[sys.version_info[:2]]))
            return "forkserver", (
                f"auto: Python {version}'s fork can hang a worker beside the process group's threads, mended in {fixed}"
            )
        return "fork", None

    def _on_gpu(self) -> bool:
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _workers(self) -> int:
        if self.num_workers != "auto":
            return int(self.num_workers)
        if not self._on_gpu():
            return 0  # on CPUs the cores are better spent on the model than on decoding tensors
        return max(1, min(8, self.rank_cores() - 1))

    def rank_cores(self) -> int:
        """The cores this rank may use, counted once: its own where srun bound each task to its cores, else its share
        of what the node's ranks may all use (our own local ranks, torchrun's, srun's without binding)."""
        processes = self.trainer.num_devices if self.trainer is not None else 1
        return ranks.rank_cores(processes)

    def describe_workers(self) -> str | None:
        """The run line's word on the loader's workers: the DataLoader pipeline's, or a count the device pipeline
        does not use (before, data.num_workers=4 there went without a word)."""
        if self.pipeline != "dataloader":
            if self.num_workers in ("auto", 0):
                return None
            return (
                f"data.num_workers={self.num_workers} unused (data.pipeline={self.pipeline} batches on the device, "
                "without loader workers; data.pipeline=dataloader uses them)"
            )
        workers, cores = self._workers(), self.rank_cores()
        if self.num_workers != "auto":  # more than the cores: said here once, not in torch's warning per loader
            crowded = ": more workers than cores, which they take from training" if workers > cores else ""
            line = f"{workers} loader workers a process (data.num_workers; {cores} core(s) for this rank){crowded}"
        elif not self._on_gpu():
            return f"0 loader workers (auto: on the CPU this rank's {cores} core(s) train)"
        else:
            line = f"{workers} loader workers a process (auto: this rank's {cores} core(s), less one, at most 8)"
        if workers == 0:
            return line
        method, why = self.worker_start()
        return f"{line}, started by {method}" + (f" ({why})" if why else "")

    def _pin(self) -> bool:
        return self._on_gpu() if self.pin_memory == "auto" else bool(self.pin_memory)
