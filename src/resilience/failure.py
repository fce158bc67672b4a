"""How a run ends when it does not end well: every failure's one line, its exit status, and who says it.

The invariant: a run that fails prints one ``error:`` line, from one process, and every process of the run stops,
with an exit status that says which kind: 2 for a mistake found before training (``UserError``), 1 for a run that
failed under way, ``128 + signal`` for a run stopped on request (130 Ctrl-C, 143 SIGTERM). Who does what:

1. **Meets it.** An exception ends an entry point's task (``src/cli/entry.py``) or a ``ddp_spawn`` rank
   (``src/distributed/strategy.py``): both call ``fail(err)``. A watch thread of ``supervision`` meets a rank that
   died, a launcher that went, or a rank that hangs (``HangWatch``), and has its line already.
2. **Decides the line and the status.** ``describe(err)``: a UserError's own line; a broken process group told as
   the rank that broke it; a full or read-only disk as what is intact; a device out of memory as the batch to try;
   anything else as its first line, its traceback in this process's log file. ``None``: another process tells it.
3. **Ends the process.** ``supervision.end_run(line, code)``: records the failure in the rendezvous store (the other
   ranks' watches read it, print nothing, and exit with its status), prints ``error: LINE`` if it is the run's
   first failure, stops the local ranks this process started, and exits: ``sys.exit`` in a lone process's main
   thread, ``os._exit`` everywhere else, since the main thread may be stuck in a collective that never returns.
4. **A sweep's job** (``-m``) records its line in the job's ``failure.json`` instead (``record_job_failure``), and
   the sweep goes on; its report names the failed job.
5. **A stop on request** is no failure: ``Terminated`` is raised on every rank after the same step
   (``src/callbacks/graceful_stop.py``), rank zero prints where it stopped and how to resume, and every process exits
   with ``128 + signal``. Ctrl-C where no step can stop (while starting, between a sweep's jobs): ``interrupted()``.
   Every command's process and every spawned rank handles SIGINT with ``on_sigint`` wherever no step listens: after
   its stop, a Ctrl-C (late, or pressed again) ends it at once with the stop's own status. A process started with
   SIGINT ignored (a shell's background job) keeps ignoring it everywhere (``sigint_ignored``), as Python does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, NoReturn

from src.core.errors import (
    EXIT_FAILED,
    EXIT_USER_ERROR,
    FAILURE_FILE,
    ToldElsewhere,
    UserError,
    loader_worker_gone_in,
    one_line,
    out_of_memory_in,
    print_line,
    shared_memory_full_in,
    storage_error_in,
    user_error_in,
    wants_traceback,
)
from src.launch import ranks, torchrun
from src.launch.run_dir import resume_with
from src.resilience import supervision, task_limit

log = logging.getLogger(__name__)


class Terminated(Exception):
    """Raised on every rank at the agreed batch; the entry point reports it and exits with ``exit_code``."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum

    @property
    def line(self) -> str:
        """What rank zero prints: ``interrupted (Ctrl-C) ...`` already says it; ``stopped: SIGTERM ...``."""
        return str(self) if self.signum == signal.SIGINT else f"stopped: {self}"


# the stop on request this process raised at the agreed step, whether its line is this process's to say, and whether
# it was said: what a SIGINT after it means (on_sigint)
_stop: dict[str, Any] = {}


def stopping(err: Terminated, speaks: bool) -> Terminated:
    """Note ``err`` as this process raises it at the agreed step; ``speaks``: rank zero's, which says its line."""
    _stop.update(err=err, speaks=speaks)
    return err


def _say_stop_line(err: Terminated, speaks: bool) -> None:
    if speaks and not _stop.get("said"):
        _stop["said"] = True
        print_line(err.line)


