"""Multirun sweeps that are safe for DDP, resume where they stopped, and write the scaling report when they end.

Hydra's basic launcher runs a sweep's jobs one after another in one process. Lightning's DDP leaves
that process with an initialised process group, MASTER_PORT / LOCAL_RANK / WORLD_SIZE / NODE_RANK and
the global seed in its environment, and local-rank children that may still be exiting; the next job
then silently reuses them (Lightning #11300). ``JobIsolation`` gives every job a clean slate.

Hydra cannot resume a sweep: the same command runs every job again (the Lightning + Hydra template lists it as a
reason not to use it). ``ResumingSweeper`` is Hydra's basic sweeper (grids, ranges, batches) that, run again with
the same ``hydra.sweep.dir``, skips the jobs that finished (their ``result.json``), runs the others, and a job
that was cut short resumes from its own ``last.ckpt`` (a sweep's job defaults to ``ckpt_path=auto``,
src/launch/run_dir.py).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml
from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from src.core.errors import FAILURE_FILE, UserError, not_swallowed, print_line, user_error_in
from src.core.settings import check_checkpoint_folder, check_no_empty_paths, check_values, hydra_config_of
from src.launch.ranks import check_strategy_of, check_sweep_job_nodes, in_sweep
from src.launch.run_dir import RESULT_FILE, read_result
from src.resilience import supervision

log = logging.getLogger(__name__)

CHILD_EXIT_GRACE_S = 120  # local ranks finish their own teardown (test, last logs) after rank zero returns


class JobIsolation(Callback):
    """In a sweep: snapshot the environment when a job starts; when it ends, reap its ranks, drop its process
    group, restore the environment. A single run has nothing to isolate (and no job number)."""

    def __init__(self) -> None:
        self._environ: dict[str, str] | None = None

    @not_swallowed
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # cuBLAS reads its workspace setting once per process, at its first use: Lightning sets the one
        # trainer.deterministic needs as each job's Trainer is built, too late where an earlier job of this process
        # has used cuBLAS without it
        swept = any(o.split("=", 1)[0].lstrip("+") == "trainer.deterministic" for o in config.hydra.overrides.task)
        if swept or OmegaConf.select(config, "trainer.deterministic", default=False):
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    @not_swallowed
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if in_sweep():
            self._environ = dict(os.environ)

    @not_swallowed
    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not in_sweep():
            return
        failed = (Path(config.hydra.runtime.output_dir) / FAILURE_FILE).exists()
        supervision.stop_watching_failures(wait=not failed)
        failure = supervision.reap_started(grace_s=0 if failed else CHILD_EXIT_GRACE_S)
        if failure is not None and not supervision.said_why(failure[1]):
            log.warning("job %s: %s", config.hydra.job.num, failure[0])
        import torch  # loaded by the job already; this module is imported at Hydra's start (hydra_plugins/)

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # Lightning's trainer, module, strategy and callbacks refer to each other, and a failed job's traceback to
        # all of them: only a collection frees the job's model, and the caching allocator then its GPU memory
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if self._environ is not None:
            os.environ.clear()
            os.environ.update(self._environ)


class ScalingReport(Callback):
    """When a sweep ends, write scaling.csv/.md/.png into its dir; exit non-zero if any job failed. (A search,
    hparams_search=..., writes its own report: src/sweeps/hparams_search.py.)"""

    @not_swallowed
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from src.sweeps.report import load_jobs, write_report_or_end

        if config.hydra.runtime.choices.get("hparams_search"):
            return

        sweep_dir = Path(config.hydra.sweep.dir)
        if config.hydra.job.name == "train":
            jobs = write_report_or_end(sweep_dir)
            failed = [j for j in jobs if j.record is None]
            log.info("Scaling report: %s (%d jobs, %d failed)", sweep_dir / "scaling.md", len(jobs), len(failed))
        else:  # eval, export, predict: nothing to scale (no throughput.json); a failed job left its failure record
            jobs = load_jobs(sweep_dir)
            failed = [j for j in jobs if (sweep_dir / str(j.num) / FAILURE_FILE).is_file()]
        if failed:
            print_line(
                f"error: {len(failed)} of {len(jobs)} jobs failed: "
                + "; ".join(f"job {j.num}: {j.error}" for j in failed)
            )
            sys.exit(1)


class ResumingSweeper(BasicSweeper):
    """Hydra's basic sweeper, resumable: run again with the same ``hydra.sweep.dir``, a job that finished is not
    run again, and the others run (one cut short resumes from its own ``last.ckpt``)."""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.launcher = _SkipFinished(self.launcher, hydra_context, config)

    def sweep(self, arguments: list[str]) -> Any:
        check_grid(arguments)
        check_grid(self._parse_config(), "hydra.sweeper.params's ")
        return super().sweep(arguments)


def check_grid(overrides: list[str], where: str = "") -> None:
    """A grid sweep runs listed values; ``interval(...)`` is a range a search draws from. Before, Hydra's
    ``BasicSweeper does not support sweep type : INTERVAL_SWEEP`` traceback, exit 1, and the sweep dir left behind."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for text in overrides:
        override = parser.parse_override(text)
        if override.is_sweep_override() and not override.is_discrete_sweep():
            key = override.get_key_element()
            search = (
                "search it with hparams_search=optuna"
                if not where
                else "hparams_search=optuna searches its own params with its own sweeper: leave out hydra/sweeper"
            )
            raise UserError(
                f"{where}{text} is a range for a search to draw from, which a grid sweep cannot run: list the "
                f"values to run ({key}=A,B or {key}='range(START,STOP,STEP)'), or {search}"
            )


