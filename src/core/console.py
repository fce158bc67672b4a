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
  each loader; the run line says it once, with the rank's cores (src/data/in_memory.py's ``describe_workers``);
- ``ModelCheckpoint(monitor='val/acc') could not find the monitored key ... Did you call log('val/acc')``: a fit
  that ended before its first validation (``trainer.limit_val_batches=0``, ``trainer.max_steps`` within an epoch);
  the test's line says no best checkpoint was kept.

A run that resumes (``ckpt_path``, a Slurm requeue, a torchrun restart) also drops ``Checkpoint directory ...
exists and is not empty`` (it resumes from there), ``The dirpath has changed from ...`` (a checkpoint of another
folder: the project's own line says what it means, src/checkpoints/resume.py), and, with ``data.pipeline=device``,
Lightning's ``your dataloader is not resumable`` (that pipeline carries its place in the epoch in the checkpoint).
``ddp_spawn``'s ranks, new interpreters, get the same filters from their parent (``spawned_rank_console``).

The project's own warnings reach the console once a run, as a ``warning:`` line from the process that owns the run
dir (``warning_line``); every rank's log file keeps them.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import warnings
from typing import Any

from src.core.errors import print_line

# Lightning lines kept on the console: they say which checkpoint a run goes on from, or tests.
_KEPT_INFO = ("Restoring states from the checkpoint path",)
# whose INFO lines stay in the log file: Lightning's, and boto's where checkpoints go to an object store (`Found
# credentials in environment variables`, `Found endpoint for s3 via: environment_global`, from every process)
_QUIET_INFO = ("lightning", "botocore", "aiobotocore", "s3fs")


# a record's attribute: its words reach the console as a ``warning:`` line of their own (``warning_line``)
SAID = "said_on_console"


class ConsoleFilter(logging.Filter):
    """Drops Lightning's (and boto's) INFO lines from a console handler, and the records a ``warning:`` line has
    said."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, SAID, False):
            return False
        if not record.name.startswith(_QUIET_INFO):
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


def warning_line(log: logging.Logger, message: str, say: bool = True) -> None:
    """A warning the user should read: one ``warning: message`` line on stderr, and the record in this process's log
    file, not on the console a second time. ``say``: whether this process speaks for the run (every rank meets the
    same warning; a world of 2,048 ranks would print it 2,048 times). Before, each rank's console handler printed
    the record too: under ``ddp`` a warning reached the terminal once per rank, and once more as this line."""
    quiet_console()  # Hydra's console handler is set up by the time anything warns
    log.warning(message, extra={SAID: True})
    if say:
        print_line(f"warning: {message}")


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
    # a fit that ends before any validation (trainer.limit_val_batches=0, trainer.max_steps within the first epoch):
    # the best-checkpoint callback finds no val/acc yet, and asks whether the model logs it (it does, once it
    # validates); the test's line says "no best checkpoint kept". A key missing after a validation is Lightning's error.
    warnings.filterwarnings("ignore", message=r"`ModelCheckpoint\(monitor=.*could not find the monitored key")
    # a new training into an s3:// prefix: the store check's probe (src/checkpoints/object_store.py) leaves some stores
    # (SeaweedFS) an empty folder marker there, which Lightning counts as a file; a prefix that holds a run's
    # checkpoints is refused before (src/checkpoints/earlier_run.py)
    warnings.filterwarnings("ignore", message=r"Checkpoint directory s3://\S+ exists and is not empty")
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
    # a checkpoint of another folder: src/checkpoints/resume.py's warn_moved_checkpoints says what it means here
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from .* won't be reloaded")
    if resumable_position:
        warnings.filterwarnings(
            "ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended"
        )


def warning_filters() -> list[tuple[Any, ...]]:
    """This process's warning filters that can travel to a spawned process (pickled with its launcher)."""
    kept = []
    for entry in warnings.filters:
        try:
            pickle.dumps(entry)
        except Exception:  # noqa: BLE001 - a category defined where a new interpreter cannot import it: stays here
            continue
        kept.append(entry)
    return kept


def spawned_rank_console(filters: list[tuple[Any, ...]] | None = None) -> None:
    """A ``ddp_spawn`` rank has no Hydra logging: the project's own lines (the run line) still reach its console,
    Lightning's own console handler gets the same filter as the parent's, and the parent's warning ``filters``
    (``warning_filters``) are set again: a spawned interpreter inherits none, and a resumed run's dropped warnings
    (``quiet_resume``) reached the console from its ranks."""
    quiet_dependencies()
    for action, message, category, module, lineno in reversed(filters or []):  # the parent's order, first first
        # a pattern, or None; Python's own defaults name a module as plain text (``__main__``)
        message, module = (getattr(p, "pattern", p) or "" for p in (message, module))
        warnings.filterwarnings(action, message, category, module, lineno)
    if not logging.getLogger().handlers:
        project = logging.getLogger("src")
        if not project.handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
            project.addHandler(handler)
            project.setLevel(logging.INFO)
    quiet_console()
