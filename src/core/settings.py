"""The values every command checks before it starts, and a sweep for each of its jobs before the first runs
(src/sweeps/sweep.py): ``trainer.*`` values Lightning misreads or takes without a word, and the seed; and, as a
command starts, paths given empty. Imports nothing of the project but its errors, and nothing heavy: a refusal here
takes the fraction of a second Hydra takes."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Any, Iterator

from omegaconf import OmegaConf

from src.core.errors import UserError, check_number, whole, write_fix

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")


def check_trainer_settings(trainer_cfg: Any) -> None:
    """The ``trainer.*`` values Lightning misreads (``max_epochs=-1``: train forever), takes without a word
    (``deterministic=maybe``) or fails on deep inside a fit (``accumulate_grad_batches=0``), each a one-line UserError
    before any other process starts. What Lightning refuses itself (``precision=15``) it says as each rank builds its
    Trainer, and a dry run builds one to say it too (src/distributed/dry_run.py)."""
    if trainer_cfg is None:
        return
    accelerator = trainer_cfg.get("accelerator", "auto")
    if accelerator not in ACCELERATORS:
        raise UserError(f"trainer.accelerator={accelerator} is not supported here: choose one of auto, cpu, gpu")
    check_number(
        "trainer.max_epochs",
        trainer_cfg.get("max_epochs"),
        whole(1),
        "a whole number >= 1: the epochs to train (Lightning's -1, 'forever', would leave the learning-rate "
        "schedule without an end)",
        optional=True,
    )
    check_number(
        "trainer.min_epochs",
        trainer_cfg.get("min_epochs"),
        whole(0),
        "a whole number >= 0: the epochs to train before an early stop may end the run, or null",
        optional=True,
    )
    least, most = trainer_cfg.get("min_epochs"), trainer_cfg.get("max_epochs")
    if least is not None and most is not None and least > most:  # Lightning ended at max_epochs without a word
        raise UserError(
            f"trainer.min_epochs={least} is more than trainer.max_epochs={most}, where it ends: raise "
            "trainer.max_epochs, or lower trainer.min_epochs"
        )
    check_number(
        "trainer.log_every_n_steps",
        trainer_cfg.get("log_every_n_steps"),
        whole(1),
        "a whole number >= 1: the steps between logged values",
        optional=True,
    )
    check_number(
        "trainer.check_val_every_n_epoch",
        trainer_cfg.get("check_val_every_n_epoch"),
        whole(1),
        "a whole number >= 1, or null (trainer.val_check_interval alone decides)",
        optional=True,
    )
    check_number(
        "trainer.num_sanity_val_steps",
        trainer_cfg.get("num_sanity_val_steps"),
        whole(-1),
        "a whole number >= 0 of validation batches before training, or -1 for all of them",
        optional=True,
    )
    benchmark = trainer_cfg.get("benchmark")
    if benchmark is not None and not isinstance(benchmark, bool) and benchmark != "auto":
        raise UserError(
            f"trainer.benchmark={benchmark} is not known: auto (cuDNN's autotuning on a GPU), true or false"
        )
    deterministic = trainer_cfg.get("deterministic")
    if deterministic is not None and not isinstance(deterministic, bool) and deterministic != "warn":
        raise UserError(
            f"trainer.deterministic={deterministic} is not known: true (deterministic kernels only), warn (a warning "
            "where one has none) or false"
        )
    max_steps = trainer_cfg.get("max_steps", -1)
    if max_steps != -1:  # Lightning's -1: the epochs decide; 0 trained nothing and tested the first weights
        check_number(
            "trainer.max_steps", max_steps, whole(1), "-1 (trainer.max_epochs decides) or a whole number of steps >= 1"
        )
    elif "max_epochs" in trainer_cfg and trainer_cfg.get("max_epochs") is None and trainer_cfg.get("max_time") is None:
        # Lightning's 1000 epochs, in a warning that says to set max_epochs=-1 (refused above)
        raise UserError(
            "trainer.max_epochs=null with trainer.max_steps=-1 sets no end (Lightning would train 1000 epochs): give "
            "trainer.max_epochs, or trainer.max_steps for a run counted in steps"
        )
    # a negative clip value flips every gradient in torch's clip_grad_norm_ (its scale is clip / norm) and trains away
    check_number(
        "trainer.gradient_clip_val",
        trainer_cfg.get("gradient_clip_val"),
        lambda v: v >= 0,
        "a number >= 0 (the largest gradient norm, or value), or null for no clipping",
        optional=True,
    )
    check_number(
        "trainer.accumulate_grad_batches",
        trainer_cfg.get("accumulate_grad_batches", 1),
        whole(1),
        "a whole number >= 1: the batches whose gradients make one optimizer step (1: every batch steps)",
    )


def check_seed(seed: Any, key: str = "seed") -> None:
    """``seed``, which Lightning's seed_everything and the data's split take: a whole number numpy accepts. Not null:
    each process would seed itself at random (Lightning's choice), and the data's split failed on it."""
    words = f"a whole number from 0 to {2**32 - 1}"
    if seed is None:
        raise UserError(f"{key}=null must be {words}, the same for every process (a new one each run: seed=$RANDOM)")
    check_number(key, seed, lambda v: whole(0)(v) and v < 2**32, words)


# The project's own switches. A word (ckpt_trusted=no, test=off) is a string, and a string is true: ckpt_trusted=no
# loaded a checkpoint in full, code and all. (data.augment, data.pin_memory: their datamodule's check.)
SWITCHES = (
    "ckpt_trusted",
    "test",
    "dry_run",
    "model.optimizer.nesterov",
    "model.optimizer.decay_norm_and_bias",
    "trainer.enable_model_summary",
    "trainer.sync_batchnorm",
)


def check_switches(cfg: Any) -> None:
    for key in SWITCHES:
        value = OmegaConf.select(cfg, key, default=False)
        if not isinstance(value, bool):
            raise UserError(f"{key}={value} must be true or false")


ROOT_DIR_DEFAULT = "${paths.output_dir}"  # conf/trainer/default.yaml: Lightning's default_root_dir is the run dir


def check_root_dir(cfg: Any) -> None:
    """``trainer.default_root_dir``, where Lightning and the project's callbacks put a run's files (``throughput.json``,
    a failure's record and stacks, a stop's ``last.ckpt`` without the last-checkpoint callback): the run dir, which
    the run's lock holds and where the checkpoints, logs and config go. Another folder, or null (Lightning's: the
    directory the run starts in), split one run's files in two, and a sweep's report found no ``throughput.json``
    in its jobs' dirs."""
    trainer = cfg.get("trainer")
    if trainer is None or "default_root_dir" not in trainer:
        return
    raw = OmegaConf.to_container(trainer, resolve=False).get("default_root_dir")
    if raw == ROOT_DIR_DEFAULT:
        return
    value = OmegaConf.select(cfg, "trainer.default_root_dir", default=None, throw_on_resolution_failure=False)
    run_dir = OmegaConf.select(cfg, "paths.output_dir", default=None, throw_on_resolution_failure=False)
    if value is not None and run_dir is not None and Path(str(value)).absolute() == Path(str(run_dir)).absolute():
        return
    given = value if value is not None else raw
    raise UserError(
        f"trainer.default_root_dir={given} is not the run dir, where every file of a run goes: give "
        f"hydra.run.dir={'DIR' if given is None else given} instead (a sweep's: hydra.sweep.dir), or leave "
        "trainer.default_root_dir out"
    )


