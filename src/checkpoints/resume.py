"""Which checkpoint a run resumes from, and what a checkpoint may hold to be loaded.

``ckpt_path=last``/``auto`` take the newest intact checkpoint of the run dir; a checkpoint is weights-only unless
``ckpt_trusted=true``, its hyperparameters are plain values of this project's model (never code to call), and it is
checked against the model before the ranks meet; a run resumed in its own dir names each setting of what it trains that
the command changes (``warn_changed_settings``). The invariant: a run never starts from a file it has not read
whole, and never from one that names code.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from src.checkpoints import object_store
from src.checkpoints.files import LAST, PREVIOUS, UnreadableCheckpoint, read_checkpoint
from src.core.console import warning_line
from src.core.errors import UserError
from src.launch.torchrun import trained_batch

log = logging.getLogger(__name__)


def resume_from(
    ckpt_path: str | None, checkpoints: str | Path, trusted: bool = False
) -> tuple[str | None, dict | None]:
    """The checkpoint a run starts from, loaded: a path, ``last`` (the run's, in ``checkpoints``, its
    ``paths.checkpoints``: a folder or an ``s3://`` prefix; required), ``auto`` (the run's, if any), or none. The run
    never deletes the file it starts from (src/checkpoints/object_store.py's ``RESUMED``).

    ``auto`` is what a requeued Slurm job (same run dir) passes: resume when there is something to resume.
    With ``last`` or ``auto``, an unreadable ``last.ckpt`` (a node lost while the filesystem held it half
    written) is passed over for the newest intact checkpoint of the run dir, with one warning naming both;
    an explicit path is taken as it is, or refused.
    """
    path, checkpoint = _chosen(ckpt_path, checkpoints, trusted)
    if path is not None:
        object_store.RESUMED.add(path if object_store.is_url(path) else str(Path(path).absolute()))
    return path, checkpoint


def _chosen(ckpt_path: str | None, folder: str | Path, trusted: bool) -> tuple[str | None, dict | None]:
    if ckpt_path in (None, ""):
        return None, None
    if ckpt_path not in ("last", "auto"):
        return str(ckpt_path), read_checkpoint(ckpt_path, trusted=trusted)
    last = object_store.join(folder, LAST)
    try:
        return str(last), read_checkpoint(last, trusted=trusted)
    except UnreadableCheckpoint as err:
        unreadable = err
    others = _others(folder)
    intact = []
    for path in others:
        try:
            intact.append((path, read_checkpoint(path, trusted=trusted)))
        except UnreadableCheckpoint:
            continue
    if intact:
        path, checkpoint = max(intact, key=lambda found: found[1].get("global_step", -1))
        if _exists(last):
            _warn(
                f"{last} cannot be read ({_reason(unreadable)}): resuming from {path} (step "
                f"{checkpoint.get('global_step')}), the newest intact checkpoint of the run dir"
            )
        return str(path), checkpoint
    if ckpt_path == "auto" and not _exists(last):
        return None, None
    if not _exists(last):
        raise UserError(
            f"ckpt_path=last but {last} does not exist: pass the run dir that holds it "
            "(hydra.run.dir=DIR) or the checkpoint's path (ckpt_path=PATH)"
        )
    raise unreadable


def _others(folder: str | Path) -> list[str | Path]:
    """``last.prev.ckpt`` and the best checkpoints of a run, wherever its checkpoints are."""
    if object_store.is_url(folder):
        return [object_store.join(folder, PREVIOUS), *object_store.names(folder, "best-*.ckpt")]
    folder = Path(folder)
    return [folder / PREVIOUS, *sorted(folder.glob("best-*.ckpt"))] if folder.is_dir() else []


def _exists(path: str | Path) -> bool:
    return object_store.exists(path) if object_store.is_url(path) else Path(path).exists()


def _reason(err: UserError) -> str:
    text = str(err)
    return text[text.find("(") + 1 : text.find(")")] if "(" in text and ")" in text else "corrupt"


def _warn(message: str) -> None:
    """One ``warning:`` line from the process that owns the run dir (every rank makes the same choice); every
    rank's log file keeps it."""
    from src.launch.ranks import is_launch_rank_zero

    warning_line(log, message, say=is_launch_rank_zero())


def check_compatible(
    checkpoint: dict[str, Any], path: str | Path, model_hparams: dict[str, Any], key: str = "ckpt_path"
) -> None:
    """A checkpoint of another network (arch, stem, width, classes) cannot be resumed: say which key differs."""
    if "state_dict" not in checkpoint or "pytorch-lightning_version" not in checkpoint:
        raise UserError(
            f"{key}={path} is not a checkpoint of this project's model (no hyper_parameters, state_dict "
            "or pytorch-lightning_version): pass a .ckpt written by src.train"
        )
    from src.models.resnet import WIDTH

    saved = {"width": WIDTH, **model_hparams_of(checkpoint, path, key)}  # a checkpoint from before model.width: 64
    for name in ("arch", "stem", "width", "num_classes"):
        if name in saved and saved[name] != model_hparams.get(name, WIDTH if name == "width" else None):
            raise UserError(
                f"{key}={path} holds a {saved.get('arch')} (model.{name}={saved[name]}) but this run builds "
                f"model.{name}={model_hparams.get(name)}: pass model.{name}={saved[name]}, or another checkpoint"
            )


# What ImageClassifier saves as hyperparameters, and what each may hold. A checkpoint's values are data from
# whoever wrote the file: none may name code to import or call (Lightning's ``_instantiator``, a ``_target_``),
# an architecture beyond torchvision's ResNets, or a path.
_SCALARS = (bool, int, float, str)


_NESTED = {
    "optimizer": {
        "lr",
        "momentum",
        "nesterov",
        "weight_decay",
        "decay_norm_and_bias",
        "lr_scaling",
        "reference_batch_size",
        "fused",
    },
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
        raise UserError(
            f"ckpt_path={path} is not a checkpoint of this project's model "
            f"({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from err
    return model


def model_hparams_of(checkpoint: dict[str, Any], path: str | Path, key: str = "ckpt_path") -> dict[str, Any]:
    """The checkpoint's model hyperparameters, checked to be the plain values ImageClassifier saves; anything else
    (an unknown key, ``_instantiator``, an unknown arch, a value that is no number or string) is one UserError."""
    import inspect

    from src.models.classifier import ImageClassifier
    from src.models.resnet import STEMS, WIDTH, check_width, resnet_names

    saved = checkpoint.get("hyper_parameters")
    if not isinstance(saved, dict):
        raise UserError(
            f"{key}={path} is not a checkpoint of this project's model (no hyper_parameters, state_dict "
            "or pytorch-lightning_version): pass a .ckpt written by src.train"
        )
    known = set(inspect.signature(ImageClassifier.__init__).parameters) - {"self"}

    def refuse(name: str, why: str) -> UserError:
        return UserError(
            f"{key}={path} holds hyperparameter {name} {why}: it is not a checkpoint src.train wrote, "
            "or was altered; pass another checkpoint"
        )

    for name, value in saved.items():
        if name not in known:
            raise refuse(
                repr(name)[:80], f"which this project's model does not have (it has {', '.join(sorted(known))})"
            )
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
    try:
        check_width(saved.get("width", WIDTH))
    except UserError:
        raise refuse(f"width={str(saved.get('width'))[:80]!r}", f"that is not a width from 1 to {WIDTH}") from None
    num_classes = saved.get("num_classes", 10)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or not 1 <= num_classes <= 1_000_000:
        raise refuse(f"num_classes={str(num_classes)[:80]!r}", "that is not a class count")
    return saved


# What a run trains, as its config says: a run resumed in its own run dir with other values goes on as another run
# from that point. (Where and how fast may change freely: devices, nodes, epochs, workers, compile, the data's
# folder, loggers and callbacks are not among them.)
SETTINGS = (
    "seed",
    "data",
    "model",
    "trainer.precision",
    "trainer.accumulate_grad_batches",
    "trainer.gradient_clip_val",
)
FREE = {
    "data.root",
    "data.download",
    "data.download_url",
    "data.num_workers",
    "data.multiprocessing_context",
    "data.pin_memory",
    "data.max_batch_size",
    "data.num_test",
    "model.compile",
    "model.channels_last",
    "model.optimizer.fused",
}


def changed_settings(cfg: DictConfig, recorded: Path) -> list[str]:
    """``KEY=VALUE (it trained with OLD)`` for each of SETTINGS that ``cfg`` gives another value than the run's own
    resolved config (``recorded``, its ``config.yaml``) holds. ``auto`` is no change (``data.batch_size=auto`` resumes
    with the batch the run trained with); a key the record lacks (an earlier version's run) neither; a value that
    interpolates another (``data.seed: ${seed}``) is named by that one."""
    try:
        before = OmegaConf.load(recorded)
    except Exception:  # noqa: BLE001 - missing, unreadable or not YAML: nothing to compare with
        return []
    changes = []
    for key in SETTINGS:
        node = OmegaConf.select(cfg, key)
        written = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else node
        for name, value in _leaves(written, key):  # as written: a value is itself unless it interpolates another
            was = OmegaConf.select(before, name, default=_ABSENT)
            if name in FREE or value == "auto" or "${" in str(value) or was is _ABSENT or was == value:
                continue
            changes.append(f"{name}={value} (it trained with {was})")
    return changes


def warn_changed_settings(cfg: DictConfig) -> None:
    """One warning line naming what a resume in the run's own dir changes (``changed_settings``)."""
    from src.launch.run_dir import CONFIG_FILE

    recorded = Path(cfg.paths.output_dir) / CONFIG_FILE
    changes = changed_settings(cfg, recorded)
    if changes:
        _warn(
            f"resuming the run in {recorded.parent} with settings other than its own: {', '.join(changes)}; it goes "
            f"on with these (to continue it as it was, pass the values {recorded} holds)"
        )


def warn_global_batch_change(
    saved_by: dict[str, Any] | None, world_size: int, batch_size: Any, accumulate: int
) -> None:
    """One warning line where a run resumed at another world size than its checkpoint's trains another global batch:
    the learning rate (scaled by it) and the steps per epoch change with it. ``saved_by``: the checkpoint's record of
    who wrote it (src/models/classifier.py). torchrun's restarts keep the global batch themselves
    (src/launch/torchrun.py's ``keep_global_batch``); a resume the user started says what changed, and how to keep
    it."""
    trained = trained_batch(saved_by, accumulate=1)
    if trained is None or isinstance(batch_size, bool) or not isinstance(batch_size, int):
        return  # an earlier version's checkpoint, or a batch size a GPU probe picks later
    old_world, _, before = trained
    now = world_size * batch_size * accumulate
    if old_world == world_size or now == before:
        return
    per_process, rest = divmod(before, world_size * accumulate)
    keep = (
        f"pass data.batch_size={per_process}"
        if not rest and per_process
        else f"make data.batch_size x trainer.accumulate_grad_batches x {world_size} process(es) {before}"
    )
    _warn(
        f"resuming a checkpoint of world size {old_world} at world size {world_size}: the global batch is {now} "
        f"({batch_size} per process) where it trained with {before}; the learning rate and the steps per epoch "
        f"follow it: to keep them, {keep}"
    )


def warn_nothing_to_train(checkpoint: dict[str, Any], path: str | Path, max_epochs: int | None, max_steps: int) -> bool:
    """One warning line where the checkpoint a run resumes from has trained all the epochs (or steps) this run
    asks for: Lightning trains nothing then, silently, and the run goes on to its test. Before, a finished run resumed
    into a new dir to train on (``trainer.max_epochs`` as before) looked like a run that had trained. The two limits
    are the run's, checked as it started (src/core/settings.py: ``max_epochs`` null or >= 1, ``max_steps`` -1 or
    >= 1); the checkpoint's progress is the file's, read as Lightning's fit loop compares it with them. True where
    it warned."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    epochs, step = progress.get("processed"), checkpoint.get("global_step")
    if not isinstance(epochs, int) or not isinstance(step, int):
        return False  # not a checkpoint of Lightning's fit loop: Lightning's own load says what is wrong
    if 0 < max_steps <= step:
        asked, more = f"trainer.max_steps={max_steps}", f"trainer.max_steps above {step}"
    elif max_epochs is not None and max_epochs <= epochs:
        asked, more = f"trainer.max_epochs={max_epochs}", f"trainer.max_epochs above {epochs}"
    else:
        return False
    _warn(
        f"ckpt_path={path} has trained {epochs} epoch(s), {step} step(s), and this run asks for {asked}: nothing is "
        f"left to train, and the test runs on its weights; to train on, pass {more} (the learning-rate schedule "
        "ends with trainer.max_epochs)"
    )
    return True


def checkpoints_folder(checkpoint: dict[str, Any]) -> str | None:
    """The folder the run that saved ``checkpoint`` kept its checkpoints in (its ``ModelCheckpoint``'s state)."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(state, dict):
            folder = state.get("dirpath")
            return folder if isinstance(folder, str) else None
    return None


def warn_moved_checkpoints(saved: str | None, path: str | Path, folder: str | None) -> None:
    """One warning line where a run resumes a checkpoint saved with its checkpoints in another folder than this
    run's (``ckpt_path=`` another run's file, or a run dir moved since). Lightning's ``ModelCheckpoint`` then takes
    back only the path of that run's best checkpoint, not its score or top-k: the best this run keeps and tests is
    the best of the epochs it trains now, whatever the earlier run reached. Before, Lightning's own warning said so
    in its words (``best_model_score``, ``kth_value``, ...) with its source line, from every rank."""
    if saved is None or folder is None:
        return
    local = not object_store.is_url(saved) and not object_store.is_url(folder)
    if (os.path.realpath(saved) == os.path.realpath(folder)) if local else saved.rstrip("/") == folder.rstrip("/"):
        return
    _warn(
        f"ckpt_path={path} was saved by a run that kept its checkpoints in {saved}: this run keeps its own in "
        f"{folder}, and its best checkpoint (the one a test uses) is the best of the epochs it trains from here; the "
        f"earlier run's best stays in {saved}"
    )


_ABSENT = object()


def _leaves(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    if not isinstance(tree, dict):
        return [(prefix, tree)]
    return [leaf for name, value in tree.items() for leaf in _leaves(value, f"{prefix}.{name}")]


def resume_own_run_dir(cfg: DictConfig) -> None:
    """A run started again in its own run dir continues it (a torchrun attempt, a sweep's job run again):
    ``ckpt_path`` becomes ``auto``. A ``ckpt_path=FILE`` the run began from counts until the run dir has a
    ``last.ckpt`` of its own (in ``paths.checkpoints``: a folder or an ``s3://`` prefix)."""
    if cfg.get("task_name") != "train" or cfg.ckpt_path in ("last", "auto"):
        return
    if cfg.ckpt_path is None or _exists(object_store.join(cfg.paths.checkpoints, LAST)):
        with open_dict(cfg):
            cfg.ckpt_path = "auto"
