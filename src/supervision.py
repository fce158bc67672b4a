"""Keeps a run's processes together: one that dies takes the others down at once, with one line naming it.

Single-process code either runs or fails; a DDP run can lose one rank while the others wait in a
collective until the timeout, or keep training as orphans of a launcher that was killed. Here:

- the process that started local ranks (rank zero of ``strategy=ddp``) watches them: when one dies it
  prints which rank, how, and stops the rest;
- every started rank watches its launcher (rank zero, or the ``ddp_spawn`` parent) and stops when it goes;
- a peer's broken connection or a spawned rank's death becomes one line instead of a gloo traceback.

A rank that exits with ``128 + SIGTERM`` stopped on request (src/callbacks/graceful_stop.py), not by a fault.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence


EXIT_RANK_FAILED = 1
POLL_S = 0.25
_STOPPED_ON_REQUEST = {128 + signal.SIGTERM}
_report_lock = threading.Lock()
_reported = False
_stopped_here: set[int] = set()  # pids this process stopped on purpose: their ending is no failure


def how_it_ended(returncode: int) -> str:
    """'killed by SIGKILL' for -9 (Popen) or 137 (a shell's 128+9); 'exited with code 3' otherwise."""
    signum = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else None
    if signum is not None:
        try:
            return f"killed by {signal.Signals(signum).name}"
        except ValueError:
            pass
    return f"exited with code {returncode}"


def report_once(message: str) -> bool:
    """Print ``error: message`` unless another thread of this process already reported; True if this one did."""
    global _reported
    with _report_lock:
        if _reported:
            return False
        _reported = True
    print(f"error: {message}", file=sys.stderr, flush=True)
    return True


def stop_processes(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM the processes still running, then SIGKILL what is left after ``grace_s``."""
    _stopped_here.update(proc.pid for proc in procs)  # before any signal, so no watch reads one as a death
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def failed_child(procs: Sequence[subprocess.Popen], ranks: Sequence[int]) -> str | None:
    """'rank 1 (pid 123) died: killed by SIGKILL' for the first started rank that ended badly, else None."""
    for proc, rank in zip(procs, ranks):
        code = proc.poll()
        if code not in (None, 0) and code not in _STOPPED_ON_REQUEST and proc.pid not in _stopped_here:
            return f"rank {rank} (pid {proc.pid}) died: {how_it_ended(code)}"
    return None


def watch_children(procs: Sequence[subprocess.Popen], ranks: Sequence[int], exit_process: bool = True
                   ) -> threading.Thread:
    """In the launching rank: when a started rank dies, report it, stop the others, and (``exit_process``) exit.

    In a sweep the launching process runs the next jobs too: there it only stops this job's ranks, and the
    job's own error is recorded as its failure.
    """

    def watch() -> None:
        while True:
            running = any(p.poll() is None for p in procs)
            failure = failed_child(procs, ranks)
            if failure is not None:
                if exit_process:
                    abort(f"{failure}; stopped the other ranks", procs)
                stop_processes(procs, grace_s=2.0)
                return
            if not running:
                return
            time.sleep(POLL_S)

    thread = threading.Thread(target=watch, name="rank-watch", daemon=True)
    thread.start()
    return thread


def abort(message: str, procs: Sequence[subprocess.Popen] = ()) -> None:
    """Report, stop the given processes, and leave at once: this process may be stuck in a collective."""
    report_once(message)
    stop_processes(procs, grace_s=2.0)
    os._exit(EXIT_RANK_FAILED)


_launcher: tuple[int, int] | None = None  # (this rank, the pid of the process that started it)


def watch_launcher(rank: int, launcher_pid: int) -> threading.Thread:
    """In a started rank: when the process that launched it is gone, report and exit."""
    global _launcher
    _launcher = (rank, launcher_pid)

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(POLL_S)
        abort(launcher_gone())

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def launcher_gone() -> str | None:
    """'rank 1: its launching process (pid 123) died; ...' once the process that started this rank is gone."""
    if _launcher is None or os.getppid() == _launcher[1]:
        return None
    rank, pid = _launcher
    return f"rank {rank}: the process that launched it (pid {pid}) died; this rank stopped too"


def explain(err: BaseException) -> tuple[str | None, int] | None:
    """One line (None: already reported by the rank) and an exit code for a distributed failure behind ``err``."""
    from torch.multiprocessing import ProcessExitedException

    from src import launch

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ProcessExitedException):  # ddp_spawn: the parent learns that a rank ended
            code = err.exit_code if err.exit_code is not None else -signal.Signals[err.signal_name].value
            if code in _STOPPED_ON_REQUEST:  # rank zero has said where it stopped and how to resume
                return None, code
            return (f"rank {err.error_index} (pid {err.error_pid}) died: {how_it_ended(code)}; "
                    "stopped the other ranks"), EXIT_RANK_FAILED
        if _is_broken_connection(err):
            failure = launch.launched_failure()
            if failure is not None:
                return f"{failure}; stopped the other ranks", EXIT_RANK_FAILED
            gone = launcher_gone()
            if gone is not None:
                return gone, EXIT_RANK_FAILED
            return (f"the process group broke ({_first_sentence(err)}): another rank has probably died or lost "
                    "the network; see its log, then resume with ckpt_path=last"), EXIT_RANK_FAILED
        err = err.__cause__ or err.__context__
    return None


def _first_sentence(err: BaseException) -> str:
    """gloo's '[.../pair.cc:545] Read error [10.0.0.2]:3225: Connection reset by peer. This is ...' -> 'Read error ...'"""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(err).strip()) or type(err).__name__
    return text.split(". ")[0].splitlines()[0][:200]


def _is_broken_connection(err: BaseException) -> bool:
    import torch

    if isinstance(err, (torch.distributed.DistBackendError, torch.distributed.DistNetworkError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("gloo/transport" in text or "Connection reset by peer" in text
                                              or "Connection closed by peer" in text)
