"""A run that may start no more processes or threads: its cgroup's ``pids.max`` (``docker run --pids-limit``,
Kubernetes' pod pids limit, Slurm's or systemd's cgroups) or this user's ``ulimit -u``, both counting every thread.

A rank starts threads (gloo's, the failure watch, the heartbeat, the progress bar) and processes (the local ranks,
the data loader's workers); past the limit Python says ``can't start new thread``, gloo ``Resource temporarily
unavailable`` and a fork ``[Errno 11] Resource temporarily unavailable``. Before, that was the run's whole line (a
traceback in the log), which says neither which limit nor what to change. The limit is named only where it is
reached (nearly every task it allows in use as the failure is told), so an unrelated ``EAGAIN`` keeps its own line.
"""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path
from typing import Iterator

from src.core.errors import in_chain

_WORDS = ("can't start new thread", "Resource temporarily unavailable")


def task_limit_in(err: BaseException | None) -> BaseException | None:
    """The error behind ``err`` that a refused new thread or process raised, if any."""
    return in_chain(
        err,
        lambda e: (
            (isinstance(e, OSError) and e.errno == errno.EAGAIN)
            or (isinstance(e, RuntimeError) and any(words in str(e) for words in _WORDS))
        ),
    )


def _near(used: int, limit: int) -> bool:
    """Whether ``used`` of ``limit`` tasks is the limit reached: a few may have ended since the refusal."""
    return limit - used <= max(8, limit // 20)


def _cgroup_folders(proc_cgroup: Path, root: Path) -> Iterator[Path]:
    """This process's pids cgroup folder and its parents', whose limits all hold (cgroup v1's pids controller or v2)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            base = root / "pids"
        elif hierarchy == "0" and not controllers:
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
        else:
            continue
        folder = base / path.lstrip("/")
        while True:
            yield folder
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent


def cgroup_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> str | None:
    """The cgroup limit on tasks that is reached, in words (``the cgroup's pids.max, 20 (20 in use)``), or None."""
    for folder in _cgroup_folders(proc_cgroup, root):
        try:
            limit = (folder / "pids.max").read_text().strip()
            used = int((folder / "pids.current").read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and _near(used, int(limit)):
            return f"the cgroup's pids.max, {limit} ({used} in use)"
    return None


def user_limit() -> str | None:
    """This user's ``ulimit -u``, in words, where it is reached (root's is not enforced: not counted)."""
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY:
        return None
    used, uid = 0, os.getuid()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                used += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:  # gone meanwhile
            continue
    return f"ulimit -u, {soft} ({used} in use)" if _near(used, soft) else None


def line_for(err: BaseException) -> str | None:
    """The run's one line where ``err`` is (or was caused by) a refused thread or process and a limit on tasks is
    reached; else None."""
    refused = task_limit_in(err)
    if refused is None:
        return None
    reached = [found for found in (cgroup_limit(), user_limit()) if found is not None]
    if not reached:
        return None
    said = str(refused).strip().splitlines()[0] if str(refused).strip() else type(refused).__name__
    return (
        f"{said}: this run may start no more processes or threads ({'; '.join(reached)}): raise that limit, or start "
        "fewer (trainer.devices, data.num_workers)"
    )