def on_sigint(signum: int, frame: Any) -> None:
    """SIGINT where no training step listens: before fit, and after Lightning's teardown, which puts back the handler
    it found at fit's start. Before a stop: Python's KeyboardInterrupt (one line, src/cli/entry.py). After this
    process raised its stop at the agreed step: the same Ctrl-C arriving late (``ddp_spawn``'s parent passes the
    terminal's on to its ranks, seconds late on a busy machine) or a second press ends it at once, with the stop's
    own status and line. As a KeyboardInterrupt there, it had ended a rank 'killed by SIGINT', and the run exit 1."""
    err = _stop.get("err")
    if err is None:
        raise KeyboardInterrupt
    _say_stop_line(err, bool(_stop.get("speaks")))
    supervision.quit_at_once(err.exit_code)


def sigint_ignored() -> bool:
    """Whether this process ignores SIGINT: started so (a job a shell started in the background, whose process group
    gets the terminal's Ctrl-C too), which Python keeps, and so does every handler of the project's."""
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def install_sigint_handler() -> None:
    """Make ``on_sigint`` this process's SIGINT handler where Python's own is: not where SIGINT is ignored (a job a
    shell started in the background keeps ignoring the terminal's Ctrl-C)."""
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, on_sigint)


def fail(err: BaseException, log_dir: str | None = None, rank_zero: bool | None = None) -> None:
    """End this process for ``err``, which ended its task: an entry point's, or a ``ddp_spawn`` rank's. Returns only
    in a sweep's job (the sweep goes on). ``log_dir``: where a traceback goes when logging has no file;
    ``rank_zero``: whether this process speaks for the run (a spawned rank knows; others ask their launcher)."""
    rank_zero = ranks.is_launch_rank_zero() if rank_zero is None else rank_zero
    if isinstance(err, Terminated):
        supervision.stop_watching_failures()  # every rank stops at this very step: a good end of sorts
        _stop.setdefault("err", err)
        _say_stop_line(err, rank_zero)
        supervision.reap_started(grace_s=60)  # they stop at the same batch; let them finish writing
        if rank_zero and ranks.in_sweep():
            print_line(stopped_line())
        sys.exit(err.exit_code)
    line, code = describe(err, log_dir)
    if ranks.in_sweep():
        if line is None and supervision.stopped_on_request(code):
            # a ddp_spawn job's ranks stopped on request, each at one step (their line said so): the sweep stops
            # with them, as it does where it trains itself (above). Before, it took them for a failed job and went
            # on to the next one: a Ctrl-C stopped only the job under way.
            if rank_zero:
                print_line(stopped_line())
            sys.exit(code)
        record_job_failure(line, code)
        return None
    if wants_traceback():
        traceback.print_exception(err)
    supervision.end_run(line, code)


def thread_out_of_tasks(err: BaseException) -> None:
    """End the run where ``err``, which ended a thread of this process (a failure or hang watch starting its helper,
    a writer), is a refused thread or process with a limit on tasks reached: the run's one line, as the main thread's
    would be. Before, the thread printed its traceback and was gone (a watch no longer watching), and the run went
    on or ended on another line. Returns where ``err`` is anything else."""
    line = task_limit.line_for(err)
    if line is not None:
        _log_traceback(err, None, console=False)  # in the log file only
        supervision.end_run(_named(line, True), EXIT_FAILED)


def interrupted() -> NoReturn:
    """Ctrl-C where no training step can stop cleanly (starting, between a sweep's jobs): exit 130, one line."""
    supervision.stop_watching_failures(wait=False)
    supervision.stop_processes(supervision.STARTED, grace_s=5.0)
    if ranks.is_launch_rank_zero():
        print_line("interrupted (Ctrl-C) outside a training step: nothing more was saved")
        if ranks.in_sweep():
            print_line(stopped_line())
    sys.exit(128 + signal.SIGINT)


