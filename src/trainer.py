"""Builds the Lightning Trainer from the config groups: strategy, callbacks, logger, trainer."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src.distributed import is_launch_rank_zero


class _NoAdvertising(logging.Filter):
    """Lightning prints a cloud-product tip at every start; a training log is no place for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoAdvertising())


def build_trainer(cfg: DictConfig) -> L.Trainer:
    """A Trainer whose strategy, callbacks and loggers come from their config groups."""
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    loggers = [instantiate(lg) for lg in (cfg.get("logger") or {}).values() if lg is not None]
    return instantiate(cfg.trainer, strategy=instantiate(cfg.strategy), callbacks=callbacks,
                       logger=loggers or False)


def resume_path(ckpt_path: str | None, run_dir: str) -> str | None:
    """``ckpt_path`` as Lightning takes it; ``auto`` means the newest checkpoint in this run dir, if any.

    After a requeue that is Lightning's ``hpc_ckpt_N.ckpt`` (saved on SIGUSR1) or ``checkpoints/last.ckpt``
    (saved at the last epoch end, e.g. before a preemption without warning).
    """
    if ckpt_path != "auto":
        return ckpt_path
    run = Path(run_dir)
    found = [*run.glob("hpc_ckpt_*.ckpt"), *run.glob("checkpoints/last.ckpt")]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def record_config(cfg: DictConfig, trainer: L.Trainer) -> None:
    """Rank zero saves the resolved config beside the outputs and logs it as hyperparameters."""
    if not is_launch_rank_zero():
        return
    resolved = OmegaConf.to_container(cfg, resolve=True)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    for logger in trainer.loggers:
        logger.log_hyperparams(resolved)
