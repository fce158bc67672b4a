"""Training throughput: samples/s in TensorBoard at every log step, throughput.json and the closing line after fit.

throughput.json holds the steady-state summary a scaling report needs, the process id and device of every
rank, gathered over the process group, as proof of how many processes really trained and on what, and the
time rank zero spent writing checkpoints. Lightning's ThroughputMonitor is not used: it calls
torch.cuda.synchronize() after every step, which stalls the GPU's queue. Here the device is synchronised
only at the edges of the measured windows (the warm-up's end, log steps, validation and epoch ends, the end
of training): between them the host runs ahead, and the window's wall time is the device's work.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from src.callbacks.run_summary import strategy_name
from src.core.errors import check_number, whole
from src.models.fast_path import cpu_model

log = logging.getLogger(__name__)


def device_name(device: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3', or the CPU model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({len(os.sched_getaffinity(0))} cores)"


def device_identity(device: torch.device) -> dict[str, Any]:
    """Which device this process trained on: a CUDA GPU's index and UUID (unique per physical GPU), or the CPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"device": "cuda", "index": index, "uuid": str(torch.cuda.get_device_properties(index).uuid)}
    return {"device": device.type}


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA); a CPU's work is done when its call returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _gather(obj: Any) -> list[Any]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        out: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj)
        return out
    return [obj]


def closing_line(record: dict[str, Any]) -> str:
    """'fit: 30 epochs, 10,530 steps in 812 s (16,620 img/s); checkpoints: 31 saved in 9.8 s, 1.2% of the time'."""

    def seconds(s: float) -> str:
        return f"{s:.1f} s" if s < 10 else f"{s:,.0f} s"

    rate = record["samples_per_second"]
    line = (
        f"fit: {record['epochs']} epoch{'s' * (record['epochs'] != 1)}, {record['steps']:,} "
        f"step{'s' * (record['steps'] != 1)} in {seconds(record['fit_time_s'])}"
    )
    if not math.isnan(rate):
        line += f" ({rate:,.0f} img/s)" if rate >= 100 else f" ({rate:.1f} img/s)"
    if record["checkpoints_saved"] is not None:
        line += (
            f"; checkpoints: {record['checkpoints_saved']} saved in {seconds(record['checkpoint_save_s'])}, "
            f"{record['checkpoint_share']:.1%} of the time"
        )
    return line


