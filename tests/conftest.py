"""Shared helpers: run the real entry points as processes, compose the real config, write CIFAR-format files."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

# One thread of computation in each process the tests start (unless the caller set a count): the suite's parallelism
# is its workers (make test). Two processes of two OpenMP threads each on two cores spin-wait for each other: two
# single-process trainings side by side ran 4 to 50 times slower than at one thread each. Set before numpy and torch
# load (read then) and before the warm parent starts (tests/warm.py: it is then every run's count).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's own processes (pytest's, each worker's) load torch, Lightning and the test modules as the commands do
# (src/core/startup.py): the garbage collector off, then on with what was loaded frozen, as the tests begin
# (pytest_runtestloop). A worker's collection took 6.6 CPU s with it, 4.8 without.
gc.disable()
ROOT = Path(__file__).resolve().parents[1]
# A cache folder of the suite's own, in the checkout (.pytest_cache/): what its one-thread runs measure (the CPU's
# bf16 speedup, src/models/fast_path.py) is not what the user's runs at their own thread count would, and the suite
# neither reads nor writes the user's ~/.cache.
os.environ["XDG_CACHE_HOME"] = str(ROOT / ".pytest_cache" / "xdg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests import budget, warm  # noqa: E402

# the CIFAR-10 sample beside the project; CIFAR10_SAMPLE=DIR names another copy (a GPU node without ../shared)
SAMPLE = Path(os.environ.get("CIFAR10_SAMPLE") or ROOT.parent / "shared" / "data" / "cifar10-sample")

# A run that exercises every part in seconds on a CPU: small ResNet, batch of 4, 2 steps (any dataset).
FAST_RUN = [
    "data.batch_size=4",
    "model.arch=resnet18",
    "model.stem=imagenet",  # 8x8 into the first block, not 32x32: a quarter of the CIFAR stem's step on a CPU
    "model.width=16",  # a narrow ResNet-18: 0.7 M parameters, not 11.2 M (checkpoints of 5.8 MB, not 89 MB)
    "trainer.accelerator=cpu",
    "backend=gloo",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.log_every_n_steps=1",
    "trainer.enable_model_summary=false",
]
# ... on a small synthetic dataset
FAST = ["data=synthetic", "data.num_train=96", "data.num_test=16", *FAST_RUN]


def run_module(
    module: str,
    *overrides: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    background: bool = False,
    prefix: Sequence[str] = (),
    **start: bool,
):
    """Run ``python -m <module> overrides...`` from the project root, as a user would (``prefix``: e.g. taskset);
    started warm where that cannot differ (tests/warm.py). ``start``, in the background: ``warm.popen``'s
    ``start_new_session``, ``ignore_sigint`` and ``default_sigint``."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or key not in env:
            full_env.pop(key, None)
    cmd = [*prefix, sys.executable, "-m", module, *overrides]
    if background:
        return warm.popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **start)
    return warm.run(cmd, cwd=ROOT, env=full_env, timeout=timeout)


def run_script(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    """``python benchmarks/X.py args...`` from the project root with ``env`` (the whole environment; the tests' own
    by default), warm where that cannot differ: so are the ``python -m src.*`` runs it starts (tests/warm.py)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"} if env is None else env
    return warm.run([sys.executable, script, *args], cwd=ROOT, env=env, timeout=timeout)


def train(*overrides: str, **kwargs):
    return run_module("src.train", *overrides, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def late_python(path: Path, rank_variable: str, rank: int, python: str = sys.executable) -> Path:
    """A ``python`` at ``path`` that starts 1.2 s late in the process whose ``rank_variable`` (the launcher's:
    ``SLURM_PROCID``, ``OMPI_COMM_WORLD_RANK``) is ``rank``, as a rank on a slow node starts; the others at once."""
    path.write_text(f'#!/bin/sh\n[ "${rank_variable}" = {rank} ] && sleep 1.2\nexec {python} "$@"\n')
    path.chmod(0o755)
    return path


def write_cifar_folder(root: Path, per_batch: int = 20, seed: int = 0) -> Path:
    """A folder in the release's python-batch format (not the release: checksums differ)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "batch_label": name,
            "labels": [int(x) for x in rng.integers(0, 10, per_batch)],
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "filenames": [],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)
    meta = {
        "label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
        "num_cases_per_batch": per_batch,
        "num_vis": 3072,
    }
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return root


