"""SIGTERM (a preempted VM, ``kubectl delete``, ``scancel``, a Slurm requeue), Ctrl-C (SIGINT) and SIGHUP (the
terminal gone: an SSH session dropped, a terminal window closed): stop every rank at the same step, write
``last.ckpt``, exit ``128 + signal`` (143, 130, 129). A second Ctrl-C quits at once. After SIGHUP the process writes
what it would have printed to its log file (a hung-up terminal fails every write); under ``nohup``, which ignores
SIGHUP, the run goes on.

This replaces Lightning's own SIGTERM handling, which (2.6.6) exits with code 0 and writes no checkpoint,
acts only on rank zero's signal, and runs a collective inside the signal handler. Here a signal only
sets a flag; at every batch end each rank adds its flag to an all-reduce on a small gloo group of its
own, started asynchronously and read one batch later, so no GPU work waits on it. Every rank reads the
same sum after the same batch, so all stop together, whichever of them was signalled. A stop agreed at an epoch's
last batch lets the epoch end first (its validation, its best checkpoint, its end hooks: a resume starts the next
epoch), through ``trainer.should_stop`` as early stopping does, and ends the run when fit returns.

The same all-reduce carries a second flag: this rank's clock says ``last.ckpt`` is due
(``callbacks.last_checkpoint.every_n_minutes``). Clocks differ between ranks and the save is collective,
so every rank saves one batch after any of them found it due: one agreement per batch for both.

One agreement per batch holds while the all-reduce is done by the next batch end, as on a few ranks. Its
latency grows with the world (gloo's ring: 2 (W - 1) hops, tenths of a second at thousands of ranks) while a
step does not, so a rank that finds itself waiting for it asks for a longer period: the all-reduce carries a
third value, the period each rank wants, and every rank reads the same maximum at the same batch and switches
together. The period doubles after ``SLOW_READS`` agreements in a row that waited longer than a fifth of the
batches between them (at most ``MAX_PERIOD`` batches), so a stop lands within two periods and a step never waits
for the all-reduce, at any world size.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from src.checkpoints.files import LAST
from src.checkpoints.last import LastCheckpoint
from src.core.errors import UserError, print_line, terminal_gone, terminals
from src.launch import torchrun
from src.launch.run_dir import job_of_a_sweep, resume_with
from src.resilience import failure, heartbeat, supervision
from src.resilience.failure import Terminated

SAME_PRESS_S = 1.0  # SIGINTs this close together are one Ctrl-C (the terminal's, and ddp_spawn's parent passing it on)
MAX_PERIOD = 64  # batches between two agreements, at most
SLOW_READS = 3  # agreements in a row that waited, before a rank asks for twice the period
MIN_WAIT_S = 0.005  # a wait shorter than this is no reason to wait less often


def _last_batch_of_epoch(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether this training batch ends the epoch (its data, or ``trainer.limit_train_batches``): the same on every
    rank (their shards have the same batches)."""
    return trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or batch_idx + 1 >= trainer.num_training_batches


def slow_read(waited_s: float, since_send_s: float) -> bool:
    """Whether an agreement's read waited long enough to ask for a longer period: over ``MIN_WAIT_S`` and over a fifth
    of the time since it was sent (the batches of one period)."""
    return waited_s > max(MIN_WAIT_S, since_send_s / 5)


def wanted_period(period: int, slow_reads: int) -> int:
    """The period a rank asks for: twice the current one after ``SLOW_READS`` slow reads in a row, up to
    ``MAX_PERIOD``; the agreed one otherwise (the all-reduce takes the largest any rank asks for)."""
    return min(MAX_PERIOD, period * 2) if slow_reads >= SLOW_READS else period


