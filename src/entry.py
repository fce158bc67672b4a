"""How an entry point (src.train, src.eval) runs its task and ends.

A good end waits for the local ranks this process started. A failure ends as one line: ``error: ...`` on
stderr, every process of the run stopped (src/supervision.py), and an exit status that says which kind —
2 for a mistake found before training (docs/troubleshooting.md), 1 for a run that failed under way (a rank that
died or raised, a run dir that stopped taking writes, a rank that hung), ``128 + signal`` for a run stopped on
request (130 for Ctrl-C, 143 for SIGTERM). A job of a sweep records ``failure.json`` instead and the sweep goes
on; a sweep stopped on request stops, saying how to resume it. HYDRA_FULL_ERROR=1 keeps tracebacks.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from src import heartbeat, launch, supervision, torchrun, tracking
from src.errors import (EXIT_FAILED, EXIT_USER_ERROR, FAILURE_FILE, USER_FULL_ERROR, ToldElsewhere, UserError,
                        hydra_error_message, one_line, out_of_memory_in, report, require, storage_error_in,
                        user_error_in, wants_traceback)
from src.run_dir import resume_own_run_dir

log = logging.getLogger(__name__)
_task_started = False  # an OSError before any task ran is Hydra's: the run dir or its log file


def run(main: Callable[[], Any]) -> Any:
    """Call a ``@hydra.main`` entry point so that what Hydra rejects before the task runs is one line too.

    Hydra prints its own errors (an unknown group option, a misspelled key, an override it cannot
    parse, a run dir it cannot create) in several lines, and offers ``+key=value`` for any key it does
    not know, typos included. With HYDRA_FULL_ERROR=1 it raises them instead, and they are reported here.
    """
    os.environ.setdefault(USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", ""))  # a local rank keeps its parent's
    if wants_traceback():
        return main()
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        return main()
    except KeyboardInterrupt:  # Ctrl-C outside training (GracefulStop's) and outside the task (Hydra's own start)
        interrupted()
    except Exception as err:  # noqa: BLE001 - what is not a user's mistake is raised again below
        message = hydra_error_message(err, _task_started)
        if message is None:
            raise  # a bug outside the task: its whole traceback
        report(message)


def handle_errors(task: Callable[..., Any]) -> Callable[..., Any]:
    """Run the task; end a failure of it as described in this module's docstring."""

    @functools.wraps(task)
    def wrapper(cfg: Any) -> Any:
        global _task_started
        _task_started = True
        # a log file on a full or read-only disk would print a traceback per record, TensorBoard's writer thread
        # one when its write fails (it raises the error again in the training loop, where it becomes one line)
        logging.raiseExceptions = False
        threading.excepthook = _quiet_storage_errors
        heartbeat.register_stack_dump(supervision.rank_label())  # kill -USR2 PID: this process's stacks to its log
        try:
            check_group_choices()
            if torchrun.active():  # its process counts; a worker never outlives its agent
                supervision.watch_launcher(int(os.environ["RANK"]), os.getppid(), what="its torchrun agent")
                torchrun.adopt(cfg, overridden_keys())
            # every torchrun attempt resumes (torchrun does not count the restart it makes when a node joins: a worker
            # cannot tell that attempt from a first start), and so does a sweep's job run again
            if torchrun.active() or launch.in_sweep():
                resume_own_run_dir(cfg)
            check_extras(cfg)
            _resolve_all(cfg)
            result = task(cfg)
        except KeyboardInterrupt:
            interrupted()
        except SystemExit as stop:
            if isinstance(stop.__context__, KeyboardInterrupt):  # Lightning's own handling (Ctrl-C before training)
                interrupted()
            raise
        except Exception as err:  # noqa: BLE001 - every failure ends the run the same way
            return _failed(err)
        supervision.stop_watching_failures()
        if not launch.in_sweep():  # a sweep's JobIsolation waits for each job's ranks itself
            failure = supervision.reap_started(grace_s=120)
            if failure is not None:
                message, code = failure
                supervision.end_run(None if supervision.said_why(code) else message, EXIT_FAILED)
        return result

    return wrapper