class _SkipFinished:
    """A sweep's launcher, minus the jobs that finished in an earlier run of the sweep dir; any launcher plugin."""

    def __init__(self, launcher: Any, hydra_context: HydraContext, config: DictConfig) -> None:
        self.launcher, self.hydra_context, self.config = launcher, hydra_context, config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.launcher, name)

    def launch(self, job_overrides: list[list[str]], initial_job_idx: int) -> list[JobReturn]:
        returns: list[JobReturn] = []
        pending: list[tuple[int, list[str]]] = []  # consecutive jobs to run: one launch keeps their numbers

        def run_pending() -> None:
            if pending:
                returns.extend(self.launcher.launch([o for _, o in pending], initial_job_idx=pending[0][0]))
                pending.clear()

        jobs = []
        here = runs_here(self.launcher)
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):  # before any job runs
            config = job_config(self.hydra_context, self.config, num, list(overrides))
            check_job_values(config, num, distinct(overrides, job_overrides), here)
            jobs.append((num, list(overrides), job_dir(config)))
        for num, overrides, folder in jobs:
            check_same_job(folder, num, overrides)
        for num, overrides, folder in jobs:
            result = read_result(folder)
            if result is None:
                (folder / FAILURE_FILE).unlink(missing_ok=True)  # an earlier attempt's: this one decides anew
                if (folder / "checkpoints" / "last.ckpt").exists():
                    log.info("\t#%d : resumes from %s", num, folder / "checkpoints" / "last.ckpt")
                pending.append((num, overrides))
                continue
            run_pending()
            log.info(
                "\t#%d : %s : finished in an earlier run of this sweep (%s): not run again",
                num,
                " ".join(overrides),
                folder / RESULT_FILE,
            )
            returns.append(
                JobReturn(
                    overrides=overrides,
                    working_dir=str(folder),
                    status=JobStatus.COMPLETED,
                    _return_value=result.get("score"),
                )
            )
        run_pending()
        return returns


def distinct(job: Sequence[str], jobs: Sequence[Sequence[str]]) -> list[str]:
    """The overrides of ``job`` that not every one of ``jobs`` has (all of its own where it has no other), which
    name the job in a line."""
    common = set.intersection(*(set(other) for other in jobs)) if jobs else set()
    return [o for o in job if o not in common] or list(job)


def runs_here(launcher: Any) -> bool:
    """Whether ``launcher`` runs a sweep's jobs in this process, on this machine (Hydra's basic launcher), so that this
    machine's folders and cores are the jobs' own."""
    return isinstance(launcher, BasicLauncher)


def job_config(hydra_context: HydraContext, config: DictConfig, num: int, overrides: list[str]) -> DictConfig:
    """Job ``num``'s config, composed as Hydra's launcher composes it."""
    job = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(job):
        job.hydra.job.id = job.hydra.job.num = num
    return job


def job_dir(job: DictConfig) -> Path:
    """Where a sweep's job writes: ``hydra.sweep.dir``/``hydra.sweep.subdir``, as Hydra's launcher computes it."""
    return Path(
        str(OmegaConf.select(job, "hydra.sweep.dir")), str(OmegaConf.select(job, "hydra.sweep.subdir"))
    ).resolve()


def check_job_values(job: DictConfig, num: int, own: list[str], here: bool = True) -> None:
    """The values each command checks as it starts (src/core/settings.py), and those building its data and model
    checks (``check_task_values``), for every job before the first runs: a value refused in job 3
    (``trainer.max_epochs=0,1``, ``data.batch_size=64,0``) was found once jobs 0 to 2 had trained. ``here``: the
    jobs run on this machine (Hydra's basic launcher), so its folders and cores are theirs: ``paths.checkpoints`` and
    the job's processes are checked too (a launcher plugin's jobs run elsewhere, where a node's own scratch folder may
    be all there is). ``own``: the job's overrides that the others do not share, which the line names."""
    try:
        check_job(job, here)
    except UserError as err:
        raise UserError(f"job {num} ({' '.join(own)}): {err}; no job of the sweep started") from None