def describe(err: BaseException, log_dir: str | None = None) -> tuple[str | None, int]:
    """The run's one error line for ``err`` (None when another process tells it) and the exit status.

    An unexpected exception keeps its traceback in this process's log file (``log_dir``: where to write one
    when logging has no file), and the line says where.
    """
    distributed = _distributed(err)
    if distributed is not None:
        return distributed
    cause = user_error_in(err)
    if isinstance(cause, ToldElsewhere) and not ranks.in_sweep():  # a sweep's process records each job's line
        return None, cause.exit_code
    if cause is not None:
        code = getattr(cause, "exit_code", EXIT_USER_ERROR)  # Lightning's MisconfigurationException: the user's
        mid_run = supervision.FAILURES is not None or code != EXIT_USER_ERROR
        return _named(one_line(str(cause)), mid_run), code
    reported = supervision.reported_failure()
    if reported is not None:  # another rank failed first; this one's error is most likely its echo
        return reported
    if shared_memory_full_in(err) is not None:  # before a full disk's line: its semaphores' error names no file
        _log_traceback(err, log_dir, console=False)
        return _named(shared_memory_line(), True), EXIT_FAILED
    worker = loader_worker_gone_in(err)
    if worker is not None:  # not a full disk's line either: the worker's socket, gone, is no file of the run's
        return _named(_with_traceback(str(worker).splitlines()[0], err, log_dir), True), EXIT_FAILED
    storage = storage_error_in(err)
    if storage is not None:
        return _named(_storage_line(storage), True), EXIT_FAILED
    memory = out_of_memory_in(err)
    if memory is not None:  # the line says all there is to do; torch's paragraph goes to the log file only
        from src.resilience.out_of_memory import line_for  # loads torch and Lightning

        _log_traceback(err, log_dir, console=False)
        return _named(line_for(memory), True), EXIT_FAILED
    limit_line = task_limit.line_for(err)
    if limit_line is not None:  # a limit on processes and threads reached: which, and what to change
        _log_traceback(err, log_dir, console=False)
        return _named(limit_line, True), EXIT_FAILED
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return _named(_with_traceback(f"{type(err).__name__}: {first}", err, log_dir), True), EXIT_FAILED


def shared_memory_line(shm: str = "/dev/shm") -> str:
    """What to do where the loader's workers found shared memory full: a container's 64 MB ``/dev/shm`` is the usual
    cause, and the dataset itself goes there where workers start by forkserver or spawn."""
    try:
        usage = shutil.disk_usage(shm)
        size = f" ({_megabytes(usage.free)} free of {_megabytes(usage.total)})"
    except OSError:
        size = ""
    return (
        f"the data loader's workers ran out of shared memory: {shm}{size} holds the batches they hand over, and the "
        "dataset where they start by forkserver or spawn (data.multiprocessing_context); give it more (docker run "
        "--shm-size=8g, a Kubernetes emptyDir of medium Memory), use fewer data.num_workers, or data.pipeline=device "
        "(no workers)"
    )


def _megabytes(size: int) -> str:
    mb = size / 2**20
    return f"{mb:,.0f} MB" if mb >= 10 or mb == 0 else f"{mb:.1f} MB"


def _distributed(err: BaseException | None) -> tuple[str | None, int] | None:
    """One line (None: told elsewhere) and an exit code for a distributed failure behind ``err``. A process that has
    not loaded torch has no distributed failure: a mistake found before that ends without loading it (2 s)."""
    if "torch" not in sys.modules:
        return None
    from torch.multiprocessing import ProcessExitedException

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, UserError):  # its own line says what to change (a rendezvous that timed out, and where)
            return None
        if isinstance(err, ProcessExitedException):  # ddp_spawn: the parent learns that a rank ended
            code = err.exit_code if err.exit_code is not None else -signal.Signals[err.signal_name].value
            if supervision.said_why(code):  # the rank said why (or, after SIGTERM, where it stopped and how to resume)
                return None, code
            return (
                f"rank {err.error_index} (pid {err.error_pid}) died: {supervision.how_it_ended(code)}; "
                "stopped the other ranks"
            ), EXIT_FAILED
        if _is_broken_connection(err):
            reported = supervision.reported_failure()
            if reported is not None:  # a rank failed, and this one lost its connection to it
                return reported
            failure = supervision.failed_child(supervision.STARTED, supervision.STARTED_RANKS)
            if failure is not None:
                message, code = failure
                return (
                    (None, code) if supervision.said_why(code) else (f"{message}; stopped the other ranks", EXIT_FAILED)
                )
            gone = supervision.launcher_gone()
            if gone is not None:
                return gone, EXIT_FAILED
            if (
                supervision.watches_a_launcher() and not torchrun.active()
            ):  # it watches this node's ranks and tells which died
                return None, EXIT_FAILED
            then = (
                "torchrun restarts the group from last.ckpt while --max-restarts allows"
                if torchrun.active()
                else f"see its log, then {resume_with()}"
            )
            return (
                f"the process group broke ({_first_sentence(err)}): another rank has probably died or lost "
                f"the network; {then}"
            ), EXIT_FAILED
        err = err.__cause__ or err.__context__
    return None


