"""Test-only failures, injected into real runs as callbacks: ``+callbacks.fault._target_=tests.faults.RaiseAt``."""

from __future__ import annotations

from typing import Any

import lightning as L


class RaiseAt(L.Callback):
    """Raise on one rank when training reaches ``step`` (a bug, a bad batch), before that step's all-reduce, so
    the other ranks are left waiting in it."""

    def __init__(self, rank: int = 0, step: int = 3) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            raise RuntimeError(f"injected failure at step {trainer.global_step}")
