"""Errors a user can cause, and how an entry point reports them: one line, non-zero exit."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from lightning.fabric.utilities.exceptions import MisconfigurationException

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
FAILURE_FILE = "failure.json"


class UserError(Exception):
    """A mistake in the command line, config, data or environment that the user can fix."""


def user_error_in(err: BaseException) -> BaseException | None:
    """The UserError (or Lightning's MisconfigurationException) behind ``err``, through Hydra's wrapping."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (UserError, MisconfigurationException)):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def handle_errors(task: Callable[..., Any]) -> Callable[..., Any]:
    """Report a failed task in one line.

    A single run prints ``error: ...`` and exits 2 for a user's mistake (HYDRA_FULL_ERROR=1 keeps the
    traceback), 1 for a rank that died, ``128 + signal`` when stopped by a signal. A job of a sweep records
    ``failure.json`` in its dir and returns, so the sweep goes on to the next job and the scaling report
    lists the failure; a signal stops the whole sweep.
    """

    @functools.wraps(task)
    def wrapper(cfg: Any) -> Any:
        from src import distributed, supervision
        from src.callbacks.graceful_stop import Terminated

        try:
            result = task(cfg)
        except Terminated as stop:
            if distributed.is_launch_rank_zero():
                print(f"stopped: {stop}", file=sys.stderr, flush=True)
            distributed.reap_launched(grace_s=60)  # they stop at the same batch; let them finish writing
            sys.exit(stop.exit_code)
        except Exception as err:
            failure = supervision.explain(err)
            if in_sweep():
                return _record_failure(err, UserError(failure[0]) if failure and failure[0] else user_error_in(err))
            if failure is not None and os.environ.get("HYDRA_FULL_ERROR") != "1":
                message, code = failure
                if message:
                    supervision.report_once(message)
                supervision.stop_processes(distributed.LAUNCHED, grace_s=2.0)
                sys.exit(code)
            cause = user_error_in(err)
            if cause is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            print(f"error: {cause}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)
        if not in_sweep():  # a sweep's JobIsolation waits for each job's ranks itself
            failure = distributed.reap_launched(grace_s=120)
            if failure is not None:
                supervision.report_once(failure)
                sys.exit(supervision.EXIT_RANK_FAILED)
        return result

    return wrapper


def in_sweep() -> bool:
    """Whether this process runs a job of a Hydra multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _record_failure(err: Exception, cause: BaseException | None) -> None:
    from hydra.core.hydra_config import HydraConfig

    message = str(cause) if cause is not None else f"{type(err).__name__}: {err}"
    if cause is None:
        log.exception("job failed")  # an unexpected error keeps its traceback, in the job's log file
    job = HydraConfig.get().job
    print(f"error: job {job.num} ({' '.join(HydraConfig.get().overrides.task)}): {message}", file=sys.stderr,
          flush=True)
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / FAILURE_FILE).write_text(json.dumps({"job": job.num, "error": message}, indent=2) + "\n")
