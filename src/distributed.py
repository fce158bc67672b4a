"""How processes find each other: the strategy factory behind ``conf/strategy/*.yaml``.

Lightning owns the process group, the samplers and rank-zero IO. This module only adds what it
lacks for a Hydra application: a ``backend`` key (auto | nccl | gloo), a rendezvous timeout that
fails with a readable message, and a launcher that starts local ranks from *this job's* overrides.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from src import supervision
from src.errors import UserError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")
STRATEGIES = ("auto", "ddp", "ddp_spawn")
_START_METHODS = {"ddp": "popen", "ddp_spawn": "spawn"}


def build_strategy(
    name: str,
    backend: str = "auto",
    timeout_s: float = 300.0,
    accelerator: str = "auto",
    devices: Any = "auto",
    num_nodes: int = 1,
    **ddp_kwargs: Any,
) -> DDPStrategy | str:
    """Return the Trainer's strategy: Lightning's single-device choice for a world of one, else DDP."""
    if name not in STRATEGIES:
        raise UserError(f"strategy={name} is not known: choose one of {', '.join(STRATEGIES)}")
    if backend not in BACKENDS:
        raise UserError(f"backend={backend} is not known: choose one of {', '.join(BACKENDS)}")
    on_cuda = uses_cuda(accelerator)
    if backend == "nccl" and not on_cuda:
        raise UserError(
            "backend=nccl needs CUDA GPUs, but this run is on the CPU "
            f"(trainer.accelerator={accelerator}, CUDA available: {torch.cuda.is_available()}); "
            "use backend=gloo (or backend=auto) on CPUs"
        )
    processes = world_size(accelerator, devices, num_nodes)
    check_slurm_allocation(processes // num_nodes, num_nodes)
    if name == "auto":
        if processes == 1:
            return "auto"  # Lightning picks SingleDeviceStrategy: no process group, no DDP wrapper
        name = "ddp"
    check_launch(accelerator, processes // num_nodes, timeout_s)
    return HydraDDPStrategy(
        start_method=_START_METHODS[name],
        process_group_backend=None if backend == "auto" else backend,  # Lightning: nccl on CUDA, else gloo
        timeout=timedelta(seconds=timeout_s),
        **ddp_kwargs,
    )


def uses_cuda(accelerator: str) -> bool:
    """Whether ``trainer.accelerator`` resolves to CUDA GPUs on this machine."""
    if accelerator in ("gpu", "cuda"):
        return True
    return accelerator == "auto" and torch.cuda.is_available()


def world_size(accelerator: str, devices: Any, num_nodes: Any) -> int:
    """Number of processes a run asks for, from the same keys Lightning's Trainer reads."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise UserError(f"trainer.num_nodes={num_nodes} must be a whole number >= 1")
    return num_nodes * local_device_count(accelerator, devices)


def local_device_count(accelerator: str, devices: Any) -> int:
    """Devices per node as Lightning will resolve them; impossible values are a UserError naming the key."""
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(f"trainer.accelerator={accelerator} but no CUDA GPU is visible here: "
                        "use trainer.accelerator=cpu (or auto)")
    if isinstance(devices, str) and "," in devices:
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, (list, tuple)):
        count = len(devices)  # explicit GPU ids
    elif devices in ("auto", -1, "-1"):
        count = torch.cuda.device_count() if uses_cuda(accelerator) else 1
    else:
        try:
            count = int(devices)
        except (TypeError, ValueError):
            raise UserError(f"trainer.devices={devices} is not a number: give a count >= 1, "
                            "-1 or auto for all devices, or a list of GPU ids") from None
        if count < 1 or isinstance(devices, bool):
            raise UserError(f"trainer.devices={devices} must be >= 1 (or -1/auto for all devices)")
    if uses_cuda(accelerator) and count > torch.cuda.device_count():
        raise UserError(f"trainer.devices={devices} asks for {count} GPUs but this node has "
                        f"{torch.cuda.device_count()}: lower trainer.devices, or use trainer.devices=auto")
    return count


