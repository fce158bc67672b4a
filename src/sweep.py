"""Hydra callbacks that make multirun sweeps safe for DDP, and write the scaling report when one ends.

Hydra's basic launcher runs a sweep's jobs one after another in one process. Lightning's DDP leaves
that process with an initialised process group, MASTER_PORT / LOCAL_RANK / WORLD_SIZE / NODE_RANK and
the global seed in its environment, and local-rank children that may still be exiting; the next job
then silently reuses them (Lightning #11300). ``JobIsolation`` gives every job a clean slate.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src import supervision
from src.errors import FAILURE_FILE
from src.launch import in_sweep

log = logging.getLogger(__name__)

CHILD_EXIT_GRACE_S = 120  # local ranks finish their own teardown (test, last logs) after rank zero returns


class JobIsolation(Callback):
    """In a sweep: snapshot the environment when a job starts; when it ends, reap its ranks, drop its process
    group, restore the environment. A single run has nothing to isolate (and no job number)."""

    def __init__(self) -> None:
        self._environ: dict[str, str] | None = None

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if in_sweep():
            self._environ = dict(os.environ)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not in_sweep():
            return
        failed = (Path(config.hydra.runtime.output_dir) / FAILURE_FILE).exists()
        supervision.stop_watching_failures(wait=not failed)
        failure = supervision.reap_started(grace_s=0 if failed else CHILD_EXIT_GRACE_S)
        if failure is not None and not supervision.said_why(failure[1]):
            log.warning("job %s: %s", config.hydra.job.num, failure[0])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if self._environ is not None:
            os.environ.clear()
            os.environ.update(self._environ)


class ScalingReport(Callback):
    """When a sweep ends, write scaling.csv/.md/.png into its dir; exit non-zero if any job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from src.report import write_report

        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = write_report(sweep_dir)
        failed = [j for j in jobs if j.record is None]
        log.info("Scaling report: %s (%d jobs, %d failed)", sweep_dir / "scaling.md", len(jobs), len(failed))
        if failed:
            print(f"error: {len(failed)} of {len(jobs)} jobs failed: "
                  + "; ".join(f"job {j.num}: {j.error}" for j in failed), file=sys.stderr, flush=True)
            sys.exit(1)
