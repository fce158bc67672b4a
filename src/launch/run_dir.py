"""One run per run dir: the process that owns a run holds a lock on its dir for as long as it lives.

Two runs writing one dir overwrite each other's ``last.ckpt``, ``config.yaml`` and ``throughput.json`` and
interleave their logs without a word. Here the run's owner (the command the user started, srun's task 0,
torchrun's rank 0, node 0 by hand) takes an fcntl lock on ``DIR/.lock`` before Hydra writes anything
there. The kernel (the lock manager, on NFS) drops it when that process ends, however it ends — ``kill -9``
too — so a crashed run's dir is free for ``ckpt_path=last`` at once. The other ranks of the run never
lock, so they are never refused. A second run pointed at a held dir stops before it writes anything,
naming the host and pid that hold it. A timestamped dir (the default ``outputs/runs/<date>/<time>``) is
claimed instead: a run that finds its timestamp owned by another run takes ``<time>_2``, ``<time>_3``, ...
Under a launcher that starts every process itself, the default is named after the launch instead
(``torchrun-<rdzv id>``, ``slurm-<job>.<step>``, ``mpirun-<PMIx namespace>``): each process reads its own clock.
A run refused before it ran (exit 2: a bad value, a missing file), or stopped with Ctrl-C before it trained (exit
130), takes back the folders it made for itself (``forget_refused_run``): a typo leaves no empty run dir behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shlex
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from src.core.console import warning_line
from src.core.errors import not_swallowed, report, unwritable_run_dir
from src.launch import torchrun
from src.launch.ranks import (
    check_sweep_started_once,
    drop_empty_run_log,
    in_sweep,
    is_launch_rank_zero,
    launch_name,
)

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
TAKE_BACK_WAIT_S = 5.0  # how long a refused rank waits for the run's first to take back the run dir it shares
_held: list[int] = []  # open for the life of the process: closing the file would drop the lock
_made: list[Path] = []  # the folders hold() made for this run, its run dir first, then the parents it made
_found_missing: list[Path] = []  # another rank's: the run dir and parents that were not there as it started
_found_locked: list[Path] = []  # another rank's: the run dir it found there as it started, locked by the first
CONFIG_FILE = "config.yaml"  # the resolved config, src/training/trainer.py's record_config
MULTIRUN_FILE = "multirun.yaml"  # Hydra's record of a sweep's config, in its sweep dir
HYDRA_RECORD = {"config.yaml", "hydra.yaml", "overrides.yaml"}  # what Hydra writes into DIR/.hydra as a run starts


class RunDirLock(Callback):
    """Hydra callback: hold ``hydra.run.dir`` (``hydra.sweep.dir`` for ``-m``) before the run writes into it."""

    @not_swallowed
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # the default dir, under a launcher: every process of the run finds the same dir, named after the launch
        launched = _timestamped(config.hydra.run) and (torchrun.active() or launch_name())
        if launched:
            default = Path(str(config.hydra.run.dir))  # <runs>/<date>/<time>
            with read_write(config.hydra):
                config.hydra.run.dir = str(
                    torchrun.run_dir_for(default) if torchrun.active() else launch_dir(default, str(launched))
                )
        if is_launch_rank_zero():
            hold(config, "run", shared=bool(launched))
        else:
            path = Path(str(config.hydra.run.dir)).absolute()
            _found_missing[:] = _missing(path)
            _found_locked[:] = [path] if (path / LOCK_FILE).is_file() else []

    @not_swallowed
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_sweep_started_once()
        hold(config, "sweep")


def launch_dir(default: Path, name: str) -> Path:
    """The run dir of srun's tasks or mpirun's ranks that did not pass ``hydra.run.dir``: ``<runs>/<date>/<name>``.
    ``default`` is the timestamped dir Hydra computed from this process's clock (``<runs>/<date>/<time>``). A
    process that starts after midnight, where the launch's first started before it, finds the dir that one made
    under the day before (the newest two date folders: one listing and two lookups a process, however many days
    ``<runs>`` holds), and its log joins the run's; where none is there yet, today's."""
    runs = default.parent.parent
    try:
        dates = sorted(entry.name for entry in os.scandir(runs) if entry.is_dir())
    except OSError:  # no <runs> yet: this is the first process
        dates = []
    for date in reversed(dates[-2:]):
        if (runs / date / name).is_dir():
            return runs / date / name
    return default.parent / name


def output_dir() -> str | None:
    """``paths.output_dir`` (``${output_dir:}``): the dir Hydra runs the job in, ``hydra.runtime.output_dir``. Where
    it runs none (``--cfg job --resolve`` shows the config without running it), the dir a run would get,
    ``hydra.run.dir`` (a sweep's: ``hydra.sweep.dir``/``subdir``), not ``null`` and ``None/checkpoints``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    ran = OmegaConf.select(hydra, "runtime.output_dir", default=None, throw_on_missing=False)
    if ran:
        return str(ran)
    try:
        where = Path(hydra.sweep.dir, hydra.sweep.subdir) if hydra.mode == RunMode.MULTIRUN else Path(hydra.run.dir)
    except Exception:  # noqa: BLE001 - a sweep's subdir names its job, which a shown config has not
        return None
    return str(where.absolute())


_SPAWNED: list[str] = []  # a ddp_spawn rank's resume_with(), said by its parent: the rank has no Hydra config
_SPAWNED_IN_SWEEP: list[bool] = []  # and whether that parent runs a sweep's job


def note_spawned_resume(words: str | None, sweep: bool = False) -> None:
    """In a ``ddp_spawn`` rank: what :func:`resume_with` says, as its parent said it (``None``: the parent had no
    Hydra config either), and whether the parent runs a sweep's job (:func:`job_of_a_sweep`)."""
    _SPAWNED[:] = [words] if words else []
    _SPAWNED_IN_SWEEP[:] = [sweep]


def job_of_a_sweep() -> bool:
    """Whether this process runs a sweep's job: the sweep's own process, or a ``ddp_spawn`` rank it started (which
    has no Hydra config: ``in_sweep`` says no there)."""
    return in_sweep() or any(_SPAWNED_IN_SWEEP)


def resume_with(run_dir: str | Path | None = None) -> str:
    """How a stopped or failed run goes on: :func:`hydra_resume`'s words; in a ``ddp_spawn`` rank, its parent's; else
    in ``run_dir``, where given."""
    words = hydra_resume() or (_SPAWNED[0] if _SPAWNED else None)
    if words is None and run_dir:
        words = f"resume with {_arg('hydra.run.dir', run_dir)} ckpt_path=last"
    return words or "resume with ckpt_path=last"


def hydra_resume() -> str | None:
    """How the run Hydra runs in this process goes on (``None`` where it runs none). A run: ``resume with
    hydra.run.dir=DIR ckpt_path=last``, in its own run dir: the same command without it makes a new dir (the default
    is timestamped, srun's is named after the job step), where ``ckpt_path=last`` finds nothing. A sweep's job: the
    same command with the sweep's dir, which skips the finished jobs and resumes this one (src/sweeps/sweep.py's
    ResumingSweeper)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if in_sweep():
        kept = (
            "the study keeps its trials and this one goes on from its last.ckpt"
            if hydra.runtime.choices.get("hparams_search")
            else f"finished jobs are skipped and job {hydra.job.num} goes on from its last.ckpt"
        )
        sweep_dir = Path(hydra.sweep.dir).resolve()
        return f"run the same command again (with {_arg('hydra.sweep.dir', sweep_dir)}) to resume the sweep: {kept}"
    where = output_dir()
    return f"resume with {_arg('hydra.run.dir', where)} ckpt_path=last" if where else None


def _arg(key: str, path: str | Path) -> str:
    """``key=path`` as a shell takes it back whole: quoted where the path holds a space (Hydra takes it so)."""
    return shlex.quote(f"{key}={path}")


def hold(config: DictConfig, kind: str, shared: bool = False) -> Path:
    """Create (or claim, if timestamped) the ``hydra.<kind>.dir`` and lock it; refuse it if another run holds it.
    ``shared``: a dir named after the launch (torchrun's, srun's, mpirun's), which any process of the run may have
    made first: this run's unless a run before (a torchrun attempt before) has locked it."""
    node = config.hydra[kind]
    if not str(node.dir).strip():  # Path("") is the directory the run starts in: a checkout, a home
        report(
            f"hydra.{kind}.dir is empty (a shell variable that is not set?): give a dir, or leave it out for "
            f"outputs/{'runs' if kind == 'run' else 'multirun'}/<date>/<time>/"
        )
    path = Path(str(node.dir))
    if _timestamped(node):
        path, made = _claim_fresh(path)
        with read_write(config.hydra):
            node.dir = str(path)
            if kind == "sweep":  # each job's config is composed again from these overrides
                config.hydra.overrides.hydra.append(f'hydra.sweep.dir="{path}"')
    else:
        made = _missing(path)
        if shared and not made and not (path / LOCK_FILE).exists():
            made = [path.absolute()]
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a name too long, a folder not writable: the parents made before it go, while empty
            for folder in made:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            report(unwritable_run_dir(err))
    # what a refused run may take back: only a dir it holds, never one that another run, started the same instant,
    # made too and holds (that run refused this one)
    if lock_run_dir(path, kind, resumable=config.get("task_name", "train") == "train"):
        _made[:] = made
    return path


def _missing(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist (yet), deepest first."""
    missing, folder = [], path.absolute()
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def forget_refused_run() -> None:
    """Remove the run dir (or a sweep's dir) this process made, and the parents it made for it
    (``outputs/runs/<date>``), when the run was refused or stopped before it ran: called at exit status 2 and 130
    (Ctrl-C). Only a dir that holds nothing but what every run writes as it starts (Hydra's ``.hydra`` record of the
    config, the resolved ``config.yaml``, a sweep's ``multirun.yaml``, the lock file, this process's log, whose lines
    the console showed too, and the other ranks' logs while empty) goes: a job's dir, a log with lines in it, a
    checkpoint, a file of the user's, anything else keeps it, and so does a dir that was there before the run. The
    run's other ranks, refused too, remove their own logs while empty, and the folders they made
    (``leave_refused_run``)."""
    if not _made:
        if not is_launch_rank_zero():  # another rank of the run: its own log, and the folders it made, while empty
            # (a torchrun worker waits for nothing: its agent ends the node's workers, and one that outlived the
            # other node's agent by the wait broke torchrun's own failure report)
            leave_refused_run(wait_s=0.0 if torchrun.active() else TAKE_BACK_WAIT_S)
        return
    run_dir, parents = _made[0], _made[1:]
    _made.clear()
    logs = {h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)}
    jobs = {Path(log).stem for log in logs if os.path.dirname(log) == str(run_dir)}  # this process's: train
    if _take_back(run_dir, logs, jobs):
        for folder in parents:  # only while empty: a run started since may have made its own dir there
            try:
                with contextlib.suppress(FileNotFoundError):  # taken back by another rank of the run, refused too
                    folder.rmdir()
            except OSError:  # something new in it: it stays
                return


def _take_back(run_dir: Path, logs: set[str], jobs: set[str]) -> bool:
    """Remove ``run_dir`` where it holds only what every run writes as it starts (``forget_refused_run``): ``logs``
    the first process's log files, ``jobs`` their names (``train``: the other ranks' logs, ``train_rank1.log``, go
    while empty). True where it went (or was gone)."""
    try:
        entries = list(os.scandir(run_dir))
        hydra = [e.name for e in os.scandir(run_dir / ".hydra")] if (run_dir / ".hydra").is_dir() else []
        if not set(hydra) <= HYDRA_RECORD or not all(_start_file(e, logs) or _empty_rank_log(e, jobs) for e in entries):
            return False
        for name in hydra:
            with contextlib.suppress(FileNotFoundError):  # another rank of the run taking it back (_take_back_unheld)
                (run_dir / ".hydra" / name).unlink()
        # the lock file last: until it goes, a run pointed here is refused, and one that comes after finds the dir
        # empty of this run's files (its own lock then keeps the dir)
        for entry in sorted(entries, key=lambda e: e.name == LOCK_FILE):
            with contextlib.suppress(FileNotFoundError):  # a rank's empty log, which that rank removed meanwhile
                (os.rmdir if entry.name == ".hydra" else os.unlink)(entry.path)
        with contextlib.suppress(FileNotFoundError):  # taken back by another rank of the run, refused too
            run_dir.rmdir()
    except FileNotFoundError:  # taken back as it was listed
        return True
    except OSError:  # something new in it: what is left stays
        return False
    return True


def leave_refused_run(wait_s: float = 0.0) -> None:
    """What a rank other than the run's first takes back as it ends refused: its log while empty, and the folders
    that were not there as it started, while empty: the run dir and its parents, where this rank made them (before
    the first, or again after the first took them back: under mpirun or srun a rank that starts a second late finds
    the dir gone and makes it again; one that found the dir there as the first had made it, and finds it made again,
    takes back the run dir: ``_made_again``). A torchrun worker, a quiet srun task or mpirun rank does it once the
    first has ended (src/launch/torchrun.py, ``before_error_line`` in src/launch/ranks.py); a rank that says its own
    line (mpirun's or srun's, once MPI is initialised or the group formed) waits up to ``wait_s`` for the first to
    take back its files in the run dir, then takes back the parents it made, which the first, started after it, did
    not know it made. Only folders this rank made, and only while empty: one another run or rank still uses stays."""
    drop_empty_run_log()
    deadline = time.monotonic() + wait_s
    for i, folder in enumerate(_found_missing or _made_again()):  # deepest first
        while True:
            try:
                with contextlib.suppress(FileNotFoundError):  # taken back by the first
                    folder.rmdir()
                break
            except OSError:  # not empty: the first's files, another rank's log, another run's dir
                if i == 0 and _take_back_unheld(folder):
                    break
                if i > 0 or time.monotonic() >= deadline:
                    return
                time.sleep(0.02)  # the run dir: the first, refused too, is taking its files back


def _made_again() -> list[Path]:
    """The run dir this rank found there as it started, locked by the first, where it is there without the lock now:
    the first took it back (the lock goes last, then the dir), and Hydra made it again for this rank, or another rank
    of the run did, before the task's first line. A dir that was there before the run keeps its lock file, and
    stays. (Not the folder's inode: a filesystem such as ext4 gives the one made again the same number.)"""
    return [path for path in _found_locked if path.is_dir() and not (path / LOCK_FILE).exists()]


def _take_back_unheld(run_dir: Path) -> bool:
    """Take back the run dir this rank found missing as it started, where the run's first process has ended without
    taking it back: it found the dir there (this rank, or another, made it first: ``hydra.run.dir=DIR`` under a
    launcher) and took it for one that was there before the run. Only once the first's lock is free (it has ended),
    and only its start files (``_take_back``). True where the dir went."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return False
    job = HydraConfig.get().job.name
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # no lock yet: the first has not held the dir (or has taken it back)
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: the first lives (or locks fail here): it stays
        return _take_back(run_dir, {str(run_dir / f"{job}.log")}, {job})
    except OSError:
        return False
    finally:
        os.close(fd)


def _start_file(entry: os.DirEntry, logs: set[str]) -> bool:
    if entry.name == ".hydra":
        return entry.is_dir(follow_symlinks=False)
    started = entry.name in (LOCK_FILE, CONFIG_FILE, MULTIRUN_FILE) or os.path.abspath(entry.path) in logs
    return started and entry.is_file(follow_symlinks=False)


def _empty_rank_log(entry: os.DirEntry, jobs: set[str]) -> bool:
    """Another process's log of this run (``train_rank1.log``, ``train_node1_local0.log``: conf/hydra/default.yaml),
    for ``jobs`` the names of this process's logs there, that is still empty: the other ranks of a refused run met the
    same mistake and said nothing there."""
    named = any(re.fullmatch(rf"{re.escape(job)}_(rank\d+|node\d+_local\d+)\.log", entry.name) for job in jobs)
    return named and entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_size == 0


def _timestamped(node: DictConfig) -> bool:
    """Whether ``hydra.run`` / ``hydra.sweep`` still has the default, timestamped dir."""
    written = OmegaConf.to_container(node, resolve=False)
    return isinstance(written, dict) and "${now:" in str(written["dir"])


def _claim_fresh(path: Path) -> tuple[Path, list[Path]]:
    """``path``, or the first of ``path_2``, ``path_3``, ... that no run has owned: creating its lock file is the
    claim. (Another rank of this run may have made the folder already, as a torchrun worker does; it has no
    lock file.) With it, the folders this made for it (``_missing``)."""
    for n in range(1, 10_000):
        candidate = path if n == 1 else path.with_name(f"{path.name}_{n}")
        made = _missing(candidate)
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            os.close(os.open(candidate / LOCK_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return candidate, made
        except FileExistsError:
            continue
        except OSError as err:
            report(unwritable_run_dir(err))
    report(f"cannot find a free run dir next to {path}: pass hydra.run.dir=DIR")


def lock_run_dir(path: Path, kind: str = "run", resumable: bool = True) -> bool:
    """Hold ``path`` for as long as this process lives, or refuse it (one line, exit 2) if another run holds it.
    False where it goes on without the lock (a filesystem without locks, a requeued Slurm job's earlier run's).
    ``resumable``: a training's dir, which the refusal's line says how to continue (not an eval's or an export's)."""
    lock_path = path / LOCK_FILE
    try:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # taken back since it was made: by a refused worker of this run (leave_refused_run)
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        report(unwritable_run_dir(err))
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EAGAIN):  # a filesystem without locks (Lustre without -o flock)
            os.close(fd)
            warning_line(
                log, f"cannot lock {lock_path} ({err.strerror}): a second run pointed at this dir would not be refused"
            )
            return False
        holder = _holder(fd)
        os.close(fd)
        if holder is not None and _earlier_run_of_this_slurm_job(holder):
            warning_line(
                log,
                f"{lock_path} is still locked by an earlier run of Slurm job {holder['slurm_job']} "
                f"(pid {holder['pid']} on {holder['host']}), which Slurm has ended: continuing in its run dir",
            )
            return False
        held_by = (
            f"pid {holder['pid']} on host {holder['host']} holds it (since {holder['started']})"
            if holder
            else f"another process holds {lock_path}"
        )
        resume = " (to continue that run once it has ended: ckpt_path=last)" if kind == "run" and resumable else ""
        report(
            f"hydra.{kind}.dir={path} is in use by another run: {held_by}; wait for it to end, or pass another "
            f"hydra.{kind}.dir=DIR{resume}"
        )
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same, only the holder's name is missing
    _held.append(fd)
    return True


def _holder(fd: int) -> dict[str, Any] | None:
    """Who holds the lock, as its holder wrote it (it writes just after locking: wait a moment for it)."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            return json.loads(os.pread(fd, 4096, 0))
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def _earlier_run_of_this_slurm_job(holder: dict[str, Any] | None) -> bool:
    """A requeued Slurm job restarts only after every process of its earlier run has ended, yet a lock held
    from a node that went down can outlive them on a shared filesystem until the lock manager notices."""
    job = os.environ.get("SLURM_JOB_ID")
    return (
        holder is not None
        and job is not None
        and holder.get("slurm_job") == job
        and holder.get("slurm_restart") != os.environ.get("SLURM_RESTART_COUNT", "0")
    )


# -- a run dir taken up again, and how a run in it ended ---------------------------------------------------------

RESULT_FILE = "result.json"  # written when a training run ends well: a sweep does not run that job again


def record_result(run_dir: str | Path, **result: Any) -> None:
    """Write ``DIR/result.json``: the run ended well (the run's owner calls this last), with what it returns."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None
    write_json(
        Path(run_dir) / RESULT_FILE, {"finished": time.strftime("%Y-%m-%d %H:%M:%S"), **result, "overrides": overrides}
    )


def read_result(run_dir: str | Path) -> dict[str, Any] | None:
    """What ``DIR/result.json`` says, or None if the run there never ended well."""
    return read_json(Path(run_dir) / RESULT_FILE)


# -- the small files runs keep beside their outputs ---------------------------------------------------------------


def write_json(path: Path, data: Any, sort_keys: bool = False) -> None:
    """Write ``path`` whole or not at all: a process killed while writing leaves the earlier file (or none), never
    half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    """The object in ``path``, or None where there is none (missing, unreadable, cut off, not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (created, and its folder, if missing) for the ``with`` block, waiting for
    it: the processes that take it one after another (a run's ranks, runs started together) see each other's work."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


torchrun.QUIET_END.append(leave_refused_run)  # a torchrun worker that left a mistake to local rank 0
