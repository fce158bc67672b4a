"""Errors a user can cause, and the words that tell them what to change: the bottom of the project's imports.

This module imports nothing of the project. How a run ends on an error (one line, the other ranks stopped, the exit
status) is src/resilience/failure.py's; how the processes of a run stop together is src/resilience/supervision.py's.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

EXIT_FAILED = 1  # the run failed: a rank died or raised, the run dir could not be written
EXIT_USER_ERROR = 2  # a mistake in the command line, config, data or environment, found before training
FAILURE_FILE = "failure.json"
# The user's own HYDRA_FULL_ERROR, recorded before run() sets it for Hydra; DDP's local ranks inherit both.
USER_FULL_ERROR = "CIFAR10_DDP_USER_HYDRA_FULL_ERROR"


class UserError(Exception):
    """A mistake in the command line, config, data or environment that the user can fix. A key's value of None reads
    ``KEY=null``, as the user wrote it (``data.augment=null``), not Python's ``KEY=None``."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (_NONE.sub(r"\1=null", args[0]), *args[1:])
        super().__init__(*args)


_NONE = re.compile(r"(\b[A-Za-z_][\w.]*)=None\b")  # a config key given null, as a line formats it


class StorageError(UserError):
    """The run dir stopped taking writes mid-run (full, read-only, removed): the run stops, its files say where
    to resume."""

    exit_code = EXIT_FAILED


class ToldElsewhere(UserError):
    """The failure another process of this run, on this node, has already printed: this one ends with its exit status,
    without a second line."""


class CallbackError(BaseException):
    """An exception of one of the project's Hydra callbacks, carried past Hydra, which would turn it into a warning
    and go on (hydra/_internal/callbacks.py catches every ``Exception``): a run would start without its dir's lock or
    the check that keeps it from overwriting an earlier run. src/cli/entry.py ends the run on ``error`` as on any
    other error Hydra raises around the task."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def not_swallowed(method: Callable[..., Any]) -> Callable[..., Any]:
    """A Hydra callback's method whose exceptions end the run (``CallbackError``), as they would in the task."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - every one: Hydra would swallow it
            raise CallbackError(err) from err

    return wrapper


def whole(least: int) -> Callable[[Any], bool]:
    """``check_number``'s test for a whole number of at least ``least``."""
    return lambda value: isinstance(value, int) and value >= least


