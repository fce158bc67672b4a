"""src/resilience/task_limit.py: a run that reaches a limit on its processes and threads (a cgroup's pids.max, as
``docker run --pids-limit`` and Kubernetes set) names the limit and what to change in its one line.

The limit is real: a pids cgroup of the test's own, where the kernel refuses the next thread and the next fork. By
hand, whole runs (``strategy=ddp trainer.devices=2`` in a cgroup of 14 to 22 tasks) ended with this line from
whichever rank met the limit first; below that, torch's or gloo's C++ threads can abort the process instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from src.resilience import failure, task_limit
from tests.conftest import ROOT

V1 = Path("/sys/fs/cgroup/pids")

# The child: in a pids cgroup whose limit is what it uses now, it starts a thread, then a process (each refused: the
# line describe() gives each), then lets one thread start and that thread start another (refused in the thread: the
# run ends with its line through the thread hook every command sets).
CHILD = r"""
import os, subprocess, sys, threading, time
from pathlib import Path
from src.cli import entry
from src.resilience import failure
group = Path(sys.argv[1])
(group / "cgroup.procs").write_text(str(os.getpid()))
def limit(spare):
    (group / "pids.max").write_text(str(int((group / "pids.current").read_text()) + spare))
limit(0)
for start in (lambda: threading.Thread(target=time.sleep, args=(1,)).start(), lambda: subprocess.Popen(["true"])):
    try:
        start()
    except Exception as err:
        print("describe:", *failure.describe(err), sep="|")
threading.excepthook = entry._thread_errors
limit(1)
threading.Thread(target=lambda: threading.Thread(target=time.sleep, args=(1,)).start(), name="watch").start()
time.sleep(30)
print("not ended")
"""


# The child: local ranks started where only one more task fits; the first starts, the second's fork is refused.
SPAWN = r"""
import os, subprocess, sys
from pathlib import Path
from src.launch import ranks
group = Path(sys.argv[1])
(group / "cgroup.procs").write_text(str(os.getpid()))
(group / "pids.max").write_text(str(int((group / "pids.current").read_text()) + 1))
started, real = [], subprocess.Popen
def popen(*args, **kwargs):
    started.append(real(*args, **kwargs))
    return started[-1]
ranks.subprocess.Popen = popen  # each rank started, seen
ranks.child_command = lambda: (["sleep", "60"], "/")  # a rank's command line, without a Hydra job to re-enter
try:
    ranks.spawn_local_ranks(3, 0)
except OSError as err:
    print("refused", err.errno, [proc.poll() for proc in started])
"""


@contextlib.contextmanager
def pids_cgroup() -> Iterator[Path]:
    """A pids cgroup of the test's own (cgroup v1's pids hierarchy, as root; else the test is skipped), removed after
    it with anything left in it."""
    if not (V1.is_dir() and os.access(V1, os.W_OK) and (V1 / "cgroup.procs").exists()):
        pytest.skip("no pids cgroup this process may make (cgroup v1's pids hierarchy, as root)")
    group = V1 / f"cifar10-ddp-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        probe = subprocess.Popen(["sleep", "30"])
        try:
            (group / "cgroup.procs").write_text(str(probe.pid))  # a container may let the folder be made, not used
            (group / "pids.max").write_text("max")
        except OSError as err:
            pytest.skip(f"a pids cgroup cannot be used here: {err}")
        finally:
            probe.kill()
            probe.wait()
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():  # what a failing test left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        group.rmdir()


def in_own_cgroup(script: str) -> subprocess.CompletedProcess:
    """``python -c script CGROUP``, the script putting itself in a pids cgroup of its own, which goes after it."""
    with pids_cgroup() as group:
        return subprocess.run(
            [sys.executable, "-c", script, str(group)], cwd=ROOT, capture_output=True, text=True, timeout=120
        )


def test_a_limit_on_tasks_reached_is_named_with_what_to_change_for_a_thread_a_fork_and_a_threads_thread(tmp_path):
    done = in_own_cgroup(CHILD)
    said = [line for line in done.stdout.splitlines() if line.startswith("describe:")]
    assert len(said) == 2, done.stdout + done.stderr
    assert "can't start new thread: this run may start no more processes or threads (the cgroup's pids.max" in said[0]
    assert "Resource temporarily unavailable: this run may start no more processes" in said[1]
    assert all(s.endswith("raise that limit, or start fewer (trainer.devices, data.num_workers)|1") for s in said), said
    # the thread's refusal ended the process with the line, not a traceback and a thread gone
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and "not ended" not in done.stdout, done.stdout + done.stderr
    assert len(errors) == 1 and "can't start new thread: this run may start no more" in errors[0], done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_local_rank_whose_fork_is_refused_stops_the_ranks_started_before_it():
    """Before, they were left to notice their launcher gone, each with a line of its own."""
    done = in_own_cgroup(SPAWN)
    assert done.stdout.split() == ["refused", "11", "[-15]"], done.stdout + done.stderr  # EAGAIN; SIGTERM, reaped


def test_a_refusal_with_no_limit_reached_keeps_its_own_line():
    """EAGAIN has other causes (a socket, memory for a thread's stack): where no limit on tasks is near, the line is
    the error's own."""
    err = RuntimeError("Resource temporarily unavailable")
    assert task_limit.task_limit_in(err) is err
    assert task_limit.line_for(err) is None  # the suite's cgroup has room, and root's ulimit -u is not enforced
    line, code = failure.describe(err)
    assert line.startswith("RuntimeError: Resource temporarily unavailable") and "limit" not in line and code == 1
    assert task_limit.task_limit_in(ValueError("can't start new thread")) is None


def test_the_cgroup_limit_is_read_from_this_process_cgroup_and_its_parents(tmp_path):
    """cgroup v1 and v2 layouts: the lowest limit on the way up that is reached counts."""
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    for folder, limit, used in (("pids/a/b", "max", 3), ("pids/a", "20", 19), ("pids", None, None)):
        (root / folder).mkdir(parents=True, exist_ok=True)
        if limit is not None:
            (root / folder / "pids.max").write_text(limit + "\n")
            (root / folder / "pids.current").write_text(f"{used}\n")
    proc.write_text("9:name=systemd:/\n8:pids:/a/b\n0::/\n")
    assert task_limit.cgroup_limit(proc, root) == "the cgroup's pids.max, 20 (19 in use)"
    (root / "pids/a/pids.current").write_text("5\n")  # 15 spare of 20: not reached
    assert task_limit.cgroup_limit(proc, root) is None
    proc.write_text("0::/pod/c\n")  # cgroup v2, mounted at the root
    (root / "cgroup.controllers").write_text("cpu pids\n")
    (root / "pod/c").mkdir(parents=True)
    (root / "pod/pids.max").write_text("1024\n")
    (root / "pod/pids.current").write_text("1000\n")
    assert task_limit.cgroup_limit(proc, root) == "the cgroup's pids.max, 1024 (1000 in use)"
