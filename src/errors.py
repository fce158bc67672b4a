"""Errors a user can cause, and how an entry point reports them: one line, non-zero exit."""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

log = logging.getLogger(__name__)

EXIT_USER_ERROR = 2
FAILURE_FILE = "failure.json"
# The user's own HYDRA_FULL_ERROR, recorded before run() sets it for Hydra; DDP's local ranks inherit both.
USER_FULL_ERROR = "CIFAR10_DDP_USER_HYDRA_FULL_ERROR"
_task_started = False  # an OSError before any task ran is Hydra's: the run dir or its log file


class UserError(Exception):
    """A mistake in the command line, config, data or environment that the user can fix."""


def user_error_in(err: BaseException) -> BaseException | None:
    """The UserError (or Lightning's MisconfigurationException) behind ``err``, through Hydra's wrapping."""
    lightning = sys.modules.get("lightning.fabric.utilities.exceptions")  # not loaded: none of its errors is raised
    known = (UserError, lightning.MisconfigurationException) if lightning else (UserError,)
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, known):
            return err
        if _is_interpolation_error(err):  # data.batch_size='${nope}', or a resolver that fails
            key = getattr(err, "full_key", None) or "an interpolation"
            return UserError(f"{key}: {str(err).splitlines()[0]}: fix or remove the ${{...}} in its value "
                             f"(`python -m {_entry_module()} --cfg job --resolve` shows every resolved value)")
        call = _TARGET_CALL.search(str(err))
        if call:
            target, kind, detail, node = call.groups()
            unknown = re.search(r"unexpected keyword argument '(\w+)'", detail)
            if kind.endswith("Error") and unknown:  # +model.foo=1: the class the node builds has no such argument
                return UserError(f"{node}.{unknown.group(1)} is not an argument of {target}: remove it, or check its "
                                 f"spelling (`python -m {_entry_module()} --cfg job` lists the keys)")
            quoted = len(detail) >= 2 and detail[0] in "'\"" and detail[-1] in "'\""
            if kind == "ValueError" and quoted:  # trainer.precision=15: the class rejected one of the node's values
                return UserError(f"{node}: {detail[1:-1].strip()} (raised by {target}): "
                                 f"change the offending {node}.* value")
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


# How hydra.utils.instantiate reports an exception raised by the target it calls: its class, its repr'd
# arguments, the config node.
_TARGET_CALL = re.compile(r"^Error in call to target '([^']+)':\n(\w+)\((.*)\)\nfull_key: (\S+)$", re.S)


def _is_interpolation_error(err: BaseException) -> bool:
    errors = sys.modules.get("omegaconf.errors")
    return errors is not None and isinstance(err, errors.InterpolationResolutionError)


def handle_errors(task: Callable[..., Any]) -> Callable[..., Any]:
    """Report a failed task in one line.

    A single run prints ``error: ...`` and exits 2 for a user's mistake (HYDRA_FULL_ERROR=1 keeps the
    traceback), 1 for a rank that died, ``128 + signal`` when stopped by a signal. A job of a sweep records
    ``failure.json`` in its dir and returns, so the sweep goes on to the next job and the scaling report
    lists the failure; a signal stops the whole sweep.
    """

    @functools.wraps(task)
    def wrapper(cfg: Any) -> Any:
        from src import launch, supervision

        global _task_started
        _task_started = True
        try:
            check_group_choices()
            _resolve_all(cfg)
            result = task(cfg)
        except Exception as err:
            from src.callbacks.graceful_stop import Terminated  # here, not at the top: it loads Lightning

            if isinstance(err, Terminated):
                if launch.is_launch_rank_zero():
                    print(f"stopped: {err}", file=sys.stderr, flush=True)
                launch.reap_launched(grace_s=60)  # they stop at the same batch; let them finish writing
                sys.exit(err.exit_code)
            failure = supervision.explain(err)
            if in_sweep():
                return _record_failure(err, UserError(failure[0]) if failure and failure[0] else user_error_in(err))
            if failure is not None and not wants_traceback():
                message, code = failure
                if message:
                    supervision.report_once(message)
                supervision.stop_processes(launch.LAUNCHED, grace_s=2.0)
                sys.exit(code)
            cause = user_error_in(err)
            if cause is None or wants_traceback():
                raise
            supervision.stop_processes(launch.LAUNCHED, grace_s=2.0)  # ranks started early, still loading
            report(str(cause))
        if not in_sweep():  # a sweep's JobIsolation waits for each job's ranks itself
            failure = launch.reap_launched(grace_s=120)
            if failure is not None:
                supervision.report_once(failure)
                sys.exit(supervision.EXIT_RANK_FAILED)
        return result

    return wrapper