class GracefulStop(L.Callback):
    """Stops training (or testing) at the same batch on every rank after a SIGTERM, SIGINT or SIGHUP to any of them."""

    def __init__(self, period: int = 1) -> None:
        if isinstance(period, bool) or not isinstance(period, int) or not 1 <= period <= MAX_PERIOD:
            raise UserError(
                f"callbacks.graceful_stop.period={period} must be a whole number of batches from 1 to {MAX_PERIOD}"
            )
        self._signum: int | None = None
        self._terminals: list[int] = []  # which of stdout and stderr were a terminal (for SIGHUP)
        self._group: Any = None
        self._pending: tuple[torch.Tensor, Any, int] | None = None  # flags, their all-reduce, saves when sent
        self._last: LastCheckpoint | None = None
        self._pressed: float | None = None  # when Ctrl-C first came
        self._run_dir: Path | None = None
        self._rank_zero = True
        self._saved_stop = False  # last.ckpt holds the step this run stopped at
        self._shared_batches = 0  # test batches every rank has
        self._period = period  # batches between two agreements, the same on every rank (agreed; it may grow)
        self._batches = 0  # batch ends of this stage
        self._slow_reads = 0  # agreements in a row that waited
        self._sent_at = 0.0  # when the pending agreement was sent
        self._stop_at_epoch_end = False  # a stop agreed at an epoch's last batch: after the epoch's validation
        self._stop_after_this_batch = False  # ... that Lightning did not stop at: at the next batch's end

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo")  # every rank creates it, in the same order
        self._last = next((cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)), None)
        self._run_dir, self._rank_zero = Path(trainer.default_root_dir), trainer.is_global_zero
        # Lightning's SIGTERM path broadcasts rank zero's flag before every training step: under NCCL a
        # device-to-host wait per step. With SIGTERM handled here, that broadcast only costs time.
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            epoch_loop._broadcast_sigterm_tensor = lambda: None

    # Lightning installs its own handler (after on_fit_start) just before a stage runs; these hooks come later,
    # so ours replaces it rather than joining it.
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()
        self._batches = 0

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()
        self._batches = 0
        # test shards are not padded (src/data), so a rank may have one batch fewer: agree on the batches all have
        self._shared_batches = sum(trainer.num_test_batches)
        if self._group is not None:
            fewest = torch.tensor([self._shared_batches])
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=self._group)
            self._shared_batches = int(fewest)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._release_sigint()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._release_sigint()  # Lightning skips teardown hooks after an exception

    def _release_sigint(self) -> None:
        # the code after fit, or a sweep's next job, must not leave a Ctrl-C to this callback's flag
        main = threading.current_thread() is threading.main_thread()
        if main and not self._saved_stop and not failure.sigint_ignored():
            signal.signal(signal.SIGINT, failure.on_sigint)

    def _install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            if not failure.sigint_ignored():  # a background job's: the terminal's Ctrl-C is not for it
                signal.signal(signal.SIGINT, self._on_signal)
            if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # ignored: nohup's, which keeps the run going
                self._terminals = terminals()  # asked now: a terminal that hung up no longer says it is one
                signal.signal(signal.SIGHUP, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:  # the terminal is gone: writes to it would fail and end the run before its stop
            terminal_gone(self._terminals)
        if signum == signal.SIGINT:
            if self._pressed is not None and time.monotonic() - self._pressed > SAME_PRESS_S:
                self._quit_now()
            self._pressed = self._pressed or time.monotonic()
        if self._signum is None:
            self._signum = signum

    def _quit_now(self) -> None:
        """A second Ctrl-C: every process goes at once; last.ckpt is whichever whole file the rename left."""
        if self._rank_zero:
            path = self._last.path if self._last is not None else (self._run_dir or Path(".")) / "checkpoints" / LAST
            # LastCheckpoint's own record of the step it last wrote: a resumed run's first file is not counted there
            step = getattr(self._last, "_saved_at_step", -1) if self._last is not None else -1
            if self._saved_stop:
                said = f"{path} was written at the step the run stopped"
            elif step >= 0:
                said = f"{path} is the previous one (step {step})"
            else:
                said = f"{path}, if there is one, is the previous one"
            print_line(f"interrupted again (Ctrl-C): quit at once; {said}; {resume_with(self._run_dir)}")
        supervision.quit_at_once(128 + signal.SIGINT)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._stop_after_this_batch:
            stop, due = True, False
        elif not self._agreement_batch():
            return
        else:
            stop, due = self._agreed(self._last)
        if not stop:
            if due:
                self._last.save(trainer)
            self._send(self._last)  # after the save: the flag it sends reads a clock the save has reset
            return
        if _last_batch_of_epoch(trainer, batch_idx) and not self._stop_after_this_batch:
            # The epoch's validation (its metrics, its best checkpoint) and its end hooks come after this one: a stop
            # here would lose them, as a resume starts the next epoch. So the epoch ends first, as early stopping
            # ends it (trainer.should_stop), and the run stops when fit returns. Every rank agreed at this batch.
            self._stop_at_epoch_end = True
            return
        # Lightning hands a step's logged values to the loggers after on_train_batch_end, which the stop below never
        # returns to: this step's would be the one missing from every logger. Handed over now, as Lightning would.
        trainer._logger_connector.update_train_step_metrics()
        self._stop(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop_at_epoch_end:
            trainer.should_stop = True  # LastCheckpoint writes last.ckpt at this epoch's end then, the best too

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._stop_at_epoch_end:  # Lightning went on (trainer.min_epochs not reached): stop at this batch's end
            self._stop_at_epoch_end, self._stop_after_this_batch = False, True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stop_at_epoch_end:
            self._stop(trainer)

    def _stop(self, trainer: L.Trainer) -> None:
        """Write last.ckpt at this step on every rank and end the run with the signal's exit status."""
        path = self._save(trainer)
        resume = self._resume()
        if self._signal_or_sigterm() == signal.SIGINT:
            raise self._terminated(
                f"interrupted (Ctrl-C) at step {trainer.global_step} of epoch {trainer.current_epoch}; {path} "
                f"written{f'; {resume}' if resume else ''}"
            )
        if torchrun.active() and resume:  # its agent stops its workers to restart them, and when it is stopped itself
            resume = f"torchrun's next attempt resumes from there; if torchrun itself was stopped, {resume}"
        raise self._terminated(
            f"{self._name()} after step {trainer.global_step}: every rank stopped there and {path} holds that step"
            f"{f'; {resume}' if resume else ''}"
        )

    def _resume(self) -> str | None:
        """How to go on: in the same run dir, which holds the run's logs, its record and its ranked best checkpoints
        (a checkpoint's path alone made a new run dir, a second run's start). The run dir is the trainer's, not the
        checkpoint's folder's parent: ``paths.checkpoints`` may be elsewhere, an ``s3://`` prefix among them (before:
        ``AttributeError`` at a Ctrl-C there). In a sweep's job None: the sweep's own line follows
        (src/resilience/failure.py's ``stopped_line``), where this said to resume the job as a run of its own, without
        the job's overrides."""
        return None if job_of_a_sweep() else resume_with(self._run_dir)

    def _terminated(self, line: str) -> Terminated:
        """The stop this rank raises at the agreed step, noted as such (``failure.on_sigint``: a Ctrl-C after it)."""
        self._saved_stop = True
        return failure.stopping(Terminated(self._signal_or_sigterm(), line), self._rank_zero)

    def on_test_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if batch_idx + 1 < self._shared_batches and not self._agreement_batch():
            return
        stop, _ = self._agreed(None)
        if batch_idx + 1 < self._shared_batches:
            self._send(None)
        if stop:
            what = "interrupted (Ctrl-C)" if self._signal_or_sigterm() == signal.SIGINT else self._name()
            raise self._terminated(
                f"{what} during the test pass; training had finished and its checkpoints are complete"
            )

    def _agreement_batch(self) -> bool:
        """Whether this batch end reads the last agreement and sends the next: every ``_period``-th one (every one
        without a group). Every rank counts the same batches, so they agree on which."""
        self._batches += 1
        return self._group is None or self._batches % self._period == 0

    def _agreed(self, last: LastCheckpoint | None) -> tuple[bool, bool]:
        """(stop, last.ckpt due) as every rank saw them at the last agreement; this rank's stop now, without a
        group (a single process's LastCheckpoint then reads its own clock)."""
        if self._group is None:
            return self._signum is not None, False
        if self._pending is None:
            return False, False
        flags, work, saves = self._pending
        self._pending = None
        heartbeat.mark("waiting for the other ranks to agree on stopping and checkpointing")
        waited = 0.0
        if not work.is_completed():
            started = time.monotonic()
            work.wait()
            waited = time.monotonic() - started
        stop, due, period = (int(flag) for flag in flags.tolist())
        self._period = period  # the most any rank asked for: the same everywhere, from this batch on
        self._slow_reads = self._slow_reads + 1 if slow_read(waited, time.monotonic() - self._sent_at) else 0
        return bool(stop), bool(due) and last is not None and last.saves == saves  # a save has reset the clocks

    def agreed_due(self) -> bool:
        """Whether any rank found last.ckpt due at the last batch end: what LastCheckpoint asks at an epoch's end
        (src/checkpoints/last.py); the next batch still reads the stop flag."""
        if self._pending is None or self._last is None:
            return False
        flags, work, saves = self._pending
        work.wait()
        return bool(flags[1]) and self._last.saves == saves

    def _send(self, last: LastCheckpoint | None) -> None:
        """Start the all-reduce of this rank's flags and the period it wants, read ``_period`` batches later."""
        if self._group is None:
            return
        wanted = wanted_period(self._period, self._slow_reads)
        if wanted != self._period:
            self._slow_reads = 0
        flags = torch.tensor([int(self._signum is not None), int(last is not None and last.due()), wanted])
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (flags, work, last.saves if last is not None else -1)
        self._sent_at = time.monotonic()

    def _save(self, trainer: L.Trainer) -> Path:
        last = self._last
        if last is not None:
            last.save(trainer)
            return last.path
        path = Path(trainer.default_root_dir) / "checkpoints" / LAST
        trainer.save_checkpoint(path, weights_only=False)
        return path

    def _signal_or_sigterm(self) -> int:
        return self._signum or signal.SIGTERM  # a peer's signal: this rank stops for the same reason

    def _name(self) -> str:
        return signal.Signals(self._signal_or_sigterm()).name