def check_values(cfg: Any) -> None:
    """A composed config's ``trainer.*`` values, run dir, seed and switches: what every command checks as it starts,
    and a sweep for each of its jobs before the first."""
    check_switches(cfg)
    check_trainer_settings(cfg.get("trainer"))
    check_root_dir(cfg)
    if "seed" in cfg:  # src.predict has none
        check_seed(cfg.seed)
    data = cfg.get("data")
    if data is not None and "seed" in data:  # ${seed}, unless set apart
        check_seed(data.seed, "data.seed")


# Keys whose empty value (``paths.checkpoints=$CKPT_DIR`` with the variable unset) a run would take quietly: a path
# as the directory it starts in, ckpt_path as no checkpoint at all (a resume become a fresh start).
EMPTY_MEANS = {
    "ckpt_path": "a checkpoint, last or auto (or leave ckpt_path out to start afresh)",
    "paths.checkpoints": "a folder or s3://BUCKET/PREFIX (or leave it out: the run dir's checkpoints/)",
    "paths.data_dir": "a folder (or leave it out: data/ where you start)",
    "data.root": "the folder that holds cifar-10-batches-py (or leave it out: paths.data_dir)",
}


def check_no_empty_paths(cfg: Any) -> None:
    """A training's path or checkpoint given as an empty string: one line naming it. (src.eval, src.export and
    src.predict refuse an empty ckpt_path as a missing one.)"""
    for key, what in EMPTY_MEANS.items():
        if key == "ckpt_path" and cfg.get("task_name") != "train":
            continue
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if isinstance(value, str) and not value.strip():
            raise UserError(f"{key} is empty (a shell variable that is not set?): give {what}")