def wants_traceback() -> bool:
    """Whether the user asked for tracebacks (HYDRA_FULL_ERROR=1), whatever run() set for Hydra."""
    return os.environ.get(USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "")) == "1"


def report(message: str) -> NoReturn:
    """Print ``error: message`` as one line and exit 2."""
    print("error: " + " ".join(line.strip() for line in message.splitlines() if line.strip()), file=sys.stderr,
          flush=True)
    sys.exit(EXIT_USER_ERROR)


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
    except Exception as err:  # noqa: BLE001 - what is not a user's mistake is raised again below
        message = hydra_error_message(err)
        if message is None:
            raise  # a bug: its whole traceback
        report(message)


def hydra_error_message(err: Exception) -> str | None:
    """What to tell the user about an error Hydra raised around the task, or None for a bug."""
    from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    cause = user_error_in(err)
    if cause is not None:
        return str(cause)
    if isinstance(err, OverrideParseException):
        return (f"cannot parse the override {err.override}: {err.message.splitlines()[0]}; write key=value, and quote a "
                "value with brackets, commas or spaces (key='[1,2]'); grammar: "
                "https://hydra.cc/docs/advanced/override_grammar/basic/")
    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option of config group {group}: choose one of {', '.join(err.options)}"
    if isinstance(err, CompactHydraException) and str(err).startswith("Could not override"):
        return _unknown_key_message(err) or str(err)
    if isinstance(err, CompactHydraException):  # Hydra prints these without a traceback too, with OmegaConf's cause
        detail = str(err.__cause__).splitlines()[0] if isinstance(err.__cause__, OmegaConfBaseException) else ""
        return f"{str(err).strip()} ({detail})" if detail else str(err)
    if isinstance(err, OSError) and not _task_started:
        return (f"cannot write the run dir: {err.filename}: {err.strerror}: pass hydra.run.dir=DIR "
                "(hydra.sweep.dir=DIR with -m) somewhere you can write, or fix its permissions")
    return None


def _unknown_key_message(err: Exception) -> str | None:
    """``trainer.max_epoch=3``: name the key, offer the nearest real ones, then ``+`` for a key meant to be new."""
    from omegaconf import DictConfig

    cause = err.__cause__
    parent, key, full_key = (getattr(cause, name, None) for name in ("parent_node", "key", "full_key"))
    override = re.search(r"use \+(.*)$", str(err), re.M)
    if not isinstance(parent, DictConfig) or not isinstance(key, str) or not full_key or override is None:
        return None
    override = override.group(1)
    prefix, rest = full_key[: -len(key)], override.split("=", 1)[0][len(full_key):]
    close = [prefix + name + rest for name in difflib.get_close_matches(key, [str(k) for k in parent.keys()], n=2)]
    name = override.split("=", 1)[0]
    if close:
        return (f"{name} is not a key of the config: did you mean {' or '.join(close)}? "
                f"(a key the config lacks on purpose is added with +{override})")
    return (f"{name} is not a key of the config (`python -m {_entry_module()} --cfg job` lists them); "
            f"a key the config lacks on purpose is added with +{override}")


def _entry_module() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else "src.train"


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


def _resolve_all(cfg: Any) -> None:
    """Resolve every interpolation once, up front, so a broken one is reported with its key (instantiate
    resolves a detached copy, and its error no longer knows where the value came from)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        OmegaConf.to_container(cfg, resolve=True)


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
