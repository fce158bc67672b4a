"""How a command (src.train, src.eval, src.export, src.predict) starts its task and ends.

Before the task: what Hydra rejects (an unknown option, a misspelled key, an override it cannot parse) becomes one
``error:`` line (``run``), and the checks that need the composed config run before any other process starts
(``handle_errors``: group options, torchrun's counts, the run dir a job run again resumes, the trainer's values,
extras, tracking servers, every interpolation). A good end waits for the local ranks this process started. Every
other end goes through src/resilience/failure.py, which says who prints the one line, which exit status, and how
the other processes stop.
HYDRA_FULL_ERROR=1 keeps tracebacks.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, NoReturn

from src.checkpoints import earlier_run, object_store
from src.core.console import quiet_console
from src.core.errors import (
    EXIT_FAILED,
    EXIT_USER_ERROR,
    USER_FULL_ERROR,
    CallbackError,
    UserError,
    hydra_error_message,
    report,
    require,
    storage_error_in,
    wants_traceback,
)
from src.core.settings import check_checkpoint_folder, check_no_empty_paths, check_values
from src.launch import ranks, run_dir, torchrun
from src.resilience import failure, heartbeat, supervision
from src.tracking import servers

log = logging.getLogger(__name__)
_task_started = False  # an OSError before any task ran is Hydra's: the run dir or its log file


def run(main: Callable[[], Any]) -> NoReturn:
    """Call a ``@hydra.main`` entry point so that what Hydra rejects before the task runs is one line too, then end
    the process at once (``exit_now``).

    Hydra prints its own errors (an unknown group option, a misspelled key, an override it cannot
    parse, a run dir it cannot create) in several lines, and offers ``+key=value`` for any key it does
    not know, typos included. With HYDRA_FULL_ERROR=1 it raises them instead, and they are reported here.
    """
    try:
        _run(main)
        code: Any = 0
    except SystemExit as stop:
        code = stop.code
    if code in (EXIT_USER_ERROR, 128 + signal.SIGINT):  # refused, or Ctrl-C'd before it ran: no empty run dir left
        run_dir.forget_refused_run()  # (one Ctrl-C'd once it trained holds its last.ckpt, and stays)
    exit_now(code)


def exit_now(code: Any) -> NoReturn:
    """End the process with ``code`` as Python's own exit would, less its teardown of every module: with torch,
    torchvision and Lightning loaded, that teardown alone takes 1.5 s of CPU (2-core AMD EPYC), paid by every command
    and every rank after its work is done. What the teardown is for comes first, in Python's order: the threads that
    are no daemons joined, the exit handlers run (logging's files flushed and closed, the trackers' and loggers' own,
    multiprocessing's workers stopped), MPI finalised where mpi4py started it (mpirun takes a rank that ends without it
    for a failed one), stdout and stderr flushed. ``code`` as ``sys.exit`` takes it."""
    import atexit

    threading._shutdown()  # type: ignore[attr-defined]  # what Python's exit does first
    atexit._run_exitfuncs()
    if ranks.mpi_initialized():  # under mpirun: MPI_Finalize, which mpi4py leaves to the interpreter's end
        sys.modules["mpi4py.MPI"].Finalize()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    os._exit(status)


def _run(main: Callable[[], Any]) -> Any:
    os.environ.setdefault(USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", ""))  # a local rank keeps its parent's
    failure.install_sigint_handler()  # what Lightning puts back after a stage (failure.on_sigint)
    if wants_traceback():
        try:
            return main()
        except CallbackError as carried:  # one of the project's Hydra callbacks: as if Hydra had raised it
            error = carried.error
        raise error  # outside the except clause: its own traceback, without the CallbackError that carried it
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        return main()
    except KeyboardInterrupt:  # Ctrl-C outside training (GracefulStop's) and outside the task (Hydra's own start)
        failure.interrupted()
    except CallbackError as carried:
        error = carried.error
    except Exception as err:  # noqa: BLE001 - what is not a user's mistake is raised again below
        error = err
    message = hydra_error_message(error, _task_started, first=ranks.is_launch_rank_zero())
    if message is None:
        raise error  # a bug outside the task: its whole traceback
    report(message)


def handle_errors(task: Callable[..., Any]) -> Callable[..., Any]:
    """Run the task; end a failure of it as described in this module's docstring."""

    @functools.wraps(task)
    def wrapper(cfg: Any) -> Any:
        global _task_started
        _task_started = True
        # a log file on a full or read-only disk would print a traceback per record, TensorBoard's writer thread
        # one when its write fails (it raises the error again in the training loop, where it becomes one line); a
        # thread a limit on processes and threads stopped ends the run with its one line
        logging.raiseExceptions = False
        quiet_console()  # Hydra's console is set up: what stays in the log file stays there from the first check on
        threading.excepthook = _thread_errors
        heartbeat.register_stack_dump(supervision.rank_label())  # kill -USR2 PID: this process's stacks to its log
        try:
            check_group_choices()
            trains = cfg.get("trainer") is not None  # src.export, src.predict: no trainer, one process
            if not trains:  # whichever launcher started it
                ranks.check_one_process(cfg.task_name)
            elif torchrun.active():  # its process counts; a worker never outlives its agent
                supervision.watch_launcher(
                    int(os.environ["RANK"]),
                    os.getppid(),
                    what="its torchrun agent",
                    hosts_store=torchrun.agent_hosts_store(),
                )
                torchrun.adopt(cfg, overridden_keys())
            # every torchrun attempt resumes (torchrun does not count the restart it makes when a node joins: a worker
            # cannot tell that attempt from a first start), and so does a sweep's job run again
            if trains and (torchrun.active() or ranks.in_sweep()):
                from src.checkpoints.resume import resume_own_run_dir  # loads torch, as the run does next

                resume_own_run_dir(cfg)
            check_values(cfg)
            check_no_empty_paths(cfg)
            check_checkpoint_folder(cfg)
            check_extras(cfg)
            _resolve_all(cfg)
            result = task(cfg)
        except KeyboardInterrupt:
            failure.interrupted()
        except SystemExit as stop:
            if isinstance(stop.__context__, KeyboardInterrupt):  # Lightning's own handling (Ctrl-C before training)
                failure.interrupted()
            raise
        except Exception as err:  # noqa: BLE001 - every failure ends the run the same way
            return failure.fail(err)
        supervision.stop_watching_failures()
        if not ranks.in_sweep():  # a sweep's JobIsolation waits for each job's ranks itself
            ended = supervision.reap_started(grace_s=120)
            if ended is not None:
                message, code = ended
                supervision.end_run(None if supervision.said_why(code) else message, EXIT_FAILED)
        return result

    return wrapper


