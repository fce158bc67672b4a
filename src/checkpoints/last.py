"""When ``last.ckpt`` is written: every N minutes (or steps), at the first and the last epoch's end, at a stop's step.

Lightning 2.6's ``save_last`` refreshes ``last.ckpt`` only when a top-k file is saved too; ``LastCheckpoint`` keeps
it the newest state. The invariant: every rank calls ``save`` at the same steps (``trainer.save_checkpoint`` is a
collective), so a save by time is agreed first. The agreement is a callback's that every rank runs at each batch
end: one with an ``agreed_due()`` method among the trainer's callbacks (src/callbacks/graceful_stop.py's
``GracefulStop``, whose all-reduce carries the stop flag and this one). ``LastCheckpoint`` asks it at an epoch's end
and never learns more of it; without one, a run of several ranks saves at every epoch end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loops.utilities import _is_max_limit_reached

from src.checkpoints import object_store
from src.checkpoints.files import LAST, remove_stale_temp_files
from src.core.errors import UserError, check_number, whole


class LastCheckpoint(Checkpoint):
    """``dirpath/last.ckpt`` at most every ``every_n_minutes`` (at a batch's or an epoch's end), every
    ``every_n_train_steps`` optimizer steps if set, at the first and the last epoch's end.

    A run killed at any point resumes (``ckpt_path=last``) having lost at most N minutes (or steps); the place
    inside the epoch travels in the checkpoint too, so the resumed run trains on exactly the batches the
    uninterrupted one would have. ``every_n_minutes: 0`` saves at every epoch end. Each rank reads its own
    clock, and ``trainer.save_checkpoint`` is collective, so ranks agree first (the module docstring).
    """

    def __init__(self, dirpath: str, every_n_minutes: float = 10, every_n_train_steps: int = 0) -> None:
        if dirpath is None:
            raise UserError(
                "callbacks.last_checkpoint.dirpath=null must be a folder or s3://BUCKET/PREFIX (or leave it out: "
                "paths.checkpoints)"
            )
        check_number(
            "callbacks.last_checkpoint.every_n_train_steps",
            every_n_train_steps,
            whole(0),
            "a whole number >= 0 (0: by time only)",
        )
        check_number(
            "callbacks.last_checkpoint.every_n_minutes",
            every_n_minutes,
            lambda v: v >= 0,
            "a number >= 0 (0: at every epoch end)",
        )
        self.dirpath = dirpath if object_store.is_url(dirpath) else Path(dirpath)  # a folder, or an s3:// prefix
        self.every_n_minutes = every_n_minutes
        self.every_n_train_steps = every_n_train_steps
        self.saves = 0  # this fit's; the same on every rank, as every save is
        self._saved_at_step = -1
        self._since = time.monotonic()

    @property
    def path(self) -> str | Path:
        return object_store.join(self.dirpath, LAST)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            if isinstance(self.dirpath, Path):  # an object store has no half-written files to leave
                remove_stale_temp_files(self.dirpath)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.saves, self._since = 0, time.monotonic()

    def due(self) -> bool:
        """Whether ``every_n_minutes`` have passed on this rank's clock since the last save (or the start)."""
        return self.every_n_minutes > 0 and time.monotonic() - self._since >= self.every_n_minutes * 60

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_train_steps
        if (n and trainer.global_step % n == 0) or (trainer.world_size == 1 and self.due()):
            self.save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning runs the epoch's validation before this hook, so the file holds its metrics and best score.
        # The first epoch's file shows early that the checkpoint folder takes writes; the last one ends the run.
        # Every short-circuit below reads the same on every rank, so all or none reach the agreement.
        if not self.every_n_minutes or not self.saves or _last_epoch(trainer) or self._due_on_every_rank(trainer):
            self.save(trainer)

    def _due_on_every_rank(self, trainer: L.Trainer) -> bool:
        # No collective of its own: the agreement the epoch's last batch started has the answer (a new one would be,
        # under NCCL, one more wait for the device; without GracefulStop nothing agrees, so every epoch end saves)
        if trainer.world_size == 1:
            return self.due()
        agreement = next((cb for cb in trainer.callbacks if callable(getattr(cb, "agreed_due", None))), None)
        return agreement.agreed_due() if agreement is not None else True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save(trainer)  # a stop asked for after the epoch's end hooks (no-op when that step is saved)

    def save(self, trainer: L.Trainer) -> None:
        """Write the trainer's whole state to ``last.ckpt`` (rank zero writes; every rank must call this)."""
        if trainer.sanity_checking or trainer.fast_dev_run or trainer.global_step == self._saved_at_step:
            return
        trainer.save_checkpoint(self.path, weights_only=False)  # the whole state: a resume needs it
        self._saved_at_step = trainer.global_step
        self.saves += 1
        self._since = time.monotonic()

    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": str(self.dirpath),
            "every_n_minutes": self.every_n_minutes,
            "every_n_train_steps": self.every_n_train_steps,
        }


def _last_epoch(trainer: L.Trainer) -> bool:
    """Whether fit stops after this epoch (its limits, or a stop asked for: early stopping, a pruned trial)."""
    loop = trainer.fit_loop
    return (
        trainer.should_stop
        or _is_max_limit_reached(trainer.global_step, loop.max_steps)
        or _is_max_limit_reached(loop.epoch_progress.current.processed, loop.max_epochs)
    )
