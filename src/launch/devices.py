"""Which devices a rank uses: what ``trainer.devices`` says (a count, ``auto``/``-1``, GPU ids), how many devices a
node's ranks take, which GPUs those are, and whether srun gave each task one GPU of its own.

Every answer is read from the config and the machine before any process starts (src/launch/ranks.py) and under
torchrun (src/launch/torchrun.py), the same way Lightning's Trainer will resolve it; an impossible value is a
UserError naming its key. The invariant: no CUDA context is made here (``torch.cuda.device_count`` only), so a rank
still selects its own GPU first. It imports nothing of the project but its errors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from src.core.errors import UserError


def gpu_ids(devices: Any) -> list[int] | None:
    """The GPU ids ``trainer.devices`` lists (``[0,2]``, Hydra's ListConfig of it, or ``"0,2"``); None for a count or
    auto. Ids that are not whole numbers are a UserError."""
    if isinstance(devices, str):
        if "," not in devices:
            return None
        parts: list[Any] = [d.strip() for d in devices.split(",") if d.strip()]
    elif isinstance(devices, Sequence):  # a list, a tuple, an OmegaConf ListConfig
        parts = list(devices)
    else:
        return None
    ids = []
    for part in parts:
        if isinstance(part, bool) or not (isinstance(part, int) or isinstance(part, str) and part.isdigit()):
            raise UserError(
                f"trainer.devices={devices} is not a list of GPU ids: give whole numbers >= 0, e.g. "
                "trainer.devices=[0,2], or a count of devices"
            )
        ids.append(int(part))
    if not ids:
        raise UserError(f"trainer.devices={devices} names no GPU: give GPU ids (trainer.devices=[0,1]) or a count")
    return ids


def _torch():  # noqa: ANN202 - the module
    import torch

    return torch


def torch_cuda_available() -> bool:
    return _torch().cuda.is_available()


def uses_cuda(accelerator: str) -> bool:
    """Whether ``trainer.accelerator`` resolves to CUDA GPUs on this machine."""
    if accelerator in ("gpu", "cuda"):
        return True
    return accelerator == "auto" and _torch().cuda.is_available()


def local_device_count(accelerator: str, devices: Any) -> int:
    """Devices per node as Lightning will resolve them; impossible values are a UserError naming the key."""
    torch = _torch()
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(
            f"trainer.accelerator={accelerator} but no CUDA GPU is visible here: use trainer.accelerator=cpu (or auto)"
        )
    ids = gpu_ids(devices)
    if ids is not None:
        check_gpu_ids(accelerator, devices, ids)
        return len(ids)
    if devices in ("auto", -1, "-1"):
        return torch.cuda.device_count() if uses_cuda(accelerator) else 1
    try:
        count = int(devices)
        if isinstance(devices, float) and devices != count:  # int() took 2.5 for 2, which Lightning then refused
            raise ValueError
    except (TypeError, ValueError):
        raise UserError(
            f"trainer.devices={devices} is not a whole number: give a count >= 1, "
            "-1 or auto for all devices, or a list of GPU ids"
        ) from None
    if count < 1 or isinstance(devices, bool):
        raise UserError(f"trainer.devices={devices} must be >= 1 (or -1/auto for all devices)")
    if uses_cuda(accelerator) and count > torch.cuda.device_count() and not one_gpu_per_task(accelerator, devices):
        raise UserError(
            f"trainer.devices={devices} asks for {count} GPUs but this node has "
            f"{torch.cuda.device_count()}{_narrowed()}: lower trainer.devices, or use trainer.devices=auto"
        )
    return count


def check_gpu_ids(accelerator: str, devices: Any, ids: list[int]) -> None:
    """GPU ids count from 0 within the GPUs this process sees (CUDA_VISIBLE_DEVICES narrows them), once each."""
    if not uses_cuda(accelerator):
        raise UserError(
            f"trainer.devices={devices} lists GPU ids, but this run is on the CPU "
            f"(trainer.accelerator={accelerator}, CUDA available: {_torch().cuda.is_available()}): "
            f"give a number of processes instead, e.g. trainer.devices={len(ids)}"
        )
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise UserError(
            f"trainer.devices={devices} names GPU {twice[0]} more than once: every process needs a GPU of its own"
        )
    visible = _torch().cuda.device_count()
    beyond = [i for i in ids if i >= visible]
    if beyond:
        raise UserError(
            f"trainer.devices={devices} names GPU {beyond[0]}, but this node has {visible} GPU(s)"
            f"{_narrowed()}: ids count from 0 within the visible GPUs, so use ids 0..{visible - 1}"
        )


def _narrowed() -> str:
    """' visible (CUDA_VISIBLE_DEVICES=1,3)' where that variable narrows the GPUs this process sees, else ''."""
    narrowed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if narrowed is None else f" visible (CUDA_VISIBLE_DEVICES={narrowed})"


def slurm_detected() -> bool:
    """Whether Slurm placed this process. What Lightning's ``SLURMEnvironment.detect()`` answers (a Slurm job, not an
    interactive allocation named bash or interactive: there you start the processes yourself), read without loading
    Lightning, as the allocation check runs before it loads; and also a task of an srun step of several tasks in an
    allocation so named. salloc names its job interactive, and ``srun python -m src.train`` there started one run:
    Lightning took each task for a run of its own (each its own world, its local ranks started again, one run dir
    for all). tests/test_config.py holds the two to these answers."""
    if "SLURM_NTASKS" not in os.environ:
        return False
    if os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return True
    step = os.environ.get("SLURM_STEP_ID")
    return step is not None and step.isdigit() and step != "4294967294" and _count("SLURM_STEP_NUM_TASKS") > 1


def _count(variable: str) -> int:
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() else 1


def srun_task() -> bool:
    """Whether srun started this process as one task of a Slurm job step, with its rank in the Slurm variables
    (Lightning's SLURMEnvironment then holds: not an interactive allocation, not torchrun's workers)."""
    return (
        slurm_detected()
        and "TORCHELASTIC_RUN_ID" not in os.environ
        and os.environ.get("SLURM_STEP_ID") not in (None, "batch", "4294967294")
    )


def one_gpu_per_task(accelerator: str, devices: Any) -> bool:
    """Whether srun gave this task one GPU of its own (``--gpus-per-task=1``) while ``trainer.devices`` counts the
    node's tasks: each task then sees one GPU, its cuda:0, and trains there (src/distributed/strategy.py's TaskGPU)."""
    if not srun_task() or not uses_cuda(accelerator) or _torch().cuda.device_count() != 1:
        return False
    if isinstance(devices, bool) or not isinstance(devices, (int, str)) or not str(devices).strip().isdigit():
        return False
    return int(devices) > 1


def node_gpus(accelerator: str, devices: Any) -> list[int]:
    """The indices of the visible GPUs this node's ranks train on, read before any of them selects its own."""
    if one_gpu_per_task(accelerator, devices):
        return [0]
    ids = gpu_ids(devices)
    return ids if ids is not None else list(range(local_device_count(accelerator, devices)))
