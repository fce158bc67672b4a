"""Test-only faults and probes, added to real runs as callbacks: ``+callbacks.fault._target_=tests.faults.RaiseAt``."""

from __future__ import annotations

from typing import Any

import lightning as L


def hold_sweep_job(job: int, marker: str, step: int = 3) -> list[str]:
    """Overrides that hold a sweep's ``job`` at ``step`` on rank 0 (for 120 s, or until the process is killed), the
    first time only: ``marker`` appears as the sleep begins, and a test waits for it before its kill (a job's
    checkpoint comes before the sleep, and a kill between the two would leave the sleep to the rerun)."""
    return [
        "+callbacks.wait._target_=tests.faults.SleepAt",
        "+callbacks.wait.rank=0",
        f"+callbacks.wait.step={step}",
        "+callbacks.wait.seconds=120",
        f"+callbacks.wait.job={job}",
        f"+callbacks.wait.once={marker}",
    ]


class RaiseAt(L.Callback):
    """Raise on one rank when training reaches ``step`` (a bug, a bad batch), before that step's all-reduce, so
    the other ranks are left waiting in it.

    ``error``: the exception's class (``torch.OutOfMemoryError``: a GPU out of memory); ``stage``: ``train``, or the
    first ``validate`` or ``test`` batch once ``step`` is reached. ``delay_s``: how long that rank computes first
    (the others wait in the all-reduce meanwhile), so that a test which waits for the step before sees the run
    alive there, however fast its steps are.
    """

    def __init__(
        self,
        rank: int = 0,
        step: int = 3,
        error: str = "builtins.RuntimeError",
        stage: str = "train",
        delay_s: float = 0.0,
    ) -> None:
        from hydra.utils import get_class

        self.rank, self.step, self.error, self.stage = rank, step, get_class(error), stage
        self.delay_s = delay_s

    def _raise_at(self, trainer: L.Trainer, stage: str) -> None:
        if stage == self.stage and trainer.global_rank == self.rank and trainer.global_step >= self.step:
            if self.delay_s:
                import time

                time.sleep(self.delay_s)
            raise self.error(f"injected failure at step {trainer.global_step}")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._raise_at(trainer, "train")

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not trainer.sanity_checking:
            self._raise_at(trainer, "validate")

    def on_test_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._raise_at(trainer, "test")


class CountAlive(L.Callback):
    """Write into ``path`` how many objects of ``class_path`` are alive when fitting starts (a sweep's job must not
    keep the previous job's model, and so its GPU memory)."""

    def __init__(self, path: str, class_path: str = "src.models.classifier.ImageClassifier") -> None:
        self.path, self.class_path = path, class_path

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import gc
        import json
        from pathlib import Path

        from hydra.utils import get_class

        kind = get_class(self.class_path)  # its exact type: Lightning's profiler holds a weakref.proxy to the module
        Path(self.path).write_text(json.dumps({"alive": sum(type(o) is kind for o in gc.get_objects())}))


class SignalAt(L.Callback):
    """Send ``signal`` (a name: SIGTERM, SIGINT) to this process when training starts the batch after ``step`` steps
    on one rank: a preemption that lands at a known batch (``step`` 11 of an epoch of 12: its last). ``group``: to
    this process's whole process group, as a terminal's Ctrl-C reaches every process of its job; it says so."""

    def __init__(self, rank: int = 0, step: int = 3, signal: str = "SIGTERM", group: bool = False) -> None:
        self.rank, self.step, self.signal, self.group = rank, step, signal, group

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        import os
        import signal

        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if self.group:
                print(f"SignalAt: {self.signal} to process group {os.getpgrp()} at step {self.step}", flush=True)
                os.killpg(os.getpgrp(), signal.Signals[self.signal])
            else:
                os.kill(os.getpid(), signal.Signals[self.signal])


class SleepAt(L.Callback):
    """Sleep ``seconds`` on one rank when training reaches ``step``, inside the training step: a rank that hangs in
    Python (a deadlock, a stuck read) while the others wait for it in the step's all-reduce.

    ``world_size``: only in a world of that size (a run that waits at a step for a node to join, and not again once it
    has). ``until_signal``: a SIGTERM or SIGINT ends the sleep too (the run's own handler still gets it), as it
    would end a long step: the run then stops as it stops at any step. ``job``: only in that job of a sweep (Hydra's
    ``job.num``). ``once``: a file this sleep creates, and which stops it from sleeping again (the resumed run)."""

    def __init__(
        self,
        rank: int = 1,
        step: int = 3,
        seconds: float = 3600,
        world_size: int | None = None,
        until_signal: bool = False,
        job: int | None = None,
        once: str | None = None,
    ) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds
        self.world_size, self.until_signal, self.job, self.once = world_size, until_signal, job, once

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        import signal
        import threading
        import time

        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.world_size is not None and trainer.world_size != self.world_size:
            return
        if self.job is not None:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.get().job.num != self.job:
                return
        if self.once is not None:
            from pathlib import Path

            if Path(self.once).exists():
                return
            Path(self.once).touch()
        if not self.until_signal:
            time.sleep(self.seconds)  # the hang
            return
        woken = threading.Event()
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def wake(signum: int, frame: Any) -> None:
            woken.set()
            handler = handlers[signum]
            if callable(handler):
                handler(signum, frame)

        for sig in handlers:
            signal.signal(sig, wake)
        try:
            woken.wait(self.seconds)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