def check_number(key: str, value: Any, within: Callable[[Any], bool], words: str, optional: bool = False) -> None:
    """Refuse a ``key`` that is not a number for which ``within`` holds (a bool, a string and NaN are none), with one
    line that names it and says what it ``must be``; ``optional``: null is taken."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not within(value):
        raise UserError(f"{key}={value} must be {words}")


# errno values that mean the filesystem, not the program, refused a write
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO}


def storage_error_in(err: BaseException | None) -> OSError | None:
    """The OSError behind ``err`` (torch.save buries it under its zip writer's RuntimeError) that a filesystem
    raised, if any."""
    found = in_chain(err, lambda e: isinstance(e, OSError) and e.errno in STORAGE_ERRNOS)
    return found if isinstance(found, OSError) else None


def in_chain(err: BaseException | None, matches: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception ``matches`` accepts in ``err``'s chain, ``err`` first, then what it was raised from or
    while handling (``__cause__``, else ``__context__``); None if none."""
    seen = set()
    while err is not None and id(err) not in seen:
        if matches(err):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def unwritable_run_dir(err: OSError) -> str:
    """What to say when the run dir cannot be created or written before the run starts (a write that fills the disk
    names no file: a stream's flush)."""
    where = f"the run dir: {err.filename}" if err.filename else "the run dir"
    return (
        f"cannot write {where}: {err.strerror or err}: pass hydra.run.dir=DIR (hydra.sweep.dir=DIR with -m) somewhere "
        f"you can write, or {write_fix(err)}"
    )


def write_fix(err: OSError) -> str:
    """What to do about a folder the filesystem refused to write: free space, a shorter name, a file out of its way, or
    its permissions."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space there"
    if err.errno == errno.ENAMETOOLONG:  # a name of over 255 bytes, a path of over 4,095
        return "shorten it"
    if err.errno in (errno.EEXIST, errno.ENOTDIR):  # a file where a folder must be
        return "move the file in its way"
    if err.errno == errno.EISDIR:  # a folder where a file must be
        return "move the folder in its way"
    if err.errno == errno.ENOENT:  # a folder made, then gone before the write
        return "leave it in place (something removed it as it was written)"
    if err.errno == errno.EROFS:
        return "remount it writable"
    return "fix its permissions"


def closed_folder(path: Path, err: OSError) -> str:
    """The folder that refused ``err`` (EACCES): the first on the way to ``path`` that may not be entered, else the one
    that may not be listed (``err.filename``)."""
    path = path.absolute()
    for step in reversed([path, *path.parents][:-1]):  # /a, /a/b, ..., path
        try:
            os.stat(step)
        except PermissionError:
            return str(step.parent)
        except OSError:
            break
    return str(err.filename or path)


def require(package: str, extra: str, what: str) -> None:
    """Raise a UserError if ``package`` is not installed; ``what`` is the choice that needs it."""
    import importlib.util

    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        found = False
    if not found:
        raise UserError(
            f'{what} needs the {package} package, which is not installed: pip install -e ".[{extra}]" '
            f"(or pip install {package})"
        )


def user_error_in(err: BaseException | None) -> BaseException | None:
    """The UserError (or Lightning's MisconfigurationException) behind ``err``, through Hydra's wrapping."""
    lightning = sys.modules.get("lightning.fabric.utilities.exceptions")  # not loaded: none of its errors is raised
    known = (UserError, lightning.MisconfigurationException) if lightning else (UserError,)
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, known):
            return err
        if _is_interpolation_error(err):  # data.batch_size='${nope}', or a resolver that fails
            key = getattr(err, "full_key", None) or "an interpolation"
            return UserError(
                f"{key}: {str(err).splitlines()[0]}: fix or remove the ${{...}} in its value "
                f"(`python -m {_entry_module()} --cfg job --resolve` shows every resolved value)"
            )
        op = _NOT_DETERMINISTIC.match(str(err)) if isinstance(err, RuntimeError) else None
        if op:
            return UserError(
                f"{op.group(1)} has no deterministic implementation, and trainer.deterministic=true "
                "allows no other: pass trainer.deterministic=warn to run it anyway with a warning "
                "(Lightning's mode), or trainer.deterministic=false"
            )
        call = _TARGET_CALL.search(str(err))
        if call:
            target, kind, detail, node = call.groups()
            unknown = re.search(r"unexpected keyword argument '(\w+)'", detail)
            if kind.endswith("Error") and unknown:  # +model.foo=1: the class the node builds has no such argument
                return UserError(
                    f"{node}.{unknown.group(1)} is not an argument of {target}: remove it, or check its "
                    f"spelling (`python -m {_entry_module()} --cfg job` lists the keys)"
                )
            quoted = len(detail) >= 2 and detail[0] in "'\"" and detail[-1] in "'\""
            # trainer.precision=15, callbacks.lr_monitor.logging_interval=hour: the class refused a value of the node
            if kind in ("ValueError", "MisconfigurationException") and quoted:
                return UserError(
                    f"{node}: {detail[1:-1].strip()} (raised by {target}): change the offending {node}.* value"
                )
            # callbacks.model_checkpoint.save_top_k=null, logger.tensorboard.save_dir=-1: a value of a type the class
            # cannot use
            if kind == "TypeError" and quoted:
                fix = (
                    f"a {node}.* value is null where it needs one: give it a value, or leave it out for the default"
                    if "NoneType" in detail
                    else f"change the offending {node}.* value"
                )
                return UserError(f"{node}: {detail[1:-1].strip()} (raised by {target}): {fix}")
            if kind in ("ModuleNotFoundError", "ImportError") and quoted:  # a value that needs a package not here
                return UserError(  # (trainer.precision=transformer-engine without NVIDIA's Transformer Engine)
                    f"{node}: {detail[1:-1].strip()} (raised by {target}): install it, or change the {node}.* value "
                    "that needs it"
                )
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


# How hydra.utils.instantiate reports an exception raised by the target it calls: its class, its repr'd
# arguments, the config node.
_TARGET_CALL = re.compile(r"^Error in call to target '([^']+)':\n(\w+)\((.*)\)\nfull_key: (\S+)$", re.S)


# torch's words for an op without a deterministic kernel under torch.use_deterministic_algorithms(True)
_NOT_DETERMINISTIC = re.compile(
    r"^(\S+) does not have a deterministic implementation, but you set "
    r"'torch\.use_deterministic_algorithms\(True\)'"
)
# what cuBLAS and cuDNN say when their workspace cannot be allocated: out of memory as much as the allocator's error
_OUT_OF_MEMORY_WORDS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)


def out_of_memory_in(err: BaseException | None) -> BaseException | None:
    """The device out-of-memory error behind ``err``, if any: torch's OutOfMemoryError, or cuBLAS / cuDNN failing to
    allocate."""
    torch = sys.modules.get("torch")  # not loaded: nothing ran out of device memory
    if torch is None:
        return None
    return in_chain(
        err,
        lambda e: (
            isinstance(e, torch.OutOfMemoryError)
            or (isinstance(e, RuntimeError) and any(words in str(e) for words in _OUT_OF_MEMORY_WORDS))
        ),
    )


# torch's words where shared memory (/dev/shm) ran out: sharing a tensor with a loader's worker, or a worker's batch
_SHARED_MEMORY_WORDS = ("unable to allocate shared memory", "out of shared memory", "insufficient shared memory")


def shared_memory_full_in(err: BaseException | None) -> BaseException | None:
    """The error behind ``err`` that says ``/dev/shm`` is full, if any: what a loader's workers share goes there, and
    the semaphores of their queues (an OSError that names no file: not a full disk)."""
    return in_chain(
        err,
        lambda e: (
            (isinstance(e, RuntimeError) and any(words in str(e) for words in _SHARED_MEMORY_WORDS))
            or (
                isinstance(e, OSError)
                and e.errno == errno.ENOSPC
                and _raised_in(e, os.path.join("multiprocessing", "synchronize.py"))
            )
        ),
    )


def loader_worker_gone_in(err: BaseException | None) -> BaseException | None:
    """torch's error for a data loader's worker that ended, if it is behind ``err``: its own line says so (the
    OSError under it, a socket of the worker's gone, names no file of the run's)."""
    return in_chain(err, lambda e: isinstance(e, RuntimeError) and str(e).startswith("DataLoader worker (pid"))


def _is_interpolation_error(err: BaseException) -> bool:
    errors = sys.modules.get("omegaconf.errors")
    return errors is not None and isinstance(err, errors.InterpolationResolutionError)


def wants_traceback() -> bool:
    """Whether the user asked for tracebacks (HYDRA_FULL_ERROR=1), whatever run() set for Hydra."""
    return os.environ.get(USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "")) == "1"


def one_line(message: str) -> str:
    """A message of several lines (Hydra's, OmegaConf's) as one."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


# The console's turn: one thread's lines at a time. A progress bar's last drawing (rich, where stdout is unbuffered)
# is its text and its newline in two writes, and a failure's line another thread printed between them was glued to
# the bar, where a reader (or grep) of ``error:`` lines missed it.
_CONSOLE = threading.RLock()
CONSOLE_WAIT_S = 5.0  # a thread that holds the turn longer (stuck on a full pipe) no longer keeps it


def _console_of_its_own() -> None:
    """A forked child's: the thread that held its parent's turn at the fork does not exist there to give it back."""
    global _CONSOLE
    _CONSOLE = threading.RLock()


os.register_at_fork(after_in_child=_console_of_its_own)


@contextlib.contextmanager
def console_turn() -> Iterator[None]:
    """Hold the console: lines written inside go out together, none of another thread's between them."""
    held = _CONSOLE.acquire(timeout=CONSOLE_WAIT_S)
    try:
        yield
    finally:
        if held:
            _CONSOLE.release()


_TERMINAL_GONE = threading.Event()  # stderr was a terminal that hung up (terminal_gone)


def terminals() -> list[int]:
    """Which of stdout and stderr are a terminal now (a hung-up one no longer says so: ask before)."""
    found = []
    for fd in (1, 2):
        try:
            if os.isatty(fd):
                found.append(fd)
        except OSError:
            continue
    return found


def terminal_gone(fds: list[int]) -> None:
    """The terminal this process wrote to is gone (SIGHUP: an SSH session dropped, a terminal window closed). Its
    descriptors ``fds`` write to /dev/null from now on, as under ``nohup``: a write to a hung-up terminal fails with
    EIO, which would end the run where it was to stop at a step and write ``last.ckpt``. ``print_line``'s lines go
    to the log file instead (``logging``'s file handlers; the console's now write nowhere)."""
    if not fds:  # stdout and stderr go elsewhere (a file, a pipe): they still take the lines
        return
    if 2 in fds:
        _TERMINAL_GONE.set()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        os.close(null)


def print_line(text: str) -> None:
    """``text`` and its newline on stderr in one write, in the console's turn. ``print`` writes them apart where
    stderr is unbuffered (``PYTHONUNBUFFERED``, ``python -u``): a launcher's SIGTERM between the two left a line
    without its end, and the launcher's own output glued to it. One write of a line to a pipe is also never cut by
    another rank's. Once stderr's terminal has hung up, into the log file."""
    if _TERMINAL_GONE.is_set():
        logging.getLogger("src").warning(text)
        return
    with console_turn():
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


# told the line before report() prints it: under torchrun and srun, each node's first process says it
# (src/launch/ranks.py)
BEFORE_REPORT: list[Callable[[str], None]] = []


def report(message: str) -> NoReturn:
    """Print ``error: message`` as one line and exit 2."""
    line = one_line(message)
    for hook in BEFORE_REPORT:
        hook(line)
    print_line("error: " + line)
    sys.exit(EXIT_USER_ERROR)


def hydra_error_message(err: Exception, task_started: bool = False, first: bool = True) -> str | None:
    """What to tell the user about an error Hydra raised around the task, or None for a bug. ``first``: whether this
    process owns the run dir (the launch's rank zero)."""
    from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    cause = user_error_in(err)
    if cause is not None:
        return str(cause)
    if isinstance(err, OverrideParseException):
        return (
            f"cannot parse the override {err.override}: {err.message.splitlines()[0]}; write key=value, and quote a "
            "value with brackets, commas or spaces (key='[1,2]'); grammar: "
            "https://hydra.cc/docs/advanced/override_grammar/basic/"
        )
    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option of config group {group}: choose one of {', '.join(err.options)}"
    if isinstance(err, CompactHydraException) and str(err).startswith("Could not override"):
        return _unknown_key_message(err) or str(err)
    if isinstance(err, CompactHydraException):  # Hydra prints these without a traceback too, with OmegaConf's cause
        detail = str(err.__cause__).splitlines()[0] if isinstance(err.__cause__, OmegaConfBaseException) else ""
        return f"{str(err).strip()} ({detail})" if detail else str(err)
    if (
        isinstance(err, ValueError)
        and isinstance(err.__cause__, OSError)
        and _raised_in(err, os.path.join("logging", "config.py"))
    ):
        # logging's "Unable to configure handler 'file'": this process's log could not be opened in the run dir (a
        # folder in its way; under a launcher, the run dir taken back by the first rank, refused as this one started)
        err = err.__cause__
    if isinstance(err, OSError) and not task_started:  # Hydra's own writes: the run dir, its log file
        if err.errno == errno.ENOENT and not first:  # what its launcher's other processes see, or say in its report
            return (
                f"the run dir went as this process started ({err.filename}: {err.strerror}): the run's first process "
                "ended before the run began and took it back; its line says why"
            )
        return unwritable_run_dir(err)
    if isinstance(err, ValueError) and any(
        _raised_in(err, os.path.join("hydra", *where)) for where in (("_internal", "utils.py"), ("main.py",))
    ):
        # Hydra's checks of its own flags (a traceback, before): --resolve without --cfg, two of --run, -m, --cfg and
        # --info, --experimental-rerun's missing file
        shows = {"--cfg", "-c", "--info", "-i"} & {arg.split("=", 1)[0] for arg in sys.argv}
        if str(err).startswith("Only one of") and shows:  # -m with --cfg or --info: they show one run's config
            return (
                f"{err}: --cfg and --info show one run's config, not a sweep's; drop -m and give each key one value "
                f"(python -m {_entry_module()} --cfg job trainer.devices=2, for each job of trainer.devices=1,2)"
            )
        return str(err)
    return None


def _raised_in(err: BaseException, path: str) -> bool:
    """Whether ``err`` was raised in a file whose path ends with ``path``."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith(path)


def _unknown_key_message(err: Exception) -> str | None:
    """``trainer.max_epoch=3``: name the key, offer the nearest real ones, then ``+`` for a key meant to be new."""
    from omegaconf import DictConfig

    cause = err.__cause__
    parent, key, full_key = (getattr(cause, name, None) for name in ("parent_node", "key", "full_key"))
    suggested = re.search(r"use \+(.*)$", str(err), re.M)
    if not isinstance(parent, DictConfig) or not isinstance(key, str) or not full_key or suggested is None:
        return None
    override = suggested.group(1)
    prefix, rest = full_key[: -len(key)], override.split("=", 1)[0][len(full_key) :]
    close = [prefix + name + rest for name in difflib.get_close_matches(key, [str(k) for k in parent.keys()], n=2)]
    name = override.split("=", 1)[0]
    if close:
        return (
            f"{name} is not a key of the config: did you mean {' or '.join(close)}? "
            f"(a key the config lacks on purpose is added with +{override})"
        )
    return (
        f"{name} is not a key of the config (`python -m {_entry_module()} --cfg job` lists them); "
        f"a key the config lacks on purpose is added with +{override}"
    )


def _entry_module() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None else "src.train"