class ThroughputRecorder(L.Callback):
    """Times training steps in synchronised windows after ``warmup_steps``; at the end of fit rank zero writes
    ``throughput.json`` and logs the closing line.

    A window opens at a batch end once the warm-up is over, and closes at the next log step (where the next
    opens), at validation or at the epoch's end: it holds whole steps, batch loading included; the first step of
    each epoch (iterator start-up) and validation are left out. At every ``trainer.log_every_n_steps`` the
    window's rate goes to the loggers as ``train/samples_per_sec`` (the world) and ``train/device/samples_per_sec``.
    """

    def __init__(self, warmup_steps: int = 5, filename: str = "throughput.json") -> None:
        check_number(
            "callbacks.throughput_record.warmup_steps", warmup_steps, whole(0), "a whole number >= 0 (0: every step)"
        )
        self.warmup_steps, self.filename = warmup_steps, filename
        self._warmup = warmup_steps
        self._device = torch.device("cpu")
        self._batches = 0  # training batches of this fit
        self._batch_size = 0
        self._window: tuple[float, int, int] | None = None  # (time, batches, global step) at its synchronised start
        self._measured_s, self._measured_batches = 0.0, 0
        self._epoch_times: list[float] = []
        self._epoch_start = 0.0
        self._fit_start = 0.0
        self._first_step_at: float | None = None
        self._start_step = 0
        self._ranks: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._device = trainer.strategy.root_device
        self._start_step = trainer.global_step  # a resumed run counts its own steps
        # Short runs (a smoke test of 3 steps) still measure something: at least the last two steps.
        total = trainer.num_training_batches * max(1, trainer.max_epochs or 1)
        if total != float("inf"):
            self._warmup = max(0, min(self.warmup_steps, int(total) - 3))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._first_step_at is None:
            self._first_step_at = time.time()  # wall clock: launch overhead is measured from the command's start

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        self._batch_size = batch[0].size(0)
        if self._batches < self._warmup:
            return
        every = trainer.log_every_n_steps  # 0: Lightning logs no step, and the windows close only at their edges
        log_step = every != 0 and trainer.global_step % every == 0
        if self._window is None or (log_step and trainer.global_step != self._window[2]):
            now = self._synchronised_now()
            if self._window is not None:
                self._close(trainer, now, log_rate=True)
            self._window = (now, self._batches, trainer.global_step)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self._window is not None:
            self._close(trainer, self._synchronised_now())

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = self._synchronised_now()
        if self._window is not None:
            self._close(trainer, now)
        self._epoch_times.append(now - self._epoch_start)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = self._synchronised_now()
        if self._window is not None:
            self._close(trainer, now)
        self._ranks = _gather(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "peak_memory_mb": _peak_memory_mb(self._device),
                **device_identity(self._device),
            }
        )

    def _synchronised_now(self) -> float:
        synchronize(self._device)
        return time.perf_counter()

    def _close(self, trainer: L.Trainer, now: float, log_rate: bool = False) -> None:
        """Add the open window to the measured total; at a log step, send its rate to the loggers."""
        assert self._window is not None
        seconds, batches = now - self._window[0], self._batches - self._window[1]
        self._window = None
        if batches <= 0 or seconds <= 0:
            return
        self._measured_s += seconds
        self._measured_batches += batches
        if log_rate:
            per_device = batches * self._batch_size / seconds
            for logger in trainer.loggers:  # plain floats, straight to the loggers: no device tensor, no sync
                logger.log_metrics(
                    {
                        "train/device/samples_per_sec": per_device,
                        "train/samples_per_sec": per_device * trainer.world_size,
                    },
                    step=trainer.global_step,
                )

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # here, not at the end of training: LastCheckpoint may write last.ckpt in on_train_end, after this callback
        if not trainer.is_global_zero or not self._ranks:
            return
        fit_time = time.perf_counter() - self._fit_start
        measured = self._measured_batches > 0
        step_time = self._measured_s / self._measured_batches if measured else float("nan")
        global_batch = self._batch_size * trainer.world_size
        samples_per_second = global_batch / step_time if measured else float("nan")
        io = trainer.strategy.checkpoint_io
        saved, save_s = getattr(io, "saved", None), getattr(io, "save_s", None)
        record = {
            "num_nodes": trainer.num_nodes,
            "devices": trainer.num_devices,
            "world_size": trainer.world_size,
            "strategy": strategy_name(trainer.strategy),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
            "arch": getattr(pl_module, "hparams", {}).get("arch"),
            "precision": str(trainer.precision),
            "channels_last": getattr(pl_module, "memory_format", None) == torch.channels_last,
            "accelerator": self._device.type,
            "device_name": device_name(self._device),
            "global_batch_size": global_batch,
            "per_device_batch_size": self._batch_size,
            "samples_per_second": samples_per_second,
            "samples_per_second_per_device": samples_per_second / trainer.world_size,
            "step_time_s": step_time,
            "steps_measured": self._measured_batches,
            "measured_s": self._measured_s,
            "warmup_steps": self._warmup,
            "epoch_time_s": sum(self._epoch_times) / len(self._epoch_times) if self._epoch_times else float("nan"),
            "epochs": len(self._epoch_times),
            "epoch_times_s": self._epoch_times,  # each epoch with its validation: the first holds any compilation
            "steps": trainer.global_step - self._start_step,
            "fit_time_s": fit_time,
            "checkpoints_saved": saved,
            "checkpoint_save_s": save_s,
            "checkpoint_share": save_s / fit_time if save_s is not None and fit_time > 0 else None,
            "peak_memory_mb": max(r["peak_memory_mb"] for r in self._ranks),
            "pids": [r["pid"] for r in self._ranks],
            "rank_devices": [{k: r[k] for k in ("host", "device", "index", "uuid") if k in r} for r in self._ranks],
            "first_step_at": self._first_step_at,
            "hosts": sorted({r["host"] for r in self._ranks}),
        }
        path = Path(trainer.default_root_dir) / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        log.info(closing_line(record))
