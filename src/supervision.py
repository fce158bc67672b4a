"""Keeps a run's processes together: when one of them fails, every process of the run stops within seconds, on
every node, and the failure is told once.

Single-process code either runs or fails; a DDP run can lose one rank while the others wait in a
collective until the timeout, or keep training as orphans of a launcher that was killed. Here:

- the process that started local ranks (rank zero of ``strategy=ddp``) watches them: when one dies it
  says which rank and how, and stops the rest;
- every started rank watches its launcher (rank zero, or the ``ddp_spawn`` parent) and stops when it goes;
- once the process group exists, every rank also watches one record in the run's rendezvous store (the
  ``MASTER_ADDR:MASTER_PORT`` key-value store torch.distributed already runs): the first rank that fails
  writes what happened there, and every other rank, on every node, stops within a poll of reading it.
  NCCL and gloo would only notice when a collective breaks or times out; a rank stuck in a barrier waits
  for the failed one forever.

``end_run`` is the one way out of a failed run: it writes that record, prints the run's one ``error:`` line
(the failing rank prints it; ranks that follow print nothing, except a node's first rank when the failure
was on another node and the outputs are not merged, as they are under srun), stops the processes this one
started, and exits. A rank that exits with ``1``, ``2`` or ``128 + SIGTERM`` has said why itself; one that
dies of a signal has not, and its watcher says it for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, NoReturn, Sequence

from src import torchrun
from src.errors import EXIT_FAILED, EXIT_USER_ERROR

POLL_S = 0.25
SEEN_WAIT_S = 5.0  # how long a failing store host waits for the others to read the record before it goes
DONE_WAIT_S = 10.0  # ... and, at a good end, for the others to stop watching
_STOPPED_ON_REQUEST = 128 + signal.SIGTERM
_SAID_WHY = {EXIT_FAILED, EXIT_USER_ERROR, _STOPPED_ON_REQUEST}  # exit codes of a rank that told its own story
_stopped_here: set[int] = set()  # pids this process stopped on purpose: their ending is no failure
_ending = threading.Lock()  # held by the thread that is ending this process

# Local ranks started by this process, so a job can wait for (or stop) its own before the next one starts.
STARTED: list[subprocess.Popen] = []
STARTED_RANKS: list[int] = []


def how_it_ended(returncode: int) -> str:
    """'killed by SIGKILL' for -9 (Popen) or 137 (a shell's 128+9); 'exited with code 3' otherwise."""
    signum = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else None
    if signum is not None:
        try:
            return f"killed by {signal.Signals(signum).name}"
        except ValueError:
            pass
    return f"exited with code {returncode}"


def said_why(returncode: int) -> bool:
    """Whether a rank that ended with ``returncode`` printed its own reason (or stopped on request)."""
    return returncode in _SAID_WHY


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


def failed_child(procs: Sequence[subprocess.Popen], ranks: Sequence[int]) -> tuple[str, int] | None:
    """('rank 1 (pid 123) died: killed by SIGKILL', its exit code) for a started rank that ended badly: one that
    did not say why first (a rank that did may only have lost its connection to it)."""
    ended = []
    for proc, rank in zip(procs, ranks):
        code = proc.poll()
        if code not in (None, 0, _STOPPED_ON_REQUEST) and proc.pid not in _stopped_here:
            ended.append((f"rank {rank} (pid {proc.pid}) died: {how_it_ended(code)}", code))
    return min(ended, key=lambda failure: said_why(failure[1]), default=None)


def track(procs: Sequence[subprocess.Popen], ranks: Sequence[int], exit_process: bool = True) -> None:
    """Remember local ranks this process started, and watch them (see ``watch_children``)."""
    STARTED.extend(procs)
    STARTED_RANKS.extend(ranks)
    watch_children(procs, ranks, exit_process)


def reap_started(grace_s: float) -> tuple[str, int] | None:
    """Wait up to ``grace_s`` for the local ranks this process started, kill what is left, forget them all.

    Returns how the first one that ended badly ended, or None.
    """
    deadline = time.monotonic() + grace_s
    for proc in STARTED:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logging.getLogger(__name__).warning("local rank pid %s still running %.0f s after this one finished: "
                                                "killing it", proc.pid, grace_s)
            _stopped_here.add(proc.pid)
            proc.kill()
            proc.wait()
    failure = failed_child(STARTED, STARTED_RANKS)
    STARTED.clear()
    STARTED_RANKS.clear()
    return failure


def watch_children(procs: Sequence[subprocess.Popen], ranks: Sequence[int], exit_process: bool = True
                   ) -> threading.Thread:
    """In the launching rank: when a started rank dies, say so (unless it did), stop the others, and
    (``exit_process``) end the run.

    In a sweep the launching process runs the next jobs too: there it only stops this job's ranks, and the
    job's own error is recorded as its failure.
    """

    def watch() -> None:
        while True:
            running = any(p.poll() is None for p in procs)
            failure = failed_child(procs, ranks)
            if failure is not None:
                message, code = failure
                if exit_process:
                    if said_why(code):
                        end_run(None, code, publish=False)
                    end_run(f"{message}; stopped the other ranks", EXIT_FAILED, dead=1)
                stop_processes(procs, grace_s=2.0)
                return
            if not running:
                return
            time.sleep(POLL_S)

    thread = threading.Thread(target=watch, name="rank-watch", daemon=True)
    thread.start()
    return thread


_launcher: tuple[int, int, str] | None = None  # (this rank, the pid of the process that started it, what it is)


def watch_launcher(rank: int, launcher_pid: int, what: str = "the process that launched it") -> threading.Thread:
    """In a started rank: when the process that launched it is gone, report and exit."""
    global _launcher
    _launcher = (rank, launcher_pid, what)

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(POLL_S)
        end_run(launcher_gone(), EXIT_FAILED)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def launcher_gone() -> str | None:
    """'rank 1: its launching process (pid 123) died; ...' once the process that started this rank is gone."""
    if _launcher is None or os.getppid() == _launcher[1]:
        return None
    rank, pid, what = _launcher
    return f"rank {rank}: {what} (pid {pid}) died; this rank stopped too"


class FailureRecord:
    """The run's first failure, in its rendezvous store, where every rank of every node polls for it.

    Keys are prefixed per torchrun attempt (src/torchrun.py): its agent keeps one store across restarts.
    """

    def __init__(self, rank: int, node_rank: int, local_rank: int, world_size: int, in_sweep: bool) -> None:
        import torch.distributed as dist

        self.rank, self.node_rank, self.local_rank, self.world_size = rank, node_rank, local_rank, world_size
        self.in_sweep = in_sweep
        self._prefix = torchrun.attempt_prefix() + "failure/"
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=timedelta(seconds=30), wait_for_workers=False)
        self._lock = threading.Lock()  # one store call at a time, and none once closed
        self._closed = False
        self.echoing = False  # this rank has read another rank's failure

    def _call(self, method: str, *args: Any) -> Any:
        """A store call, or None once closed or when the store is gone (its host, rank 0, has ended)."""
        with self._lock:
            if self._closed:
                return None
            try:
                return getattr(self._store, method)(*args)
            except Exception:  # noqa: BLE001 - DistNetworkError, RuntimeError: the store host is gone
                self._closed = True
                return None

    def publish(self, line: str | None, code: int, dead: int = 0) -> bool:
        """Write this rank's failure unless one is there already; True if this one is the run's failure."""
        record = json.dumps({"rank": self.rank, "node": self.node_rank, "host": socket.gethostname(),
                             "line": line, "code": code})
        current = self._call("compare_set", self._prefix + "failure", "", record)
        self._call("add", self._prefix + "seen", 1 + dead)
        return current is None or current.decode() == record  # no store: nobody else can have reported

    def read(self) -> dict[str, Any] | None:
        """The run's failure, if a rank has written one."""
        if not self._call("check", [self._prefix + "failure"]):
            return None
        value = self._call("get", self._prefix + "failure")
        return None if value is None else json.loads(value)

    def follow(self) -> tuple[str | None, int] | None:
        """If another rank has failed the run: acknowledge it, and return what this rank should print (mostly
        nothing) and the exit code. From then on this rank only echoes that failure: it never claims the run's."""
        record = self.read()
        if record is None or record["rank"] == self.rank:  # its own: this rank is ending already
            return None
        self._call("add", self._prefix + "seen", 1)
        self.echoing = True
        return self.line_for_this_rank(record), record["code"]

    def wait_for(self, key: str, seconds: float) -> None:
        """Wait until every rank has added itself to ``key`` (the store host must not go before they have)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            count = self._call("add", self._prefix + key, 0)
            if count is None or count >= self.world_size:
                return
            time.sleep(0.05)

    def close(self, wait: bool = True) -> None:
        """Stop watching; at a good end (``wait``) rank 0, the store's host, waits until every rank has."""
        if self._closed:
            return
        self._call("add", self._prefix + "done", 1)
        if self.rank == 0 and wait:
            self.wait_for("done", DONE_WAIT_S)
        with self._lock:
            self._closed = True

    def watch(self) -> threading.Thread:
        def loop() -> None:
            while not self._closed:
                if launcher_gone() is not None:  # the launcher may host the store: its watch takes over
                    return
                failure = self.follow()
                if failure is not None:
                    if self.in_sweep:  # a sweep's process runs the next job: stop this job's ranks only
                        stop_processes(STARTED, grace_s=2.0)
                        return
                    end_run(*failure, publish=False)
                time.sleep(POLL_S)

        thread = threading.Thread(target=loop, name="failure-watch", daemon=True)
        thread.start()
        return thread

    def line_for_this_rank(self, record: dict[str, Any]) -> str | None:
        """The failing rank printed the line; a node's first rank repeats it where that output is not seen."""
        merged = "SLURM_STEP_ID" in os.environ  # srun gathers every task's output in one place
        if record["node"] == self.node_rank or self.local_rank != 0 or merged or not record["line"]:
            return None
        return f"{record['line']} [on {record['host']}]; this node's ranks stopped too"


