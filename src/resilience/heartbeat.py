"""Where each rank is, for the hang watch (src/resilience/supervision.py), and its Python stacks when asked for.

The training thread only bumps a Python counter and swaps a string at hooks Lightning calls anyway (no device
tensor is read, so nothing waits for a GPU); the hang watch's thread publishes them. Every rank makes the same
marks in the same order, so the rank whose count is behind the others' is the one they wait for. Only marks every
rank makes alike count there: validation and test batches, which shards make uneven (one rank may have a batch more
than another), move a rank but not its place. A checkpoint being written counts as progress while its file grows.

``kill -USR2 PID`` writes every thread's Python stack to that process's log file (faulthandler, so even a
process stuck in C code answers) and says where on the console. On CUDA, NCCL's flight recorder keeps the last
collectives of every rank and writes them into the run dir (``nccl_trace/rank_N``) when a collective times out
or a hang stops the run.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Callable

from src.core.errors import print_line

log = logging.getLogger(__name__)

STACK_SIGNAL = signal.SIGUSR2  # SIGUSR1 is Slurm's (src/callbacks/slurm_requeue.py)
NCCL_TRACE_DIR = "nccl_trace"
NCCL_TRACE_ENTRIES = 2000  # collectives each rank's flight recorder keeps (a few steps of ResNet-50's buckets)


class Progress:
    """This rank's place: ``position`` counts the marks every rank makes alike (compared across ranks), ``tick``
    every mark (any change is progress); the rest says what it is."""

    def __init__(self) -> None:
        self.tick, self.position, self.step, self.epoch = 0, 0, 0, 0
        self.phase = "starting"
        self.writing: Path | None = None  # a checkpoint this rank is writing

    def activity(self) -> int:
        """``tick`` plus the bytes of the checkpoint being written: any change is progress."""
        writing = self.writing
        if writing is None:
            return self.tick
        try:
            grown = sum(p.stat().st_size for p in writing.parent.glob(f".{writing.name}*"))
        except OSError:
            grown = 0
        return self.tick + grown

    def where(self) -> str:
        return f"at step {self.step} of epoch {self.epoch}, {self.phase}"


PROGRESS = Progress()


def mark(phase: str, trainer: Any = None, alike: bool = True) -> None:
    """Record that this rank has reached ``phase`` (and, with ``trainer``, its step and epoch). ``alike``: every
    rank makes this mark as often (not so a validation or test batch: shards differ by a batch)."""
    if trainer is not None:
        PROGRESS.step, PROGRESS.epoch = trainer.global_step, trainer.current_epoch
    PROGRESS.phase = phase
    PROGRESS.tick += 1
    PROGRESS.position += alike


def _marked(
    phase: Callable[..., str], call: Callable[..., Any], trainer: Any, writes: bool = False
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(phase(*args, **kwargs), trainer)
        if writes and args:
            PROGRESS.writing = Path(str(args[0]))
        try:
            return call(*args, **kwargs)
        finally:
            PROGRESS.writing = None
            mark("after " + phase(*args, **kwargs), trainer)

    wrapper._marks_progress = True  # type: ignore[attr-defined]  # wrapped once: setup runs at every stage
    return wrapper


def progress_callback() -> Any:
    """A Lightning callback that marks where this rank is at every batch, validation, checkpoint and barrier."""
    import lightning as L

    class ProgressReport(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            strategy = trainer.strategy
            if not getattr(strategy.barrier, "_marks_progress", False):
                barrier = _marked(
                    lambda name=None, **_: f"waiting for the other ranks at a barrier ({name})",
                    strategy.barrier,
                    trainer,
                )
                strategy.barrier = barrier  # wrapped on this instance only
            if not getattr(trainer.save_checkpoint, "_marks_progress", False):
                save = _marked(
                    lambda path, *a, **k: f"writing a checkpoint ({path})",
                    trainer.save_checkpoint,
                    trainer,
                    writes=True,
                )
                trainer.save_checkpoint = save  # wrapped on this instance only

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            mark("in a training step", trainer)

        def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
            mark("in the backward pass (and its gradient all-reduce)", trainer)

        def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
            mark("in the optimizer step", trainer)

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            mark("at the end of a training step", trainer)

        def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
            mark("in the sanity check's validation" if trainer.sanity_checking else "in validation", trainer)

        def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            mark(
                "in the sanity check's validation" if trainer.sanity_checking else "in validation", trainer, alike=False
            )

        def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
            mark("after validation", trainer)

        def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
            mark("at the end of the epoch", trainer)

        def on_test_start(self, trainer: L.Trainer, *args: Any) -> None:
            mark("in the test", trainer)

        def on_test_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            mark("in the test", trainer, alike=False)

        def on_test_end(self, trainer: L.Trainer, *args: Any) -> None:
            mark("after the test", trainer)

    return ProgressReport()


def log_file() -> Path | None:
    """This process's log file (Hydra's file handler), if it has one."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return None


