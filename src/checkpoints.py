"""Checkpoints: ``last.ckpt`` every N minutes (or steps), written atomically and timed, and which file a run resumes
from.

Lightning writes checkpoints and restores the loops, optimizer, scheduler and callbacks from them; this
module adds what it lacks: a ``last.ckpt`` that is always the newest state (Lightning 2.6's
``save_last`` refreshes it only when a top-k file is saved too), a write that a kill cannot leave half
done, the generation before it (``last.prev.ckpt``) for when ``last.ckpt`` cannot be read, one line for a
write the filesystem refuses, and one-line errors for a checkpoint this run cannot resume from.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shutil
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loops.utilities import _is_max_limit_reached

from src.errors import StorageError, UserError, storage_error_in

log = logging.getLogger(__name__)

LAST = "last.ckpt"
PREVIOUS = "last.prev.ckpt"  # the last.ckpt before the current one
_TMP_MARK = ".tmp-"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``name.ckpt`` as a hidden temp file beside it, fsyncs, then renames it over the final name.

    Lightning's own save goes through a temp file in the system temp dir, then a move: across filesystems
    (node-local /tmp, tmpfs) that move is a copy into the final name, which a kill leaves half written.
    A rename within one directory is atomic: the final name holds the old file or the new, never a part.
    ``last.ckpt``'s previous generation becomes ``last.prev.ckpt``, deleted just before the next ``last.ckpt``
    is written: between writes it takes one checkpoint's worth of disk more. A write the filesystem refuses (full, read-only, a
    folder removed under the run) leaves no temp file and raises one StorageError saying what is intact.
    ``saved`` and ``save_s`` count this process's writes (rank zero's: only it writes) and the seconds they took.
    """

    def __init__(self) -> None:
        super().__init__()
        self._made: set[Path] = set()
        self.saved, self.save_s = 0, 0.0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        started = time.perf_counter()
        self._write(checkpoint, path, storage_options)
        self.save_s += time.perf_counter() - started
        self.saved += 1

    def _write(self, checkpoint: dict[str, Any], path: Any, storage_options: Any) -> None:
        if "://" in str(path):  # remote storage: fsspec's transaction is the best there is
            return super().save_checkpoint(checkpoint, path, storage_options)
        final = Path(path)
        tmp = final.with_name(f".{final.name}{_TMP_MARK}{os.getpid()}")
        previous = final.with_name(PREVIOUS) if final.name == LAST else None
        try:
            self._make_dir(final.parent)
            if previous is not None:
                previous.unlink(missing_ok=True)
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            if previous is not None and final.exists():
                _keep_as(final, previous)
            os.replace(tmp, final)
            _fsync_dir(final.parent)  # the rename itself survives a power cut only once the directory is synced
        except Exception as err:
            tmp.unlink(missing_ok=True)
            refused = storage_error_in(err)
            if refused is None:
                raise
            raise StorageError(refused_write(refused, final, final.parent, _tensor_bytes(checkpoint))) from err
        finally:
            tmp.unlink(missing_ok=True)

    def _make_dir(self, directory: Path) -> None:
        """Create the checkpoint folder once; if it is gone later, something removed it under the run."""
        if directory not in self._made:
            directory.mkdir(parents=True, exist_ok=True)
            self._made.add(directory)
        elif not directory.is_dir():
            raise FileNotFoundError(errno.ENOENT, "vanished during the run", str(directory))


def _keep_as(current: Path, previous: Path) -> None:
    """Make ``previous`` a second name of ``current`` (a hard link, staged and renamed: never half there)."""
    staged = previous.with_name(f".{previous.name}{_TMP_MARK}{os.getpid()}")
    try:
        os.link(current, staged)
        os.replace(staged, previous)
    except OSError as err:
        staged.unlink(missing_ok=True)
        if storage_error_in(err) is not None and err.errno != errno.EPERM:
            raise
        os.replace(current, previous)  # no hard links here: moved instead (resume falls back to it meanwhile)


