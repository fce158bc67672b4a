"""Test-only faults of Hydra callbacks, added to real runs: ``+hydra.callbacks.fault._target_=tests.hydra_faults.X``.
Torch-free, as the project's own Hydra callbacks are: Hydra builds them before the task."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback

from src.core.errors import not_swallowed


class RaiseOnRunStart(Callback):
    """A bug of a Hydra callback as the run starts, as the project's callbacks are written (``not_swallowed``)."""

    @not_swallowed
    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        raise RuntimeError("a fault of a Hydra callback as the run starts")