def _quiet_storage_errors(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None and storage_error_in(args.exc_value) is not None:
        log.debug("thread %s: %s", args.thread.name if args.thread else "?", args.exc_value)
        return
    threading.__excepthook__(args)


def _failed(err: Exception) -> None:
    stopping = sys.modules.get("src.callbacks.graceful_stop")  # not loaded yet: nothing raised Terminated
    if stopping is not None and isinstance(err, stopping.Terminated):
        supervision.stop_watching_failures()  # every rank stops at this very step: a good end of sorts
        if launch.is_launch_rank_zero():
            print(err.line, file=sys.stderr, flush=True)
        supervision.reap_started(grace_s=60)  # they stop at the same batch; let them finish writing
        if launch.in_sweep() and launch.is_launch_rank_zero():
            from src.sweep import stopped_line

            print(stopped_line(), file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    line, code = describe(err)
    if launch.in_sweep():
        _record_failure(line, code)
        return None
    if wants_traceback():
        traceback.print_exception(err)
    supervision.end_run(line, code)


def interrupted() -> None:
    """Ctrl-C where no training step can stop cleanly (starting, between a sweep's jobs): exit 130, one line."""
    supervision.stop_watching_failures(wait=False)
    supervision.stop_processes(supervision.STARTED, grace_s=5.0)
    if launch.is_launch_rank_zero():
        print("interrupted (Ctrl-C) outside a training step: nothing more was saved", file=sys.stderr, flush=True)
        if launch.in_sweep():
            from src.sweep import stopped_line

            print(stopped_line(), file=sys.stderr, flush=True)
    sys.exit(128 + signal.SIGINT)


def describe(err: BaseException, log_dir: str | None = None) -> tuple[str | None, int]:
    """The run's one error line for ``err`` (None when another process tells it) and the exit status.

    An unexpected exception keeps its traceback in this process's log file (``log_dir``: where to write one
    when logging has no file), and the line says where.
    """
    distributed = supervision.explain(err)
    if distributed is not None:
        return distributed
    cause = user_error_in(err)
    if isinstance(cause, ToldElsewhere) and not launch.in_sweep():  # a sweep's process records each job's line
        return None, cause.exit_code
    if cause is not None:
        code = getattr(cause, "exit_code", EXIT_USER_ERROR)  # Lightning's MisconfigurationException: the user's
        mid_run = supervision.FAILURES is not None or code != EXIT_USER_ERROR
        return _named(one_line(str(cause)), mid_run), code
    reported = supervision.reported_failure()
    if reported is not None:  # another rank failed first; this one's error is most likely its echo
        return reported
    storage = storage_error_in(err)
    if storage is not None:
        return _named(_storage_line(storage), True), EXIT_FAILED
    memory = out_of_memory_in(err)
    if memory is not None:  # the line says all there is to do; torch's paragraph goes to the log file only
        from src.callbacks.out_of_memory import line_for

        _log_traceback(err, log_dir, console=False)
        return _named(line_for(memory), True), EXIT_FAILED
    logged = _log_traceback(err, log_dir)
    where = f" (traceback in {logged})" if logged else ""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return _named(f"{type(err).__name__}: {first}{where}", True), EXIT_FAILED


def _named(line: str, mid_run: bool) -> str:
    """Prefix the rank in a run of several processes, for a failure under way."""
    return f"{supervision.rank_label()}: {line}" if mid_run and supervision.in_distributed_run() else line


def _storage_line(err: OSError) -> str:
    """A write outside the checkpoints (TensorBoard's events, a log) refused: the same line a checkpoint's gets."""
    from hydra.core.hydra_config import HydraConfig

    from src.checkpoints import refused_write  # loads Lightning: only once a run is under way

    run_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    return refused_write(err, None, Path(run_dir, "checkpoints") if run_dir else None)


def _log_traceback(err: BaseException, log_dir: str | None, console: bool = True) -> str | None:
    """Write ``err``'s traceback to this process's log file only; return the file. Without one, print it
    (``console``)."""
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    if not files and log_dir is not None:
        try:
            files = [logging.FileHandler(Path(log_dir) / f"traceback_{supervision.rank_label().replace(' ', '')}.log")]
        except OSError:
            files = []
    if not files:
        if console:
            traceback.print_exception(err)  # nowhere else to keep it
        return None
    record = logging.LogRecord(log.name, logging.ERROR, __file__, 0, "the run failed:", None,
                               (type(err), err, err.__traceback__))
    for handler in files:
        handler.handle(record)
        handler.flush()
    path = files[0].baseFilename
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def check_group_choices() -> None:
    """Refuse an option of an ``optional`` group that does not exist: Hydra skips it and runs the defaults."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if not (HydraConfig.initialized() and GlobalHydra.instance().is_initialized()):
        return
    loader = GlobalHydra.instance().config_loader()
    for group, option in HydraConfig.get().runtime.choices.items():
        if not isinstance(option, str) or group.startswith("hydra/"):  # unset, or several options at once
            continue
        options = loader.get_group_options(group)
        if option not in options:
            raise UserError(f"{group}={option} is not an option of config group {group}: "
                            f"choose one of {', '.join(options)}")


def check_extras(cfg: Any) -> None:
    """A choice whose optional package is missing (``logger=mlflow`` without mlflow): one line naming the extra
    (pyproject.toml), before any other process starts."""
    loggers = cfg.get("logger") or {}
    needs = [(f"logger={name}", name) for name in ("mlflow", "wandb") if name in loggers]
    if cfg.get("search") is not None:  # conf/hparams_search/optuna.yaml
        needs.append(("hparams_search=optuna", "optuna"))
        if cfg.search.get("trial") is None:  # not a trial the sweeper started: the -m is missing
            raise UserError("hparams_search=optuna searches as a multirun: add -m "
                            "(python -m src.train -m hparams_search=optuna ...)")
    for what, package in needs:
        require(package, package, what)
    if launch.is_launch_rank_zero():  # only rank zero logs: only its way to the servers matters
        tracking.check_servers(loggers)


def overridden_keys() -> set[str]:
    """The config keys set on the command line (``trainer.devices=2``, ``+x=1``, ``~y``)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return set()
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)  # as typed: ${...} unresolved
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def _resolve_all(cfg: Any) -> None:
    """Resolve every interpolation once, up front, so a broken one is reported with its key (instantiate
    resolves a detached copy, and its error no longer knows where the value came from)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        OmegaConf.to_container(cfg, resolve=True)


def _record_failure(line: str | None, code: int) -> None:
    """A sweep's job failed: stop its other ranks, print and record its line; the sweep goes on."""
    from hydra.core.hydra_config import HydraConfig

    if supervision.FAILURES is not None:
        record = supervision.FAILURES.read(from_store=True)
        if line is None and record is not None:
            line = record["line"]  # a rank of this job said it, on its own stderr
        supervision.FAILURES.publish(line, code)  # the job's ranks on other nodes stop too
    supervision.stop_processes(supervision.STARTED, grace_s=2.0)
    message = line or "a rank of this job failed: see its log"
    job = HydraConfig.get().job
    print(f"error: job {job.num} ({' '.join(HydraConfig.get().overrides.task)}): {message}", file=sys.stderr,
          flush=True)
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / FAILURE_FILE).write_text(json.dumps({"job": job.num, "error": message, "exit_code": code}, indent=2) + "\n")
