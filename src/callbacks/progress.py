"""Lightning's rich progress bar, redrawn at most every ``min_interval_s`` during training."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class ProgressBar(RichProgressBar):
    """RichProgressBar that skips the per-batch update between redraws.

    Lightning's bar reads every logged value after every training batch; on a GPU each read waits for
    the device to finish all queued work, so the next step cannot be queued behind this one. Reading
    twice a second keeps the bar live and the queue full.
    """

    def __init__(self, min_interval_s: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.min_interval_s = min_interval_s
        self._drawn_at = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.monotonic()
        last = batch_idx + 1 >= self.total_train_batches
        if now - self._drawn_at >= self.min_interval_s or last:
            self._drawn_at = now
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
