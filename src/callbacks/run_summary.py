"""The line every run starts with: who trains, how they talk, and the batch the optimizer really sees."""

from __future__ import annotations


import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info


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


class RunSummary(L.Callback):
    """Prints, on rank zero when fitting starts, nodes x devices, strategy, backend, precision and global batch."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
        per_process = getattr(trainer.datamodule, "batch_size", None)
        accumulate = trainer.accumulate_grad_batches
        global_batch = per_process * trainer.world_size * accumulate if per_process else "unknown"
        rank_zero_info(
            f"Run: {trainer.num_nodes} node(s) x {trainer.num_devices} device(s) = world size {trainer.world_size}"
            f" | strategy {strategy_name(trainer.strategy)} | backend {backend}"
            f" | device {trainer.strategy.root_device.type} | precision {trainer.precision}"
            f" | global batch {global_batch} ({per_process} per process"
            f"{f' x {accumulate} accumulated' if accumulate > 1 else ''})"
            + (f" | peak lr {peak_lr(trainer):.4g}" if trainer.optimizers else "")
        )