FAILURES: FailureRecord | None = None


def watch_failures(rank: int, node_rank: int, local_rank: int, world_size: int, in_sweep: bool = False) -> None:
    """Once the process group exists: join the run's failure record and watch it (see the module's docstring)."""
    global FAILURES
    if world_size < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return
    FAILURES = FailureRecord(rank, node_rank, local_rank, world_size, in_sweep)
    FAILURES.watch()


def stop_watching_failures(wait: bool = True) -> None:
    """At a good end (or a job's end in a sweep): this rank no longer follows the run's failure record."""
    global FAILURES
    if FAILURES is not None:
        FAILURES.close(wait)
        FAILURES = None


def reported_failure() -> tuple[str | None, int] | None:
    """If another rank has already failed the run: what this rank should print (mostly nothing) and the code."""
    return None if FAILURES is None else FAILURES.follow()


def in_distributed_run() -> bool:
    """Whether this process is one rank of several (its failures then name the rank)."""
    return FAILURES is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank_label() -> str:
    """'rank 3' for this process, or 'node 1 local rank 0' before a process group has told the global rank."""
    if FAILURES is not None:
        return f"rank {FAILURES.rank}"
    if "RANK" in os.environ:
        return f"rank {os.environ['RANK']}"
    if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ:
        return f"rank {os.environ['SLURM_PROCID']}"
    node, local = os.environ.get("NODE_RANK", "0"), os.environ.get("LOCAL_RANK", "0")
    return f"rank {local}" if node == "0" else f"node {node} local rank {local}"