def check_slurm_allocation(devices: int, num_nodes: int) -> None:
    """Under a Slurm job, the processes must come from srun and match the allocation, or DDP waits forever."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if "SLURM_JOB_ID" not in os.environ or not SLURMEnvironment.detect():
        return  # not Slurm, or an interactive allocation (job name bash/interactive) Lightning leaves alone
    in_batch_script = os.environ.get("SLURM_STEP_ID") in (None, "batch", "4294967294")
    if in_batch_script and (int(os.environ.get("SLURM_NTASKS", "1")) > 1 or devices * num_nodes > 1):
        raise UserError(
            "python runs in the Slurm job's batch script without srun, so no other rank will start: "
            "launch it as `srun python -m src.train ...` (slurm/train.sbatch does)"
        )
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if per_node and int(per_node) != devices:
        raise UserError(
            f"the Slurm allocation runs --ntasks-per-node={per_node} but trainer.devices={devices}: "
            f"make them equal (trainer.devices=$SLURM_NTASKS_PER_NODE, as slurm/train.sbatch passes)"
        )
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if nodes and int(nodes) != num_nodes:
        raise UserError(
            f"the Slurm allocation has --nodes={nodes} but trainer.num_nodes={num_nodes}: "
            f"make them equal (trainer.num_nodes=$SLURM_JOB_NUM_NODES, as slurm/train.sbatch passes)"
        )


class HydraDDPStrategy(DDPStrategy):
    """DDP whose local ranks join this Hydra job, watch their launcher, and whose rendezvous failure says what is
    missing."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":
            self._launcher = HydraJobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = HydraSpawnLauncher(self, start_method=self._start_method)

    def setup_distributed(self) -> None:
        launcher_pid = _launcher_pid()
        if launcher_pid is not None:  # a started rank: it must not outlive the process that started it
            supervision.watch_launcher(self.node_rank * self.num_processes + self.local_rank, launcher_pid)
        try:
            super().setup_distributed()
        except torch.distributed.DistError as err:
            env = self.cluster_environment
            raise UserError(
                f"rank {self.global_rank} (NODE_RANK={self.node_rank}) could not form a process group of "
                f"world size {self.world_size} at MASTER_ADDR:MASTER_PORT={env.main_address}:{env.main_port} "
                f"within {self._timeout.total_seconds():.0f} s: start every node with the same MASTER_ADDR, "
                "MASTER_PORT and trainer.num_nodes, check the address is reachable, "
                f"or raise strategy.timeout_s ({type(err).__name__})"
            ) from err


_LAUNCHER_PID = "CIFAR10_DDP_LAUNCHER_PID"  # set for the local ranks HydraJobLauncher starts


def _launcher_pid() -> int | None:
    """The pid of the HydraJobLauncher that started this rank, if one did (ddp_spawn's ranks watch from
    HydraSpawnLauncher)."""
    pid = os.environ.get(_LAUNCHER_PID)
    return int(pid) if pid is not None and int(pid) == os.getppid() else None


class HydraJobLauncher(_SubprocessScriptLauncher):
    """Starts local ranks 1..N-1 as ``python -m <entry> <this job's overrides>`` in this job's run dir.

    Lightning's own launcher replays ``sys.argv``; under ``-m`` that starts a whole sweep in every
    child (Lightning issue #11300). Rebuilding the command from the job's own task overrides fixes that.
    The started ranks are watched: one that dies stops the run (src/supervision.py).
    """

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        command, cwd = child_command()
        self.procs = []
        first = env.node_rank() * self.num_processes
        for local_rank in range(1, self.num_processes):
            child_env = {**os.environ, "LOCAL_RANK": str(local_rank), _LAUNCHER_PID: str(os.getpid())}
            self.procs.append(subprocess.Popen(command, env=child_env, cwd=cwd))
            LAUNCHED.append(self.procs[-1])
            LAUNCHED_RANKS.append(first + local_rank)
        from src.errors import in_sweep

        supervision.watch_children(self.procs, LAUNCHED_RANKS[-len(self.procs):], exit_process=not in_sweep())


class HydraSpawnLauncher(_MultiProcessingLauncher):
    """``ddp_spawn``'s launcher: the parent passes a SIGTERM on to its ranks (it is no rank itself), and a rank
    that stopped on request exits with ``128 + signal`` instead of multiprocessing's 1."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return super().launch(function, *args, trainer=trainer, **kwargs)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: self.kill(signum))
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> Any:
        from src.callbacks.graceful_stop import Terminated

        # torch makes a spawned rank get SIGINT when its parent dies; that KeyboardInterrupt races the watch
        # below and ends the rank without a word. One owner: the watch, which says what happened.
        _clear_parent_death_signal()
        rank = self._strategy.node_rank * self._strategy.num_processes + process_idx
        supervision.watch_launcher(rank, multiprocessing.parent_process().pid)
        try:
            return super()._wrapping_function(process_idx, *args, **kwargs)
        except Terminated as stop:
            if self._strategy.global_rank == 0:
                print(f"stopped: {stop}", file=sys.stderr, flush=True)
            sys.exit(stop.exit_code)


def _clear_parent_death_signal() -> None:
    """Undo torch's prctl(PR_SET_PDEATHSIG, SIGINT) for this process (Linux; elsewhere nothing was set)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0)  # 1: PR_SET_PDEATHSIG, 0: no signal


