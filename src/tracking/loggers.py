"""The loggers ``logger=`` picks beyond TensorBoard and CSV: Lightning's own MLflow and W&B loggers, resumable.

Lightning's loggers already log from rank zero only and create their run lazily there. What they lack here:

- Lightning's CSV writer deletes the metrics.csv it finds, so a resumed run lost every row before it. Here the
  rows before the step it resumes from stay;

- a resumed run (``ckpt_path``, a Slurm requeue, a torchrun restart) would open a new MLflow or W&B run, so one
  training is split over several. Rank zero records the runs it opened in ``DIR/loggers.json``; a run that
  resumes from a checkpoint continues the runs recorded beside that checkpoint's folder, and one that resumes
  its own run dir (``ckpt_path=auto``/``last``) those of its run dir, even before its first checkpoint;
- MLflow refuses a param logged again with another value, and a resumed config differs (``ckpt_path``, a longer
  ``trainer.max_epochs``): a continued run keeps the params it began with;
- W&B needs an account: the run is offline unless an API key is configured.

Their packages are optional extras: choosing a logger whose package is missing is one ``error:`` line
(src/cli/entry.py, before any other process starts).
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.loggers import CSVLogger as _CSVLogger
from lightning.pytorch.loggers import MLFlowLogger as _MLFlowLogger
from lightning.pytorch.loggers import WandbLogger as _WandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, open_dict

from src.launch.run_dir import locked, read_json, write_json
from src.tracking.servers import wandb_offline

log = logging.getLogger(__name__)

RUNS_FILE = "loggers.json"
CONTINUED = ("mlflow", "wandb")  # the conf/logger/ nodes whose runs a resumed run continues


def _run_name(run_dir: str | os.PathLike) -> str:
    """What the MLflow and W&B runs are called: the run dir, relative to where the command ran if it is below it."""
    path = Path(run_dir).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def continue_logs(cfg: DictConfig, ckpt_path: str | None, checkpoint: dict[str, Any] | None) -> None:
    """A run that resumes logs on where it left off: metrics.csv keeps its rows before the step it resumes from,
    and the MLflow and W&B loggers continue the runs it began (see the module docstring).

    A ``run_id``/``id`` given in the config wins; a run recorded under another tracking store or project is not
    continued.
    """
    loggers = cfg.get("logger") or {}
    if "csv" in loggers and checkpoint is not None:
        with open_dict(cfg):
            loggers.csv.resume_step = int(checkpoint.get("global_step", 0))
    if not any(name in loggers for name in CONTINUED):
        return
    candidates = []
    if ckpt_path:
        candidates.append(Path(ckpt_path).resolve().parent.parent / RUNS_FILE)
    if cfg.get("ckpt_path") in ("auto", "last"):
        candidates.append(Path(cfg.paths.output_dir) / RUNS_FILE)
    known = next((read_json(path) or {} for path in candidates if path.is_file()), {})
    mlflow, wandb = known.get("mlflow") or {}, known.get("wandb") or {}
    with open_dict(cfg):
        if (
            "mlflow" in loggers
            and not loggers.mlflow.get("run_id")
            and mlflow.get("run_id")
            and mlflow.get("tracking_uri") == loggers.mlflow.get("tracking_uri")
        ):
            loggers.mlflow.run_id = mlflow["run_id"]
        if (
            "wandb" in loggers
            and not loggers.wandb.get("id")
            and wandb.get("id")
            and wandb.get("project") == loggers.wandb.get("project")
        ):
            loggers.wandb.id = wandb["id"]


def remember_runs(loggers: list[Any], run_dir: str) -> None:
    """Record in ``DIR/loggers.json`` the MLflow and W&B runs this run logs to (the run dir's owner, once the
    config has been logged: the runs exist then)."""
    known: dict[str, Any] = {}
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            known["mlflow"] = {
                "run_id": logger.run_id,
                "tracking_uri": logger._tracking_uri,
                "experiment_id": logger.experiment_id,
            }
        elif isinstance(logger, WandbLogger):
            known["wandb"] = {
                "id": logger.experiment.id,
                "project": logger._project,
                "mode": "offline" if logger._offline else "online",
            }
    if known:
        write_json(Path(run_dir) / RUNS_FILE, known)


class CSVLogger(_CSVLogger):
    """Lightning's CSV logger, for runs that resume in their run dir: Lightning's writer deletes the metrics.csv it
    finds; here the rows logged before the step the run resumes from (``resume_step``) stay, and the resumed run's
    rows follow them."""

    def __init__(self, save_dir: str, resume_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(save_dir, **kwargs)
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is not None:
            return self._experiment
        path = Path(self.log_dir) / "metrics.csv"
        earlier = _rows_before(path, self.resume_step) if self.resume_step is not None else []
        with warnings.catch_warnings():  # "... will be deleted": the earlier rows are written back below
            warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
            writer = _CSVLogger.experiment.fget(self)
        if earlier:
            keys = sorted(set().union(*earlier))
            with open(path, "w", newline="") as f:
                rows = csv.DictWriter(f, fieldnames=keys)
                rows.writeheader()
                rows.writerows(earlier)
            writer.metrics_keys = keys
        return writer


def _rows_before(path: Path, step: int) -> list[dict[str, str]]:
    """The rows of a metrics.csv logged before ``step`` (those from ``step`` on, the resumed run logs again)."""
    try:
        with open(path, newline="") as f:
            return [row for row in csv.DictReader(f) if row.get("step") and float(row["step"]) < step]
    except (OSError, ValueError):
        return []


class MLFlowLogger(_MLFlowLogger):
    """Lightning's MLflow logger, its run named after the run dir; a continued run (``run_id``) is marked running
    again and keeps the params it began with."""

    def __init__(self, run_dir: str, run_name: str | None = None, **kwargs: Any) -> None:
        importlib.import_module("mlflow")  # it configures its loggers when first imported: quieten them after that

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial MLflow tables"
        with _sqlite_store_lock(kwargs.get("tracking_uri")):  # Lightning opens the store in every process
            super().__init__(run_name=run_name or _run_name(run_dir), **kwargs)
        self._first_params: dict[str, str] | None = None  # a continued run's params, as it began

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if not self._initialized:
            if self._run_id is not None:
                self._reopen()
            if self._run_id is None and self._experiment_id is None:  # Lightning would warn that it creates it
                found = self._mlflow_client.get_experiment_by_name(self._experiment_name)
                if found is None or found.lifecycle_stage == "deleted":
                    self._experiment_id = self._mlflow_client.create_experiment(
                        self._experiment_name, artifact_location=self._artifact_location
                    )
                    log.info("MLflow experiment %s created at %s", self._experiment_name, self._tracking_uri)
                else:
                    self._experiment_id = found.experiment_id
        return _MLFlowLogger.experiment.fget(self)

    def _reopen(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            run = self._mlflow_client.get_run(self._run_id)
        except MlflowException as err:  # deleted, or a store that never had it
            log.warning(
                "cannot continue MLflow run %s at %s (%s): starting a new run",
                self._run_id,
                self._tracking_uri,
                str(err).splitlines()[0],
            )
            self._run_id = None
            return
        self._first_params = dict(run.data.params)
        self._mlflow_client.update_run(self._run_id, status="RUNNING")
        log.info("continuing MLflow run %s (%s) at %s", self._run_id, run.info.run_name, self._tracking_uri)

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        _ = self.experiment
        if self._first_params is not None:  # MLflow refuses a param logged again with another value
            flat = _flatten_dict(_convert_params(params))
            changed = sorted(
                k for k, v in flat.items() if k in self._first_params and self._first_params[k] != str(v)[:250]
            )
            if changed:
                log.debug("the continued MLflow run keeps the params it began with: %s", ", ".join(changed))
            params = {k: v for k, v in flat.items() if k not in self._first_params}
        super().log_hyperparams(params)


def _sqlite_store_lock(tracking_uri: str | None) -> contextlib.AbstractContextManager:
    """Holds ``DB.lock`` beside an MLflow SQLite store while this process opens it.

    Opening the store creates or upgrades its tables; two processes doing that at once (the ranks of a run, two
    runs started together) collide: ``table _alembic_tmp_experiments already exists``. A server URI needs none.
    """
    database = None
    if (tracking_uri or "").startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        database = make_url(tracking_uri).database
    if not database or database == ":memory:":
        return contextlib.nullcontext()
    path = Path(database)
    return locked(path.with_name(path.name + ".lock"))


class WandbLogger(_WandbLogger):
    """Lightning's W&B logger, its run named after the run dir, offline unless an API key is configured."""

    def __init__(self, save_dir: str, offline: bool | str = "auto", name: str | None = None, **kwargs: Any) -> None:
        super().__init__(name=name or _run_name(save_dir), save_dir=save_dir, offline=wandb_offline(offline), **kwargs)
        self._wandb_init.pop("anonymous", None)  # Lightning passes None, which W&B warns is a setting without effect
