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

A rank can also hang without dying (a deadlock, a stuck read on a network filesystem, a stopped process): the
others then wait for it in the next collective until ``strategy.timeout_s``. ``HangWatch`` finds it sooner:
every rank publishes where it is (src/resilience/heartbeat.py) and a pulse from a thread of its own; when no rank has
moved for ``strategy.hang_timeout_s`` while one of them is behind the others (or its pulse stopped), that rank
writes its stack to its log and the run ends with one line naming it. Which rank that is, of those that hold the
others back, is ``culprits``'s rule.

The threads of a rank, all daemons, each with one job: ``rank-watch`` (in a process that started local ranks: their
exits), ``launcher-watch`` (in a started rank: its launcher's), ``failure-watch`` (once the group exists: the
failure record, read from the node's board), ``failure-wait`` (the node's reporter only: the store's blocking wait
for that record), ``hang-watch`` (this rank's record and pulse, and the judge's rounds) and ``hang-watch-store``
(the store calls of a round, which a stopped store host can hold forever, apart from the loop that counts the
time). The invariant: whichever thread first calls ``end_run`` ends the process, and the others wait for it; the
failure path from an exception to the exit status is src/resilience/failure.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from src.core.errors import EXIT_FAILED, EXIT_USER_ERROR, console_turn, print_line
from src.launch import torchrun
from src.launch.ranks import before_error_line, in_sweep, launcher_rank, proc_stat
from src.launch.run_dir import resume_with
from src.resilience.node_board import NodeBoard

POLL_S = 0.25
SEEN_WAIT_S = 5.0  # how long a failing store host waits for the others to read the record before it goes
SPEAK_WAIT_S = 2.0  # how long a local rank whose failure is the run's gets to print its line and end by itself
DONE_WAIT_S = 10.0  # ... and, at a good end, for the others to stop watching
WAIT_S = 24 * 3600.0  # a node's reporter waits this long for the run's failure in one request, then again
# (torch logs a timed-out wait twice on stderr: a short one would fill the logs; rank 0 ends the wait at a good end)
BOARD_STALE_S = 3.0  # a local rank whose pulse on the node's board is older stops being the node's reporter
WAITER_JOIN_S = 5.0  # how long a good end waits for its failure wait to return (rank 0's "ended" wakes it)
RUN_WAIT_S = 120.0  # how long a rank waits for rank 0 to say which run this is
# A rank's connection to the store when it fails or ends: the store has answered all run long, so one that does not
# answer within this long has gone with its host (rank 0, ending too). torch's client tries a refused connection
# again until its timeout, and the whole connection twice: at 30 s, a rank that found the host alive an instant
# before it ended waited a minute to exit.
END_CONNECT_S = 5.0
_STOPPED_ON_REQUEST = 128 + signal.SIGTERM
_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C: rank zero says where the run stopped
_HUNG_UP = 128 + signal.SIGHUP  # the terminal gone: stopped at a step as on SIGTERM, its line in the log
_STOPS = (_STOPPED_ON_REQUEST, _INTERRUPTED, _HUNG_UP)  # exit codes of a rank stopped on request: no failure
# exit codes of a rank that told its own story
_SAID_WHY = {EXIT_FAILED, EXIT_USER_ERROR, *_STOPS}
_stopped_here: set[int] = set()  # pids this process stopped on purpose: their ending is no failure
_ending = threading.Lock()  # held by the thread that is ending this process

OPEN_LINES: list[Callable[[], bool]] = []  # whether a progress bar may have left a line unfinished
BARS_DRAWN: list[Callable[[], bool]] = []  # whether this process has drawn a progress bar (live, on a terminal)
KILL_NOTES: list[Callable[[int], None]] = []  # told the pid of a stuck rank this process kills (ddp_spawn's parent)
SAID_NOTES: list[Callable[[str], None]] = []  # told the failure line this process says (ddp_spawn: for the parent)
SPAWNED_SAID: list[str] = []  # in ddp_spawn's parent: the line its ranks said as they failed (a sweep's record)

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


def stopped_on_request(returncode: int) -> bool:
    """Whether a rank that ended with ``returncode`` stopped on request (Ctrl-C, SIGTERM, a hangup), not failed."""
    return returncode in _STOPS


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
        if code not in (None, 0, *_STOPS) and proc.pid not in _stopped_here:
            ended.append((f"rank {rank} (pid {proc.pid}) died: {how_it_ended(code)}", code))
    return min(ended, key=lambda failure: said_why(failure[1]), default=None)


def track(procs: Sequence[subprocess.Popen], ranks: Sequence[int], exit_process: bool | None = None) -> None:
    """Remember local ranks this process started, and watch them (see ``watch_children``). A death ends this
    process too (``exit_process``), but in a sweep, whose process runs the next jobs: there it fails its job."""
    if exit_process is None:
        exit_process = not in_sweep()
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
            logging.getLogger(__name__).warning(
                "local rank pid %s still running %.0f s after this one finished: killing it", proc.pid, grace_s
            )
            _stopped_here.add(proc.pid)
            proc.kill()
            proc.wait()
    failure = failed_child(STARTED, STARTED_RANKS)
    STARTED.clear()
    STARTED_RANKS.clear()
    return failure