def end_run(line: str | None, code: int, publish: bool = True, dead: int = 0) -> NoReturn:
    """End this process of a failed run: record the failure for the other ranks, print ``error: line`` if this
    is the run's first failure, stop the local ranks it started, and exit with ``code``.

    ``dead``: ranks known dead, which will never read the record. Several threads may get here at once (the
    main one with an exception, a watch); the first ends the process, the others wait for it.
    """
    if not _ending.acquire(blocking=False):
        while True:
            time.sleep(60)
    publish = publish and FAILURES is not None and not FAILURES.echoing
    first = FAILURES.publish(line, code, dead) if publish else True
    if line and first:
        print(f"error: {line}", file=sys.stderr, flush=True)
    if FAILURES is not None and FAILURES.rank == 0 and not torchrun.active():
        FAILURES.wait_for("seen", SEEN_WAIT_S)  # it hosts the store: the others must read the record first
        # (torchrun's agent hosts it there, and outlives this rank)
    stop_processes(STARTED, grace_s=2.0)
    if FAILURES is None and threading.current_thread() is threading.main_thread():
        sys.exit(code)  # one process and nothing started: the ordinary way out
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)  # not sys.exit: the main thread may be stuck in a collective, a process group may hang teardown


def explain(err: BaseException) -> tuple[str | None, int] | None:
    """One line (None: told elsewhere) and an exit code for a distributed failure behind ``err``."""
    from torch.multiprocessing import ProcessExitedException

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, ProcessExitedException):  # ddp_spawn: the parent learns that a rank ended
            code = err.exit_code if err.exit_code is not None else -signal.Signals[err.signal_name].value
            if said_why(code):  # the rank said why (or, after SIGTERM, where it stopped and how to resume)
                return None, code
            return (f"rank {err.error_index} (pid {err.error_pid}) died: {how_it_ended(code)}; "
                    "stopped the other ranks"), EXIT_FAILED
        if _is_broken_connection(err):
            reported = reported_failure()
            if reported is not None:  # a rank failed, and this one lost its connection to it
                return reported
            failure = failed_child(STARTED, STARTED_RANKS)
            if failure is not None:
                message, code = failure
                return (None, code) if said_why(code) else (f"{message}; stopped the other ranks", EXIT_FAILED)
            gone = launcher_gone()
            if gone is not None:
                return gone, EXIT_FAILED
            if _launcher is not None and not torchrun.active():  # it watches this node's ranks and tells which died
                return None, EXIT_FAILED
            then = ("torchrun restarts the group from last.ckpt while --max-restarts allows" if torchrun.active()
                    else "see its log, then resume with ckpt_path=last")
            return (f"the process group broke ({_first_sentence(err)}): another rank has probably died or lost "
                    f"the network; {then}"), EXIT_FAILED
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