class SlowCheckpoint(L.Callback):
    """Make rank zero's checkpoint writes after the first ``after`` take ``seconds`` at least, as on a slow
    filesystem: the file grows in steps of ``chunk`` bytes, evenly spread (its progress is visible, as a live
    write's is)."""

    def __init__(self, seconds: float = 8.0, chunk: int = 1 << 20, after: int = 0) -> None:
        self.seconds, self.chunk, self.after = seconds, chunk, after

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import io
        import time

        import torch

        real = torch.save
        seconds, chunk, fast = self.seconds, self.chunk, [self.after]

        def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if not hasattr(f, "write") or isinstance(f, io.BytesIO) or fast[0] > 0:
                fast[0] -= 1
                return real(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            pieces = max(1, len(data) // chunk)
            for i in range(pieces):
                f.write(data[i * len(data) // pieces : (i + 1) * len(data) // pieces])
                f.flush()
                time.sleep(seconds / pieces)

        if trainer.is_global_zero and getattr(torch.save, "__name__", "") != "slow_save":
            torch.save = slow_save  # this process's: src/checkpoints/ writes through it


class SlowValidation(L.Callback):
    """Sleep ``seconds`` in every validation batch on one rank (a slow disk, a busy node), the sanity check's too."""

    def __init__(self, rank: int = 1, seconds: float = 1.0) -> None:
        self.rank, self.seconds = rank, seconds

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        import time

        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class RecordGroupEnv(L.Callback):
    """Record, in ``folder``/rank_N.json, the NCCL and flight-recorder variables this process has at the moment it
    forms a process group. The CPU stands in for CUDA here: the run dir's NCCL environment is set as on a GPU
    (``src.distributed.strategy.traces_nccl``); gloo ignores it."""

    def __init__(self, folder: str) -> None:
        import json
        import os

        import torch.distributed

        import src.distributed.strategy

        src.distributed.strategy.traces_nccl = lambda device_type: True
        form = torch.distributed.init_process_group

        def recording(*args: Any, **kwargs: Any) -> Any:
            os.makedirs(folder, exist_ok=True)
            seen = {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL_", "TORCH_FR_"))}
            with open(os.path.join(folder, f"rank_{kwargs.get('rank')}.json"), "w") as f:
                json.dump(seen, f)
            return form(*args, **kwargs)

        torch.distributed.init_process_group = recording


class RecordCollector(L.Callback):
    """Record, in ``folder``/gc_rank_N.json, the garbage collector's state as training starts: on or off, and how
    many objects are frozen (src/core/startup.py)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import gc
        import json
        import os

        os.makedirs(self.folder, exist_ok=True)
        state = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
        with open(os.path.join(self.folder, f"gc_rank_{trainer.global_rank}.json"), "w") as f:
            json.dump(state, f)


class RecordBatches(L.Callback):
    """Append to ``path``, on global rank 0, one line per training batch: the epoch, and the batch's labels (which
    images it holds, in order)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(f"{trainer.current_epoch} {batch[1].tolist()}\n")


class SlowEnd(L.Callback):
    """Keep global rank ``rank`` ``seconds`` longer at the end of fit, before its loggers write their last lines: the
    rank that flushes the run's logs is the last to exit."""

    def __init__(self, rank: int = 0, seconds: float = 5.0) -> None:
        self.rank, self.seconds = rank, seconds

    def _wait(self, trainer: L.Trainer) -> None:
        if trainer.global_rank == self.rank:
            import time

            time.sleep(self.seconds)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._wait(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._wait(
            trainer
        )  # a stop (SIGTERM, Ctrl-C) ends fit with an exception: Lightning finalizes the loggers after


class HoldInSetup(L.Callback):
    """Hold global rank 0 in Lightning's ``setup`` (a dataset's preparation, a checkpoint's load) for up to
    ``seconds``, after creating ``marker``: a run whose ranks have started, their training steps not listening yet."""

    def __init__(self, marker: str, seconds: float = 120.0) -> None:
        self.marker, self.seconds = marker, seconds

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import time
        from pathlib import Path

        if trainer.global_rank == 0:
            Path(self.marker).touch()
            time.sleep(self.seconds)
