"""Finds, on a CPU, every operation of a training step that would make the host wait for a CUDA GPU.

On a GPU the host queues kernels and runs ahead; an operation that needs a value or a size back from the
device (``.item()``, ``bool(tensor)``, ``nonzero``, a copy to host memory, a copy of host data to the device
without ``non_blocking``) makes it wait until the queue has drained, and the GPU idles while the host catches
up. A CPU runs every operation at once, so none of this shows there. ``HostSyncProbe`` replays the
distinction on the CPU: it marks the tensors that would live on the GPU (the model's parameters and buffers,
the metrics' states, the batches of the device pipeline, and everything computed from them or created on the
training device), and records each such operation on them, with the Python stack that made it.

On CUDA the same callback switches ``torch.cuda.set_sync_debug_mode("error")`` on for the recorded steps, so
any such wait raises where it happens.

    python -m src.train ... +callbacks.host_syncs._target_=tests.host_syncs.HostSyncProbe \
        +callbacks.host_syncs.out=DIR/syncs.json

``syncs.json`` (one per rank: ``syncs_rank1.json`` ...) lists, per recorded step, the operations found.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_MARK = "_would_live_on_device"
aten = torch.ops.aten

# Operators whose CUDA kernels read a value or a size back to the host before they return.
_SYNCING_OPS = {
    aten._local_scalar_dense.default: "item/bool/int/float of a tensor (_local_scalar_dense)",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.equal.default: "torch.equal",
    aten.bincount.default: "bincount",
}
# Tensor methods that return host data without an operator a dispatch mode sees on a CPU (item, bool, int and
# float of a tensor do reach one: _local_scalar_dense).
_TO_HOST = {"tolist", "numpy", "cpu"}
# Factories that copy Python data into a new tensor: on CUDA a host-to-device copy, waited for.
_FROM_HOST_DATA = {"tensor", "as_tensor", "scalar_tensor"}
# Frames of these files are left out of a recorded stack.
_UNINTERESTING = (os.sep + "torch" + os.sep, os.sep + "host_syncs.py", os.sep + "contextlib.py")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _on_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.device.type == "cuda" or getattr(t, _MARK, False))


def _mark(value: Any) -> None:
    for t in _tensors(value):
        try:
            setattr(t, _MARK, True)
        except (AttributeError, RuntimeError):  # a tensor type that takes no attributes
            pass


class _Recorder:
    """The operations found while armed, each with the stack that made it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.armed = False
        self.found: list[dict[str, Any]] = []

    def record(self, what: str) -> None:
        if not self.armed:
            return
        frames = [f for f in traceback.extract_stack() if not any(part in f.filename for part in _UNINTERESTING)]
        self.found.append({"op": what, "stack": [f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-8:]]})

    def is_device(self, device: Any) -> bool:
        return device is not None and torch.device(device) == self.device


class _FunctionLevel(TorchFunctionMode):
    """Python-level calls: copies to host, host data copied to the device, factories on the training device."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if name in _TO_HOST and _on_device(first):
            self.recorder.record(f"Tensor.{name}() of a device tensor (copy to host)")
        elif name in ("to", "cuda", "copy_") and isinstance(first, torch.Tensor):
            self._copy(name, first, args, kwargs)
        elif name in _FROM_HOST_DATA and self.recorder.is_device(kwargs.get("device")) and not _tensors(first):
            self.recorder.record(f"torch.{name}(<python data>, device=...) (host-to-device copy)")
        out = func(*args, **kwargs)
        if self.recorder.is_device(kwargs.get("device")) or (name in ("to", "cuda") and self._to_device(args, kwargs)):
            if out is first and not _on_device(first):  # on the CPU .to(cpu) is the host tensor itself: mark a view
                out = first.view_as(first)
            _mark(out)
        return out

    def _to_device(self, args: tuple, kwargs: dict) -> bool:
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return self.recorder.is_device(target)

    def _copy(self, name: str, tensor: torch.Tensor, args: tuple, kwargs: dict) -> None:
        non_blocking = kwargs.get("non_blocking", False) or any(a is True for a in args[1:])
        if name == "copy_":
            source = args[1] if len(args) > 1 else kwargs.get("src")
            if _on_device(source) and not _on_device(tensor):
                self.recorder.record("copy_ of a device tensor into host memory")
            elif (
                _on_device(tensor) and isinstance(source, torch.Tensor) and not _on_device(source) and not non_blocking
            ):
                self.recorder.record("copy_ of host memory into a device tensor without non_blocking")
            return
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if name == "cuda":
            target = self.recorder.device
        if target is None:
            return  # a dtype or memory-format change stays where it is
        if _on_device(tensor) and torch.device(target).type == "cpu" and self.recorder.device.type != "cpu":
            self.recorder.record(f"Tensor.{name}(cpu) of a device tensor (copy to host)")
        elif not _on_device(tensor) and self.recorder.is_device(target) and not non_blocking:
            self.recorder.record(f"Tensor.{name}(device) of a host tensor without non_blocking (host-to-device copy)")


class _DispatchLevel(TorchDispatchMode):
    """Operator-level: what reads a device value back (below autograd, so backward ops count too), and which
    results would live on the device."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        on_device = any(_on_device(t) for t in inputs)
        if on_device:
            what = _SYNCING_OPS.get(func)
            if (
                what is None
                and func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default)
                and any(t is not None and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else []))
            ):
                what = f"{func.__name__.split('.')[0]} with a boolean mask"
            if what is None and func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                what = "repeat_interleave without output_size"
            if what is not None:
                self.recorder.record(what)
        out = func(*args, **kwargs)
        if on_device:
            _mark(out)
        return out