def _thread_errors(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None and storage_error_in(args.exc_value) is not None:
        log.debug("thread %s: %s", args.thread.name if args.thread else "?", args.exc_value)
        return
    if args.exc_value is not None:
        failure.thread_out_of_tasks(args.exc_value)  # ends the run where a limit on tasks stopped the thread
    threading.__excepthook__(args)


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
            raise UserError(
                f"{group}={option} is not an option of config group {group}: choose one of {', '.join(options)}"
            )


def check_extras(cfg: Any) -> None:
    """A choice whose optional package is missing (``logger=mlflow`` without mlflow): one line naming the extra
    (pyproject.toml), before any other process starts; and checkpoints in an object store (``paths.checkpoints=s3://``)
    whose bucket, credentials or endpoint do not work: one line too, before any rank trains."""
    loggers = cfg.get("logger") or {}
    needs = [(f"logger={name}", name) for name in ("mlflow", "wandb") if name in loggers]
    if cfg.get("search") is not None:  # conf/hparams_search/optuna.yaml
        needs.append(("hparams_search=optuna", "optuna"))
        if cfg.search.get("trial") is None:  # not a trial the sweeper started: the -m is missing
            raise UserError(
                "hparams_search=optuna searches as a multirun: add -m "
                "(python -m src.train -m hparams_search=optuna ...)"
            )
    for what, package in needs:
        require(package, package, what)
    checkpoints = (cfg.get("paths") or {}).get("checkpoints")
    if checkpoints and object_store.is_url(checkpoints):  # an object store: reachable, and ours to write, first
        object_store.check_url(str(checkpoints))
        require("s3fs", "s3", f"paths.checkpoints={checkpoints}")
        if ranks.is_launch_rank_zero():
            object_store.check_store(str(checkpoints), write=cfg.get("task_name") == "train")
            if earlier_run.starts_anew(cfg):  # a prefix another run wrote (a local folder: EarlierRunCheck's)
                earlier_run.refuse_earlier_run(str(checkpoints), str(cfg.paths.output_dir))
    if ranks.is_launch_rank_zero():  # only rank zero logs: only its way to the servers matters
        servers.check_servers(loggers)


def overridden_keys() -> set[str]:
    """The config keys set on the command line (``trainer.devices=2``, ``+x=1``, ``~y``)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return set()
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)  # as typed: ${...} unresolved
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def data_overrides() -> tuple[bool, list[str]]:
    """Whether the command line chose the data group (``data=...``), and the ``data.*`` keys it set."""
    keys = overridden_keys()
    return "data" in keys, sorted(key for key in keys if key.startswith("data."))


def _resolve_all(cfg: Any) -> None:
    """Resolve every interpolation once, up front, so a broken one is reported with its key (instantiate
    resolves a detached copy, and its error no longer knows where the value came from)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        OmegaConf.to_container(cfg, resolve=True)