def refused_write(err: OSError, target: Path | None, checkpoints: Path | None, needed: int | None = None) -> str:
    """One line for a write the filesystem refused (full, read-only, removed under the run): what happened, which
    ``last.ckpt`` in ``checkpoints`` is intact, and what to do."""
    target = target or Path(os.fsdecode(err.filename or "the run dir"))
    folder = target.parent
    if err.errno == errno.ENOENT and not folder.is_dir():
        gone = folder
        while not gone.parent.is_dir() and gone.parent != gone:
            gone = gone.parent
        return (f"{gone} vanished during the run (it was removed while the run was writing {target.name}): "
                "its checkpoints and logs went with it; restore it and resume with ckpt_path=last, or start again")
    step = _step_of(checkpoints / LAST) if checkpoints is not None else None
    previous = "the previous " if target.name == LAST else ""
    intact = f"{previous}{LAST} (step {step}) is intact" if step is not None else f"there is no intact {LAST} yet"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _megabytes(shutil.disk_usage(folder).free) if folder.is_dir() else "?"
        sizes = f"{_megabytes(needed)} MB needed, {free} MB free" if needed else f"{free} MB free"
        return (f"no space left on device writing {target} ({sizes}): {intact}; free space and resume with "
                "ckpt_path=last")
    return f"cannot write {target} ({err.strerror}): {intact}; make {folder} writable and resume with ckpt_path=last"


def _step_of(path: Path) -> int | None:
    """The global step of an intact checkpoint at ``path``, else None."""
    try:
        return int(read_checkpoint(path)["global_step"])
    except (UserError, KeyError, TypeError, ValueError):
        return None


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _megabytes(size: int) -> str:
    return f"{size / 2**20:.0f}" if size >= 2**20 else f"{size / 2**20:.1f}"


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
    """``dirpath/last.ckpt`` at most every ``every_n_minutes`` (at a batch's or an epoch's end), every
    ``every_n_train_steps`` optimizer steps if set, at the first and the last epoch's end.

    A run killed at any point resumes (``ckpt_path=last``) having lost at most N minutes (or steps); the place
    inside the epoch travels in the checkpoint too, so the resumed run trains on exactly the batches the
    uninterrupted one would have. ``every_n_minutes: 0`` saves at every epoch end. Each rank reads its own
    clock, and ``trainer.save_checkpoint`` is collective, so ranks agree first: through GracefulStop's per-batch
    agreement (``agreed_due``); a run of several ranks without it saves at every epoch end instead.
    """

    def __init__(self, dirpath: str, every_n_minutes: float = 10, every_n_train_steps: int = 0) -> None:
        if not isinstance(every_n_train_steps, int) or isinstance(every_n_train_steps, bool) or every_n_train_steps < 0:
            raise UserError(f"callbacks.last_checkpoint.every_n_train_steps={every_n_train_steps} must be a whole "
                            "number >= 0 (0: by time only)")
        minutes = every_n_minutes
        if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes >= 0:  # NaN too
            raise UserError(f"callbacks.last_checkpoint.every_n_minutes={every_n_minutes} must be a number >= 0 "
                            "(0: at every epoch end)")
        self.dirpath, self.every_n_minutes = Path(dirpath), every_n_minutes
        self.every_n_train_steps = every_n_train_steps
        self.saves = 0  # this fit's; the same on every rank, as every save is
        self.agreed_due: Callable[[], bool] | None = None  # whether any rank found a save due (set by GracefulStop)
        self._saved_at_step = -1
        self._since = time.monotonic()

    @property
    def path(self) -> Path:
        return self.dirpath / LAST

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:
            remove_stale_temp_files(self.dirpath)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.saves, self._since = 0, time.monotonic()

    def due(self) -> bool:
        """Whether ``every_n_minutes`` have passed on this rank's clock since the last save (or the start)."""
        return self.every_n_minutes > 0 and time.monotonic() - self._since >= self.every_n_minutes * 60

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
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
        return self.agreed_due() if self.agreed_due is not None else True

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
        return {"dirpath": str(self.dirpath), "every_n_minutes": self.every_n_minutes,
                "every_n_train_steps": self.every_n_train_steps}


def _last_epoch(trainer: L.Trainer) -> bool:
    """Whether fit stops after this epoch (its limits, or a stop asked for: early stopping, a pruned trial)."""
    loop = trainer.fit_loop
    return (trainer.should_stop or _is_max_limit_reached(trainer.global_step, loop.max_steps)
            or _is_max_limit_reached(loop.epoch_progress.current.processed, loop.max_epochs))


class UnreadableCheckpoint(UserError):
    """A checkpoint file that is missing, cut off, corrupt or unreadable (not one that is merely untrusted)."""


