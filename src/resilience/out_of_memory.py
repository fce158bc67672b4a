"""A device out of memory, on any rank, in training, validation or testing: the run's one line names the device, how
full it was, the per-device batch, and the batch to try instead.

torch's own message is a paragraph about its caching allocator that names neither the batch nor what to change.
The memory is read in Lightning's ``on_exception`` hook, while the failed step's tensors still hold it: Lightning's
teardown, which comes next, moves the model to the CPU and the memory goes back to the allocator.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.trainer.states import RunningStage

from src.core.errors import out_of_memory_in

LINE = "out_of_memory_line"  # the attribute of the error that carries the line to src/resilience/failure.py


class OutOfMemoryReport(L.Callback):
    """Gives a device out-of-memory error its one line (``describe``), read before Lightning frees the memory."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        error = out_of_memory_in(exception)
        if error is not None and not hasattr(error, LINE):
            setattr(
                error,
                LINE,
                describe(
                    trainer.strategy.root_device,
                    getattr(getattr(trainer, "datamodule", None), "batch_size", None),
                    _where(trainer),
                    str(trainer.precision),
                ),
            )


def describe(
    device: torch.device | None, batch_size: int | None = None, where: str | None = None, precision: str | None = None
) -> str:
    """'CUDA out of memory on cuda:1 (NAME) at data.batch_size=1024 per device, step 37: 78.1 GiB in use of 79.1 GiB;
    lower data.batch_size (e.g. data.batch_size=512)' (what is not known is left out)."""
    if device is None and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
    line = "CUDA out of memory"
    if device is not None:
        line += f" on {_device_name(device)}"
    if batch_size:
        line += f" at data.batch_size={batch_size} per device"
    if where:  # 'step 37', 'in the test'
        line += f", {where}" if batch_size else f" at {where}" if where.startswith("step") else f" {where}"
    memory = _memory(device)
    line += f": {memory}" if memory else ""
    if batch_size and batch_size > 1:
        line += f"; lower data.batch_size (e.g. data.batch_size={batch_size // 2})"
    elif batch_size == 1:
        line += "; a batch of one image does not fit: train a smaller model.arch"
    else:
        line += "; lower data.batch_size"
    if precision in ("32-true", "32", "64-true", "64"):
        line += f", or trainer.precision={_half_precision(device)}, which also halves the activations"
    return line


def _half_precision(device: torch.device | None) -> str:
    """bf16-mixed, or 16-mixed on a GPU below compute capability 8.0, which would emulate bf16."""
    if device is None or device.type != "cuda":
        return "bf16-mixed"
    try:
        major, _ = torch.cuda.get_device_capability(device)
    except Exception:  # noqa: BLE001 - a broken context: the usual answer
        return "bf16-mixed"
    return "bf16-mixed" if major >= 8 else "16-mixed"


def _where(trainer: L.Trainer) -> str | None:
    """Which pass ran out: the training step, a validation after it, the sanity check or the test."""
    stage = trainer.state.stage
    if stage == RunningStage.TRAINING:
        return f"step {trainer.global_step}"
    if stage == RunningStage.SANITY_CHECKING:
        return "in the sanity check"
    if stage == RunningStage.VALIDATING:
        return f"in the validation after step {trainer.global_step}"
    if stage == RunningStage.TESTING:
        return "in the test"
    return None


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    except Exception:  # noqa: BLE001 - a CUDA context broken by the failure: the index alone
        return f"cuda:{index}"


def _memory(device: torch.device | None) -> str | None:
    """'78.1 GiB in use of 79.1 GiB' (every process on the device), or what this process's allocator holds; None
    where CUDA cannot say (no CUDA, or not initialised: nothing of it was used)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_initialized():
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        return f"{(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB"
    except Exception:  # noqa: BLE001 - mem_get_info needs a working context: the allocator's own count then
        pass
    try:
        return f"{torch.cuda.memory_reserved(device) / 2**30:.1f} GiB held by this process"
    except Exception:  # noqa: BLE001 - nothing to say of memory, rather than a second failure
        return None


def line_for(error: BaseException) -> str:
    """The line ``OutOfMemoryReport`` gave ``error``, or what can still be said (no callback, or outside a pass)."""
    return getattr(error, LINE, None) or describe(None)
