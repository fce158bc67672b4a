"""What the ranks of one node share without the network: a folder in shared memory, one per node of a run.

The control plane (src/resilience/supervision.py) talks to the run's store once per node, not once per rank: each rank
leaves its record here, and the node's *reporter*, the lowest local rank still alive, carries them all to the
store in one request and brings back what the store says (a failure, a hang verdict) as a file every local rank
reads. A file's age is its rank's pulse: a rank that cannot run Python (stopped, or stuck in C code) stops
touching it, and the next local rank takes its place as the reporter.

The folder is ``/dev/shm`` (``TMPDIR`` where there is none) ``/cifar10-ddp-<run id>-node<N>``; the run id comes
from rank 0 through the process group's store, so a run never reads a folder an earlier run left behind. The ranks
of a node must share that folder, as processes of one job on one host do (a container per rank would not).

A folder lives as long as a process of its run holds it: each rank takes a shared lock (flock) on its ``lock`` file
for as long as it runs, and the kernel lets go of it when the process ends, however it ends. The node's last rank
to finish removes the folder, whether the run ended well or not; where a rank was killed, the next run on the node
does (``sweep``). Left there, a folder in shared memory would outlive its run until the machine restarts.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "cifar10-ddp-"
BOARD_NAME = re.compile(rf"{PREFIX}[0-9a-f]+-node[0-9]+")  # not the object store's cifar10-ddp-UID beside it
LOCKLESS_STALE_S = 600.0  # a folder without a lock file (an earlier version's) unchanged this long is removed
_swept = False  # this process swept the folders that ended runs left, once


def root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class NodeBoard:
    """The folder of one node of one run: ``r<local rank>.json`` per rank (its record; its age, the pulse), and the
    notes the reporter brings from the store (``failure.json``, ``verdict.json``, ``end.json``)."""

    def __init__(
        self, run_id: str, node_rank: int, local_rank: int, local_world: int, stale_s: float, folder: Path | None = None
    ) -> None:
        self.local_rank, self.local_world, self.stale_s = local_rank, local_world, stale_s
        global _swept
        if folder is None and not _swept:
            _swept = True
            sweep(root())
        self.path = folder or root() / f"{PREFIX}{run_id}-node{node_rank}"
        self._lock_fd = hold(self.path)
        self._own = self.path / f"r{local_rank}.json"
        self._opened = time.time()
        self._record: dict[str, Any] = {}
        self.closed = False  # this rank is done with the run: it writes nothing more here
        self._warned = False

    def _write(self, path: Path, value: Any) -> None:
        if self.closed:
            return
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")  # two threads may write at once
        try:
            try:
                temp.write_text(json.dumps(value))
            except FileNotFoundError:
                # Gone with the run's end on this node: a write of another thread, begun before this rank finished,
                # must not make the folder again after the node's last rank removed it (left in /dev/shm, lockless)
                if self.closed:
                    return
                self.path.mkdir(parents=True, exist_ok=True)  # cleaned away under the run (a tmp cleaner): again
                temp.write_text(json.dumps(value))
            os.replace(temp, path)
        except OSError as err:  # full, or read-only: the pulse (a file's time) still works; say it once
            temp.unlink(missing_ok=True)
            if self.closed:  # the folder went with the run's end: nothing to say
                return
            if not self._warned:
                self._warned = True
                log.warning(
                    "the node's board %s cannot be written (%s): this node's hang reports may be stale; "
                    "free space in %s",
                    self.path,
                    err.strerror or err,
                    self.path.parent,
                )

    def beat(self) -> None:
        """This rank can run Python: its file's age starts again from zero."""
        if self.closed:
            return
        try:
            os.utime(self._own)
        except FileNotFoundError:
            self._write(self._own, self._record)

    def publish(self, record: dict[str, Any]) -> None:
        """This rank's record (where it is), for the reporter to carry."""
        self._record = record
        self._write(self._own, record)

    def ranks(self) -> dict[int, tuple[dict[str, Any], float]]:
        """Every local rank's record and its age in seconds."""
        now, found = time.time(), {}
        for local in range(self.local_world):
            path = self.path / f"r{local}.json"
            try:
                age = now - path.stat().st_mtime
                found[local] = (json.loads(path.read_text() or "{}"), max(0.0, age))
            except (OSError, ValueError):  # not there yet, or being replaced this instant
                continue
        return found

    def reporter(self, ranks: dict[int, tuple[dict[str, Any], float]] | None = None) -> int | None:
        """The lowest local rank whose pulse is fresh: the one that talks to the store for the node. A lower rank
        not seen yet gets ``stale_s`` from this rank's start to appear, as a silent one gets to beat again: a rank
        that took the role only because it ticked first would hold a store wait beside the real reporter's."""
        if ranks is not None:
            return min((local for local, (_, age) in ranks.items() if age < self.stale_s), default=None)
        now = time.time()
        for local in range(self.local_world):
            try:
                if now - (self.path / f"r{local}.json").stat().st_mtime < self.stale_s:
                    return local
            except FileNotFoundError:
                if now - self._opened < self.stale_s:
                    return local
            except OSError:
                continue
        return None

    def post(self, name: str, value: dict[str, Any]) -> bool:
        """Leave a note (``failure``, ``verdict``, ``end``) for every local rank; the first one stays."""
        path = self.path / f"{name}.json"
        if self.closed or path.exists():
            return False
        self._write(path, value)
        return True

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None

    def count(self, local_rank: int) -> bool:
        """Take ``local_rank``'s place in the count of ranks that have read the run's failure (the store's
        ``seen``): True for the one caller that takes it. The rank itself takes it before it writes to the store
        (the store's host then waits for it), the node's reporter for every rank that reads the failure here. A rank
        whose place the reporter took must not go to the store: its host may have gone. Where the folder cannot be
        written, both take it: the host may go early, as the count is then too high, never wait too long."""
        try:
            os.close(os.open(self.path / f"counted{local_rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:
            return True
        return True

    def finish(self) -> bool:
        """This rank is done with the run: True for the one rank that makes the node complete (it tells the store
        for the node, and removes the folder)."""
        self.closed = True
        try:
            try:
                (self.path / f"done{self.local_rank}").touch()
            except OSError:
                return False
            if sum((self.path / f"done{local}").exists() for local in range(self.local_world)) < self.local_world:
                return False
            try:
                os.close(os.open(self.path / "done", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except OSError:  # another rank's (FileExistsError), or the folder is gone: not this rank's to say
                return False
            for _ in range(3):  # a count another rank's reporter made as the folder went: rmtree's listing missed it
                shutil.rmtree(self.path, ignore_errors=True)
                if not self.path.exists():
                    break
            return True
        finally:
            self.release()

    def release(self) -> None:
        """This process no longer holds the folder (a later run's ``sweep`` may remove it once none does)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def hold(path: Path) -> int | None:
    """Make the folder ``path`` and hold it: a shared lock on its ``lock`` file, kept while this process runs, on the
    file that is there now (a ``sweep`` that removed the folder between its making and the lock: made again)."""
    for _ in range(5):
        path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # swept this instant
            continue
        except OSError as err:  # no inode left, say: the board works without; a sweep leaves it while it changes
            log.warning("the node's board %s cannot hold its lock file (%s)", path, err.strerror or err)
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)  # a sweep holds it exclusively only while it removes the folder
        if _still_there(fd, path / "lock"):
            return fd
        os.close(fd)
    log.warning("the node's board %s was removed under this rank as it was made: a later run may remove it too", path)
    return None


def sweep(folder: Path) -> list[Path]:
    """Remove this user's node boards in ``folder`` that no process holds: left by runs whose ranks were killed or
    failed. A board of an earlier version (no lock file) goes once nothing in it changed for LOCKLESS_STALE_S."""
    removed: list[Path] = []
    try:
        entries = [e for e in os.scandir(folder) if BOARD_NAME.fullmatch(e.name)]
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = os.open(path / "lock", os.O_RDONLY)
        except FileNotFoundError:
            if _unchanged_for(path, LOCKLESS_STALE_S):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a rank of its run still runs
                continue
            if _still_there(fd, path / "lock"):  # not swept by another and made again meanwhile
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d node board(s) that ended runs left in %s", len(removed), folder)
    return removed


def _still_there(fd: int, path: Path) -> bool:
    """Whether ``fd`` is open on the file at ``path`` now, not on one a sweep removed (the folder made again since)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def _unchanged_for(path: Path, seconds: float) -> bool:
    try:
        newest = max([path.stat().st_mtime, *(child.stat().st_mtime for child in path.iterdir())])
    except OSError:
        return False
    return time.time() - newest > seconds
