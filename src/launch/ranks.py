"""Which processes a run has, and how the local ones start: decided from the config before Lightning loads.

``strategy=ddp`` runs one process per device. The process the user started is local rank 0; it starts
local ranks 1..N-1 as ``python -m <entry> <this job's overrides>`` as soon as the config is checked, so
they load torch and Lightning while it does. Lightning's launcher would start them only inside
``trainer.fit``, after this process had loaded and built everything: two start-ups one after the other.
Lightning's own command line would also replay ``sys.argv``, which under ``-m`` starts a whole sweep in
every child (Lightning issue #11300); the job's own overrides start just this job.

Nothing here imports Lightning, and torch only where a GPU count is needed.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from src.core.errors import BEFORE_REPORT, EXIT_USER_ERROR, UserError
from src.launch import torchrun
from src.launch.devices import local_device_count, slurm_detected, srun_task, torch_cuda_available, uses_cuda

BACKENDS = ("auto", "nccl", "gloo")
STRATEGIES = ("auto", "ddp", "ddp_spawn")
STARTED_RANK_STOP_S = 10  # a rank still importing ends on SIGTERM at once; one that got further saves nothing yet
# Environments whose launcher (srun, torchrun, mpirun, jsrun, a Kubeflow job) starts every rank itself.
_EXTERNAL_LAUNCHERS = ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "LSB_JOBID")


def check_strategy(
    name: str, backend: str, timeout_s: Any, accelerator: str, devices: Any, num_nodes: Any
) -> tuple[str, int]:
    """The strategy a run resolves to (auto -> ddp for more than one process) and its processes per node.

    Every impossible value is a UserError naming its key, raised before any process starts.
    """
    if name not in STRATEGIES:
        raise UserError(f"strategy={name} is not known: choose one of {', '.join(STRATEGIES)}")
    if backend not in BACKENDS:
        raise UserError(f"backend={backend} is not known: choose one of {', '.join(BACKENDS)}")
    if backend == "nccl" and not uses_cuda(accelerator):
        raise UserError(
            "backend=nccl needs CUDA GPUs, but this run is on the CPU "
            f"(trainer.accelerator={accelerator}, CUDA available: {torch_cuda_available()}); "
            "use backend=gloo (or backend=auto) on CPUs"
        )
    local = world_size(accelerator, devices, num_nodes) // num_nodes
    if name == "auto":
        if local * num_nodes == 1:
            return "auto", 1
        name = "ddp"
    check_launch(accelerator, local, timeout_s, num_nodes)
    return name, local


# Open MPI's, MPICH's and Intel MPI's. Not PMIx's PMIX_RANK alone: a process that merely imported mpi4py's MPI (a
# singleton MPI_Init, as Lightning's own MPI detection does) has PMIX_RANK=0 in its environment, and so has every
# process it starts after that.
MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


MPI_LOCAL_SIZES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")  # this node's ranks: Open MPI's, MPICH's


def first_set(keys: Sequence[str]) -> str | None:
    """The value of the first of ``keys`` set in the environment (launchers name one value differently)."""
    return next((value for key in keys if (value := os.environ.get(key))), None)


def mpi_world_size() -> str | None:
    """The world size mpirun (or another MPI process manager) gave this process, if it started it."""
    return first_set(MPI_SIZES)


def mpi_launched() -> bool:
    """Whether mpirun (or another MPI process manager) started this process."""
    return mpi_world_size() is not None


def check_mpi() -> None:
    """Under mpirun (Open MPI, MPICH, Intel MPI) every process is a rank already, and Lightning learns which one
    through mpi4py (its MPIEnvironment). Without mpi4py, or with one that finds no MPI library, each would take itself
    for the only rank (Lightning's detection says no MPI and goes on): one line instead."""
    size = mpi_world_size()
    if size is None or "SLURM_STEP_ID" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ or size == "1":
        return
    try:
        from mpi4py import MPI  # noqa: F401 - what Lightning's MPIEnvironment imports; under mpirun: MPI_Init
    except ImportError as err:
        if (launcher_rank() or "0") != "0":
            raise SystemExit(EXIT_USER_ERROR) from None  # mpirun gathers every process's output: rank 0 says it, once
        raise UserError(
            f"mpirun started {size} processes, but Lightning reads their ranks through mpi4py, which "
            f"this Python cannot import ({err}): pip install mpi4py (built against your MPI, or "
            "cifar10-ddp[mpi]), or start the ranks with srun or torchrun"
        ) from None


def check_strategy_of(strategy: Any) -> tuple[str, int]:
    """``check_strategy`` of a composed ``cfg.strategy``."""
    return check_strategy(
        strategy.name, strategy.backend, strategy.timeout_s, strategy.accelerator, strategy.devices, strategy.num_nodes
    )


def start_local_ranks(strategy: Any, ckpt_path: str | None = None) -> tuple[list[subprocess.Popen], list[int]]:
    """In the process the user started, start this node's other ranks now, if this run has any (ddp, >1 device).

    ``strategy`` is the composed ``cfg.strategy``; ``ckpt_path`` the run's, which the ranks of a sweep's job take
    from this process (a job run again resumes: src/launch/run_dir.py). LOCAL_RANK=0 in this process then tells
    Lightning the ranks exist already (its launcher starts none). Under srun, torchrun and the like, their
    launcher starts them. In a Slurm job it first checks that the allocation can run this config. Returns the
    processes started and their global ranks, for src/resilience/supervision.py's ``track`` to watch.
    """
    check_mpi()
    if "LOCAL_RANK" in os.environ:  # a rank started by this project or torchrun: its launcher checked
        return [], []
    name, local = check_strategy_of(strategy)
    check_slurm_allocation(local, strategy.num_nodes)
    check_mpi_world(local, strategy.num_nodes)
    if name != "ddp" or local == 1 or ranks_placed_by_launcher():
        return [], []
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # one node (more need it set): a port held here until rank 0's store listens
        os.environ["MASTER_PORT"] = str(_hold_free_port())
    os.environ.setdefault("NODE_RANK", "0")
    os.environ["LOCAL_RANK"] = "0"
    os.environ["WORLD_SIZE"] = str(local * strategy.num_nodes)
    extra = [f'ckpt_path="{ckpt_path}"'] if ckpt_path is not None and in_sweep() else []
    return spawn_local_ranks(local, int(os.environ["NODE_RANK"]), extra)


def spawn_local_ranks(
    local_processes: int, node_rank: int, extra: Sequence[str] = ()
) -> tuple[list[subprocess.Popen], list[int]]:
    """Start local ranks 1..N-1 of this node with this job's command line (and ``extra`` overrides) and
    environment; return them and their global ranks."""
    command, cwd = child_command()
    command += list(extra)
    procs: list[subprocess.Popen] = []
    ranks: list[int] = []
    try:
        for local_rank in range(1, local_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank), _LAUNCHER_PID: str(os.getpid())}
            procs.append(subprocess.Popen(command, env=env, cwd=cwd))
            ranks.append(node_rank * local_processes + local_rank)
    except OSError:  # a fork refused (a limit on processes reached): the ranks started so far go before the line
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(STARTED_RANK_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    return procs, ranks


def in_sweep() -> bool:
    """Whether this process runs a job of a Hydra multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


_HELD_PORT: socket.socket | None = None


def check_mpi_world(devices: int, num_nodes: int) -> None:
    """Under mpirun every process is a rank of the world mpirun started: trainer.devices x trainer.num_nodes must be
    its size, and trainer.devices the ranks on this node. Before, a run of 2 ranks with trainer.devices=3 trained, its
    run line saying "1 node(s) x 3 device(s) = world size 2"."""
    size = mpi_world_size()
    if size is None or "SLURM_STEP_ID" in os.environ or torchrun.active():
        return
    if int(size) != devices * num_nodes:
        raise UserError(
            f"mpirun started {size} processes, but trainer.num_nodes x trainer.devices is {num_nodes} x {devices} = "
            f"{devices * num_nodes}: make them equal (trainer.devices: the ranks mpirun starts on each node)"
        )
    # Open MPI's, MPICH's and Intel MPI's count of this node's ranks: mpirun -np 2 on one host with trainer.devices=1
    # trainer.num_nodes=2 failed in rank 1 (an IndexError, a traceback) and rank 0 waited for it
    here = first_set(MPI_LOCAL_SIZES)
    if here is not None and int(here) != devices:
        raise UserError(
            f"mpirun started {here} of its {size} processes on this node, but trainer.devices={devices}: Lightning "
            f"runs trainer.devices ranks on every node: place {devices} a node (mpirun --map-by ppr:{devices}:node), "
            "or make trainer.devices the ranks each node runs"
        )


def _slurm_places_ranks() -> bool:
    return "SLURM_JOB_ID" in os.environ and slurm_detected() and not torchrun.active()


def check_sweep_job_nodes(num_nodes: int) -> None:
    """A job of a ``-m`` sweep in a Slurm batch script runs on this one node: one of several nodes cannot run. Asked
    by each job's ranks, and by the sweep of every job before the first (src/sweeps/sweep.py)."""
    if num_nodes > 1 and _slurm_places_ranks() and in_slurm_batch_script():
        raise UserError(
            f"a -m sweep in a Slurm batch script runs its jobs on this one node, but trainer.num_nodes="
            f"{num_nodes}: sweep multi-node jobs with python -m src.slurm_sweep, which submits each "
            "job to Slurm"
        )


def check_sweep_started_once() -> None:
    """A ``-m`` sweep (a grid, a search) runs its jobs from the one process the user starts, which starts each job's
    ranks. Under torchrun, an srun step of several tasks or mpirun with several ranks, every process would run the
    whole sweep: the first held the sweep dir and the others said it was held by another run. Asked as the sweep
    starts, before its dir is made (src/launch/run_dir.py's ``RunDirLock``)."""
    if torchrun.active():
        launcher, count = "torchrun", os.environ.get("WORLD_SIZE", "1")
    elif "SLURM_STEP_ID" in os.environ and not in_slurm_batch_script():
        launcher, count = "srun", os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS", "1")
    else:
        launcher, count = "mpirun", mpi_world_size() or "1"
    if count.strip().isdigit() and int(count) > 1:
        raise UserError(
            f"a -m sweep runs its jobs from one process, which starts each job's ranks, but {launcher} started "
            f"{count}: start the sweep once, without {launcher} (python -m src.train -m ...); on a Slurm cluster, "
            "python -m src.slurm_sweep submits each job"
        )


def check_slurm_allocation(devices: int, num_nodes: int) -> None:
    """Under a Slurm job, the processes must come from srun and match the allocation, or DDP waits forever.

    Checked before Lightning loads: a job that cannot run says so at once, not after every task of every node has
    imported Lightning, torchvision and torchmetrics (from a cluster's shared filesystem, seconds to minutes at
    thousands of tasks).
    """
    if not _slurm_places_ranks():
        return  # not Slurm, one process of an interactive allocation (named bash/interactive), or srun torchrun:
        # its agents start the ranks (src/launch/torchrun.py matched the counts to them)
    if ranks_started_here_under_slurm():  # a sweep in the batch script starts each job's ranks on this node
        check_sweep_job_nodes(num_nodes)
        return
    if in_slurm_batch_script() and (int(os.environ.get("SLURM_NTASKS", "1")) > 1 or devices * num_nodes > 1):
        raise UserError(
            "python runs in the Slurm job's batch script without srun, so no other rank will start: "
            "launch it as `srun python -m src.train ...` (slurm/train.sbatch does)"
        )
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    nodes = first_set(("SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    if tasks > 1 and not per_node:  # srun -n N, salloc -n N: Lightning's SLURMEnvironment refuses it in each rank
        nodes_given = int(nodes or 1)
        raise UserError(
            f"srun started {tasks} tasks without --ntasks-per-node, which Lightning needs to tell each rank its "
            f"place: pass srun --nodes={nodes_given} --ntasks-per-node="
            f"{tasks // nodes_given if tasks % nodes_given == 0 else devices} (sbatch slurm/train.sbatch sets both)"
        )
    if per_node and int(per_node) != devices:
        raise UserError(
            f"the Slurm allocation runs --ntasks-per-node={per_node} but trainer.devices={devices}: "
            f"make them equal (trainer.devices=$SLURM_NTASKS_PER_NODE, as slurm/train.sbatch passes)"
        )
    if nodes and int(nodes) != num_nodes:
        raise UserError(
            f"the Slurm allocation has --nodes={nodes} but trainer.num_nodes={num_nodes}: "
            f"make them equal (trainer.num_nodes=$SLURM_JOB_NUM_NODES, as slurm/train.sbatch passes)"
        )
    if per_node and tasks != devices * num_nodes:  # --ntasks=3 --ntasks-per-node=2 --nodes=2: 2 tasks and 1
        raise UserError(
            f"srun started {tasks} tasks ({os.environ.get('SLURM_TASKS_PER_NODE', '?')} a node), but trainer.num_nodes"
            f" x trainer.devices is {num_nodes} x {devices} = {num_nodes * devices}: Lightning runs the same number on"
            f" every node: leave --ntasks out, or give --ntasks={num_nodes * devices}"
        )


def _hold_free_port() -> int:
    """A free port on 127.0.0.1 (where one node's store listens), kept bound from now until rank 0's store takes the
    socket (:func:`held_port`). Picked and released, it stayed free for the seconds the ranks take to start, and
    another process could bind it first: rank 0's store then failed with EADDRINUSE."""
    global _HELD_PORT
    if _HELD_PORT is not None:  # a sweep's earlier job that never formed its group
        _HELD_PORT.close()
    _HELD_PORT = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # no SO_REUSEADDR: nobody else may bind it
    _HELD_PORT.bind(("127.0.0.1", 0))
    return _HELD_PORT.getsockname()[1]


def held_port(host: str, port: int) -> socket.socket | None:
    """The bound socket of :func:`_hold_free_port`, for rank 0's store to listen on, if it is ``host:port``; once."""
    global _HELD_PORT
    held, _HELD_PORT = _HELD_PORT, None
    if held is not None and held.getsockname() != (host, port):
        held.close()
        return None
    return held


def rank_cores(local_processes: int) -> int:
    """The cores a rank of ``local_processes`` on this node may use, counted once.

    Under srun with per-task binding (``--cpu-bind=cores``, a cluster's default binding) the process's affinity is
    its task's own cores, and dividing them by the node's ranks again left each GPU rank one loader worker instead of
    ``--cpus-per-task`` less one. Elsewhere (our own local ranks, torchrun's, srun's unbound) the ranks share the
    affinity they see.
    """
    cores = len(os.sched_getaffinity(0))
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if srun_task() and per_task.isdigit() and cores < (os.cpu_count() or cores) and cores <= int(per_task):
        return cores  # bound: fewer cores than the machine has, no more than the task was given
    return max(1, cores // max(1, local_processes))


def world_size(accelerator: str, devices: Any, num_nodes: Any) -> int:
    """Number of processes a run asks for, from the same keys Lightning's Trainer reads."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise UserError(f"trainer.num_nodes={num_nodes} must be a whole number >= 1")
    return num_nodes * local_device_count(accelerator, devices)


def check_launch(accelerator: str, local_processes: int, timeout_s: Any, num_nodes: int = 1) -> None:
    """What a DDP run needs from this node, checked before any other process starts, each a one-line UserError.

    CPU processes beyond the cores thrash (and each holds a model copy in memory); a timeout of 0 fails every
    rendezvous; and a MASTER_PORT that is not a port, or one already taken where this process will host the
    rendezvous, fails only once the ranks try to meet, after the others have started.
    """
    # Where srun, torchrun or mpirun started the ranks, each process is one of them, and the launcher placed it (mpirun
    # and srun's binding give each its own cores): what this process may use says nothing of the node's count.
    cores = len(os.sched_getaffinity(0))
    if not uses_cuda(accelerator) and not ranks_placed_by_launcher() and local_processes > cores:
        raise UserError(
            f"trainer.devices={local_processes} starts {local_processes} CPU processes but this node has "
            f"{cores} CPU core(s) for this run: use trainer.devices={cores} or fewer"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise UserError(
            f"strategy.timeout_s={timeout_s} must be a number of seconds > 0: how long ranks wait for "
            "each other (default 300)"
        )
    port = os.environ.get("MASTER_PORT")
    external = any(key in os.environ for key in _EXTERNAL_LAUNCHERS)
    if num_nodes > 1 and not external and (port is None or "MASTER_ADDR" not in os.environ):
        raise UserError(
            f"trainer.num_nodes={num_nodes} started by hand needs MASTER_ADDR and MASTER_PORT: set both, "
            "on every node, to node 0's address and a free port there (see docs/multi-node.md)"
        )
    if port is None:
        return  # Lightning picks a free one
    if not port.strip().isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(
            f"MASTER_PORT={port} is not a port: set a number in 1-65535, or unset MASTER_PORT and "
            "Lightning picks a free one"
        )
    if not is_launch_rank_zero() or "TORCHELASTIC_RUN_ID" in os.environ:
        return  # another process hosts the rendezvous (under torchrun, its agent already holds the port)
    if _HELD_PORT is not None and _HELD_PORT.getsockname()[1] == int(port):
        return  # this process picked it, and holds it for its store
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store binds it
        try:
            probe.bind(("", int(port)))
        except OSError as err:
            raise UserError(
                f"MASTER_PORT={port} cannot be used on this node ({err.strerror}): pick a free port, or "
                "unset MASTER_PORT and Lightning picks a free one"
            ) from err


# The ranks mpirun (Open MPI, MPICH, Intel MPI) and jsrun give each process they start.
LAUNCHER_RANKS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "JSM_NAMESPACE_RANK")


def launcher_rank() -> str | None:
    """The global rank a launcher gave this process (torchrun's RANK, srun's SLURM_PROCID, mpirun's, jsrun's), if
    any: known before any process group exists."""
    if "RANK" in os.environ:
        return os.environ["RANK"]
    if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ:  # inside srun, not the batch script
        return os.environ["SLURM_PROCID"]
    return next((os.environ[key] for key in LAUNCHER_RANKS if key in os.environ), None)


def launched_processes() -> tuple[str, int] | None:
    """The launcher that started this process as one of several (srun's tasks, torchrun's workers, mpirun's ranks)
    and how many it started, if one did."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torchrun.active() and world > 1:
        return "torchrun", world
    tasks = int(os.environ.get("SLURM_NTASKS", "1"))  # an srun step's, not the batch script's (one process)
    if "SLURM_PROCID" in os.environ and not in_slurm_batch_script() and tasks > 1:
        return "srun", tasks
    size = int(mpi_world_size() or 1)
    return ("mpirun", size) if size > 1 else None


def launch_name() -> str | None:
    """A name for this run that every process a launcher started computes alike, without a word to the others:
    ``slurm-<job id>.<step id>`` for srun's tasks (``-restart<N>`` once the job is requeued: a new run, as a new
    timestamp was), ``mpirun-<PMIx namespace>`` for mpirun's ranks. None for one process, or a launcher that gives
    its processes no shared id (torchrun's is its rendezvous id: src/launch/torchrun.py). The default run dir's
    time cannot serve: each process reads its own clock as it starts, and a task that starts a second later (a
    slow node, a shared filesystem) wrote its log into a dir of its own, or into another run's."""
    found = launched_processes()
    if found is None or found[0] == "torchrun":
        return None
    if found[0] == "srun":
        restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        step = f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
        return f"{step}-restart{restart}" if restart else step
    namespace = os.environ.get("PMIX_NAMESPACE")  # Open MPI's and any PMIx launcher's, the same in every rank
    return f"mpirun-{namespace}" if namespace else None


# how each launcher names a process's rank on its node, and its own process there, the ranks' parent
LOCAL_RANK_KEYS = {"srun": ("SLURM_LOCALID",), "mpirun": ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")}
LAUNCHER_PROCESSES = {
    "srun": ("slurmstepd",),
    "mpirun": ("mpirun", "mpiexec", "orterun", "orted", "prted", "prterun", "hydra_pmi_proxy"),  # Open MPI 4, 5; MPICH
}


def before_error_line(line: str, code: int) -> None:
    """Under srun or mpirun, or as a local rank the project's launcher started, before this process prints ``error:
    line`` and ends with ``code``, where its process group has not formed.

    A mistake found then (exit status 2: the command line, the config, the allocation, the data) is the same in every
    process of a node, and each printed it: 8 lines a node, 2,048 at 256 nodes, in the one file the launcher gathers
    them in. Local rank 0 says it; the others wait, quiet, until it has ended (their launcher started them side by
    side: the same parent, slurmstepd or mpirun's daemon) and then end with ``code`` as they would have, without a
    word, or at once where the launcher stops them. One whose local rank 0 goes on (it did not fail so) says its own
    line after ``QUIET_S``, and so does one that finds no such local rank 0 (a wrapper between the launcher and
    Python). torchrun's workers: its ``before_error_line``, called from here. mpirun's ranks only while MPI is not
    initialised (a mistake in the command line or the config): once it is, rank 0 ends only after every rank has
    called MPI_Finalize (src/cli/entry.py's ``exit_now``), and a rank that waited for it waited out ``QUIET_S``."""
    if torchrun.active():
        torchrun.before_error_line(line, code)
        return
    if code != EXIT_USER_ERROR or threading.current_thread() is not threading.main_thread():
        return
    launcher = launcher_pid()
    if launcher is not None:  # started by start_local_ranks: its launcher, this node's local rank 0, has the same
        _leave_it_to(launcher, code)  # command line (before, both said a world the nodes count differently)
        return
    found = launched_processes()
    if found is None or found[0] not in LOCAL_RANK_KEYS:
        return
    keys = LOCAL_RANK_KEYS[found[0]]
    if found[0] == "mpirun" and mpi_initialized():
        return
    local = first_set(keys) or "0"
    if local == "0":
        return
    first = _local_rank_zero(keys)
    if first is None and not _started_by_launcher(LAUNCHER_PROCESSES[found[0]]):
        return
    _leave_it_to(first, code)


def _leave_it_to(first: int | None, code: int) -> None:
    """Wait, quiet, until this node's local rank 0 (``first``; None: none found beside this one, which has ended) has
    ended, then end with ``code``; return after ``QUIET_S`` where it goes on (it did not fail so)."""
    # the launcher's stop (mpirun stops the others once local rank 0 has ended so; the project's launcher its local
    # ranks as it ends), or Ctrl-C, ends it the same way
    with torchrun.ending_on_stop(lambda: torchrun.end_quietly(code)):
        deadline = time.monotonic() + torchrun.QUIET_S
        while time.monotonic() < deadline:
            if first is None or not alive(first):  # it said the line and ended
                torchrun.end_quietly(code)
            time.sleep(0.05)
    # it goes on: this process says its own line


def mpi_initialized() -> bool:
    """Whether mpi4py has initialised MPI in this process (``check_mpi``), and not finalised it."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def proc_stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name, which may hold spaces and ``)``: state, ppid, ...,
    flags (``[6]``). OSError where there is no such process."""
    with open(f"/proc/{pid}/stat") as file:
        return file.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process on this node that has not ended (a zombie has)."""
    try:
        return proc_stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return False


def _started_by_launcher(names: tuple[str, ...]) -> bool:
    """Whether this process's parent is the launcher's own process on this node (``names``: slurmstepd, mpirun's
    daemon), not a wrapper of the user's, where local rank 0, not beside this one any more, has ended."""
    try:
        with open(f"/proc/{os.getppid()}/comm") as file:
            return file.read().strip() in names
    except OSError:
        return False


def _local_rank_zero(keys: tuple[str, ...]) -> int | None:
    """The pid of this node's local rank 0 of this launch: the process beside this one (the same parent, the
    launcher's) whose local rank (``keys``: ``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``, ...) is 0."""
    parent = os.getppid()
    marks = {f"{key}=0".encode() for key in keys}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if int(proc_stat(entry.name)[1]) != parent:
                continue
            with open(f"/proc/{entry.name}/environ", "rb") as file:
                if marks & set(file.read().split(b"\0")):
                    return int(entry.name)
        except (OSError, ValueError, IndexError):  # ended meanwhile, or another user's
            continue
    return None


def check_one_process(command: str) -> None:
    """``src.export`` and ``src.predict`` run in one process: under a launcher that started several, each would do
    the same work into the same files. The first says so in one line and exits 2; the others end at once, quietly,
    with status 0: torchrun and mpirun stop every process when one fails, and the first could be stopped before its
    line was out (the launcher's own status is still the first's)."""
    found = launched_processes()
    if found is None:
        return
    launcher, count = found
    if launcher_rank() not in (None, "0"):
        drop_empty_run_log()  # so that the first takes back the run dir it made
        raise SystemExit(0)
    raise UserError(
        f"python -m src.{command} runs in one process, but {launcher} started {count}, each of which would do the "
        f"same work into the same files: start it once, without {launcher}"
        + (" (or srun --ntasks=1)" if launcher == "srun" else "")
    )


def drop_empty_run_log() -> None:
    """Remove this process's log file in the run dir while it is still empty: Hydra's job log, a regular file
    directly in ``hydra.runtime.output_dir``; no other file a logging handler writes. What a rank other than the
    run's first does as it ends refused: the first takes back the run dir it made (src/launch/run_dir.py)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    run_dir = os.path.realpath(HydraConfig.get().runtime.output_dir)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler, logging.FileHandler):
            continue
        path = handler.baseFilename
        try:
            info = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if os.path.dirname(os.path.realpath(path)) == run_dir and stat.S_ISREG(info.st_mode) and info.st_size == 0:
            handler.close()
            os.unlink(path)


_LAUNCHER_PID = "CIFAR10_DDP_LAUNCHER_PID"  # set for the local ranks start_local_ranks starts
# This process and its parent when this module loaded, early in a rank's start (before torch): a rank whose launcher
# died in the seconds before the rank's watch began still knows that launcher, and its watch ends it at once
_LOADED_IN = (os.getpid(), os.getppid())


def launcher_pid() -> int | None:
    """The pid of the process that started this rank with start_local_ranks, if one did, alive or not (ddp_spawn's
    ranks are watched from src/distributed/strategy.py's HydraSpawnLauncher). Not for a process further down that
    inherited the variable: the launcher must have been this process's parent."""
    pid = os.environ.get(_LAUNCHER_PID)
    if pid is None:
        return None
    # a process forked after this module loaded inherits _LOADED_IN: its own parent is the one that counts then
    parent = _LOADED_IN[1] if _LOADED_IN[0] == os.getpid() else os.getppid()
    return int(pid) if int(pid) == parent else None


def in_slurm_batch_script() -> bool:
    """Whether this process runs in a Slurm job's batch script (sbatch), outside any srun step."""
    return "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_STEP_ID") in (None, "batch", "4294967294")


def ranks_placed_by_launcher() -> bool:
    """Whether a launcher (srun, torchrun, mpirun, LSF) started every rank, this process one of them, rather than
    this process starting its node's ranks itself."""
    return any(key in os.environ for key in _EXTERNAL_LAUNCHERS) and not ranks_started_here_under_slurm()


def ranks_started_here_under_slurm() -> bool:
    """A ``-m`` sweep (a grid, a search) in a Slurm batch script, or a rank one of its jobs started.

    The sweep's one process runs its jobs one after another and starts each job's ranks on this node itself, as
    on a workstation (slurm/search.sbatch): those ranks are local ranks, not srun's tasks, whatever the Slurm
    variables they inherit say.
    """
    return (
        in_slurm_batch_script()
        and "TORCHELASTIC_RUN_ID" not in os.environ
        and (in_sweep() or launcher_pid() is not None)
    )


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


def is_launch_rank_zero() -> bool:
    """True in the process that owns the run dir, judged before any process group exists."""
    rank = launcher_rank()
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
    rank = launcher_rank()
    if rank is not None:
        return f"_rank{rank}"
    return f"_node{os.environ.get('NODE_RANK', 0)}_local{os.environ.get('LOCAL_RANK', 0)}"


BEFORE_REPORT.append(lambda line: before_error_line(line, EXIT_USER_ERROR))  # Hydra's mistakes, the run dir's