def without_root_permissions(call, *args):
    """``call(*args)`` in a forked child that obeys file permissions as a user does, and its result (JSON).

    root reads and writes through any mode bits; the child drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (still uid
    0, as setpriv does for the cold runs of tests/test_errors.py), so a folder of mode 000 stops it as it stops
    another user. Nothing else changes: the same process, its modules already loaded.
    """
    import ctypes
    import json

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its answer, or its error, goes up the pipe; it never returns into pytest
        try:
            os.close(read)
            if os.geteuid() == 0:
                libc = ctypes.CDLL(None, use_errno=True)
                header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
                sets = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: twice (capabilities 0-31, 32-63)
                if libc.capget(header, sets) != 0:
                    raise OSError(ctypes.get_errno(), "capget")
                for kind in range(3):  # effective, permitted (access(2) checks root with these), inheritable
                    sets[kind] &= ~0b110  # CAP_DAC_OVERRIDE (1), CAP_DAC_READ_SEARCH (2)
                if libc.capset(header, sets) != 0:
                    raise OSError(ctypes.get_errno(), "capset")
            answer = {"result": call(*args)}
        except BaseException as err:  # noqa: BLE001 - the parent raises it
            answer = {"error": f"{type(err).__name__}: {err}"}
        with os.fdopen(write, "w") as pipe:
            json.dump(answer, pipe)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = json.loads(pipe.read())
    os.waitpid(pid, 0)
    if "error" in answer:
        raise AssertionError(f"in the child without root's permissions: {answer['error']}")
    return answer["result"]


def refusal_lines(check, items, taken: str = "taken") -> list[str]:
    """For each of ``items``: the line of the UserError ``check(item)`` raises, or ``taken``."""
    from src.core.errors import UserError

    lines = []
    for item in items:
        try:
            check(item)
        except UserError as err:
            lines.append(str(err))
        else:
            lines.append(taken)
    return lines


def output(result) -> str:
    return result.stdout + result.stderr


@pytest.fixture
def cifar_root(tmp_path: Path) -> Path:
    return write_cifar_folder(tmp_path / "cifar")


def needs_sample() -> Path:
    """The CIFAR-10 sample's folder; the test skips where it is not (a node without ../shared), naming the variable."""
    if not (SAMPLE / "cifar-10-batches-py").is_dir():
        pytest.skip(f"the CIFAR-10 sample is not at {SAMPLE} (../shared has it; CIFAR10_SAMPLE=DIR names a copy)")
    return SAMPLE


@pytest.fixture
def sample_root() -> Path:
    return needs_sample()


def process_environ(pid: int) -> dict[str, str] | None:
    """The environment process ``pid`` was started with (/proc/PID/environ), or None where it is gone; for a warm
    start (tests/warm.py), whose /proc shows the warm parent's, the one it was given."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_text(errors="replace")
        started = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except OSError:
        return None
    if " -m tests.warm " in started:
        raw = warm.recorded_environ(pid)
        if raw is None:
            return None  # the parent, or a spare not yet given a run: none of the test's processes yet
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def parent_pid(pid: int) -> int | None:
    """``pid``'s parent, read from /proc; None where it is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = parent_pid(int(entry.name))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    """``pid``'s command line, words joined by spaces; for a warm start (tests/warm.py), the one it runs as."""
    try:
        text = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""
    return warm.recorded_cmdline(pid) if " -m tests.warm " in text else text


@pytest.fixture(autouse=True)
def _rank_zero_is_restored():
    """A Trainer built in-process sets the process-wide rank Lightning's rank_zero_only reads (a test standing in
    for rank 3 of an srun step leaves 3): the next in-process Trainer's rank-zero work (a logger's files) would be
    skipped. What a test changed there is undone after it."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

    saved = [(f, getattr(f, "rank", None)) for f in (rank_zero_only, utils_rank_zero_only)]
    yield
    for function, rank in saved:
        if rank is not None:
            function.rank = rank


