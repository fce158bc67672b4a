"""Lightning's rich progress bar, moved at most every ``min_interval_s``, its values read only at log steps."""

from __future__ import annotations

import time
import weakref
from typing import Any, Sequence

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from src.core.errors import check_number, console_turn
from src.resilience import supervision


class ProgressBar(RichProgressBar):
    """RichProgressBar that moves at most every ``min_interval_s`` and shows new metric values at log steps only.

    Lightning's bar reads every logged value after every training batch; on a GPU each read waits for
    the device to finish all queued work, so the next step cannot be queued behind this one. Here the
    count moves twice a second, and the values (``train/loss``) are read where Lightning's logger reads
    them anyway: at the log steps (``trainer.log_every_n_steps``) and at the epoch's end.
    """

    def __init__(
        self, min_interval_s: float = 0.5, step_values: Sequence[str] = ("train/loss",), **kwargs: Any
    ) -> None:
        check_number(
            "callbacks.progress_bar.min_interval_s", min_interval_s, lambda v: v >= 0, "a number of seconds >= 0"
        )
        super().__init__(**kwargs)
        self.min_interval_s, self.step_values = min_interval_s, tuple(step_values)
        self._drawn_at = 0.0
        # a line another thread prints while the bar is drawn (a failure's error: line) starts on a line of its own
        # (a weak reference: the bar refers to its trainer, and a sweep's next job must not keep the last one's)
        bar = weakref.ref(self)
        supervision.OPEN_LINES[:] = [
            lambda: (b := bar()) is not None and b.progress is not None and not b._progress_stopped
        ]
        supervision.BARS_DRAWN[:] = [lambda: (b := bar()) is not None and b.progress is not None]

    def _stop_progress(self) -> None:
        # its last drawing (where the console is no terminal: the bar's text, then its newline, in two writes) in the
        # console's turn, so a failure's line that another thread prints at that moment comes before it or after it
        with console_turn():
            super()._stop_progress()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Lightning's values (logged with prog_bar=True), and ``step_values``: per-step values logged without it,
        read here, where the bar reads at all (log steps, epoch ends), instead of by Lightning after every batch."""
        metrics = super().get_metrics(trainer, pl_module)
        logged = trainer.callback_metrics
        for name in self.step_values:
            if name in logged and name not in metrics:
                metrics[name] = float(logged[name])
        return metrics

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The epoch's values (train/acc_epoch, train/loss_epoch) are reduced across ranks when first read: a
        # collective. Lightning's bar reads them on rank zero alone, before its logger reads them on every rank, and
        # with nothing else reading them first (callbacks.model_checkpoint=null) the ranks' collectives no longer
        # pair up and the run hangs. Every rank reads them here, together.
        _ = trainer.progress_bar_metrics
        # the epoch's count as it ended: an epoch that trainer.max_steps (or a stop) ends early ended between drawings,
        # and the bar said 1/45 after 3 steps
        self._update(self.train_progress_bar_id, trainer.fit_loop.epoch_loop.batch_idx + 1)
        super().on_train_epoch_end(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if now - self._drawn_at < self.min_interval_s and batch_idx + 1 < self.total_train_batches:
            return
        self._drawn_at = now
        if trainer._logger_connector.should_update_logs or batch_idx + 1 >= self.total_train_batches:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # the count and the values
            return
        if not self.is_disabled and self.train_progress_bar_id is None:  # a run resumed mid-epoch
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, batch_idx + 1)  # the count alone: nothing read from the device
