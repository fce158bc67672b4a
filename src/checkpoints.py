"""Checkpoints: ``last.ckpt`` every N steps and every epoch, written atomically, and which file a run resumes from.

Lightning writes checkpoints and restores the loops, optimizer, scheduler and callbacks from them; this
module adds what it lacks: a ``last.ckpt`` that is always the newest state (Lightning 2.6's
``save_last`` refreshes it only when a top-k file is saved too), a write that a kill cannot leave half
done, and one-line errors for a checkpoint this run cannot resume from.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint

from src.errors import UserError

LAST = "last.ckpt"
_TMP_MARK = ".tmp-"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``name.ckpt`` as a hidden temp file beside it, fsyncs, then renames it over the final name.

    Lightning's own save goes through a temp file in the system temp dir, then a move: across filesystems
    (node-local /tmp, tmpfs) that move is a copy into the final name, which a kill leaves half written.
    A rename within one directory is atomic: the final name holds the old file or the new, never a part.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if "://" in str(path):  # remote storage: fsspec's transaction is the best there is
            return super().save_checkpoint(checkpoint, path, storage_options)
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}{_TMP_MARK}{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(final.parent)  # the rename itself survives a power cut only once the directory is synced


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Temp files of writes that were killed half way (their final names were never touched)."""
    stale = sorted(directory.glob(f".*.ckpt{_TMP_MARK}*")) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


class LastCheckpoint(Checkpoint):
    """``dirpath/last.ckpt`` after every ``every_n_train_steps`` optimizer steps and at every epoch end.

    A run killed at any point resumes (``ckpt_path=last``) having lost at most N steps; the place inside
    the epoch travels in the checkpoint too, so the resumed run trains on exactly the batches the
    uninterrupted one would have. ``every_n_train_steps: 0`` keeps the per-epoch file only.
    """

    def __init__(self, dirpath: str, every_n_train_steps: int = 500) -> None:
        if not isinstance(every_n_train_steps, int) or isinstance(every_n_train_steps, bool) or every_n_train_steps < 0:
            raise UserError(f"callbacks.last_checkpoint.every_n_train_steps={every_n_train_steps} must be a whole "
                            "number >= 0 (0: only at epoch ends)")
        self.dirpath, self.every_n_train_steps = Path(dirpath), every_n_train_steps
        self._saved_at_step = -1

    @property
    def path(self) -> Path:
        return self.dirpath / LAST

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            remove_stale_temp_files(self.dirpath)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning runs the epoch's validation before this hook, so the file holds its metrics and best score.
        self.save(trainer)

    def save(self, trainer: L.Trainer) -> None:
        """Write the trainer's whole state to ``last.ckpt`` (rank zero writes; every rank must call this)."""
        if trainer.sanity_checking or trainer.fast_dev_run or trainer.global_step == self._saved_at_step:
            return
        trainer.save_checkpoint(self.path)
        self._saved_at_step = trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": str(self.dirpath), "every_n_train_steps": self.every_n_train_steps}


def resume_path(ckpt_path: str | None, run_dir: str) -> str | None:
    """The checkpoint a run starts from: a path, ``last`` (this run dir's, required), ``auto`` (if any), or none.

    ``auto`` is what a requeued Slurm job (same run dir) passes: resume when there is something to resume.
    """
    if ckpt_path in (None, ""):
        return None
    if ckpt_path in ("last", "auto"):
        last = Path(run_dir) / "checkpoints" / LAST
        if last.is_file():
            return str(last)
        if ckpt_path == "auto":
            return None
        raise UserError(f"ckpt_path=last but {last} does not exist: pass the run dir that holds it "
                        "(hydra.run.dir=DIR) or the checkpoint's path (ckpt_path=PATH)")
    return str(ckpt_path)


def read_checkpoint(path: str | Path, key: str = "ckpt_path", trusted: bool = False) -> dict[str, Any]:
    """Load a checkpoint on the CPU, weights-only unless ``trusted``; any failure is a UserError naming ``key``.

    ``weights_only`` unpickles tensors, numbers and strings only; a file that needs more can run code
    when loaded, so it loads only when the user says they trust it.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{key}={path} does not exist: pass the path of a .ckpt file written by src.train")
    try:
        with open(path, "rb") as f:
            intact = zipfile.is_zipfile(f)  # torch.save writes a zip archive: a cut-off one lacks its directory
    except OSError as err:
        raise UserError(f"{key}={path} cannot be read ({err.strerror}): fix its permissions, or pass another "
                        "checkpoint") from err
    if not intact:
        raise UserError(f"{key}={path} is not a checkpoint: truncated, corrupt or in another format (not the zip "
                        "archive torch.save writes); pass an intact .ckpt written by src.train")
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted, mmap=True)  # mmap: no tensor is read yet
    except pickle.UnpicklingError as err:
        if not trusted and "weights_only" in str(err):
            raise UserError(
                f"{key}={path} holds Python objects beyond tensors and numbers, and unpickling them can run code: "
                "if you trust the file, pass ckpt_trusted=true to load it in full"
            ) from err
        raise UserError(f"{key}={path} is not a readable checkpoint (corrupt or truncated: {err})") from err
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        raise UserError(f"{key}={path} is not a readable checkpoint (corrupt or truncated: "
                        f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from err


def check_compatible(checkpoint: dict[str, Any], path: str | Path, model_hparams: dict[str, Any],
                     key: str = "ckpt_path") -> None:
    """A checkpoint of another network (arch, stem, classes) cannot be resumed: say which key differs."""
    saved = checkpoint.get("hyper_parameters")
    if not isinstance(saved, dict) or "state_dict" not in checkpoint or "pytorch-lightning_version" not in checkpoint:
        raise UserError(f"{key}={path} is not a checkpoint of this project's model (no hyper_parameters, state_dict "
                        "or pytorch-lightning_version): pass a .ckpt written by src.train")
    for name in ("arch", "stem", "num_classes"):
        if name in saved and saved[name] != model_hparams.get(name):
            raise UserError(
                f"{key}={path} holds a {saved.get('arch')} (model.{name}={saved[name]}) but this run builds "
                f"model.{name}={model_hparams.get(name)}: pass model.{name}={saved[name]}, or another checkpoint"
            )
