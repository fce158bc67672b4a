"""Reports a trial's validation accuracy to its Optuna study at every epoch; stops the run when the pruner says so."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L

log = logging.getLogger(__name__)


def pruned_at(trainer: L.Trainer) -> int | None:
    """The epoch at which the study's pruner stopped this run, or None."""
    return next((c.pruned_at for c in trainer.callbacks if isinstance(c, TrialPruning)), None)


class TrialPruning(L.Callback):
    """Reports ``monitor`` (val/acc) to the trial at every validation's end; stops the run when the pruner says so.

    Rank zero asks the study; every rank stops at the same epoch's end through Lightning's own broadcast, and the
    run ends as any run does (its last.ckpt written, its loggers closed): the sweeper then tells the study that the
    trial was pruned. (optuna-integration's callback raises TrialPruned from inside ``fit`` on one process, so the
    run ends as failed, and it needs a Trial object on every rank.)
    """

    def __init__(
        self,
        storage: str | None,
        study_name: str | None,
        trial: int | None,
        pruner: Any = None,
        monitor: str = "val/acc",
    ) -> None:
        self.storage, self.study_name, self.trial, self.monitor = storage, study_name, trial, monitor
        self.pruner = pruner  # an optuna pruner: a study loaded from storage would otherwise get the default one
        self.pruned_at: int | None = None
        self._trial: Any = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.trial is None or trainer.state.fn != "fit":
            return
        prune = False
        if trainer.is_global_zero:
            value = trainer.callback_metrics.get(self.monitor)
            if value is not None:
                trial = self._study_trial()
                with warnings.catch_warnings():  # a resumed trial reports its last epoch again: Optuna keeps the first
                    warnings.simplefilter("ignore")
                    trial.report(float(value), step=trainer.current_epoch)
                prune = trial.should_prune()
        if trainer.strategy.broadcast(prune):
            trainer.should_stop = True
            self.pruned_at = trainer.current_epoch
            if trainer.is_global_zero:
                log.info(
                    "trial %s pruned after epoch %d (%s %.4f): the study's pruner stopped it",
                    self.trial,
                    trainer.current_epoch,
                    self.monitor,
                    float(trainer.callback_metrics[self.monitor]),
                )

    def _study_trial(self) -> Any:
        if self._trial is None:
            import optuna

            study = optuna.load_study(study_name=self.study_name, storage=self.storage, pruner=self.pruner)
            trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, self.trial)
            self._trial = optuna.trial.Trial(study, trial_id)
        return self._trial