def check_job(job: DictConfig, here: bool = True) -> None:
    """``check_job_values``'s checks of one job, in the words of the check that refused it (``hparams_search``'s
    check of the values its trials may take, too). The job's values are resolved with Hydra's config of the job set,
    as Hydra's launcher sets it for the run (the data's default folder names ``${hydra:runtime.cwd}``; the default
    ``paths.checkpoints``, the job's own dir); what was set before is put back."""
    check_job_dir(job)
    with hydra_config_of(job):
        check_values(job)
        nodes = OmegaConf.select(job, "trainer.num_nodes", default=1)
        if isinstance(nodes, int) and not isinstance(nodes, bool):  # any other value: its job says what is wrong
            check_sweep_job_nodes(nodes)
        check_task_values(job)
        check_no_empty_paths(job)
        if here:  # a launcher plugin's jobs run elsewhere, where a node's own scratch folder may be all there is
            check_checkpoint_folder(job)
            check_job_processes(job)
            check_given_checkpoint(job)


def check_job_dir(job: DictConfig) -> None:
    """A sweep keeps job N in ``hydra.sweep.dir/N``: the resume, the scaling report and the search read them there.
    Before, ``hydra.sweep.subdir=same`` ran job 1 as a resume of job 0's finished run (a warning, no training, job 0's
    test again), and the report, which reads ``N/``, ended in a traceback."""
    sweep = OmegaConf.select(job, "hydra.sweep")
    num = OmegaConf.select(job, "hydra.job.num")
    if sweep is None or num is None or job_dir(job) == Path(str(sweep.dir), str(num)).resolve():
        return
    subdir = OmegaConf.to_container(sweep, resolve=False).get("subdir")  # type: ignore[union-attr]
    raise UserError(
        f"hydra.sweep.subdir={subdir} puts job {num} in {job_dir(job)}, but a sweep keeps each job in "
        "hydra.sweep.dir/<job number> (its resume, its scaling report and a search read them there): leave "
        "hydra.sweep.subdir out, and name the sweep with hydra.sweep.dir"
    )


def check_job_processes(job: DictConfig) -> None:
    """What a training's or an evaluation's first process checks as it starts the job's ranks on this node
    (src/launch/ranks.py's ``check_strategy``): its processes against this node's cores, the backend against the
    device, the variables a run of several nodes needs. Before, ``trainer.devices=1,2,4`` on two cores trained jobs
    0 and 1, then refused job 2."""
    strategy = OmegaConf.select(job, "strategy", default=None)
    if job.get("task_name") not in ("train", "eval") or strategy is None or "LOCAL_RANK" in os.environ:
        return  # export and predict start no ranks; a rank's launcher checked (src/launch/ranks.py)
    check_strategy_of(strategy)


def check_given_checkpoint(job: DictConfig) -> None:
    """The checkpoint a job is given (``ckpt_path=PATH``: an evaluation's, or a training's that starts from it) is a
    file here. Before, ``python -m src.eval -m ckpt_path=A,B`` with B missing evaluated A, then job 1 failed as it
    started. Whether it is there only: each job reads its own checkpoint whole as it starts, and an object store's
    (``s3://``) is read there too."""
    given = OmegaConf.select(job, "ckpt_path", default=None, throw_on_missing=False)
    if job.get("task_name") not in ("train", "eval") or not isinstance(given, str) or given in ("", "last", "auto"):
        return  # last and auto: the job's own run dir, which may hold nothing yet
    from src.checkpoints import object_store
    from src.checkpoints.files import not_a_file

    if object_store.is_url(given):
        return
    refused = not_a_file("ckpt_path", Path(given), "the path of a .ckpt file written by src.train")
    if refused is not None:
        raise UserError(refused)


TASK_NODES = ("data", "model")  # what a job builds from its config before the ranks meet, each checking its arguments


def check_task_values(job: DictConfig) -> None:
    """What building the job's data and model checks: each argument's name and range (``data.batch_size=0``,
    ``model.optimizer.lr=-0.1``, ``model.arch=resnet99``, ``+model.foo=1``). The model is built on torch's meta
    device: no memory and no weights, 0.07 s for a ResNet-50 on a 2-core EPYC; the data module reads nothing as it is
    built. A UserError in the words the job would have said."""
    import torch
    from hydra.utils import instantiate

    for key in TASK_NODES:
        node = job.get(key)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        try:
            with torch.device("meta"):
                instantiate(node)
        except Exception as err:  # noqa: BLE001 - a refusal in the job's words, or what no user value causes
            found = user_error_in(err)
            if found is None:
                raise
            raise UserError(str(found)) from None


def check_same_job(folder: Path, num: int, overrides: list[str]) -> None:
    """A sweep dir run again must hold the same jobs: another command's job there would be skipped or resumed."""
    recorded = folder / ".hydra" / "overrides.yaml"
    if not recorded.is_file():
        return
    before = yaml.safe_load(recorded.read_text()) or []
    if before != overrides:
        was = " ".join(o for o in before if o not in overrides) or "(these overrides in another order)"
        now = " ".join(o for o in overrides if o not in before) or "(those overrides in another order)"
        raise UserError(
            f"hydra.sweep.dir={folder.parent} holds another sweep: its job {num} ran with {was} where "
            f"this sweep's job {num} has {now}; pass a new hydra.sweep.dir to start another sweep, or the "
            "same overrides to go on with that one"
        )