def _named(line: str, mid_run: bool) -> str:
    """Prefix the rank in a run of several processes, for a failure under way."""
    return f"{supervision.rank_label()}: {line}" if mid_run and supervision.in_distributed_run() else line


def _storage_line(err: OSError) -> str:
    """A write outside the checkpoints (TensorBoard's events, a log) refused: the same line a checkpoint's gets."""
    from hydra.core.hydra_config import HydraConfig

    from src.checkpoints.files import refused_write  # loads torch: only once a run is under way

    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    run_dir = hydra.runtime.output_dir if hydra is not None else None
    checkpoints = Path(run_dir, "checkpoints") if run_dir else None
    trains = hydra is None or hydra.job.name == "train"  # src.eval: no checkpoint to name
    return refused_write(err, None, checkpoints, trains=trains)


def _with_traceback(line: str, err: BaseException, log_dir: str | None) -> str:
    """``line``, saying where ``err``'s traceback went (``_log_traceback``)."""
    logged = _log_traceback(err, log_dir)
    return f"{line} (traceback in {logged})" if logged else line


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
    record = logging.LogRecord(
        log.name, logging.ERROR, __file__, 0, "the run failed:", None, (type(err), err, err.__traceback__)
    )
    for handler in files:
        handler.handle(record)
        handler.flush()
    path = files[0].baseFilename
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def _first_sentence(err: BaseException) -> str:
    """gloo's '[.../pair.cc:545] Read error [10.0.0.2]:3225: Connection reset by peer. This is ...' -> 'Read
    error [10.0.0.2]:3225: Connection reset by peer'."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip()) or type(err).__name__
    return text.split(". ")[0].splitlines()[0][:200]


def _is_broken_connection(err: BaseException) -> bool:
    import torch

    if isinstance(err, (torch.distributed.DistBackendError, torch.distributed.DistNetworkError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and (
        "gloo/transport" in text or "Connection reset by peer" in text or "Connection closed by peer" in text
    )


def record_job_failure(line: str | None, code: int) -> None:
    """A sweep's job failed: stop its other ranks, print and record its line; the sweep goes on."""
    from hydra.core.hydra_config import HydraConfig

    if supervision.FAILURES is not None:
        record = supervision.FAILURES.read(from_store=True)
        if line is None and record is not None:
            line = record["line"]  # a rank of this job said it, on its own stderr
        supervision.FAILURES.publish(line, code)  # the job's ranks on other nodes stop too
    supervision.stop_processes(supervision.STARTED, grace_s=2.0)
    line = line or next(iter(supervision.SPAWNED_SAID), None)  # a ddp_spawn rank's, its group gone with it
    supervision.SPAWNED_SAID.clear()
    message = line or "a rank of this job failed: see its log"
    job = HydraConfig.get().job
    print_line(f"error: job {job.num} ({' '.join(HydraConfig.get().overrides.task)}): {message}")
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / FAILURE_FILE).write_text(json.dumps({"job": job.num, "error": message, "exit_code": code}, indent=2) + "\n")


def stopped_line() -> str:
    """What a sweep (or a search) stopped on request (Ctrl-C, SIGTERM) says: the same command resumes it."""
    from hydra.core.hydra_config import HydraConfig

    return f"the sweep stopped at job {HydraConfig.get().job.num}: {resume_with()}"
