"""What ``data.batch_size=auto`` becomes: the largest per-device batch that fits the GPU with a margin.

A short probe before training, on every rank: the run's network, number format and memory layout train two steps (SGD
with momentum, as the recipe) at per-device batches 64, 128, 256, ... up to ``data.max_batch_size``; the largest whose
peak reserved memory stays within ``MARGIN`` of what the device can give this process is kept. The ranks take the
smallest of their answers (one all-reduce), so every rank trains the same batch. The answer goes into the run line and
``config.yaml``; the learning rate scales with it as with any batch (``model.optimizer.lr_scaling``). A run that resumes
keeps its checkpoint's batch (``keep_checkpoint_batch``). On a CPU there is no memory to probe: ``auto`` is the recipe's
reference batch, 128.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MARGIN = 0.15  # of the device's memory left free: the dataset on the device, DDP's buckets, cuDNN's workspaces
FIRST = 64
CPU_DEFAULT = 128  # the recipe's reference batch (model.optimizer.reference_batch_size)
STEPS_PER_EPOCH_MIN = 8  # auto never leaves an epoch fewer steps than this


@dataclass(frozen=True)
class Choice:
    batch_size: int
    why: str  # one clause for the run line


def largest_fitting(
    measure: Callable[[int], int | None], capacity: int, cap: int, first: int = FIRST
) -> tuple[int | None, dict[int, int | None]]:
    """The largest of ``first``, 2 x ``first``, ... <= ``cap`` whose ``measure`` (peak bytes, None: out of memory)
    stays within (1 - MARGIN) x ``capacity``; also every batch measured and its peak."""
    measured: dict[int, int | None] = {}
    best, batch = None, first
    while batch <= cap:
        peak = measured[batch] = measure(batch)
        if peak is None or peak > (1 - MARGIN) * capacity:
            break
        best, batch = batch, batch * 2
    return best, measured


def resolve(trainer: Any, pl_module: Any, datamodule: Any) -> Choice | None:
    """Replace ``datamodule.batch_size == "auto"`` by a number, the same on every rank; None when it was one."""
    if getattr(datamodule, "batch_size", None) != "auto":
        return None
    if trainer.strategy.root_device.type != "cuda":
        choice = Choice(CPU_DEFAULT, "auto: the recipe's reference batch on a CPU, where no memory is probed")
    else:
        choice = _probe(trainer, pl_module, datamodule)
    datamodule.batch_size = choice.batch_size
    datamodule.batch_size_why = choice.why
    return choice


def keep_checkpoint_batch(datamodule: Any, checkpoint: dict | None) -> None:
    """A run that resumes with ``data.batch_size=auto`` trains on with the batch its checkpoint was trained with
    (its learning rate and steps per epoch follow from it), rather than probing again."""
    saved = ((checkpoint or {}).get("saved_by") or {}).get("batch_size")
    if getattr(datamodule, "batch_size", None) == "auto" and isinstance(saved, int) and saved > 0:
        datamodule.batch_size = saved
        datamodule.batch_size_why = "auto: the checkpoint's batch, as the run resumes"


def _probe(trainer: Any, pl_module: Any, datamodule: Any) -> Choice:
    from src.models.resnet import build_resnet

    device = trainer.strategy.root_device
    hparams = pl_module.hparams
    precision = str(trainer.precision)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    image_size = int(getattr(datamodule, "image_size", 32))
    per_rank = len(datamodule.train_set) // trainer.world_size if datamodule.train_set is not None else None
    cap = int(getattr(datamodule, "max_batch_size", 1024))
    if per_rank:
        cap = min(cap, per_rank // STEPS_PER_EPOCH_MIN)
    free, _ = torch.cuda.mem_get_info(device)
    capacity = free + torch.cuda.memory_reserved(device)  # what this process can have: its own, and what is free
    net = build_resnet(hparams.arch, hparams.num_classes, hparams.stem, hparams.width).to(
        device, memory_format=pl_module.memory_format
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)

    def measure(batch: int) -> int | None:
        gc.collect()
        torch.cuda.empty_cache()  # the previous batch's cached blocks would count in this one's peak
        torch.cuda.reset_peak_memory_stats(device)
        try:
            images = torch.randn(batch, 3, image_size, image_size, device=device).contiguous(
                memory_format=pl_module.memory_format
            )
            labels = torch.randint(0, hparams.num_classes, (batch,), device=device)
            for _ in range(2):  # the second step holds the momentum buffers too
                with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                    loss = F.cross_entropy(net(images), labels)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_reserved(device)
        except torch.cuda.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            return None

    first = min(FIRST, 1 << max(0, cap.bit_length() - 1))  # a small dataset: its largest power of two
    # With cuDNN's autotuning on, the probe of five ResNet-50 batches took about 35 s on an H100: it times every
    # convolution's algorithms afresh at each new batch. Its heuristics' choice needs about the same memory (the
    # margin is GiBs), and training autotunes once, for its own batch.
    autotune, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, False
    started = time.monotonic()
    try:
        best, measured = largest_fitting(measure, capacity, cap, first)
    finally:
        torch.backends.cudnn.benchmark = autotune
        net = optimizer = None  # freed before the run's own model takes the memory
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    seconds = time.monotonic() - started
    local = best or first
    agreed = _smallest_over_ranks(local, device)
    gib = 2**30
    peak = measured.get(agreed)
    tried = ", ".join(f"{b}: {'OOM' if p is None else f'{p / gib:.1f}'}" for b, p in measured.items())
    why = (
        f"auto: the largest power of two up to {cap} that fits {precision} training in {1 - MARGIN:.0%} of "
        f"{capacity / gib:.1f} GiB (peak {'?' if peak is None else f'{peak / gib:.1f}'} GiB; "
        f"probed {tried} GiB in {seconds:.1f} s)"
    )
    if best is None:
        why = f"auto: not even {first} images fit with a margin here (probed {tried} GiB in {seconds:.1f} s): "
        why += f"trying {first}"
    log.info("data.batch_size=%s (%s)", agreed, why)
    return Choice(agreed, why)


def _smallest_over_ranks(batch: int, device: torch.device) -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return batch
    value = torch.tensor([batch], device=device if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return int(value.item())


def record_in_config(output_dir: str | Path, batch_size: int) -> None:
    """Put the number ``auto`` became into the run's ``config.yaml`` (rank zero wrote it before the probe)."""
    from omegaconf import OmegaConf

    path = Path(output_dir) / "config.yaml"
    if not path.is_file():
        return
    config = OmegaConf.load(path)
    if OmegaConf.select(config, "data.batch_size") == "auto":
        config.data.batch_size = batch_size
        path.write_text(OmegaConf.to_yaml(config))
