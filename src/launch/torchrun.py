"""What a run takes from torchrun (TorchElastic) when torchrun started its processes.

torchrun's agent starts every worker of a node, restarts the whole group when one fails
(``--max-restarts``), and re-forms it with the nodes that are left or have come back
(``--nnodes=MIN:MAX``). Here, in each worker:

- ``trainer.devices`` and ``trainer.num_nodes`` come from what the agent started (``LOCAL_WORLD_SIZE``,
  ``WORLD_SIZE / LOCAL_WORLD_SIZE``); a value the user set that disagrees is one ``error:`` line;
- the worker stops when its agent is gone, however it went (SIGKILL leaves workers running otherwise);
- every worker of the run, on every node and across restarts, writes one run dir named after the
  rendezvous id: ``outputs/runs/<date>/torchrun-<id>``;
- every attempt resumes from the run dir's newest intact ``last.ckpt`` if it has one (``ckpt_path`` defaults to
  ``auto``): a restart after a failure, and one when a node joins;
- a restart at another world size keeps the global batch (larger or smaller per-process batches) and so
  the learning rate and its schedule, and the epoch in progress goes on with the images it has not
  trained on yet (src/data/device_batches.py);
- the process group of each attempt forms under a key prefix of its own (:func:`attempt_store`);
- a mistake found before the group forms is said once per node, by local rank 0, and torchrun's own failure
  report gives the line too (:func:`before_error_line`).

Nothing here loads Lightning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from src.core.errors import EXIT_USER_ERROR, UserError
from src.launch.devices import gpu_ids

log = logging.getLogger(__name__)

RUN_ID = "TORCHELASTIC_RUN_ID"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # where the agent reads why a worker failed, for its failure report
QUIET_S = 30.0  # how long a worker other than local rank 0 leaves a mistake's line to it (before_error_line)
# what a quiet rank (torchrun's worker, srun's task, mpirun's rank) takes back as it ends: src/launch/run_dir.py's
# leave_refused_run
QUIET_END: list[Callable[[], None]] = []


def active() -> bool:
    """Whether torchrun (or another TorchElastic agent: TorchX, Kubeflow's PyTorchJob) started this process."""
    return RUN_ID in os.environ


def agent_hosts_store() -> bool:
    """Whether this worker's agent (its parent) hosts the store the workers use: torch's default, the rendezvous
    store, on the node of ``--rdzv-endpoint`` (or ``--standalone``'s). Read from ``/proc``: a socket listening at
    ``MASTER_PORT`` among the agent's open files (False where that cannot be read)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") != "True" or "MASTER_PORT" not in os.environ:
        return False
    port, listening = int(os.environ["MASTER_PORT"]), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                for row in list(rows)[1:]:
                    fields = row.split()  # local address (hex ip:port), remote, state (0A: LISTEN), ..., inode
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        listening.add(f"socket:[{fields[9]}]")
        except (OSError, IndexError, ValueError):
            continue
    agent_fds = f"/proc/{os.getppid()}/fd"
    try:
        names = os.listdir(agent_fds) if listening else []
    except OSError:
        return False
    for name in names:
        with contextlib.suppress(OSError):
            if os.readlink(os.path.join(agent_fds, name)) in listening:
                return True
    return False


def before_error_line(line: str, code: int) -> None:
    """Under torchrun, before this worker prints ``error: line`` and ends with ``code``, where its process group has
    not formed.

    A mistake found then (exit status 2: the command line, the config, torchrun's counts, the data) is the same on
    every worker of a node, and each printed it (8 workers: up to 8 lines an attempt). Local rank 0 says it; the
    others wait here, quiet, for the agent, which stops them (SIGTERM) once local rank 0 has ended, and they end
    with ``code`` as they would have. A worker whose local rank 0 did not end so says its own line after
    ``QUIET_S``. Each worker's error file gets the line (``tell_agent``). After the group forms, one rank says a
    failure for the run (src/resilience/supervision.py), and it tells the agent. Called through src/launch/ranks.py's
    ``before_error_line``, as srun's tasks are."""
    if not active():
        return
    tell_agent(line)
    main = threading.current_thread() is threading.main_thread()  # only its signal handlers can be set
    if code == EXIT_USER_ERROR and os.environ.get("LOCAL_RANK", "0") != "0" and main:
        with ending_on_stop(lambda: end_quietly(code)):  # the agent's stop, or Ctrl-C at the terminal
            time.sleep(QUIET_S)
        # no stop came: this worker says its own line


@contextlib.contextmanager
def ending_on_stop(end: Callable[[], None]) -> Iterator[None]:
    """While inside, SIGTERM and SIGINT call ``end`` (which ends the process as it would have ended, without a word);
    their handlers are put back after. A SIGINT a shell's background job ignores stays ignored. In the main thread
    only: the one whose handlers can be set."""
    stops = [stop for stop in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(stop) is not signal.SIG_IGN]
    before = {stop: signal.signal(stop, lambda *_: end()) for stop in stops}
    try:
        yield
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)


def end_quietly(code: int) -> NoReturn:
    """End a rank that left a mistake's line to local rank 0 (torchrun's worker, srun's task, mpirun's rank), with
    ``code``: what it made for the run taken back first (``QUIET_END``), its logs flushed."""
    for leave in QUIET_END:  # after local rank 0, which has ended and taken back the run dir's files
        leave()
    logging.shutdown()
    os._exit(code)


def tell_agent(line: str) -> None:
    """``error: line`` in this worker's error file, as torch's ``@record`` writes an exception there, without its call
    stack: the agent's failure report gives the line (``traceback : error: ...``) where it said ``To enable traceback
    see ...``, and the agent copies it to its own error file where it has one (the format torch's agent expects: a
    short one made it warn)."""
    path = os.environ.get(ERROR_FILE)
    if path:
        said = {"message": f"error: {line}", "extraInfo": {"timestamp": str(int(time.time()))}}
        # whole or not at all: the agent reads the file of a worker it has just stopped, and one it stopped in the
        # middle of this write left half a file, which the agent cannot parse and ended on (its traceback, no report)
        partial = f"{path}.{os.getpid()}.tmp"
        with contextlib.suppress(OSError):
            with open(partial, "w") as file:
                json.dump({"message": said}, file)
            os.replace(partial, path)


def restart() -> tuple[int, int]:
    """(this attempt's restart count, the agent's --max-restarts)."""
    return (
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")),
    )


def launched_shape() -> tuple[int, int]:
    """(processes on this node, nodes) as the agent started them. Lightning runs the same number on every node: nodes
    of unlike ``--nproc-per-node`` are a UserError (a world of 3 over 2 nodes read as 1 node of 2 before)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world, agents = int(os.environ.get("WORLD_SIZE", str(local))), int(os.environ.get("GROUP_WORLD_SIZE", "0"))
    if world % local or (agents and local * agents != world):  # Lightning's ranks: node_rank x devices + local rank
        raise UserError(
            f"torchrun started {local} process(es) on this node and {world} in all"
            + (f" over {agents} nodes" if agents else "")
            + ": Lightning runs the same number on every node: give every node the same --nproc-per-node"
        )
    return local, max(1, world // local)


def adopt(cfg: Any, overridden: set[str]) -> None:
    """Under torchrun, make the config describe the processes the agent started.

    ``overridden``: the config keys the user set on the command line. Every mismatch is a UserError naming both
    values; the agent started the processes, so its numbers are the ones that hold.
    """
    if not active():
        return
    from omegaconf import open_dict

    local, nodes = launched_shape()
    trainer = cfg.trainer
    if cfg.strategy.get("name") == "ddp_spawn":
        raise UserError(
            "strategy=ddp_spawn starts processes of its own, but torchrun has started them: "
            "use strategy=ddp (or leave strategy at auto)"
        )
    devices = trainer.devices
    if devices in ("auto", -1, "-1"):
        devices = local
    elif _count(devices) != local:
        raise UserError(
            f"trainer.devices={devices} but torchrun started {local} process(es) on this node "
            f"(--nproc-per-node={local}): leave trainer.devices out under torchrun, or make them equal"
        )
    if ("trainer.num_nodes" in overridden or trainer.num_nodes != 1) and trainer.num_nodes != nodes:
        raise UserError(
            f"trainer.num_nodes={trainer.num_nodes} but torchrun formed a group of {nodes} node(s) "
            f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')} / LOCAL_WORLD_SIZE={local}): leave "
            "trainer.num_nodes out under torchrun (with --nnodes=MIN:MAX it changes from attempt to attempt)"
        )
    with open_dict(cfg):
        trainer.devices = devices
        trainer.num_nodes = nodes


def _count(devices: Any) -> int:
    """Processes per node that ``trainer.devices`` asks for: a count, or a list of GPU ids ("0,1" or [0, 1])."""
    ids = gpu_ids(devices)
    if ids is not None:
        return len(ids)
    try:
        return int(devices)
    except ValueError:
        raise UserError(f"trainer.devices={devices} is not a number: leave it out under torchrun") from None


def restart_line(ckpt_path: str | None, checkpoint: dict | None, run_dir: str) -> str | None:
    """'restart 1 of 3: resuming from step 40 of DIR/checkpoints/last.ckpt' for a restart, or an attempt that
    resumes (a scale-up restart, a run started again with its --rdzv-id); None for a first start."""
    count, most = restart()
    if not active() or (count == 0 and checkpoint is None):
        return None
    attempt = f"restart {count} of {most}" if count else "torchrun (re)formed the group"
    if checkpoint is None:
        return f"{attempt}: no checkpoint in {Path(run_dir, 'checkpoints')} yet: training from the start"
    return f"{attempt}: resuming from step {checkpoint.get('global_step', '?')} of {ckpt_path}"


def trained_batch(saved_by: dict | None, accumulate: int) -> tuple[int, int, int] | None:
    """(world size, per-process batch, global batch) a checkpoint trained with, from the ``saved_by`` record its model
    writes (src/models/classifier.py; ``accumulate`` where the record lacks it); None for a record without them."""
    saved = saved_by or {}
    old_world, old_batch = saved.get("world_size"), saved.get("batch_size")
    if not old_world or not old_batch:
        return None
    return old_world, old_batch, old_world * old_batch * saved.get("accumulate", accumulate)


def keep_global_batch(checkpoint: dict | None, datamodule: Any, world_size: int, accumulate: int) -> str | None:
    """Resumed at another world size than the checkpoint's: the same global batch from other per-process
    batches, so the learning rate (scaled by the global batch) and the steps per epoch stay as they were.

    Returns the line that says so, or None when nothing changed.
    """
    trained = trained_batch((checkpoint or {}).get("saved_by"), accumulate)
    batch = getattr(datamodule, "batch_size", None)
    if trained is None or not batch or trained[0] == world_size:
        return None
    old_world, old_batch, global_batch = trained
    per_process, rest = divmod(global_batch, world_size * accumulate)
    per_process = max(1, per_process + (rest * 2 >= world_size * accumulate))
    datamodule.batch_size = per_process
    now = per_process * world_size * accumulate
    kept = (
        f"global batch {global_batch} kept"
        if now == global_batch
        else f"global batch {global_batch} cannot be split over {world_size} process(es): it is now {now}"
    )
    return (
        f"world size {old_world} -> {world_size}: {kept} (data.batch_size {old_batch} -> {per_process} per "
        f"process); the learning rate and its schedule follow the global batch"
    )


def run_dir_for(default: Path) -> Path:
    """The run dir of a torchrun run that did not pass ``hydra.run.dir``: ``<runs>/<date>/torchrun-<id>``.

    ``default`` is the timestamped dir Hydra computed (``<runs>/<date>/<time>``). Every worker, on every node and
    after every restart, finds the same dir: one that already exists for this rendezvous id (a restart after
    midnight, a node started later), else today's.
    """
    name = f"torchrun-{os.environ[RUN_ID]}"
    runs = default.parent.parent
    found = sorted(runs.glob(f"*/{name}")) if runs.is_dir() else []
    return found[-1] if found else default.parent / name


# -- the process group of each attempt --------------------------------------------------------------------------

_PREFIX: str | None = None  # the store prefix this attempt's ranks agreed on


def attempt_prefix() -> str:
    """This attempt's key prefix in the rendezvous store (the run's failure record lives under it too,
    src/resilience/supervision.py). Without the agent's store, each attempt's store is new: its restart count does."""
    return _PREFIX or f"cifar10_ddp/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def attempt_store(rank: int, timeout: timedelta) -> Any:
    """The store this attempt's process group forms on: the agent's store under a prefix of this attempt's own.

    torch 2.14's env:// rendezvous hands every worker the agent's store as it is ("we create a new TCPStore for
    every retry"), but the agent keeps one store across restarts: a restarted rank can read a peer's address
    from the attempt before and fail to connect (gloo) or hang (nccl). Restart counts do not tell attempts apart
    either: an agent that joins later counts from 0, and a scale-up restart does not count. So rank 0 picks a
    fresh prefix and hands it to each rank under a number of that rank's own, which no earlier attempt can
    have written (:func:`handshake`)."""
    global _PREFIX
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") != "True":
        return None  # rank 0 hosts a new store on a new port each attempt: nothing stale to read

    def connect() -> Any:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )

    store = connect()
    # rank 0 answers on a connection of its own, from a thread
    _PREFIX = handshake(store, rank, timeout, answering=connect() if rank == 0 else None)
    return dist.PrefixStore(_PREFIX + "pg/", store)


def handshake(
    store: Any,
    rank: int,
    timeout: timedelta,
    answering: Any = None,
    formed: threading.Event | None = None,
) -> str:
    """This attempt's prefix: rank 0 picks it and answers every hello on ``answering`` (a thread, until ``formed``,
    by default :func:`group_formed`'s); another rank takes the run's next hello number, which no rank of this run
    had before, and waits for rank 0's answer under it. Per rank: three requests (the number, the wait, the
    answer), once an attempt."""
    if rank == 0:
        prefix = f"cifar10_ddp/attempt/{uuid.uuid4().hex}/"
        _answer(answering or store, prefix, time.monotonic() + timeout.total_seconds(), formed or _formed)
        return prefix
    answer = f"{_ANSWER}{store.add(_HELLOS, 1)}"
    store.wait([answer], timeout)
    return store.get(answer).decode()


_HELLOS = "cifar10_ddp/attempt/hellos"  # how many hellos every attempt of the run has said: the last one's number
_ANSWER = "cifar10_ddp/attempt/answer/"  # + a hello's number: the prefix rank 0 chose
_BATCH = 1024  # answers written in one request
_formed = threading.Event()


def _answer(store: Any, prefix: str, deadline: float, formed: threading.Event) -> None:
    """In rank 0, until the process group has formed: answer every hello with ``prefix``.

    Every 50 ms one request reads the count of hellos; the new ones are answered in a request a thousand. The hellos
    of earlier attempts are answered too, once (their ranks are gone).
    """

    def loop() -> None:
        answered = 0
        while time.monotonic() < deadline and not formed.is_set():
            try:
                said = int(store.add(_HELLOS, 0))
                for first in range(answered + 1, said + 1, _BATCH):
                    numbers = range(first, min(first + _BATCH, said + 1))
                    store.multi_set([f"{_ANSWER}{n}" for n in numbers], [prefix] * len(numbers))
                answered = said
            except Exception:  # noqa: BLE001 - the store is gone: so is this attempt
                return
            time.sleep(0.05)

    threading.Thread(target=loop, name="attempt-answer", daemon=True).start()


def group_formed() -> None:
    """Called once the process group exists: every rank had its answer (the group could not form otherwise)."""
    _formed.set()