# Local ranks started by this process, so a job can wait for (or stop) its own before the next one starts.
LAUNCHED: list[subprocess.Popen] = []
LAUNCHED_RANKS: list[int] = []


def launched_failure() -> str | None:
    """'rank 1 (pid 123) died: killed by SIGKILL' if a local rank this process started ended badly."""
    return supervision.failed_child(LAUNCHED, LAUNCHED_RANKS)


def reap_launched(grace_s: float) -> str | None:
    """Wait up to ``grace_s`` for the local ranks this process started, kill what is left, forget them all.

    Returns how the first one that ended badly ended ('rank 1 (pid 123) died: exited with code 2'), or None.
    """
    deadline = time.monotonic() + grace_s
    for proc in LAUNCHED:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("local rank pid %s still running %.0f s after this one finished: killing it", proc.pid, grace_s)
            proc.kill()
            proc.wait()
    failure = launched_failure()
    LAUNCHED.clear()
    LAUNCHED_RANKS.clear()
    return failure


def child_command() -> tuple[list[str], str]:
    """The command line (and cwd) that re-enters this Hydra job as another local rank."""
    from hydra.core.hydra_config import HydraConfig

    import __main__

    hydra_cfg = HydraConfig.get()
    if __main__.__spec__ is not None:
        entry = [sys.executable, "-m", __main__.__spec__.name]
    else:
        entry = [sys.executable, os.path.abspath(sys.argv[0])]
    overrides = list(hydra_cfg.overrides.task)
    overrides += [
        f'hydra.run.dir="{hydra_cfg.runtime.output_dir}"',
        "hydra.output_subdir=null",  # rank zero already saved the config
        f"hydra.job.name={hydra_cfg.job.name}",
    ]
    return entry + overrides, hydra_cfg.runtime.cwd


def _rank_from_env() -> str | None:
    """Global rank set by a launcher (torchrun's RANK, srun's SLURM_PROCID), if any."""
    if "RANK" in os.environ:
        return os.environ["RANK"]
    if "SLURM_STEP_ID" in os.environ:  # inside srun, not the batch script
        return os.environ.get("SLURM_PROCID")
    return None


def is_launch_rank_zero() -> bool:
    """True in the process that owns the run dir, judged before any process group exists."""
    rank = _rank_from_env()
    if rank is not None:
        return rank == "0"
    return os.environ.get("NODE_RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


def rank_zero_only(value: str) -> str | None:
    """``value`` on rank zero, else None: lets conf/hydra/default.yaml keep ``.hydra/`` a rank-zero file."""
    return value if is_launch_rank_zero() else None


def rank_log_suffix() -> str:
    """'' on rank zero, else a suffix that keeps each process's log file its own."""
    if is_launch_rank_zero():
        return ""
    rank = _rank_from_env()
    if rank is not None:
        return f"_rank{rank}"
    return f"_node{os.environ.get('NODE_RANK', 0)}_local{os.environ.get('LOCAL_RANK', 0)}"


def check_launch(accelerator: str, local_processes: int, timeout_s: Any) -> None:
    """What a DDP run needs from this node, checked before any other process starts, each a one-line UserError.

    CPU processes beyond the cores thrash (and each holds a model copy in memory); a timeout of 0 fails every
    rendezvous; and a MASTER_PORT that is not a port, or one already taken where this process will host the
    rendezvous, fails only once the ranks try to meet, after the others have started.
    """
    import socket

    cores = len(os.sched_getaffinity(0))
    if not uses_cuda(accelerator) and local_processes > cores:
        raise UserError(f"trainer.devices={local_processes} starts {local_processes} CPU processes but this node has "
                        f"{cores} CPU core(s) for this run: use trainer.devices={cores} or fewer")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise UserError(f"strategy.timeout_s={timeout_s} must be a number of seconds > 0: how long ranks wait for "
                        "each other (default 300)")
    port = os.environ.get("MASTER_PORT")
    if port is None:
        return  # Lightning picks a free one
    if not port.strip().isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"MASTER_PORT={port} is not a port: set a number in 1-65535, or unset MASTER_PORT and "
                        "Lightning picks a free one")
    if not is_launch_rank_zero() or "TORCHELASTIC_RUN_ID" in os.environ:
        return  # another process hosts the rendezvous (under torchrun, its agent already holds the port)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store binds it
        try:
            probe.bind(("", int(port)))
        except OSError as err:
            raise UserError(f"MASTER_PORT={port} cannot be used on this node ({err.strerror}): pick a free port, or "
                            "unset MASTER_PORT and Lightning picks a free one") from err