def resume_from(ckpt_path: str | None, run_dir: str, trusted: bool = False) -> tuple[str | None, dict | None]:
    """The checkpoint a run starts from, loaded: a path, ``last`` (this run dir's, required), ``auto`` (this run
    dir's, if any), or none.

    ``auto`` is what a requeued Slurm job (same run dir) passes: resume when there is something to resume.
    With ``last`` or ``auto``, an unreadable ``last.ckpt`` (a node lost while the filesystem held it half
    written) is passed over for the newest intact checkpoint of the run dir, with one warning naming both;
    an explicit path is taken as it is, or refused.
    """
    if ckpt_path in (None, ""):
        return None, None
    if ckpt_path not in ("last", "auto"):
        return str(ckpt_path), read_checkpoint(ckpt_path, trusted=trusted)
    folder = Path(run_dir) / "checkpoints"
    last = folder / LAST
    others = [folder / PREVIOUS, *sorted(folder.glob("best-*.ckpt"))] if folder.is_dir() else []
    try:
        return str(last), read_checkpoint(last, trusted=trusted)
    except UnreadableCheckpoint as err:
        unreadable = err
    intact = []
    for path in others:
        try:
            intact.append((path, read_checkpoint(path, trusted=trusted)))
        except UnreadableCheckpoint:
            continue
    if intact:
        path, checkpoint = max(intact, key=lambda found: found[1].get("global_step", -1))
        if last.exists():
            _warn(f"{last} cannot be read ({_reason(unreadable)}): resuming from {path} (step "
                  f"{checkpoint.get('global_step')}), the newest intact checkpoint of the run dir")
        return str(path), checkpoint
    if ckpt_path == "auto" and not last.exists():
        return None, None
    if not last.exists():
        raise UserError(f"ckpt_path=last but {last} does not exist: pass the run dir that holds it "
                        "(hydra.run.dir=DIR) or the checkpoint's path (ckpt_path=PATH)")
    raise unreadable


def _reason(err: UserError) -> str:
    text = str(err)
    return text[text.find("(") + 1:text.find(")")] if "(" in text and ")" in text else "corrupt"


