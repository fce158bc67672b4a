"""A new training never writes over an earlier run's checkpoints.

A training started anew (no ``ckpt_path``) whose ``paths.checkpoints`` already holds a run's checkpoints (the same
command again with a fixed ``hydra.run.dir``, a Slurm job id given again to srun's default dir, a prefix another run
wrote) would overwrite that run's ``last.ckpt`` and best ones, and draw its TensorBoard curves over that run's,
without a word. ``EarlierRunCheck`` refuses it (exit 2) as the run starts, after ``RunDirLock`` has held the dir (a
run still going there is named as such) and before Hydra writes into it. Torch-free: Hydra builds its callbacks
before a launcher's local ranks are started.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.checkpoints import object_store
from src.core.errors import report
from src.launch import torchrun


class EarlierRunCheck(Callback):
    """Hydra callback: refuse a new training whose checkpoints folder holds another run's (``refuse_earlier_run``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.get("task_name") == "train" and not config.get("ckpt_path") and not torchrun.active():
            refuse_earlier_run(config)


def refuse_earlier_run(config: DictConfig) -> None:
    """Every process looks, and finds the same: a run writes its first checkpoint only once all its ranks have met,
    so none sees this run's own. A torchrun attempt and a sweep's job go on from their dir instead (``ckpt_path=auto``:
    src/checkpoints/resume.py's ``resume_own_run_dir``); Hydra calls ``on_run_start`` for a single run only, never for
    a sweep's jobs. One listing a process, once a run (an ``s3://`` prefix: one LIST request; every rank of a resume
    reads the whole checkpoint)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_config = HydraConfig.instance()
    before = hydra_config.cfg  # put back after: run_job sets its own next (and a test's process keeps its own)
    try:
        hydra_config.set_config(config)  # paths.checkpoints names the run dir through ${output_dir:}
        folder = str(config.paths.checkpoints)
    except Exception:  # noqa: BLE001 - a value that cannot resolve yet is refused by the run's own checks, in one line
        return
    finally:
        hydra_config.cfg = before
    names: list[str] = []
    if object_store.is_url(folder):
        names = [url.rsplit("/", 1)[-1] for url in object_store.names(folder, "*.ckpt")]
    else:
        with contextlib.suppress(OSError):  # no folder (yet): nothing to overwrite
            names = [e.name for e in os.scandir(folder) if e.name.endswith(".ckpt") and not e.name.startswith(".")]
    names.sort(key=lambda name: (not name.startswith("last"), name))
    if not names:
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    run_dir = Path(str(config.hydra.run.dir)).absolute()
    if Path(folder) == run_dir / "checkpoints":
        where, elsewhere = f"hydra.run.dir={run_dir}", "hydra.run.dir=DIR"
    else:
        where, elsewhere = f"paths.checkpoints={folder}", "paths.checkpoints"
    report(
        f"{where} holds an earlier run's checkpoints ({shown}), which a new run would overwrite: to go on with that "
        f"run, pass ckpt_path=last; to train anew, pass another {elsewhere} (or remove {folder} first)"
    )