def watch_children(
    procs: Sequence[subprocess.Popen], ranks: Sequence[int], exit_process: bool = True
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


# (this rank, the pid of the process that started it, what it is, whether it hosts the run's store)
_launcher: tuple[int, int, str, bool] | None = None


def watch_launcher(
    rank: int, launcher_pid: int, what: str = "the process that launched it", hosts_store: bool = False
) -> threading.Thread:
    """In a started rank: when the process that launched it is gone, report and exit. ``hosts_store``: the launcher
    hosts the run's store (rank 0 on node 0 under ``ddp``, torchrun's agent on the rendezvous node): the failure has
    no store to go to then (a client dialling it under load once found the port still accepting, and waited out its
    timeout twice, logging each try), and the node's reporter asks the store rather than waiting in it."""
    global _launcher
    _launcher = (rank, launcher_pid, what, hosts_store)

    def watch() -> None:
        while (gone := launcher_gone()) is None:
            time.sleep(POLL_S)
        end_run(gone, EXIT_FAILED)  # end_run publishes nothing to a store whose host is going

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def launcher_hosts_store() -> bool:
    """Whether the process that started this rank hosts the run's store (``watch_launcher``'s ``hosts_store``)."""
    return _launcher is not None and _launcher[3]


def watches_a_launcher() -> bool:
    """Whether this rank watches the process that started it (``watch_launcher``): that watch tells which rank died."""
    return _launcher is not None


PF_EXITING = 0x4  # a flag of /proc/PID/stat's flags word: the process has begun to exit


def _exiting(pid: int) -> bool:
    """Whether process ``pid`` has begun to exit (its flags in /proc/PID/stat); False where they cannot be read (it
    is gone, or there is no /proc): the parent pid tells then."""
    try:
        return bool(int(proc_stat(pid)[6]) & PF_EXITING)
    except (OSError, ValueError, IndexError):
        return False


def launcher_gone() -> str | None:
    """'rank 1: its launching process (pid 123) died; ...' once the process that started this rank is gone, or,
    where it hosts the run's store, has begun to exit. The kernel marks a process exiting before it closes its
    files (the store's sockets: a call in flight or sent then is broken, and torch prints that with a C++ stack)
    and gives its children another parent only after, so the parent pid alone comes too late there: under the
    suite's load store calls slipped into that gap in 5 of 12 SIGKILLed torchrun agents."""
    if _launcher is None:
        return None
    rank, pid, what, hosts_store = _launcher
    if os.getppid() == pid and not (hosts_store and _exiting(pid)):
        return None
    return f"rank {rank}: {what} (pid {pid}) died; this rank stopped too"


def store_host_going() -> bool:
    """Whether this rank's launcher hosts the run's store and is gone or on its way out (``launcher_gone``)."""
    return launcher_hosts_store() and launcher_gone() is not None


class FailureRecord:
    """The run's first failure, in its rendezvous store; each node reads it there for all of its ranks.

    Keys are prefixed per torchrun attempt (src/launch/torchrun.py): its agent keeps one store across restarts. The
    node's reporter (src/resilience/node_board.py) waits for the record with the store's blocking ``wait``, on a
    connection of its own, and leaves it on the node's board, which every local rank reads every POLL_S: one request per
    node every WAIT_S, where each rank polling the store would make 4 per rank per second (``_wait`` says which
    reporters ask instead). A rank writes to the store only when it has something to say (a failure, its end), on a
    connection it opens then.
    """

    def __init__(
        self,
        rank: int,
        node_rank: int,
        local_rank: int,
        world_size: int,
        in_sweep: bool,
        board: NodeBoard,
        connect: Callable[[float], Any] | None = None,
    ) -> None:
        self.rank, self.node_rank, self.local_rank, self.world_size = rank, node_rank, local_rank, world_size
        self.in_sweep, self.board = in_sweep, board
        self._prefix = torchrun.attempt_prefix() + "failure/"
        self._new_store = connect or store_client
        self._store: Any = None  # opened by the first write
        self._lock = threading.Lock()  # one store call at a time, and none once closed
        self._closed = False
        self._waiter: threading.Thread | None = None
        self._ticks = 0
        self.echoing = False  # this rank has read another rank's failure
        self._counted = False  # this rank took its own place in the failure's count (NodeBoard.count)

    def _call(self, method: str, *args: Any) -> Any:
        """A store call, or None once closed or when the store is gone (its host, rank 0, has ended)."""
        with self._lock:
            if self._closed:
                return None
            try:
                if self._store is None:
                    self._store = self._new_store(END_CONNECT_S)
                return getattr(self._store, method)(*args)
            except Exception:  # noqa: BLE001 - DistNetworkError, RuntimeError: the store host is gone
                self._closed = True
                return None

    def publish(self, line: str | None, code: int, dead: int = 0, stuck: dict[str, Any] | None = None) -> bool:
        """Write this rank's failure unless one is there already; True if this one is the run's failure.

        ``stuck``: the host and pid of a rank that cannot run Python, for its host's ranks to kill."""
        if not self._counted and not self.board.count(self.local_rank):
            # the node's reporter has brought the run's failure to the board and counted this rank as having read
            # it: that failure came first, and the store's host (rank 0) may have gone on that count
            return False
        self._counted = True  # the store's host waits for this rank's own count
        record = json.dumps(
            {
                "rank": self.rank,
                "node": self.node_rank,
                "host": socket.gethostname(),
                "line": line,
                "code": code,
                "stuck": stuck,
            }
        )
        current = self._call("compare_set", self._prefix + "failure", "", record)
        self._call("add", self._prefix + "seen", 1 + dead)
        first = current is None or current.decode() == record  # no store: nobody else can have reported
        self.board.post("failure", json.loads(current) if current else json.loads(record))  # this node, at once
        return first

    def read(self, from_store: bool = False) -> dict[str, Any] | None:
        """The run's failure, if a rank has written one: as this node's board has it, or (``from_store``) as the
        store has it, where the board does not have it yet."""
        record = self.board.read("failure")
        if record is not None or not from_store or not self._call("check", [self._prefix + "failure"]):
            return record
        value = self._call("get", self._prefix + "failure")
        record = None if value is None else json.loads(value)
        return None if record is None or record.get("ended") else record

    def follow(self, from_store: bool = False) -> tuple[str | None, int] | None:
        """If another rank has failed the run: return what this rank should print (mostly nothing) and the exit
        code. From then on this rank only echoes that failure: it never claims the run's."""
        record = self.read(from_store)
        if record is None or record["rank"] == self.rank:  # its own: this rank is ending already
            return None
        self.echoing = True
        kill_stuck(record.get("stuck"))
        return self.line_for_this_rank(record), record["code"]

    def _wait(self) -> None:
        """The reporter's: wait for the run's failure in the store, and leave it on the node's board."""
        import torch.distributed as dist

        key = self._prefix + "failure"
        # torch logs a store call that the host's death breaks, with a C++ stack, before Python sees the error, and
        # a reporter is in its wait nearly all the time. Where the host is this rank's own launcher (torchrun's agent
        # on the rendezvous node; ddp's rank 0 on node 0, for a rank that took the reporter's role), whose end ends
        # this rank too, the reporter asks every POLL_S while the launcher lives: one node's, 4 requests a second.
        # A rank that took the role from a lower local rank (its pulse stale: stopped, starved, slow to start) asks
        # too, and leaves the role within POLL_S of that rank's next beat: a wait would hold a second connection to
        # the store beside that rank's for up to WAIT_S, and a wait that times out sooner is logged by torch
        polls = launcher_hosts_store() or self.local_rank > 0
        try:
            store = self._new_store(30.0)
            while not self._closed and self.board.reporter() == self.local_rank:
                if polls:
                    if launcher_gone() is not None:
                        return
                    if not store.check([key]):
                        time.sleep(POLL_S)
                        continue
                else:
                    try:
                        store.wait([key], timedelta(seconds=WAIT_S))
                    except dist.DistStoreError:  # not yet: still this node's reporter?
                        continue
                record = json.loads(store.get(key))
                if record.get("ended"):  # rank 0's word that the run ended well: no failure to wait for
                    return
                self.board.post("failure", record)
                # every local rank that does not write to the store itself (the failing one, one ending as this
                # arrived) reads the failure here: one count for the node
                counted = sum(self.board.count(local) for local in range(self.board.local_world))
                store.add(self._prefix + "seen", counted)
                return
        except Exception:  # noqa: BLE001 - the store's host is gone: the hang watch says so, if it must
            return

    def tick(self) -> tuple[str | None, int, dict[str, Any] | None] | None:
        """One look, as the watch makes it every POLL_S: this rank's pulse on the board, the failure wait where
        this rank is its node's reporter, and what the board says: another rank's failure, or the node's reporter
        found the store's host silent. What to print, the exit code and the rank to kill, or None."""
        self.board.beat()
        self._ticks += 1
        if (
            self._ticks % 4 == 1
            and (self._waiter is None or not self._waiter.is_alive())
            and self.board.reporter() == self.local_rank
        ):  # a second's delay is nothing beside BOARD_STALE_S
            self._waiter = threading.Thread(target=self._wait, name="failure-wait", daemon=True)
            self._waiter.start()
        failure = self.follow()
        if failure is not None:
            return (*failure, None)
        note = self.board.read("end")
        if note is not None:
            return (
                note["line"] if says_store_silence(self.rank, self.node_rank, self.local_rank) else None,
                note["code"],
                note["stuck"],
            )
        return None

    def wait_for(self, key: str, seconds: float) -> None:
        """Wait until every rank has added itself to ``key`` (the store host must not go before they have)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            count = self._call("add", self._prefix + key, 0)
            if count is None or count >= self.world_size:
                return
            time.sleep(0.05)

    def close(self, wait: bool = True) -> None:
        """Stop watching; at a good end (``wait``) rank 0, the store's host, waits until every rank has (each
        node's last rank tells the store for the node)."""
        if self._closed:
            return
        if self.board.finish():
            self._call("add", self._prefix + "done", self.board.local_world)
        if self.rank == 0 and wait:
            self.wait_for("done", DONE_WAIT_S)
            self._call("compare_set", self._prefix + "failure", "", json.dumps({"ended": True}))  # ends the waits
        if self._waiter is not None and wait:  # out of its store call before this process may end
            self._waiter.join(WAITER_JOIN_S)
        with self._lock:
            self._closed = True
            self._store = None

    def watch(self) -> threading.Thread:
        def loop() -> None:
            while not self._closed:
                if launcher_gone() is not None:  # the launcher may host the store: its watch takes over
                    return
                failure = self.tick()
                if failure is not None:
                    if self.in_sweep:  # a sweep's process runs the next job: stop this job's ranks only
                        stop_processes(STARTED, grace_s=2.0)
                        return
                    line, code, stuck = failure
                    end_run(line, code, publish=False, stuck=stuck)
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


def says_store_silence(rank: int, node_rank: int, local_rank: int) -> bool:
    """Who says that the store's host went silent: rank 1 (rank 0 is the host), and each other node's first rank
    where outputs are not merged."""
    merged = "SLURM_STEP_ID" in os.environ
    return rank == 1 or (local_rank == 0 and node_rank != 0 and not merged)


def kill_stuck(stuck: dict[str, Any] | None) -> None:
    """SIGKILL a rank found unable to run Python (stopped, stuck in C code) if it runs on this host: nothing else
    ends it (SIGTERM waits while a process is stopped)."""
    if not stuck or stuck.get("host") != socket.gethostname() or stuck.get("pid") in (None, os.getpid()):
        return
    _stopped_here.add(stuck["pid"])
    for note in KILL_NOTES:
        note(stuck["pid"])
    try:
        os.kill(stuck["pid"], signal.SIGKILL)
    except OSError:
        pass


class HangWatch:
    """Publishes where this rank is; one judge reads every node's and ends a run that has stopped moving while one
    rank holds the others back (module docstring).

    Each rank leaves its record on its node's board (src/resilience/node_board.py); the node's reporter carries the
    node's records to the store in one ``set`` a round, compact while they move (place, activity, waiting, age), with
    where a rank is only once it has not moved for ``detail_after_s``. The judge is node 0's reporter: one ``multi_get``
    of the nodes' records a round; node 1's reporter stands by and judges in its place when node 0's record stops
    changing. Who each rank is (host, pid, log) is read once a verdict is due.

    The store host is rank 0 (torchrun's agent under torchrun): when it stops answering a node's reporter for
    ``timeout_s``, the node's ranks end, and the line says it was that rank.
    """

    def __init__(
        self,
        rank: int,
        node_rank: int,
        local_rank: int,
        world_size: int,
        timeout_s: float,
        run_dir: str | None,
        board: NodeBoard,
        num_nodes: int,
        host: dict[str, Any] | None = None,
        progress: Any = None,
        connect: Callable[[float], Any] | None = None,
    ) -> None:
        self.rank, self.node_rank, self.local_rank, self.world_size = rank, node_rank, local_rank, world_size
        self.timeout_s, self.run_dir, self.board, self.num_nodes = float(timeout_s), run_dir, board, num_nodes
        self.poll_s = min(max(self.timeout_s / 20, 0.2), 1.0)  # a record a second: the line says where it stopped
        self.silent_s = max(self.timeout_s / 2, 3 * self.poll_s)  # a rank whose pulse stopped this long can't run
        self.detail_after_s = max(min(self.timeout_s / 4, 10.0), 2 * self.poll_s)
        self._prefix = torchrun.attempt_prefix() + "progress/"
        self._store: Any = None
        self._closed = False
        self._pulse = 0
        self._seen: dict[int, dict[str, Any]] = {}  # judge: rank -> its last record, and when its activity moved
        self._nodes: dict[int, dict[str, Any]] = {}  # judge: node -> its record's last pulse, and when it changed
        self._moved: dict[int, tuple[int, float]] = {}  # reporter: local rank -> its activity, and when it changed
        self._told: dict[str, Any] | None = None  # reporter: who its node's ranks are, as last written
        self._host = host  # rank 0's host and pid
        self._last_ok = 0.0  # when the store last answered this node's reporter
        self.log: Path | None = None
        # where this rank is (src/resilience/heartbeat.py's PROGRESS), the store, and the way out: the control-plane
        # simulator (benchmarks/control_plane.py) gives each of its ranks its own
        self.progress = progress
        self._new_store = connect or store_client
        self.end = end_run

    def _connect(self) -> Any:
        if self._store is None:
            self._store = self._new_store(min(10.0, max(2.0, self.timeout_s / 4)))
        return self._store

    def record(self) -> dict[str, Any]:
        from src.resilience import heartbeat

        progress = self.progress or heartbeat.PROGRESS
        return {
            "rank": self.rank,
            "position": progress.position,
            "activity": progress.activity(),
            "where": progress.where(),
            "step": progress.step,
            "epoch": progress.epoch,
            "waiting": progress.phase.startswith("waiting") or _in_collective(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "log": str(self.log) if self.log else None,
        }

    def start(self) -> threading.Thread:
        from src.resilience import heartbeat

        self.log = heartbeat.stack_file(self.run_dir, f"rank {self.rank}")
        thread = threading.Thread(target=self._loop, name="hang-watch", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._closed = True

    def _loop(self) -> None:
        self._last_ok = last_round = time.monotonic()
        worker: threading.Thread | None = None
        while not self._closed:
            now = time.monotonic()
            if now - last_round > 3 * self.poll_s + 2:  # this process was stopped or starved (Ctrl-Z): start afresh
                self._seen.clear()
                self._nodes.clear()
                self._last_ok = now
            last_round = now
            self._pulse += 1
            # a call to a stopped store host never returns (its timeout bounds waits for keys, not replies): the
            # store's calls run in a thread of their own, which such a call holds, and this one keeps counting
            if worker is None or not worker.is_alive():
                worker = threading.Thread(target=self._round, args=(now,), name="hang-watch-store", daemon=True)
                worker.start()
                worker.join(self.poll_s)
            if self._closed or launcher_gone() is not None or not _group_exists():
                return  # its run is over (a watch outside a run ends quietly)
            if time.monotonic() - self._last_ok >= self.timeout_s:
                self._store_host_silent(self._rank_zero(), time.monotonic() - self._last_ok)
            time.sleep(self.poll_s)

    def _rank_zero(self) -> dict[str, Any] | None:
        """Rank 0's latest record, as this rank knows it: on node 0, the one rank 0 itself last left on the node's
        board (where it is, always); elsewhere the judge's, as node 0 last reported it. Not the judge's on node 0:
        a rank that judged for a few rounds (node 0's reporter while rank 0 was slow to publish, under load) keeps
        that early record, without where rank 0 was and steps behind it."""
        if self.node_rank == 0:
            own = self.board.ranks().get(0, (None, 0.0))[0]
            if own is not None and "rank" in own:
                return own
        return self._seen[0]["record"] if 0 in self._seen else None

    def _round(self, now: float) -> None:
        """Leave this rank's record on the board; answer a verdict; as the node's reporter, carry the node's
        records to the store, and judge (node 0's) or stand by (node 1's)."""
        self.board.publish(self.record())
        verdict = self.board.read("verdict")
        if verdict is not None:
            self._answer(verdict)
        if self.board.reporter() != self.local_rank:
            self._store, self._told = None, None  # another local rank reports: no connection held here
            self._last_ok = time.monotonic()
            return
        if store_host_going():  # a call now is broken (torch prints a C++ stack); the launcher watch ends this rank
            return
        ranks = self.board.ranks()  # only the reporter reads the others' records
        try:
            store = self._connect()
            self._tell_who(store, ranks)
            store.set(f"{self._prefix}node{self.node_rank}", json.dumps(self._summary(ranks, now)))
            self._last_ok = time.monotonic()
            if verdict is None and store.check([self._prefix + "verdict"]):
                verdict = json.loads(store.get(self._prefix + "verdict"))
                self.board.post("verdict", verdict)
                self._answer(verdict)
            elif self.node_rank == 0 or (self.node_rank == 1 and self._judge_silent(store, now)):
                self._judge(store, now)
        except Exception:  # noqa: BLE001 - the store's host does not answer (or is gone): reconnect next round
            self._store = None

    def _summary(self, ranks: dict[int, tuple[dict[str, Any], float]], now: float) -> dict[str, Any]:
        """The node's ranks, compact: [place, activity, waiting, age of its pulse in s, step, epoch], and where it
        is once it has not moved for ``detail_after_s`` (a node stopped whole, SIGSTOP or a frozen host, never
        sends that: its step and epoch say where it was last)."""
        entries = {}
        for local, (record, age) in ranks.items():
            if "rank" not in record:  # its watch has not written a record yet
                continue
            if self._moved.get(local, (None,))[0] != record["activity"]:
                self._moved[local] = (record["activity"], now)
            entry = [record["position"], record["activity"], int(record["waiting"]), round(age, 1)]
            entry += [record["step"], record["epoch"]]
            if max(now - self._moved[local][1], age) >= self.detail_after_s:
                entry.append(record["where"])
            entries[record["rank"]] = entry
        return {"pulse": self._pulse, "by": self.rank, "ranks": entries}

    def _tell_who(self, store: Any, ranks: dict[int, tuple[dict[str, Any], float]]) -> None:
        """Who the node's ranks are (host, pid, stack log), for a verdict's line: a key per rank, written when its
        entry changes (once per run, and again by a reporter that takes over). Per rank, so that a late write (the
        node's previous reporter, slow on a loaded machine, writing what it saw before the next one wrote every
        rank) repeats what it says of each rank and drops none: one record for the whole node could lose a rank so,
        and a verdict on that rank then had no host, pid or log to name."""
        who = {str(r["rank"]): [r["host"], r["pid"], r["log"]] for r, _ in ranks.values() if "rank" in r}
        told = self._told or {}
        changed = {rank: entry for rank, entry in who.items() if told.get(rank) != entry}
        if changed:
            store.multi_set([f"{self._prefix}who/{r}" for r in changed], [json.dumps(e) for e in changed.values()])
            self._told = {**told, **changed}

    def _judge_silent(self, store: Any, now: float) -> bool:
        """The standby's look at node 0's record: has it stopped changing (its reporter cannot run)?"""
        summary = json.loads(store.get(f"{self._prefix}node0"))
        node = self._nodes.setdefault(0, {"pulse": None, "changed": now})
        if (summary["pulse"], summary["by"]) != node["pulse"]:
            node["pulse"], node["changed"] = (summary["pulse"], summary["by"]), now
        return now - node["changed"] >= self.silent_s

    def _judge(self, store: Any, now: float) -> None:
        keys = [f"{self._prefix}node{n}" for n in range(self.num_nodes)]
        if not store.check(keys):  # a node that has not reported yet is still starting
            return
        records: dict[int, dict[str, Any]] = {}
        for n, raw in enumerate(store.multi_get(keys)):
            summary = json.loads(raw)
            node = self._nodes.setdefault(n, {"pulse": None, "changed": now})
            if (summary["pulse"], summary["by"]) != node["pulse"]:
                node["pulse"], node["changed"] = (summary["pulse"], summary["by"]), now
            for rank, entry in summary["ranks"].items():
                records[int(rank)] = {
                    "position": entry[0],
                    "activity": entry[1],
                    "waiting": bool(entry[2]),
                    "silent_s": max(entry[3], now - node["changed"]),
                    "node": n,
                    "where": entry[6] if len(entry) > 6 else None,
                    "last": entry[4:6],  # step, epoch
                }
        if len(records) < self.world_size:  # a rank that has not reported yet is still starting
            return
        for rank, record in records.items():
            seen = self._seen.get(rank)
            if seen is None:
                seen = self._seen[rank] = {"moved": now}
            elif record["activity"] != seen["record"]["activity"]:
                seen["moved"] = now  # it moved: where it was still, its node said before, is no longer where it is
            else:  # still: the place its node said once keeps (a node stopped whole sends none again)
                record["where"] = record["where"] or seen["record"]["where"]
            seen["record"] = record
        if now - max(s["moved"] for s in self._seen.values()) < self.timeout_s:
            return
        records = {r: s["record"] for r, s in self._seen.items()}
        held_back_by = culprits(records, self.silent_s)
        if (
            not held_back_by
        ):  # every rank busy alike (a first compile) or waiting alike (a deadlock): timeout_s's to end
            return
        rank = held_back_by[0]
        silent = [r for r, record in records.items() if record["silent_s"] >= self.silent_s]
        record = self._seen[rank]["record"]
        who = f"{self._prefix}who/{rank}"
        unknown: list[Any] = ["?", None, None]
        host, pid, log = json.loads(store.get(who)) if store.check([who]) else unknown
        verdict = {
            "rank": rank,
            "can_run": rank not in silent,
            "host": host,
            "pid": pid,
            "line": self._line(rank, record, host, pid, log, now, rank in silent),
        }
        verdict = json.loads(store.compare_set(self._prefix + "verdict", "", json.dumps(verdict)))
        self.board.post("verdict", verdict)
        if verdict["rank"] == self.rank:
            self._answer(verdict)
        if not verdict["can_run"]:
            self.end(verdict["line"], EXIT_FAILED, stuck={"host": verdict["host"], "pid": verdict["pid"]})
        deadline = time.monotonic() + ANSWER_WAIT_S  # the stuck rank writes its stack, then ends the run itself
        while time.monotonic() < deadline:
            time.sleep(self.poll_s)
            self._last_ok = time.monotonic()  # waiting for it, not for the store
        self.end(
            verdict["line"].split("; its Python stack")[0] + "; it did not answer, so its stack could not be "
            f"written: look at it with py-spy dump {_pid_on_host(verdict['pid'], verdict['host'])}; every rank stopped",
            EXIT_FAILED,
        )

    def _line(
        self, rank: int, record: dict[str, Any], host: str, pid: int | None, log: str | None, now: float, silent: bool
    ) -> str:
        seconds = now - self._seen[rank]["moved"]
        others = "the other ranks" if self.world_size > 2 else f"rank {1 - rank}"
        where = last_place(record)
        who = f"host {host}, pid {pid}" if pid is not None else "host and pid not reported"
        head = f"rank {rank} ({who}) made no progress for {seconds:.0f} s {where}, while {others} waited for it"
        tail = f"; every rank stopped, the previous last.ckpt is intact: {resume_with()}"
        if silent:
            return (
                f"{head}; it cannot run Python (stopped, e.g. by SIGSTOP or a debugger, or stuck in C code), so "
                f"its stack could not be written: look at it with py-spy dump --native {_pid_on_host(pid, host)}{tail}"
            )
        return f"{head}; its Python stack is in {log or 'its log'}{tail}"

    def _answer(self, verdict: dict[str, Any]) -> None:
        """The judge found this rank stuck: its stack goes to its log, then the run ends with the verdict's line."""
        from src.resilience import heartbeat

        if verdict["rank"] != self.rank or not verdict["can_run"]:
            return
        if self.log is None or not heartbeat.dump_stacks(self.log, "the run stopped: this rank made no progress"):
            verdict["line"] = verdict["line"].split("; its Python stack")[0] + "; its stack could not be written"
        self.end(verdict["line"], EXIT_FAILED)

    def _store_host_silent(self, last: dict[str, Any] | None, seconds: float) -> None:
        """The store stopped answering this node's reporter: its host (rank 0, unless torchrun's agent holds it) is
        stopped or gone. The node's ranks end with it (the board's ``end`` note). ``last``: rank 0's latest record,
        where this rank judges."""
        host = self._host
        if torchrun.active():
            who = f"the torchrun agent at {os.environ['MASTER_ADDR']}, which hosts the run's store,"
        elif host is None:
            who = "rank 0, which hosts the run's store,"
        else:
            who = f"rank 0 (host {host['host']}, pid {host['pid']}), which hosts the run's store,"
        where = f" (last seen {last_place(last)})" if last else ""
        line = (
            f"{who} stopped answering for {seconds:.0f} s{where}: it cannot run (stopped, e.g. by SIGSTOP or a "
            "debugger, or stuck in C code) or its host is gone; every rank stopped, the previous last.ckpt is "
            f"intact: {resume_with()}"
        )
        stuck = {"host": host["host"], "pid": host["pid"]} if host and not torchrun.active() else None
        self.board.post("end", {"line": line, "code": EXIT_FAILED, "stuck": stuck})
        self.end(
            line if says_store_silence(self.rank, self.node_rank, self.local_rank) else None,
            EXIT_FAILED,
            publish=False,
            stuck=stuck,
        )


def last_place(record: dict[str, Any]) -> str:
    """Where a rank was, from its record: a rank's own (on its node's board) always says; the judge's says once the
    rank had not moved for ``detail_after_s``, and otherwise gives the step and epoch its node last reported."""
    return record.get("where") or "at step {} of epoch {}, as its node last reported".format(*record["last"])


def culprits(records: dict[int, dict[str, Any]], silent_s: float) -> list[int]:
    """The ranks that hold the others back, once no rank has moved for the hang timeout, by the first rule that names
    any (``records``: each rank's ``silent_s``, ``position`` and ``waiting``, as the judge last read them):

    1. the ranks that cannot run: their pulse has been silent for ``silent_s`` (stopped, stuck in C code);
    2. else the ranks behind the others: at the lowest of the progress marks every rank makes alike;
    3. else, all at one mark, the ranks not waiting in a collective while the others wait there for them.

    None: every rank busy alike (a first compile) or waiting alike (a deadlock), which no rank's record can tell apart
    from work; the backend's timeout (``strategy.timeout_s``) ends that run.
    """
    silent = sorted(r for r, record in records.items() if record["silent_s"] >= silent_s)
    if silent:
        return silent
    places = {r: record["position"] for r, record in records.items()}
    if len(set(places.values())) > 1:
        return sorted(r for r, place in places.items() if place == min(places.values()))
    idle = sorted(r for r, record in records.items() if not record["waiting"])
    return idle if len(idle) < len(records) else []


def store_client(timeout_s: float) -> Any:
    """A client of the run's store (``MASTER_ADDR:MASTER_PORT``), for the failure record and the hang watch."""
    import torch.distributed as dist

    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # torch's client tries a refused address again until its timeout, and a rank that fails after the store's host
    # has gone would wait that long to say so: one plain connect first tells at once whether anything listens
    socket.create_connection((address, port), timeout=min(timeout_s, 2.0)).close()
    return dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def _group_exists() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


# Python files whose functions wait for the other ranks: a main thread inside one is in a collective
_COLLECTIVES = (os.path.join("torch", "distributed", ""), os.path.join("torch", "nn", "parallel", "distributed.py"))


def _in_collective() -> bool:
    """Whether the main thread is inside torch.distributed (or DDP's own collectives) now: a look at its stack,
    nothing more."""
    ident = threading.main_thread().ident
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _COLLECTIVES):
            return True
        frame = frame.f_back
    return False


ANSWER_WAIT_S = 10.0  # how long a judge waits for a stuck rank that can run Python to write its stack
HANGS: HangWatch | None = None
_WATCHED: tuple[Any, ...] | None = None  # the process group FAILURES and HANGS watch


def watch_failures(
    rank: int,
    node_rank: int,
    local_rank: int,
    world_size: int,
    in_sweep: bool = False,
    hang_timeout_s: float | None = None,
    run_dir: str | None = None,
    local_world: int = 1,
) -> None:
    """Once the process group exists: join the run's failure record and watch it, and (``hang_timeout_s``) watch
    for a rank that hangs (see the module's docstring). ``local_world``: the ranks of each node."""
    global FAILURES, HANGS, _WATCHED
    if world_size < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return
    group = (rank, world_size, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], torchrun.attempt_prefix())
    if FAILURES is not None and group == _WATCHED:  # Lightning sets the group up again for each stage (fit, test)
        return
    stop_watching_failures(wait=False)  # an earlier group's (a sweep's previous job): closed, never orphaned
    _WATCHED = group
    run = _this_run(rank)
    board = NodeBoard(run["id"], node_rank, local_rank, local_world, stale_s=BOARD_STALE_S)
    FAILURES = FailureRecord(rank, node_rank, local_rank, world_size, in_sweep, board)
    FAILURES.watch()
    if hang_timeout_s:
        HANGS = HangWatch(
            rank,
            node_rank,
            local_rank,
            world_size,
            hang_timeout_s,
            run_dir,
            board,
            num_nodes=max(1, world_size // local_world),
            host=run,
        )
        HANGS.start()


def _pid_on_host(pid: int | None, host: str) -> str:
    """py-spy's target, as a verdict's line names it: ``--pid 123 on node7``, or where it is not known, a pattern."""
    return f"--pid {pid} on {host}" if pid is not None else "--pid PID on its host"


def _this_run(rank: int) -> dict[str, Any]:
    """What identifies this run, from rank 0 through the store (once per rank): an id no earlier run on the same
    address and port had (the nodes' boards are named by it), and rank 0's host and pid (for the line that says it
    stopped answering)."""
    key = torchrun.attempt_prefix() + "run"
    store = store_client(RUN_WAIT_S)
    if rank == 0:
        run = {"id": uuid.uuid4().hex[:16], "host": socket.gethostname(), "pid": os.getpid()}
        store.set(key, json.dumps(run))
        return run
    return json.loads(store.get(key))  # waits for rank 0's, up to RUN_WAIT_S


def stop_watching_failures(wait: bool = True) -> None:
    """At a good end (or a job's end in a sweep): this rank no longer follows the run's failure record."""
    global FAILURES, HANGS, _WATCHED
    _WATCHED = None
    if HANGS is not None:
        HANGS.close()
        HANGS = None
    if FAILURES is not None:
        FAILURES.close(wait)
        FAILURES = None
    if wait:
        leave_group()


def leave_group() -> None:
    """At a good end, the process group goes before the interpreter does: left to the interpreter's exit, gloo's
    threads can abort the process there ('terminate called without an active exception', SIGABRT) after a run
    that succeeded. Never after a failure: another rank may be inside a collective with this one."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def leave_board() -> None:
    """A rank that ends without a good end is done with its node's board too: the node's last rank removes it."""
    failures = FAILURES  # once: another thread may be stopping the watch (FAILURES = None) as this one ends
    if failures is not None:
        failures.board.finish()


def quit_at_once(code: int) -> NoReturn:
    """End this process now, with no teardown (a stop's second signal): the processes it started stopped, its
    node's board left."""
    stop_processes(STARTED, grace_s=2.0)
    leave_board()
    os._exit(code)


def reported_failure() -> tuple[str | None, int] | None:
    """If another rank has already failed the run: what this rank should print (mostly nothing) and the code. Not
    from a store whose host, this rank's launcher, is going: its node's board has what that store had."""
    return None if FAILURES is None else FAILURES.follow(from_store=not store_host_going())


def in_distributed_run() -> bool:
    """Whether this process is one rank of several (its failures then name the rank)."""
    return FAILURES is not None or int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank_label() -> str:
    """'rank 3' for this process, or 'node 1 local rank 0' before a process group has told the global rank."""
    if FAILURES is not None:
        return f"rank {FAILURES.rank}"
    rank = launcher_rank()
    if rank is not None:
        return f"rank {rank}"
    node, local = os.environ.get("NODE_RANK", "0"), os.environ.get("LOCAL_RANK", "0")
    return f"rank {local}" if node == "0" else f"node {node} local rank {local}"


def _let_the_failing_rank_speak(wait_s: float = SPEAK_WAIT_S) -> None:
    """The rank whose failure is the run's prints its line after recording it, and then ends: where that is a rank
    this process started, it gets ``wait_s`` to do both before the others are stopped (a SIGTERM in between, while
    its setup had no handler yet, ended it before it printed: a run with no error line at all)."""
    if FAILURES is None:
        return
    record = FAILURES.read()
    if record is None or record.get("rank") == FAILURES.rank:
        return
    for proc, rank in zip(STARTED, STARTED_RANKS):
        if rank == record.get("rank"):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait_s)


def say_error(line: str) -> None:
    """``error: line``, a line of its own: after a newline where a progress bar's line is open, and never between a
    bar's last text and its newline, which the bar's stop writes in the console's turn (src/callbacks/progress.py).
    In a terminal the live bar takes this process's lines itself and prints them above it."""
    with console_turn():
        if any(open_line() for open_line in OPEN_LINES) and not _terminal():  # a bar's line, still being drawn
            print(file=sys.stderr, flush=True)
        print_line(f"error: {line}")


def _terminal(*streams: Any) -> bool:
    """Whether each of ``streams`` (stderr, by default) is a terminal."""
    return all(stream is not None and stream.isatty() for stream in streams or (sys.__stderr__,))


def _said_elsewhere_on_this_terminal() -> str | None:
    """The run's line, where another rank of this node printed it on the terminal this process drew its live
    progress bar on: the bar's next drawing, its last at its stop too, clears the lines it drew from where the
    cursor is, and the cursor is then below the other rank's line, which it wipes (seen: a run that ended with exit
    status 1 and no line). Where the bar had stopped before the other rank printed, the line shows twice."""
    # the bar draws on stdout, the line goes to stderr: both the terminal (not `> log`, where the bar is no live one)
    if FAILURES is None or not _terminal(sys.__stdout__, sys.__stderr__) or not any(d() for d in BARS_DRAWN):
        return None
    record = FAILURES.read()
    if record is None or record.get("rank") == FAILURES.rank or record.get("node") != FAILURES.node_rank:
        return None
    return record.get("line") or None


def end_run(
    line: str | None, code: int, publish: bool = True, dead: int = 0, stuck: dict[str, Any] | None = None
) -> NoReturn:
    """End this process of a failed run: record the failure for the other ranks, print ``error: line`` if this
    is the run's first failure, stop the local ranks it started, and exit with ``code``.

    ``dead``: ranks known dead, which will never read the record; ``stuck``: the host and pid of a rank that
    cannot run Python, killed by its host's ranks. Several threads may get here at once (the
    main one with an exception, a watch); the first ends the process, the others wait for it.
    """
    if line and FAILURES is None:  # before the group: each node's local rank 0 says it (a watch may end this one)
        before_error_line(line, code)
    if not _ending.acquire(blocking=False):
        while True:
            time.sleep(60)
    # not to a store whose host, this rank's launcher, is going: the call would wait out its connect, twice, each try
    # printed with torch's C++ stack, before this rank could end
    publish = publish and FAILURES is not None and not FAILURES.echoing and not store_host_going()
    if HANGS is not None:
        HANGS.close()
    first = FAILURES.publish(line, code, dead + bool(stuck), stuck) if publish and FAILURES is not None else True
    line = line or _said_elsewhere_on_this_terminal()  # said again, above the bar that would wipe it
    if line and first:
        if FAILURES is not None:
            torchrun.tell_agent(line)  # torchrun's failure report gives it
        say_error(line)
        for note in SAID_NOTES:
            note(line)
    kill_stuck(stuck)
    if FAILURES is not None:  # on CUDA, NCCL's flight recorder: this rank's last collectives, into the run dir
        from src.resilience import heartbeat

        heartbeat.write_nccl_trace(FAILURES.rank)
    if FAILURES is not None and FAILURES.rank == 0 and not torchrun.active():
        FAILURES.wait_for("seen", SEEN_WAIT_S)  # it hosts the store: the others must read the record first
        # (torchrun's agent hosts it there, and outlives this rank)
    _let_the_failing_rank_speak()
    stop_processes(STARTED, grace_s=2.0)
    leave_board()
    if FAILURES is None and threading.current_thread() is threading.main_thread():
        sys.exit(code)  # one process and nothing started: the ordinary way out
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)  # not sys.exit: the main thread may be stuck in a collective, a process group may hang teardown