def check_checkpoint_folder(cfg: Any) -> None:
    """A training's ``paths.checkpoints``, where it is a local folder: one this process can make and write. Before,
    a folder it could not write was found at the first save, an epoch in (hours, for a long one), and a file where
    the folder must be ended the run there on a traceback. A few ``stat`` calls, once per process; nothing is made."""
    if cfg.get("task_name") != "train":
        return
    value = OmegaConf.select(cfg, "paths.checkpoints", default=None, throw_on_missing=False)
    if not isinstance(value, str) or not value.strip() or "://" in value:
        return  # empty: check_no_empty_paths; s3://: src/checkpoints/object_store.py
    path = Path(value).absolute()
    step = path
    while True:  # the nearest part of the path that exists: the folder itself, or where it will be made
        try:
            mode = os.stat(step).st_mode
            break
        except (FileNotFoundError, NotADirectoryError, PermissionError):  # the last: a folder above not entered
            step = step.parent
    if not stat.S_ISDIR(mode):
        where = "is a file" if step == path else f"lies under {step}, a file"
        raise UserError(
            f"paths.checkpoints={value} {where}, not a folder: pass paths.checkpoints=DIR (or leave it out: the run "
            "dir's checkpoints/)"
        )
    if not os.access(step, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):  # as writes
        code = errno.EROFS if os.statvfs(step).f_flag & os.ST_RDONLY else errno.EACCES
        refused = OSError(code, os.strerror(code))
        raise UserError(
            f"paths.checkpoints={value} cannot be written ({refused.strerror} on {step}): pass paths.checkpoints=DIR "
            f"somewhere you can write, or {write_fix(refused)}"
        )


@contextlib.contextmanager
def hydra_config_of(config: Any) -> Iterator[None]:
    """Hydra's config (``HydraConfig``) set to ``config``'s while its values resolve outside the run Hydra runs it in
    (a sweep's job before any job runs, a run's before Hydra's ``run_job`` sets it): ``${hydra:runtime.cwd}`` (the
    data's default folder) and ``${output_dir:}`` (the run dir, the default ``paths.checkpoints``) resolve as in the
    run. What was set before (the sweep's, a test process's own, none) is put back."""
    from hydra.core.hydra_config import HydraConfig

    hydra_config = HydraConfig.instance()
    before = hydra_config.cfg
    try:
        hydra_config.set_config(config)
        yield
    finally:
        hydra_config.cfg = before
