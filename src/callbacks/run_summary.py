"""The line every run starts with: who trains, how they talk, the number format, and the batch the optimizer sees."""

from __future__ import annotations

import logging

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from src.models.fast_path import channels_last_choice, fast_path

log = logging.getLogger(__name__)


def strategy_name(strategy: L.pytorch.strategies.Strategy) -> str:
    """The config name (ddp, ddp_spawn, single-device) of a strategy instance."""
    method = getattr(strategy, "_start_method", None)
    if method is not None:
        return "ddp" if method == "popen" else f"ddp_{method}"
    return "single-device"


def peak_lr(trainer: L.Trainer) -> float:
    """The first parameter group's rate before the schedule's factor: what lr scaling made of the config's."""
    group = trainer.optimizers[0].param_groups[0]
    return group.get("initial_lr", group["lr"])


def number_format(trainer: L.Trainer, pl_module: L.LightningModule, precision: str) -> str:
    """'precision bf16-mixed, channels-last (auto: the CPU has native bf16 (AVX512_BF16))'."""
    layout = "channels-last" if getattr(pl_module, "memory_format", None) == torch.channels_last else "contiguous"
    asked = [precision == "auto", getattr(pl_module, "hparams", {}).get("channels_last") == "auto"]
    why = ""
    if asked[0]:
        what = "auto" if all(asked) else "precision auto"
        # on CUDA, the GPUs whose capability chose the precision (trainer.device_ids reads [cuda:0, cuda:0] as [0, 1])
        devices = getattr(trainer.strategy, "parallel_devices", None) or [trainer.strategy.root_device]
        gpus = (tuple(d.index for d in devices),) if devices[0].type == "cuda" else ()
        why = f" ({what}: {fast_path(devices[0].type, pl_module.hparams.arch, *gpus).why})"
    elif asked[1]:  # the precision was the user's: the layout's own reason, not what chose a precision
        why = f" (channels_last auto: {channels_last_choice(trainer.strategy.root_device.type)[1]})"
    if not asked[0] and str(trainer.precision) != LIGHTNING_ALIASES.get(precision, precision):
        # Lightning's own substitution: fp16 autocast needs a GPU, so 16-mixed runs bf16-mixed on a CPU
        device = trainer.strategy.root_device.type
        why += f" (trainer.precision={precision}: Lightning runs {trainer.precision} on the {device}, without fp16 AMP)"
    return f"precision {trainer.precision}, {layout}{why}"


LIGHTNING_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # its short names


def compilation(pl_module: L.LightningModule) -> str:
    """'compiled reduce-overhead (auto: CUDA graphs on a GPU)', 'eager (auto: on a CPU)'."""
    mode = getattr(pl_module, "compile_mode", None)
    why = getattr(pl_module, "compile_why", "")
    return f"{f'compiled {mode}' if mode else 'eager'}{f' ({why})' if why else ''}"


def _synced_batchnorm(module: torch.nn.Module) -> bool:
    """Whether Lightning made the network's BatchNorm layers torch's SyncBatchNorm (``trainer.sync_batchnorm``)."""
    return any(isinstance(layer, torch.nn.SyncBatchNorm) for layer in module.modules())


class RunSummary(L.Callback):
    """Prints, on rank zero when fitting starts, nodes x devices, strategy, backend, precision and global batch.

    ``precision`` is the configured ``trainer.precision``, so the line can say why ``auto`` became what it did.
    """

    def __init__(self, precision: str = "auto") -> None:
        self.precision = str(precision)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
        per_process = getattr(trainer.datamodule, "batch_size", None)
        accumulate = trainer.accumulate_grad_batches
        global_batch = per_process * trainer.world_size * accumulate if per_process else "unknown"
        rank_zero_only(log.info)(
            f"Run: {trainer.num_nodes} node(s) x {trainer.num_devices} device(s) = world size {trainer.world_size}"
            f" | strategy {strategy_name(trainer.strategy)} | backend {backend}"
            f" | device {trainer.strategy.root_device.type} | {number_format(trainer, pl_module, self.precision)}"
            f" | {compilation(pl_module)}"
            f" | global batch {global_batch} ({per_process} per process"
            f"{f' x {accumulate} accumulated' if accumulate > 1 else ''}"
            f"{f'; {why}' if (why := getattr(trainer.datamodule, 'batch_size_why', None)) else ''})"
            + (" | BatchNorm synchronised over every rank" if _synced_batchnorm(pl_module) else "")
            + (f" | peak lr {peak_lr(trainer):.4g}" if trainer.optimizers else "")
            + (
                f" | {workers}"
                if (describe := getattr(trainer.datamodule, "describe_workers", None)) and (workers := describe())
                else ""
            )
        )
