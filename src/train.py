"""``python -m src.train [overrides]``: compose the config, start the local ranks, build the parts, fit, test.

Every process of a run executes this file (the local ranks of ``strategy=ddp`` re-enter it; srun
starts one per task); Lightning decides which rank does what. Lightning and the model code load
inside ``main``, after this process has started its local ranks, so they load theirs meanwhile.
"""

from __future__ import annotations

import logging
import os

import hydra
from omegaconf import DictConfig

from src.cli.entry import handle_errors, run
from src.core import startup
from src.launch import torchrun
from src.launch.ranks import is_launch_rank_zero, start_local_ranks
from src.resilience import supervision

log = logging.getLogger("src.train")


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
@handle_errors
def main(cfg: DictConfig) -> float | None:
    """Train; return the best validation accuracy (what a sweep's search maximises)."""
    if cfg.get("dry_run"):  # one rank's view of the configured world, on torch's fake process group: nothing trains
        startup.resume()
        from src.distributed.dry_run import run as dry_run

        dry_run(cfg)
        return None
    supervision.track(*start_local_ranks(cfg.strategy, cfg.ckpt_path))  # started now, watched from now on
    import lightning as L
    from hydra.utils import instantiate

    from src.callbacks.trial_pruning import pruned_at
    from src.checkpoints.resume import (
        check_compatible,
        checkpoints_folder,
        resume_from,
        warn_changed_settings,
        warn_global_batch_change,
        warn_moved_checkpoints,
        warn_nothing_to_train,
    )
    from src.core.console import quiet_resume
    from src.launch.run_dir import record_result
    from src.models.batch_size import keep_checkpoint_batch
    from src.sweeps.hparams_search import log_trial
    from src.tracking.loggers import continue_logs
    from src.training.trainer import (
        build_trainer,
        describe_checkpoint,
        record_config,
        route_lightning_logs,
        test_summary,
    )

    startup.resume()  # loaded: the garbage collector on again (src/core/startup.py)
    route_lightning_logs()
    log_trial(cfg)  # in a search, every rank says the values it trains with
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    ckpt_path, checkpoint = resume_from(cfg.ckpt_path, cfg.paths.checkpoints, trusted=cfg.ckpt_trusted)
    finished = False  # the checkpoint has trained all this run asks for (said): nothing of its own to keep
    if checkpoint is not None:  # a wrong file fails here in one line, before the ranks meet
        check_compatible(checkpoint, ckpt_path, model.hparams)
        if cfg.ckpt_path in ("last", "auto") and is_launch_rank_zero():  # the run goes on in its own dir
            warn_changed_settings(cfg)
        if cfg.ckpt_path != "auto":  # auto: a requeue, which may come after the last epoch, during the test
            finished = warn_nothing_to_train(
                checkpoint, ckpt_path, cfg.trainer.max_epochs, cfg.trainer.get("max_steps", -1)
            )
        keep_checkpoint_batch(datamodule, checkpoint)  # data.batch_size=auto resumes with the batch it trained with
    if torchrun.active():  # a restart says where it resumes; at another world size, the global batch stays
        for line in (
            torchrun.restart_line(ckpt_path, checkpoint, cfg.paths.output_dir),
            torchrun.keep_global_batch(
                checkpoint, datamodule, int(os.environ["WORLD_SIZE"]), cfg.trainer.accumulate_grad_batches
            ),
        ):
            if line and is_launch_rank_zero():
                log.info(line)
    continue_logs(cfg, ckpt_path, checkpoint)  # metrics.csv keeps its rows; the MLflow / W&B runs go on
    saved_by = (checkpoint or {}).get("saved_by")
    saved_in = checkpoints_folder(checkpoint) if checkpoint is not None and not finished else None
    del checkpoint  # Lightning loads it again on every rank
    quiet_resume(ckpt_path, getattr(datamodule, "pipeline", None) == "device")
    trainer = build_trainer(cfg, model.hparams.arch)
    warn_moved_checkpoints(saved_in, ckpt_path, getattr(trainer.checkpoint_callback, "dirpath", None))
    if saved_by and not torchrun.active():  # a resume at another world size: the global batch it trains, if changed
        batch = getattr(datamodule, "batch_size", None)
        warn_global_batch_change(saved_by, trainer.world_size, batch, trainer.accumulate_grad_batches)
    # every rank, before the ranks meet: a missing dataset is downloaded once while the others wait, however long it
    # takes (the rendezvous would time out); missing or bad data fails here
    datamodule.prepare_data()
    record_config(cfg, trainer)  # once the data is there: a refused resume leaves the run's record as it was
    if hasattr(datamodule, "test_after_fit"):  # a test shard that cannot work fails before training, not after
        datamodule.test_after_fit = bool(cfg.test)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=not cfg.ckpt_trusted)
    best = getattr(trainer.checkpoint_callback, "best_model_path", None) or None
    pruned, metrics = pruned_at(trainer), None
    if cfg.test and pruned is None:  # the best epoch's weights, or the last ones when no best checkpoint is kept
        metrics = trainer.test(model, datamodule=datamodule, ckpt_path=best, weights_only=True, verbose=False)[0]
        if trainer.is_global_zero:
            weights = describe_checkpoint(best) if best else "the final weights (no best checkpoint kept)"
            log.info(test_summary(metrics, weights, trainer, datamodule))
    score = getattr(trainer.checkpoint_callback, "best_model_score", None)
    score = None if score is None else float(score)
    if trainer.is_global_zero:  # the run ended well: a sweep run again skips it
        record_result(
            cfg.paths.output_dir,
            score=score,
            monitor="val/acc",
            best_checkpoint=best,
            pruned_at_epoch=pruned,
            test=metrics,
        )
    return score


if __name__ == "__main__":
    run(main)  # Hydra's own rejections (unknown option, misspelled key) in one line too
