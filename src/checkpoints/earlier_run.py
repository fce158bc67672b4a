"""A new training never writes over an earlier run's checkpoints.

A training started anew (no ``ckpt_path``) whose ``paths.checkpoints`` already holds a run's checkpoints (the same
command again with a fixed ``hydra.run.dir``, a Slurm job id given again to srun's default dir, a prefix another run
wrote) would overwrite that run's ``last.ckpt`` and best ones, and draw its TensorBoard curves over that run's,
without a word. It is refused (exit 2) as the run starts: a folder by ``EarlierRunCheck``, after ``RunDirLock`` has
held the dir (a run still going there is named as such) and before Hydra writes into it; a prefix once the store has
answered the run's own check. Torch-free: Hydra builds its callbacks before a launcher's local ranks are started.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.checkpoints import object_store
from src.core.errors import not_swallowed, report
from src.core.settings import hydra_config_of
from src.launch import torchrun


class EarlierRunCheck(Callback):
    """Hydra callback: refuse a new training whose checkpoints folder holds another run's, before Hydra writes into
    the run dir. An ``s3://`` prefix is looked at later, once the run has found the store reachable and writable
    (src/cli/entry.py's ``check_extras``): a store that does not answer is said so, not as a listing that failed."""

    @not_swallowed
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not starts_anew(config):
            return
        try:
            with hydra_config_of(config):  # paths.checkpoints names the run dir through ${output_dir:}
                folder = str(config.paths.checkpoints)
        except Exception:  # noqa: BLE001 - a value that cannot resolve yet is refused by the run's own checks
            return
        if not object_store.is_url(folder):
            refuse_earlier_run(folder, str(config.hydra.run.dir))


def starts_anew(config: DictConfig) -> bool:
    """A training that starts from nothing: no ``ckpt_path``, and not a torchrun attempt (every attempt resumes)."""
    return config.get("task_name") == "train" and not config.get("ckpt_path") and not torchrun.active()


def refuse_earlier_run(folder: str, run_dir: str) -> None:
    """Refuse the run (exit 2) if ``folder`` (``paths.checkpoints``, a folder or an ``s3://`` prefix) holds a
    checkpoint. Every process looks at a folder and finds the same: a run writes its first checkpoint only once all
    its ranks have met, so none sees this run's own. A torchrun attempt and a sweep's job go on from their dir instead
    (``ckpt_path=auto``: src/checkpoints/resume.py's ``resume_own_run_dir``); Hydra calls ``on_run_start`` for a
    single run only, never for a sweep's jobs. One listing a process, once a run; a prefix, one LIST request of the
    run's owner, after its store check."""
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
    run = Path(run_dir).absolute()
    if Path(folder) == run / "checkpoints":
        where, elsewhere = f"hydra.run.dir={run}", "hydra.run.dir=DIR"
    else:
        where, elsewhere = f"paths.checkpoints={folder}", "paths.checkpoints"
    report(
        f"{where} holds an earlier run's checkpoints ({shown}), which a new run would overwrite: to go on with that "
        f"run, pass ckpt_path=last; to train anew, pass another {elsewhere} (or remove {folder} first)"
    )
