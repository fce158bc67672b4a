"""What reaches the console: the run line, progress, metrics, warnings that ask something of the user, errors.

Lightning's and torch's informational lines (accelerators found, seeds set, process-group banners, the
loop's reasons for stopping) still go to each process's log file; only the console is spared them.
Warnings a user can do nothing about are dropped everywhere:

- ``isinstance(treespec, LeafSpec) is deprecated``: torch deprecating a name Lightning 2.6 still uses;
- ``The srun command is available on your system but is not used``: Lightning's hint on every local run
  of a machine with Slurm installed. Inside a Slurm allocation (``SLURM_JOB_ID`` set) it stays, as a
  forgotten ``srun`` is then a real mistake;
- ``The number of training batches (N) is smaller than the logging interval``: the epoch's training loss
  and accuracy are logged at every epoch's end regardless (``train/loss_epoch``, src/models/classifier.py);
- ``Precision bf16-mixed is not supported by the model summary ... Using 32 bits instead``: under a mixed
  precision (bf16-mixed is the default on GPUs) the weights are fp32, so the 32 bits the summary falls back on
  give the right size;
- ``This DataLoader will create N worker processes in total ... suggested max number of worker``: torch's, for
  each loader; the run line says it once, with the rank's cores (src/data/in_memory.py's ``describe_workers``).

A run that resumes (``ckpt_path``, a Slurm requeue, a torchrun restart) also drops ``Checkpoint directory ...
exists and is not empty`` (it resumes from there), and, with ``data.pipeline=device``, Lightning's ``your
dataloader is not resumable`` (that pipeline carries its place in the epoch in the checkpoint).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Lightning lines kept on the console: they say which checkpoint a run goes on from, or tests.
_KEPT_INFO = ("Restoring states from the checkpoint path",)


class ConsoleFilter(logging.Filter):
    """Drops Lightning's INFO lines from a console handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("lightning"):
            return True
        return record.levelno >= logging.WARNING or record.getMessage().startswith(_KEPT_INFO)


class _NoAdvertising(logging.Filter):
    """Lightning prints a cloud-product tip at every start; neither a console nor a training log is the place."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


def _is_console(handler: logging.Handler) -> bool:
    return (
        isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and getattr(handler, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    )


def quiet_console() -> None:
    """Put ``ConsoleFilter`` on every console handler (Hydra's, or Lightning's own in a process without Hydra)."""
    loggers = [
        logging.getLogger(),
        *(logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")),
    ]
    for handler in (h for lg in loggers for h in lg.handlers if _is_console(h)):
        if not any(isinstance(f, ConsoleFilter) for f in handler.filters):
            handler.addFilter(ConsoleFilter())


def quiet_dependencies() -> None:
    """Drop the warnings that ask nothing of the user (see the module's docstring), and Lightning's advert."""
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoAdvertising) for f in rank_zero.filters):
        rank_zero.addFilter(_NoAdvertising())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging")
    warnings.filterwarnings("ignore", message=r"Precision \S+-mixed is not supported by the model summary")
    # torch's per-loader warning of more workers than cores: the run line says it once (src/data/in_memory.py)
    warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes in total")
    # trainer.precision=16-mixed on a CPU: the run line says it runs bf16-mixed, and why (src/callbacks/run_summary.py)
    warnings.filterwarnings("ignore", message=r"You passed `Trainer\(accelerator='cpu', precision='16-mixed'\)`")
    step = os.environ.get("SLURM_STEP_ID", "")  # srun's: a number ("4294967294", older Slurm's batch script: none)
    if "SLURM_JOB_ID" not in os.environ or (step.isdigit() and step != "4294967294"):  # outside Slurm, or in srun
        # (Lightning says srun is not used in an allocation named interactive, as salloc names its job, srun or not)
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")


def quiet_resume(ckpt_path: str | None, resumable_position: bool) -> None:
    """A run that resumes from a checkpoint: Lightning's warning that its checkpoint folder is not empty says
    what the user asked for; its "dataloader is not resumable" warning is wrong where the datamodule carries the
    place in the epoch itself (``data.pipeline=device``, src/data/device_batches.py)."""
    if ckpt_path is None:
        return
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    if resumable_position:
        warnings.filterwarnings(
            "ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended"
        )


def spawned_rank_console() -> None:
    """A ``ddp_spawn`` rank has no Hydra logging: the project's own lines (the run line) still reach its console,
    Lightning's own console handler gets the same filter as the parent's, and the same warnings are dropped
    (a spawned interpreter inherits no warning filter)."""
    quiet_dependencies()
    if not logging.getLogger().handlers:
        project = logging.getLogger("src")
        if not project.handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
            project.addHandler(handler)
            project.setLevel(logging.INFO)
    quiet_console()