@pytest.fixture(autouse=True)
def _environment_is_restored():
    """What a test's in-process code put in os.environ (src.resilience.heartbeat's TORCH_NCCL_* variables, a launcher's
    MASTER_PORT) is undone after it: left there, it would reach every later run of the worker, and a variable read
    when torch loads would make each of them start cold (tests/warm.py)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def sample_checkpoint(tmp_path_factory) -> Path:
    """A narrow ResNet-18 (the FAST runs' width 16, ImageNet stem: cheap at 32x32) trained for 60 steps on the
    CIFAR-10 sample: better than chance (21% of the sample's first 1,000 test images on the reference CPU),
    so its predictions have something to agree on. Its run dir; the checkpoint is checkpoints/last.ckpt."""
    needs_sample()  # session-scoped: sample_root, a test's fixture, cannot be asked for here
    with shared_between_workers(tmp_path_factory, "sample") as (folder, made):
        run_dir = folder / "run"
        if not made:
            _train_sample(run_dir)
    return run_dir


def _train_sample(run_dir: Path) -> None:
    result = train(
        "data=cifar10",
        f"data.root={SAMPLE}",
        "data.download=false",
        "model.arch=resnet18",
        "model.stem=imagenet",
        "model.width=16",  # 0.7 M parameters: the full width's 60 steps took 5 CPU seconds more, to 18% to 20%
        "model.optimizer.lr=0.05",
        "data.batch_size=32",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=60",
        "trainer.limit_val_batches=4",
        "test=false",
        "trainer.enable_model_summary=false",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, output(result)[-4000:]


@pytest.fixture(scope="session")
def exported_sample_model(sample_checkpoint, tmp_path_factory) -> tuple[Path, str]:
    """``sample_checkpoint`` exported by src.export in both formats and validated on the sample's test images: the
    folder of the files, and what src.export printed."""
    with shared_between_workers(tmp_path_factory, "exported") as (out, made):
        if not made:
            result = run_module(
                "src.export",
                f"ckpt_path={sample_checkpoint}/checkpoints/last.ckpt",
                f"export.dir={out}",
                f"hydra.run.dir={out}/run",
            )
            assert result.returncode == 0, output(result)[-4000:]
            (out / "said.txt").write_text(output(result))
        return out, (out / "said.txt").read_text()


@contextlib.contextmanager
def shared_between_workers(tmp_path_factory, name: str):
    """A folder that the session's pytest-xdist workers share, made by the first that asks (under a lock), and
    whether it was made already: a session fixture runs once per worker otherwise, and these are minutes of
    training. Without xdist, the session's own folder."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's popen-gwN
    folder = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / ".done"
        made = done.exists()
        if not made:
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed half way
            folder.mkdir()
        yield folder, made
        done.touch()


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """A real S3 server (SeaweedFS on 127.0.0.1, tests/s3server.py), started once a session by the first worker that
    asks and shared by the others; the session's end stops it (``pytest_sessionfinish``), and so does the session's
    process going away."""
    from tests.s3server import S3Server, start

    with shared_between_workers(tmp_path_factory, S3_FOLDER) as (folder, made):
        watched = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
        return S3Server.load(folder) if made else start(folder, watch=watched)


S3_FOLDER = "s3server"


def _stop_the_s3_server(session: pytest.Session) -> None:
    """In the session's own process (not a worker): the shared S3 server, if a worker started one."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests.s3server import S3Server

    folder = session.config._tmp_path_factory.getbasetemp() / f"shared-{S3_FOLDER}"  # type: ignore[attr-defined]
    if (folder / "server.json").is_file():
        S3Server.load(folder).stop()


# ------------------------------------------------------------------------------------------------- the time budget


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (make test): a worker per core this process may use and two more, at most 8 (each has its warm
    parent, tests/warm.py, about 1 GB). The ones more compute while another worker's test waits (a Slurm job to be
    scheduled, a timeout a hang test must cross, a rendezvous); each process computes on one thread (above), so an
    extra process adds no spin-waits. On 2 cores (an AMD EPYC): 7 min 12 s for three workers against 7 min 57 s and
    8 min 14 s for two; on an Intel Xeon with AMX, at the reference CPU's pace, 5 min 44 s and 5 min 54 s for four
    against 6 min 5 s for three (docs/development.md). ``make test-fast`` (``-m fast``), whose tests wait for nothing,
    takes one more only: a worker more is one more import of torch and collection."""
    extra = 1 if config.getoption("markexpr", "") == "fast" else 2
    return max(1, min(len(os.sched_getaffinity(0)) + extra, 8))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` (make test) with the Slurm files as one unit (``budget.scope``)."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return budget.scope(nodeid)

    return Scheduling(config, log)


@pytest.hookimpl(trylast=True)  # after pytest's own, which sets up the session's folder
def pytest_configure(config: pytest.Config) -> None:
    """Every process the suite starts keeps its temporary files in the session's folder, not the machine's /tmp:
    ``TMPDIR`` is ``<basetemp>/tmp``, which pytest removes with the rest of that folder when every test passed and
    keeps, for reading, when one failed. A session left there before: the object store's downloaded checkpoints (a
    node's copies, kept for a week), torchrun's agents' folders, the S3 server's logs, inductor's cache (so a compile
    here starts from an empty one, as in a fresh CI). The S3 server's sockets: tests/s3server.py's ``stop``."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # its controller's folder, inherited
        return
    folder = config._tmp_path_factory.getbasetemp() / "tmp"  # type: ignore[attr-defined]
    folder.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # tempfile's answer, cached in this process


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Collected (in a worker; xdist's own process collects nothing): the collector on again, what is loaded frozen."""
    gc.freeze()
    gc.enable()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._budget_start = time.monotonic()  # type: ignore[attr-defined]
    # xdist's own process (make test) runs no test: it starts the workers at once, without Lightning's 2 to 3 s of
    # imports before them, when the other cores had nothing to do
    if not session.config.pluginmanager.has_plugin("dsession"):
        _no_mpi_in_this_process()


def _remove_multiprocessing_folder() -> None:
    """multiprocessing's own folder (``pymp-*``) lives in ``TMPDIR``, the session's folder, which pytest removes when
    every test passed; Python's exit removed it again after that, and a one-process pytest ended with a
    FileNotFoundError traceback. multiprocessing's own finalizer removes it now, once."""
    from multiprocessing import util

    for finalizer in list(util._finalizer_registry.values()):  # type: ignore[attr-defined]
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:  # type: ignore[attr-defined]
            finalizer()


def _no_mpi_in_this_process() -> None:
    """The suite's own process builds Lightning Trainers (tests/test_models.py). Lightning's MPI detection imports
    mpi4py's MPI there, whose singleton MPI_Init writes OMPI_*/PMIX_* variables into this process's environment, below
    os.environ, where every later subprocess started without an env of its own inherits them. The project's trainer
    never asks outside mpirun (src/training/trainer.py's not_mpi_environment); neither does this process."""
    from lightning.fabric.plugins.environments import MPIEnvironment

    from src.launch.ranks import mpi_launched

    detect = MPIEnvironment.detect
    MPIEnvironment.detect = staticmethod(lambda: mpi_launched() and detect())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = budget.recorded().get("tests", {})
    budget.mark_fast(items, seconds)
    budget.longest_files_first(items, seconds)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    budget.record_took(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _stop_the_s3_server(session)
    _remove_multiprocessing_folder()
    budget.judge(session, time.monotonic() - session.config._budget_start)  # type: ignore[attr-defined]
