"""Builds the Lightning Trainer from the config groups: strategy, callbacks, logger, trainer."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.pytorch.callbacks import Checkpoint, LearningRateMonitor, ProgressBar
from omegaconf import DictConfig, OmegaConf

from src.checkpoints.files import AtomicCheckpointIO, read_checkpoint
from src.core.console import quiet_console, quiet_dependencies, warning_line
from src.core.errors import UserError
from src.distributed.strategy import HydraDDPStrategy, TaskGPU, training_recipe
from src.launch import torchrun
from src.launch.devices import node_gpus, one_gpu_per_task, slurm_detected, uses_cuda
from src.launch.ranks import is_launch_rank_zero, mpi_launched, ranks_started_here_under_slurm
from src.launch.run_dir import CONFIG_FILE
from src.models.fast_path import fast_path
from src.tracking.loggers import remember_runs

quiet_dependencies()


log = logging.getLogger("src.training.trainer")


def route_lightning_logs() -> None:
    """Send Lightning's messages through Hydra's handlers, so each process's log file holds them too.

    Lightning gives its logger a console handler of its own when it is imported, before Hydra has
    configured logging, and stops it propagating; the run's log files then miss every Lightning line.
    The console keeps only what asks something of the user (src/core/console.py).
    """
    if logging.getLogger().handlers:  # Hydra's logging; a spawned child without it keeps Lightning's own
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
    quiet_console()


def hardware_defaults(trainer_cfg: DictConfig, arch: str = "resnet50") -> dict:
    """``precision`` and ``benchmark`` left at ``auto``, resolved for the hardware found and the network
    ``arch`` trains (src/models/fast_path.py), the accelerator of an srun task that has one GPU of its own, and
    ``devices=-1`` on a CPU (``auto``: the one process); ``sync_batchnorm`` on a CPU is refused.

    On CUDA also cuDNN autotuning (CIFAR's shapes never change) and TF32 matmuls.
    """
    cuda = uses_cuda(trainer_cfg.accelerator)
    resolved = {}
    if trainer_cfg.precision == "auto":
        chosen = (
            fast_path("cuda", arch, tuple(node_gpus(trainer_cfg.accelerator, trainer_cfg.devices)))
            if cuda
            else fast_path(device_type(trainer_cfg.accelerator), arch)
        )
        resolved["precision"] = chosen.precision
    if cuda and one_gpu_per_task(trainer_cfg.accelerator, trainer_cfg.devices):
        resolved["accelerator"] = TaskGPU()  # every local rank on its own task's cuda:0
    if not cuda and trainer_cfg.get("sync_batchnorm"):  # torch's SyncBatchNorm: DDP refused it, a traceback, exit 1
        raise UserError(
            "trainer.sync_batchnorm=true needs CUDA GPUs (torch's SyncBatchNorm runs on them only): on CPUs, "
            "trainer.sync_batchnorm=false"
        )
    if not cuda and trainer_cfg.get("devices") in (-1, "-1"):  # all devices: on a CPU, the one process auto runs
        resolved["devices"] = "auto"  # (Lightning's CPU accelerator refuses -1)
    if trainer_cfg.benchmark == "auto":
        resolved["benchmark"] = cuda and not trainer_cfg.deterministic
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return resolved


def device_type(accelerator: str) -> str:
    """The torch device type a non-CUDA ``trainer.accelerator`` trains on."""
    return "mps" if accelerator == "mps" else "cpu"


def not_mpi_environment() -> ClusterEnvironment:
    """Lightning's own choice of cluster environment, less MPI's: its MPIEnvironment.detect() imports mpi4py's MPI,
    which initialises MPI in every process where mpi4py is installed, mpirun or not."""
    for kind in (TorchElasticEnvironment, LSFEnvironment):  # SLURMEnvironment is build_trainer's
        if kind.detect():
            return kind()
    return LightningEnvironment()


def build_trainer(cfg: DictConfig, arch: str) -> L.Trainer:
    """A Trainer whose strategy, callbacks and loggers come from their config groups; ``arch``: the network it
    trains or tests (what ``trainer.precision=auto`` is measured with on a CPU). Its ``trainer.*`` values were checked
    before any process started (src/core/settings.py's ``check_trainer_settings``); Lightning checks the rest here."""
    route_lightning_logs()
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [instantiate(lg) for lg in (cfg.get("logger") or {}).values() if lg is not None]
    if not loggers:  # logger=none: the rate has nowhere to go, and LearningRateMonitor refuses the fit (before: exit 2)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    choices: dict[str, Any] = {}
    if "enable_checkpointing" not in cfg.trainer and not any(isinstance(c, Checkpoint) for c in callbacks):
        # callbacks=none means no checkpoints: Lightning would add its own ModelCheckpoint, into the logger's folder
        choices["enable_checkpointing"] = False
    if "enable_progress_bar" not in cfg.trainer and not any(isinstance(c, ProgressBar) for c in callbacks):
        # callbacks.progress_bar=null (or callbacks=none) means no bar: Lightning would add its own, which reads every
        # logged value after every step (on a GPU, a wait for the device at each); +trainer.enable_progress_bar=true
        # still asks for that one
        choices["enable_progress_bar"] = False
    plugins = [AtomicCheckpointIO()]
    if ranks_started_here_under_slurm():  # a sweep's jobs in a batch script: local ranks, as on a workstation
        plugins.append(LightningEnvironment())
    elif slurm_detected() and not torchrun.active():  # srun torchrun: torchrun's environment, Lightning's
        # src/callbacks/slurm_requeue.py owns SIGUSR1 instead of Lightning (see there why)
        plugins.append(SLURMEnvironment(auto_requeue=False))
    elif not mpi_launched():
        plugins.append(not_mpi_environment())
    users_cublas = os.environ.get(CUBLAS)
    strategy = instantiate(cfg.strategy)
    if isinstance(strategy, HydraDDPStrategy):  # what every node must train alike, compared as the group forms
        strategy.recipe = training_recipe(cfg)
    trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=plugins,
        **choices,
        **hardware_defaults(cfg.trainer, arch),
    )
    keep_users_cublas_config(users_cublas, cfg.trainer.get("deterministic"))
    return trainer


CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")  # the two torch accepts under deterministic algorithms


def keep_users_cublas_config(before: str | None, deterministic: Any) -> None:
    """Lightning sets CUBLAS_WORKSPACE_CONFIG=:4096:8 under trainer.deterministic whatever the user had set; cuBLAS
    reads it at its first use, later. A user's :16:8 (less GPU memory, deterministic too) is put back; any other
    value of theirs stays replaced, and a warning says so."""
    if not deterministic or before is None or os.environ.get(CUBLAS) == before:
        return
    if before in DETERMINISTIC_CUBLAS:
        os.environ[CUBLAS] = before
    else:
        warning_line(
            log,
            f"{CUBLAS}={before} replaced by {os.environ.get(CUBLAS)}: trainer.deterministic={deterministic} needs "
            f"{' or '.join(DETERMINISTIC_CUBLAS)} (torch refuses other values there)",
            say=is_launch_rank_zero(),  # every rank builds its trainer
        )


def record_config(cfg: DictConfig, trainer: L.Trainer) -> None:
    """Rank zero saves the resolved config beside the outputs, logs it as hyperparameters, and records which
    MLflow / W&B runs that opened (src/tracking/loggers.py)."""
    if not is_launch_rank_zero():
        return
    resolved = OmegaConf.to_container(cfg, resolve=True)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(OmegaConf.to_yaml(resolved))
    for logger in trainer.loggers:
        logger.log_hyperparams(resolved)
    remember_runs(trainer.loggers, cfg.paths.output_dir)


def test_summary(
    metrics: dict[str, float], weights: str, trainer: L.Trainer, datamodule: L.LightningDataModule, data: str = ""
) -> str:
    """The one line a test ends with, from src.train and src.eval alike: what accuracy, which weights, which images
    (of ``data``, or of the ``data=`` option chosen)."""
    test_set = getattr(datamodule, "test_set", None)
    images = "the test set"
    if test_set is not None:
        # trainer.limit_test_batches may have cut the test short: count the images the ranks' batches held
        tested = sum(trainer.num_test_batches) * getattr(datamodule, "batch_size", len(test_set)) * trainer.world_size
        images = f"{min(tested, len(test_set))} test images"
        images += "" if tested >= len(test_set) else f" (of {len(test_set)}: trainer.limit_test_batches)"
    if data:
        images += f" of {data}"
    else:
        try:
            from hydra.core.hydra_config import HydraConfig

            images += f" of data={HydraConfig.get().runtime.choices['data']}"
        except (ValueError, KeyError):  # no Hydra run (a spawned child, a test calling this directly)
            pass
    return f"test accuracy {metrics['test/acc']:.4f} | test loss {metrics['test/loss']:.4f} | {weights} | {images}"


def describe_checkpoint(path: str | Path, checkpoint: dict | None = None) -> str:
    """'DIR/checkpoints/best-epoch001-acc0.7031.ckpt (epoch 1, step 28)'."""
    if checkpoint is None:
        checkpoint = read_checkpoint(path)
    return f"{path} (epoch {checkpoint.get('epoch', '?')}, step {checkpoint.get('global_step', '?')})"
