"""``hparams_search=optuna``: an Optuna study in which every trial is a whole training run, all its processes.

    python -m src.train -m hparams_search=optuna hydra.sweeper.n_trials=20 strategy=ddp trainer.devices=2

The sweep's process asks Optuna for a trial's values and runs the trial as a job of the sweep (``SWEEP_DIR/<trial>/``),
exactly as ``-m`` runs a grid's jobs: the values are overrides of the job, so the local ranks it starts
(src/launch/ranks.py) are given the same ones. In the Lightning + Hydra template every DDP rank re-runs the sweeper and
samples values of its own (its issue #639). The study lives in ``SWEEP_DIR/optuna.db``: the same command again continues
it. A trial the sweep was running when it was killed is run again with its own values and resumes from its
``last.ckpt``; one that had finished is told from its ``result.json``; the study ends with ``n_trials`` trials, not one
more. Each trial's validation accuracy goes to the study at every epoch's end, and the pruner stops a bad trial there
(src/callbacks/trial_pruning.py). When the search ends, ``best.yaml`` and ``trials.md`` / ``trials.csv`` hold the best
values and every trial.

hydra-optuna-sweeper (1.3.0) is not used: it requires optuna < 3, and optuna 2.10 cannot create an SQLite study
with the SQLAlchemy 2 that pip installs beside this project's other packages (docs/search.md).
Optuna's own ask-and-tell API does the work here. Optuna is imported only when a search runs: it is an extra.
Hydra imports this module at every start (hydra_plugins/cifar10_ddp), before a run's local ranks start: it loads
neither torch nor Lightning.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from src.core.errors import FAILURE_FILE, UserError, check_number, print_line, require, whole
from src.launch.ranks import is_launch_rank_zero
from src.launch.run_dir import RESULT_FILE, read_result
from src.sweeps.sweep import check_job, job_config, runs_here
from src.sweeps.sweep import job_dir as sweep_job_dir

log = logging.getLogger(__name__)

STUDY_FILE = "optuna.db"


def log_trial(cfg: DictConfig) -> None:
    """In a search, every rank of a trial says in its own log which values it trains with."""
    search = cfg.get("search")
    if search is None or search.get("trial") is None:
        return
    values = " ".join(f"{key}={OmegaConf.select(cfg, key)}" for key in search.params)
    log.info("trial %s of study %s: this process trains with %s", search.trial, search.study_name, values)


class OptunaSweeper(Sweeper):
    """Runs ``n_trials`` trials of an Optuna study as jobs of this sweep (see the module docstring)."""

    def __init__(
        self,
        n_trials: int,
        direction: str = "maximize",
        study_name: str = "cifar10-ddp",
        storage: str | None = None,
        sampler: Any = None,
        pruner: Any = None,
        params: dict[str, str] | None = None,
    ) -> None:
        self.n_trials, self.direction, self.study_name, self.storage = n_trials, direction, study_name, storage
        self.sampler, self.pruner, self.params = sampler, pruner, dict(params or {})
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> list[Sequence[JobReturn]]:
        if self.config is not None and "search" not in self.config:  # before: "search.storage is not a key"
            raise UserError(
                "hydra/sweeper=optuna is the search's sweeper, picked with its search space by hparams_search=optuna: "
                "pass hparams_search=optuna instead (python -m src.train -m hparams_search=optuna ...)"
            )
        require("optuna", "optuna", "hparams_search=optuna")
        import optuna

        check_one_sweeping_process(self.config)
        check_number("hydra.sweeper.n_trials", self.n_trials, whole(1), "a whole number >= 1")
        if self.direction not in ("maximize", "minimize"):  # optuna's ValueError, a traceback, before
            raise UserError(
                f"hydra.sweeper.direction={self.direction} must be maximize (the trials' best val/acc, the default) "
                "or minimize"
            )
        space, fixed = search_space(self.params, arguments)
        sweep_dir = Path(self.config.hydra.sweep.dir).resolve()
        storage = self.storage or f"sqlite:///{sweep_dir / STUDY_FILE}"
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the trials' own lines say what happens
        sampler, pruner = self._built("sampler"), self._built("pruner")
        job = [
            *fixed,
            f"search.storage='{storage}'",
            f"search.study_name='{self.study_name}'",
            f"search.params=[{','.join(space)}]",
        ]
        self._check_trials(space, job)
        try:
            study = optuna.create_study(
                study_name=self.study_name,
                storage=storage,
                direction=self.direction,
                sampler=sampler,
                pruner=pruner,
                load_if_exists=True,
            )
        except Exception as err:  # noqa: BLE001 - SQLAlchemy's and optuna's errors for a storage they cannot open
            raise UserError(
                f"hydra.sweeper.storage={storage} cannot be opened ({type(err).__name__}: {_first_line(err)}): pass "
                "a database URL optuna can open (sqlite:///PATH in a folder you can write), or null for the sweep "
                "dir's optuna.db"
            ) from err
        check_same_search(study, fixed, sweep_dir)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        earlier = len(study.trials)
        if earlier:
            log.info(
                "Study %s in %s: %d trial(s) from an earlier run of this sweep; %d in all",
                self.study_name,
                storage,
                earlier,
                self.n_trials,
            )
        returns = []
        # a trial that an earlier run of this sweep left running was cut short: finish it with its own values
        for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            returns.append(self._run(study, trial.number, trial.params, job))
        while len(study.trials) < self.n_trials:
            trial = study.ask(space)
            returns.append(self._run(study, trial.number, trial.params, job))
        write_study_report(study, sweep_dir, space)
        return [returns]

    def _built(self, what: str) -> Any:
        """The study's ``sampler`` or ``pruner`` from its config node (None: optuna's default), or one line naming
        ``hydra.sweeper.<what>`` (before: the node's name alone, as Hydra's instantiate knows it)."""
        from hydra.utils import instantiate

        node = getattr(self, what)
        if not node:
            return None
        try:
            return instantiate(node)
        except Exception as err:  # noqa: BLE001 - what the target refused, or a target that is not there
            words = _first_line(err if "Error locating target" in str(err) else err.__cause__ or err)
            raise UserError(
                f"hydra.sweeper.{what}: {words.split(', set env var HYDRA_FULL_ERROR')[0].rstrip('.')}: change "
                f"hydra.sweeper.{what}.* (its _target_: one of optuna.{what}s)"
            ) from err

    def _check_trials(self, space: dict[str, Any], job: list[str]) -> None:
        """What each trial checks as it starts, before the study is made or any trial starts: the fixed overrides,
        and each searched key at both ends of its range and at every choice (a trial's values lie between them).
        Before, ``trainer.max_epochs=0`` or a choice no model takes failed every trial the search ran, each one
        recorded in the study as failed. The ends are zipped into jobs (as many as the most choices of a key)."""
        ends = {key: trial_ends(d) for key, d in space.items()}
        here = runs_here(self.launcher)
        for i in range(max(len(values) for values in ends.values())):
            tried = {key: values[i] if i < len(values) else values[0] for key, values in ends.items()}
            overrides = [*(f"{key}={_override_value(v)}" for key, v in tried.items()), *job, "search.trial=0"]
            try:
                check_job(job_config(self.hydra_context, self.config, 0, overrides), here)
            except UserError as err:
                said = str(err)
                for key, value in tried.items():
                    if said.startswith(f"{key}={_override_value(value)}"):
                        what = "choices" if is_choice(space[key]) else "range"
                        said += f" (a value the search may try: narrow {key}'s {what})"
                        break
                raise UserError(f"{said}; no trial of the search started") from None

    def _run(self, study: Any, number: int, params: dict[str, Any], job: list[str]) -> JobReturn:
        """Run trial ``number`` as job ``number`` of the sweep (or take its result, if it finished), and tell the
        study how it ended."""
        import optuna

        overrides = [*(f"{key}={_override_value(v)}" for key, v in params.items()), *job, f"search.trial={number}"]
        job_dir = sweep_job_dir(job_config(self.hydra_context, self.config, number, overrides))
        result = read_result(job_dir)
        if result is None:
            (job_dir / FAILURE_FILE).unlink(missing_ok=True)  # an earlier attempt's: this one decides anew
            ret = self.launcher.launch([overrides], initial_job_idx=number)[0]
            result = read_result(job_dir)
        else:
            log.info(
                "\t#%d : finished in an earlier run of this sweep (%s): told from its result",
                number,
                job_dir / RESULT_FILE,
            )
            ret = JobReturn(
                overrides=overrides,
                working_dir=str(job_dir),
                status=JobStatus.COMPLETED,
                _return_value=result.get("score"),
            )
        if result is not None and result.get("pruned_at_epoch") is not None:
            study.tell(number, state=optuna.trial.TrialState.PRUNED)
        elif result is not None and result.get("score") is not None:
            study.tell(number, float(result["score"]))
        else:  # it failed: its failure.json and the sweep's console say why
            study.tell(number, state=optuna.trial.TrialState.FAIL)
        return ret


def check_same_search(study: Any, fixed: list[str], sweep_dir: Path) -> None:
    """A study run again must be the same search: the trials of another command's search (other epochs, another
    network) would be compared with this one's as if they were alike."""
    before = study.user_attrs.get("fixed_overrides")
    if before is None:
        study.set_user_attr("fixed_overrides", fixed)
    elif sorted(before) != sorted(fixed):  # each key once (search_space): the order does not matter
        was = " ".join(o for o in before if o not in fixed) or "(no other overrides)"
        now = " ".join(o for o in fixed if o not in before) or "(no other overrides)"
        raise UserError(
            f"hydra.sweep.dir={sweep_dir} holds the study of another search: its trials ran with {was} "
            f"where this search has {now}; pass a new hydra.sweep.dir to start another search, or the same "
            "overrides to go on with that one"
        )


