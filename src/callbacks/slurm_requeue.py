"""Requeue a Slurm job on SIGUSR1 (``#SBATCH --signal=SIGUSR1@90``); the restart resumes from ``last.ckpt``.

This replaces Lightning's own SIGUSR1 handler (``SLURMEnvironment(auto_requeue=True)``), the one
requeue owner being this callback. Lightning's handler saves ``hpc_ckpt_N.ckpt`` from inside the signal
handler, in the middle of a training step. Here ``scontrol requeue`` makes Slurm send SIGTERM to every
task, src/callbacks/graceful_stop.py stops all ranks at the same step with ``last.ckpt`` written, and
the restarted job (same run dir, ``ckpt_path=auto``) continues from that step.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment

log = logging.getLogger(__name__)

# Slurm stops every process of a job once slurmctld has taken its requeue, scontrol too where it has not exited yet
# (on a loaded node it may not have), and its answer was then lost: "failed" for a job that was requeued. scontrol
# runs with SIGTERM ignored (a disposition exec keeps), so it exits on its own with its answer; and within
# ANSWER_S, so that rank zero, which runs it in its signal handler, does not stall the other ranks into a hang.
REQUEUE = ["/bin/sh", "-c", 'trap "" TERM; exec scontrol requeue "$1"', "scontrol"]
ANSWER_S = 30.0


class SlurmRequeue(L.Callback):
    """On SIGUSR1, rank zero runs ``scontrol requeue $SLURM_JOB_ID``; Slurm then stops and restarts the job."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and SLURMEnvironment.detect() and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, lambda signum, frame: self._requeue(trainer))

    @staticmethod
    def _requeue(trainer: L.Trainer) -> None:
        if not trainer.is_global_zero:
            return
        array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
        job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
        try:
            result = subprocess.run([*REQUEUE, job_id], capture_output=True, text=True, timeout=ANSWER_S)
        except subprocess.TimeoutExpired:
            log.error(
                "SIGUSR1: scontrol requeue %s gave no answer in %g s: the job is not known to be requeued",
                job_id,
                ANSWER_S,
            )
            return
        if result.returncode == 0:
            log.warning("SIGUSR1: requeued Slurm job %s; it will resume from checkpoints/last.ckpt", job_id)
        else:
            log.error(
                "SIGUSR1: scontrol requeue %s failed: %s", job_id, result.stderr.strip() or f"exit {result.returncode}"
            )
