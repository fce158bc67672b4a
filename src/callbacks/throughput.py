"""Training throughput: samples/s in TensorBoard at every log step, and throughput.json after training.

throughput.json holds the steady-state summary a scaling report needs, and the process ids of every
rank, gathered over the process group, as proof of how many processes really trained. Lightning's
ThroughputMonitor is not used: it calls torch.cuda.synchronize() after every step, which stalls the
GPU's queue; wall time between log steps measures the same rate without waiting on the device.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from src.callbacks.run_summary import strategy_name
from src.fast_path import cpu_model


def device_name(device: torch.device) -> str:
    """'NVIDIA H100 80GB HBM3', or the CPU model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({len(os.sched_getaffinity(0))} cores)"


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


class ThroughputRecorder(L.Callback):
    """Times training steps after ``warmup_steps``, then writes ``throughput.json`` (rank zero) at the end of fit.

    A step's time is the wall time between the ends of two consecutive training batches of one
    epoch, so it includes loading the batch; the first step of each epoch (iterator start-up) and
    validation are left out. Every ``trainer.log_every_n_steps`` steps the rate since the last log step
    goes to the loggers as ``train/samples_per_sec`` (the world) and ``train/device/samples_per_sec``.
    """

    def __init__(self, warmup_steps: int = 5, filename: str = "throughput.json") -> None:
        self.warmup_steps, self.filename = warmup_steps, filename
        self._intervals: list[float] = []
        self._epoch_times: list[float] = []
        self._last_end: float | None = None
        self._epoch_start = 0.0
        self._steps = 0
        self._warmup = warmup_steps
        self._batch_size = 0
        self._first_step_at: float | None = None
        self._window: tuple[float, int] | None = None  # (time, step) of the last log step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Short runs (a smoke test of 3 steps) still measure something: at least the last two steps.
        total = trainer.num_training_batches * max(1, trainer.max_epochs or 1)
        if total != float("inf"):
            self._warmup = max(0, min(self.warmup_steps, int(total) - 3))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = time.perf_counter()
        self._last_end = None
        self._window = None  # the epoch's first step includes the iterator's start-up: not a rate

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._first_step_at is None:
            self._first_step_at = time.time()  # wall clock: launch overhead is measured from the command's start

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        self._steps += 1
        self._batch_size = batch[0].size(0)
        if self._last_end is not None and self._steps > self._warmup:
            self._intervals.append(now - self._last_end)
        self._last_end = now
        if trainer.global_step % trainer.log_every_n_steps == 0 and self._steps > self._warmup:
            self._log_rate(trainer, now)

    def _log_rate(self, trainer: L.Trainer, now: float) -> None:
        if self._window is not None and trainer.global_step > self._window[1]:
            seconds, steps = now - self._window[0], trainer.global_step - self._window[1]
            per_device = steps * self._batch_size / seconds
            for logger in trainer.loggers:  # plain floats, straight to the loggers: no device tensor, no sync
                logger.log_metrics({"train/device/samples_per_sec": per_device,
                                    "train/samples_per_sec": per_device * trainer.world_size}, step=trainer.global_step)
        self._window = (now, trainer.global_step)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_times.append(time.perf_counter() - self._epoch_start)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ranks = _gather({"pid": os.getpid(), "host": socket.gethostname(), "peak_memory_mb": _peak_memory_mb(device)})
        if not trainer.is_global_zero:
            return
        step_time = sum(self._intervals) / len(self._intervals) if self._intervals else float("nan")
        global_batch = self._batch_size * trainer.world_size
        samples_per_second = global_batch / step_time if self._intervals else float("nan")
        record = {
            "num_nodes": trainer.num_nodes,
            "devices": trainer.num_devices,
            "world_size": trainer.world_size,
            "strategy": strategy_name(trainer.strategy),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else "none",
            "arch": getattr(pl_module, "hparams", {}).get("arch"),
            "precision": str(trainer.precision),
            "channels_last": getattr(pl_module, "memory_format", None) == torch.channels_last,
            "accelerator": device.type,
            "device_name": device_name(device),
            "global_batch_size": global_batch,
            "per_device_batch_size": self._batch_size,
            "samples_per_second": samples_per_second,
            "samples_per_second_per_device": samples_per_second / trainer.world_size,
            "step_time_s": step_time,
            "steps_measured": len(self._intervals),
            "warmup_steps": self._warmup,
            "epoch_time_s": sum(self._epoch_times) / len(self._epoch_times) if self._epoch_times else float("nan"),
            "epochs": len(self._epoch_times),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in ranks),
            "pids": [r["pid"] for r in ranks],
            "first_step_at": self._first_step_at,
            "hosts": sorted({r["host"] for r in ranks}),
        }
        path = Path(trainer.default_root_dir) / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