def check_one_sweeping_process(config: DictConfig) -> None:
    """The search runs in one process, which starts each trial's ranks: under srun or torchrun every task would
    run a search of its own, and on several nodes every node would."""
    import os

    from src.launch import torchrun

    srun = "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1
    if srun or torchrun.active() or not is_launch_rank_zero() or config.trainer.get("num_nodes", 1) != 1:
        raise UserError(
            "hparams_search=optuna runs its trials from one process, which starts each trial's ranks: "
            "start it once, without srun or torchrun, on one node (trainer.num_nodes=1)"
        )


def search_space(params: dict[str, str], arguments: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Optuna distributions from ``hydra.sweeper.params`` and the sweep overrides of the command line (which win),
    and the command line's fixed overrides."""
    parser = OverridesParser.create()
    swept: dict[str, Override] = {
        o.get_key_element(): o for o in parser.parse_overrides([f"{k}={v}" for k, v in params.items()])
    }
    fixed: dict[str, str] = {}  # a key given twice: its last value holds, as in any Hydra command line
    for override in parser.parse_overrides(arguments):
        key = override.get_key_element()
        if override.is_sweep_override():
            swept[key] = override
            fixed.pop(key, None)
        else:
            swept.pop(key, None)
            fixed[key] = override.input_line
    if not swept:
        raise UserError(
            "hparams_search=optuna has nothing to search: give hydra.sweeper.params, or sweep a key on the "
            "command line (model.optimizer.lr='interval(0.01,0.5)', data.batch_size=64,128)"
        )
    return {key: distribution(override) for key, override in swept.items()}, list(fixed.values())


def distribution(override: Override) -> Any:
    """One key's Optuna distribution: interval(a,b) (``tag(log, interval(a,b))`` on a log scale, ``tag(int, ...)``
    whole numbers), choice(a,b,...) or a,b,c, range(start,stop,step)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value, key = override.value(), override.get_key_element()
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if isinstance(value, RangeSweep):
        numbers = list(override.sweep_iterator())
        if all(isinstance(n, int) for n in numbers) and len(numbers) > 1:
            return IntDistribution(numbers[0], numbers[-1], step=numbers[1] - numbers[0])
        return CategoricalDistribution(numbers)
    if isinstance(value, ChoiceSweep):
        return CategoricalDistribution(list(override.sweep_iterator()))
    raise UserError(
        f"{key}: cannot search {override.input_line}: use interval(a,b), choice(a,b,...) or range(a,b,step)"
    )


def is_choice(dist: Any) -> bool:
    from optuna.distributions import CategoricalDistribution

    return isinstance(dist, CategoricalDistribution)


def trial_ends(dist: Any) -> list[Any]:
    """The values of a key's distribution that bound what a trial may take: every choice, or a range's two ends."""
    if is_choice(dist):
        return list(dist.choices)
    return [dist.low] if dist.low == dist.high else [dist.low, dist.high]


def _override_value(value: Any) -> str:
    """A sampled value as an override's value (floats in full, so every rank parses the very same number)."""
    return repr(value) if isinstance(value, float) else str(value)


def write_study_report(study: Any, sweep_dir: Path, space: dict[str, Any]) -> None:
    """best.yaml (the best trial's values, as overrides too) and trials.md / trials.csv (every trial) in the sweep
    dir, the best in one line on the console; exit 1, as a grid sweep does, if a trial failed."""
    import optuna

    rows = []
    for trial in study.get_trials(deepcopy=False):
        rows.append(
            {
                "trial": trial.number,
                "state": trial.state.name.lower(),
                "val/acc": "" if trial.value is None else f"{trial.value:.4f}",
                "epochs": len(trial.intermediate_values),
                **{key: trial.params.get(key, "") for key in space},
            }
        )
    with open(sweep_dir / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Study {study.study_name}: {len(rows)} trials ({sweep_dir / STUDY_FILE})",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|---:|---|" + "---:|" * (len(rows[0]) - 2),
    ]
    lines += [
        "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()) + " |" for row in rows
    ]
    if study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        best = study.best_trial
        overrides = [f"{k}={_override_value(v)}" for k, v in best.params.items()]
        (sweep_dir / "best.yaml").write_text(
            OmegaConf.to_yaml(
                {
                    "trial": best.number,
                    "value": best.value,
                    "direction": study.direction.name.lower(),
                    "params": dict(best.params),
                    "overrides": overrides,
                    "run_dir": str(sweep_dir / str(best.number)),
                }
            )
        )
        lines += ["", f"Best: trial {best.number}, val/acc {best.value:.4f}: `{' '.join(overrides)}`"]
        log.info(
            "Best of %d trials: trial %d, val/acc %.4f: %s (%s, %s)",
            len(rows),
            best.number,
            best.value,
            " ".join(overrides),
            sweep_dir / "best.yaml",
            sweep_dir / "trials.md",
        )
    else:
        log.warning("no trial of study %s completed (%s): no best values", study.study_name, sweep_dir / "trials.md")
    (sweep_dir / "trials.md").write_text("\n".join(lines) + "\n")
    failed = [t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))]
    if failed:
        errors = [f"trial {n}: {_failure(sweep_dir / str(n))}" for n in failed]
        print_line(f"error: {len(failed)} of {len(rows)} trials failed: " + "; ".join(errors))
        sys.exit(1)


def _failure(job_dir: Path) -> str:
    try:
        return json.loads((job_dir / FAILURE_FILE).read_text())["error"]
    except (OSError, ValueError, KeyError):
        return f"no result.json: see {job_dir}"


def _first_line(err: BaseException) -> str:
    return str(err).strip().split("\n", 1)[0]