def _warn(message: str) -> None:
    """One ``warning:`` line from the process that owns the run dir (every rank makes the same choice)."""
    from src.launch import is_launch_rank_zero

    log.warning(message)
    if is_launch_rank_zero():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def read_checkpoint(path: str | Path, key: str = "ckpt_path", trusted: bool = False) -> dict[str, Any]:
    """Load a checkpoint on the CPU, weights-only unless ``trusted``; any failure is a UserError naming ``key``.

    ``weights_only`` unpickles tensors, numbers and strings only; a file that needs more can run code
    when loaded, so it loads only when the user says they trust it.
    """
    path = Path(path)
    if not path.is_file():
        raise UnreadableCheckpoint(f"{key}={path} does not exist: pass the path of a .ckpt file written by src.train")
    try:
        with open(path, "rb") as f:
            intact = zipfile.is_zipfile(f)  # torch.save writes a zip archive: a cut-off one lacks its directory
    except OSError as err:
        raise UnreadableCheckpoint(f"{key}={path} cannot be read ({err.strerror}): fix its permissions, or pass "
                                   "another checkpoint") from err
    if not intact:
        raise UnreadableCheckpoint(f"{key}={path} is not a checkpoint: truncated, corrupt or in another format (not "
                                   "the zip archive torch.save writes); pass an intact .ckpt written by src.train")
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted, mmap=True)  # mmap: no tensor is read yet
    except pickle.UnpicklingError as err:
        if not trusted and "weights_only" in str(err):
            raise UserError(
                f"{key}={path} holds Python objects beyond tensors and numbers, and unpickling them can run code: "
                "if you trust the file, pass ckpt_trusted=true to load it in full"
            ) from err
        raise UnreadableCheckpoint(f"{key}={path} is not a readable checkpoint (corrupt or truncated: {err})") from err
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        raise UnreadableCheckpoint(f"{key}={path} is not a readable checkpoint (corrupt or truncated: "
                                   f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from err


def check_compatible(checkpoint: dict[str, Any], path: str | Path, model_hparams: dict[str, Any],
                     key: str = "ckpt_path") -> None:
    """A checkpoint of another network (arch, stem, classes) cannot be resumed: say which key differs."""
    if "state_dict" not in checkpoint or "pytorch-lightning_version" not in checkpoint:
        raise UserError(f"{key}={path} is not a checkpoint of this project's model (no hyper_parameters, state_dict "
                        "or pytorch-lightning_version): pass a .ckpt written by src.train")
    saved = model_hparams_of(checkpoint, path, key)
    for name in ("arch", "stem", "num_classes"):
        if name in saved and saved[name] != model_hparams.get(name):
            raise UserError(
                f"{key}={path} holds a {saved.get('arch')} (model.{name}={saved[name]}) but this run builds "
                f"model.{name}={model_hparams.get(name)}: pass model.{name}={saved[name]}, or another checkpoint"
            )


# What ImageClassifier saves as hyperparameters, and what each may hold. A checkpoint's values are data from
# whoever wrote the file: none may name code to import or call (Lightning's ``_instantiator``, a ``_target_``),
# an architecture beyond torchvision's ResNets, or a path.
_SCALARS = (bool, int, float, str)
_NESTED = {
    "optimizer": {"lr", "momentum", "nesterov", "weight_decay", "decay_norm_and_bias", "lr_scaling",
                  "reference_batch_size", "fused"},
    "scheduler": {"warmup_epochs", "warmup_start_factor", "decay", "min_lr_factor"},
}


def model_from(checkpoint: dict[str, Any], path: str | Path):  # noqa: ANN201 - an ImageClassifier
    """The project's model with a read checkpoint's weights, built from its checked hyperparameters only; a file that
    holds another model is one UserError."""
    from src.models.classifier import ImageClassifier

    try:
        # values checked: data, never code; not compiled: one pass over a test set costs less than compiling for it
        model = ImageClassifier(**{**model_hparams_of(checkpoint, path), "compile": False})
        model.load_state_dict(checkpoint["state_dict"])
    except (KeyError, TypeError, RuntimeError) as err:
        raise UserError(f"ckpt_path={path} is not a checkpoint of this project's model "
                        f"({type(err).__name__}: {str(err).splitlines()[0]})") from err
    return model


def model_hparams_of(checkpoint: dict[str, Any], path: str | Path, key: str = "ckpt_path") -> dict[str, Any]:
    """The checkpoint's model hyperparameters, checked to be the plain values ImageClassifier saves; anything else
    (an unknown key, ``_instantiator``, an unknown arch, a value that is no number or string) is one UserError."""
    import inspect

    from src.models.classifier import ImageClassifier
    from src.models.resnet import STEMS, resnet_names

    saved = checkpoint.get("hyper_parameters")
    if not isinstance(saved, dict):
        raise UserError(f"{key}={path} is not a checkpoint of this project's model (no hyper_parameters, state_dict "
                        "or pytorch-lightning_version): pass a .ckpt written by src.train")
    known = set(inspect.signature(ImageClassifier.__init__).parameters) - {"self"}

    def refuse(name: str, why: str) -> UserError:
        return UserError(f"{key}={path} holds hyperparameter {name} {why}: it is not a checkpoint src.train wrote, "
                         "or was altered; pass another checkpoint")

    for name, value in saved.items():
        if name not in known:
            raise refuse(repr(name)[:80], f"which this project's model does not have (it has "
                                          f"{', '.join(sorted(known))})")
        if name in _NESTED:
            if not isinstance(value, dict):
                raise refuse(name, f"= {type(value).__name__}, not a mapping")
            for inner, item in value.items():
                if inner not in _NESTED[name]:
                    raise refuse(f"{name}.{repr(inner)[:80]}", f"which model.{name} does not have")
                if not isinstance(item, _SCALARS):
                    raise refuse(f"{name}.{inner}", f"= {type(item).__name__}, not a number, string or boolean")
        elif not isinstance(value, _SCALARS):
            raise refuse(name, f"= {type(value).__name__}, not a number, string or boolean")
    arch, stem = saved.get("arch", "resnet50"), saved.get("stem", "cifar")
    if arch not in resnet_names():
        raise refuse(f"arch={str(arch)[:80]!r}", "that is no torchvision ResNet this project builds")
    if stem not in STEMS:
        raise refuse(f"stem={str(stem)[:80]!r}", f"that is not one of {', '.join(STEMS)}")
    num_classes = saved.get("num_classes", 10)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or not 1 <= num_classes <= 1_000_000:
        raise refuse(f"num_classes={str(num_classes)[:80]!r}", "that is not a class count")
    return saved