class HostSyncProbe(L.Callback):
    """Records host-device waits in training steps ``first_step`` .. ``first_step + steps - 1`` (optimizer steps).

    Each recorded interval runs from one step's ``on_train_batch_start`` to the next one's: the step, every
    callback's hooks and the fetching of the next batch. Log steps (``trainer.log_every_n_steps``) may wait
    once and are recorded apart, as ``log_step``. On CUDA the same steps run under
    ``torch.cuda.set_sync_debug_mode("error")`` (``sync_debug``), which raises at the first wait.
    """

    def __init__(self, out: str, first_step: int = 3, steps: int = 10, sync_debug: bool = True) -> None:
        self.out, self.first_step, self.steps, self.sync_debug = Path(out), first_step, steps, sync_debug
        self._modes: list[Any] = []
        self._recorder: _Recorder | None = None
        self._steps: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # first of all callbacks, so that a step's interval starts before any other callback's hooks of that step
        # (same length: the loop calling this hook goes on with the next callback)
        trainer.callbacks.remove(self)
        trainer.callbacks.insert(0, self)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        self._recorder = _Recorder(device)
        if device.type != "cuda":  # on CUDA a tensor says where it lives; on the CPU the marks stand in for that
            _mark(list(pl_module.parameters()) + list(pl_module.buffers()))
            for metric in pl_module.modules():
                for name in getattr(metric, "_defaults", {}):
                    _mark(getattr(metric, name))
            for optimizer in trainer.optimizers:
                _mark([value for state in optimizer.state.values() for value in state.values()])
            batches = getattr(trainer.datamodule, "_train_batches", None)
            if batches is not None:
                _mark([batches.images, batches.labels, batches.scale, batches.shift])
        self._modes = [_FunctionLevel(self._recorder), _DispatchLevel(self._recorder)]
        for mode in self._modes:
            mode.__enter__()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._close(trainer)
        step = trainer.global_step
        if self._recorder is not None and self.first_step <= step < self.first_step + self.steps:
            log_step = trainer._logger_connector.should_update_logs
            self._current = {"step": step, "log_step": log_step, "found": []}
            self._recorder.found = self._current["found"]
            self._recorder.armed = True
            if self.sync_debug and self._recorder.device.type == "cuda" and not log_step:
                torch.cuda.set_sync_debug_mode("error")

    def _close(self, trainer: L.Trainer) -> None:
        if self._current is None:
            return
        if self._recorder.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        self._recorder.armed = False
        self._steps.append(self._current)
        self._current = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(trainer)  # validation and the epoch's end are not steady-state steps

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(trainer)
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        name = (
            self.out.name if trainer.global_rank == 0 else f"{self.out.stem}_rank{trainer.global_rank}{self.out.suffix}"
        )
        self.out.parent.mkdir(parents=True, exist_ok=True)
        (self.out.parent / name).write_text(
            json.dumps(
                {"device": str(self._recorder.device if self._recorder else None), "steps": self._steps}, indent=1
            )
            + "\n"
        )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
