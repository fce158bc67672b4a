"""What ``trainer.devices`` says: a count, ``auto``/``-1``, or GPU ids. Read by src/launch.py before any process
starts and by src/torchrun.py under torchrun; it imports nothing of the project but its errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from src.errors import UserError


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
            raise UserError(f"trainer.devices={devices} is not a list of GPU ids: give whole numbers >= 0, e.g. "
                            "trainer.devices=[0,2], or a count of devices")
        ids.append(int(part))
    if not ids:
        raise UserError(f"trainer.devices={devices} names no GPU: give GPU ids (trainer.devices=[0,1]) or a count")
    return ids