def stack_file(run_dir: str | os.PathLike | None, label: str) -> Path | None:
    """Where this process's stacks go: its log file, else (a ``ddp_spawn`` rank has none) ``DIR/stacks_rank1.log``."""
    found = log_file()
    if found is not None or run_dir is None:
        return found
    return Path(run_dir) / f"stacks_{label.replace(' ', '')}.log"


def dump_stacks(path: Path, reason: str) -> bool:
    """Append every thread's Python stack to ``path`` under a line saying why; False if it cannot be written."""
    try:
        with open(path, "a") as f:
            f.write(
                f"\n--- {reason}: every thread's Python stack of pid {os.getpid()} on {socket.gethostname()} at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')} (most recent call first) ---\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return True
    except OSError:
        return False


_stack_target: Any = None  # the open file faulthandler writes into: it must outlive the registration


def register_stack_dump(label: str, run_dir: str | os.PathLike | None = None) -> Path | None:
    """``kill -USR2 PID``: this process writes every thread's stack to its log file, and carries on."""
    global _stack_target
    path = stack_file(run_dir, label)
    if path is None or not hasattr(faulthandler, "register"):
        return None
    try:
        target = open(path, "a")
    except OSError:
        return None

    def say(signum: int, frame: Any) -> None:
        print_line(f"stacks: every thread's Python stack of {label} (pid {os.getpid()}) written to {path}")

    try:
        signal.signal(STACK_SIGNAL, say)  # the console line: Python, once the main thread runs again
    except ValueError:  # not the main thread: the dump alone
        pass
    # the dump itself from C, at once, even while Python is stuck; then the handler above
    faulthandler.register(STACK_SIGNAL, file=target, all_threads=True, chain=True)
    if _stack_target is not None:
        _stack_target.close()
    _stack_target = target
    return path


def nccl_trace_env(run_dir: str | os.PathLike) -> dict[str, str]:
    """The environment that switches NCCL's watchdog and flight recorder on, with dumps into ``run_dir``.

    torch reads these when it creates an NCCL process group, under either of two names as it renames them
    (``TORCH_FR_*`` the newer, read first). A value the user set under either name is kept, and given to both: the
    project's own under the newer name would otherwise win over the user's under the older.
    """
    prefix = str(Path(run_dir, NCCL_TRACE_DIR, "rank_"))
    env = {}
    for older, newer, value in (
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", str(NCCL_TRACE_ENTRIES)),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_ON_TIMEOUT", "1"),
        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", prefix),
    ):
        users = os.environ.get(newer, os.environ.get(older))
        env[older] = os.environ.get(older, users or value)
        env[newer] = os.environ.get(newer, users or value)
    env["TORCH_NCCL_ENABLE_MONITORING"] = os.environ.get("TORCH_NCCL_ENABLE_MONITORING", "1")  # the watchdog's
    # own watchdog: a stuck NCCL call ends the process; and a timed-out collective ends it, not just its stream
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    return env


def switch_on_nccl_trace(run_dir: str | os.PathLike) -> Path:
    """Before any process group forms, on CUDA: set :func:`nccl_trace_env` here; return the dump's folder (the one
    torch writes to: the user's, where they named one)."""
    env = nccl_trace_env(run_dir)
    os.environ.update(env)
    folder = Path(env["TORCH_FR_DUMP_TEMP_FILE"]).parent
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_nccl_trace(rank: int) -> Path | None:
    """Write this rank's flight recorder now (a hang stops the run before NCCL's own timeout would); None without
    CUDA, NCCL or a configured dump file."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
    try:
        import torch
        import torch.distributed as dist

        if not (prefix and torch.cuda.is_initialized() and dist.is_initialized() and dist.get_backend() == "nccl"):
            return None
        dump = torch._C._distributed_c10d._dump_nccl_trace()  # the pickled entries fr_trace reads
        path = Path(f"{prefix}{rank}")
        path.write_bytes(dump)
        return path
    except Exception:  # noqa: BLE001 - a forensic extra: never in the way of ending the run
        return None
