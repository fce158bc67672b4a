"""How processes find each other: the strategy factory behind ``conf/strategy/*.yaml``.

Lightning owns the process group, the samplers and rank-zero IO. This module only adds what it
lacks for a Hydra application: a ``backend`` key (auto | nccl | gloo), a rendezvous timeout that
fails with a readable message, local ranks started from *this job's* overrides (src/launch/ranks.py),
ranks that stop together when one of them or their launcher dies (src/resilience/supervision.py), srun tasks that
each see one GPU of their own (TaskGPU), spawned ranks that keep the parent's TF32 settings, and a rendezvous
that listens only where the ranks are (:func:`rendezvous_store`).
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from src.core.console import spawned_rank_console, warning_filters
from src.core.errors import EXIT_FAILED, UserError, terminal_gone, terminals
from src.launch import ranks, torchrun
from src.launch.devices import uses_cuda
from src.launch.run_dir import hydra_resume, note_spawned_resume
from src.resilience import failure, heartbeat, supervision

_START_METHODS = {"ddp": "popen", "ddp_spawn": "spawn"}
SAID_BYTES = 4096  # a ddp_spawn rank's failure line, as its parent keeps it


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
    resolved, local = ranks.check_strategy(name, backend, timeout_s, accelerator, devices, num_nodes)
    hang_timeout_s = ddp_kwargs.pop("hang_timeout_s", None)
    store_bind = ddp_kwargs.pop("store_bind", "master_addr")
    if store_bind not in STORE_BINDS:
        raise UserError(
            f"strategy.store_bind={store_bind} is not known: choose one of {', '.join(STORE_BINDS)} (where "
            "rank 0's rendezvous store listens across nodes)"
        )
    if resolved == "auto":
        return "auto"  # Lightning picks SingleDeviceStrategy: no process group, no DDP wrapper
    hang_timeout_s = check_hang_timeout(hang_timeout_s, timeout_s)
    if ddp_kwargs.get("gradient_as_bucket_view") == "auto":
        # On GPUs the views save a copy of every gradient into its bucket. On CPUs they cost time instead: with gloo on
        # an Intel Xeon, 2 processes trained ResNet-50 at 22.5 img/s with them and 23.8 without (docs/performance.md).
        ddp_kwargs["gradient_as_bucket_view"] = uses_cuda(accelerator)
    return HydraDDPStrategy(
        start_method=_START_METHODS[resolved],
        process_group_backend=None if backend == "auto" else backend,  # Lightning: nccl on CUDA, else gloo
        timeout=timedelta(seconds=timeout_s),
        hang_timeout_s=hang_timeout_s,
        store_bind=store_bind,
        **ddp_kwargs,
    )


STORE_BINDS = ("master_addr", "all")


HANG_TIMEOUT_AUTO_S = 120.0


def check_hang_timeout(hang_timeout_s: Any, timeout_s: float) -> float | None:
    """``strategy.hang_timeout_s``: seconds without progress before a stuck rank stops the run (null: never; auto:
    120 s, or half of ``strategy.timeout_s`` where that is shorter, so a lowered collective timeout keeps it below)."""
    if hang_timeout_s is None:
        return None
    if hang_timeout_s == "auto":
        return min(HANG_TIMEOUT_AUTO_S, timeout_s / 2)
    if isinstance(hang_timeout_s, bool) or not isinstance(hang_timeout_s, (int, float)) or not hang_timeout_s > 0:
        raise UserError(
            f"strategy.hang_timeout_s={hang_timeout_s} must be a number of seconds > 0, auto, or null to "
            "never stop a run whose rank hangs before strategy.timeout_s"
        )
    if hang_timeout_s >= timeout_s:
        raise UserError(
            f"strategy.hang_timeout_s={hang_timeout_s} must be below strategy.timeout_s={timeout_s}: "
            "a collective would give up first, without naming the stuck rank"
        )
    return float(hang_timeout_s)


class TaskGPU(CUDAAccelerator):
    """CUDA for srun tasks that each see one GPU of their own (``--gpus-per-task=1``): every local rank trains on
    its cuda:0, and Lightning still counts ``trainer.devices`` = the node's tasks (its Slurm check wants that).

    Lightning's own CUDA accelerator would put local rank N on cuda:N, which such a task does not have.
    """

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        return [0] * int(devices)

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("cuda", 0)] * len(devices)


class HydraDDPStrategy(DDPStrategy):
    """DDP whose local ranks join this Hydra job, watch their launcher, and whose rendezvous failure says what is
    missing; a rank that hangs is found within ``hang_timeout_s`` (src/resilience/supervision.py's HangWatch)."""

    def __init__(
        self, *args: Any, hang_timeout_s: float | None = None, store_bind: str = "master_addr", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.hang_timeout_s = hang_timeout_s
        self.store_bind = store_bind
        self._store_where = ""  # where this rank's store listened, or what it dialled: for the timeout's line
        self.recipe: dict[str, Any] = {}  # training_recipe(cfg), set by src/training/trainer.py's build_trainer

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":
            self._launcher = HydraJobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = HydraSpawnLauncher(self, start_method=self._start_method)

    def setup_distributed(self) -> None:
        """Lightning calls this at every stage (fit, then test): the process group forms at the first, and the
        watches start at each (a stage's end stops them). The order, each step needing the one before:

        1. a started rank watches its launcher: it must not outlive the process that started it;
        2. before the group forms: the open-file limit checked (sockets run out as it forms), one node's traffic kept
           to loopback, NCCL's watchdog and flight-recorder variables set (NCCL reads them as the group forms);
        3. the nodes agree on the world and the recipe (``agree_on_world``), and the group forms: on torchrun's
           attempt keys under torchrun, else on the rendezvous store bound where the ranks are (``rendezvous_store``);
        4. Lightning's own setup, which leaves a group that exists as it is;
        5. from here on a failure or a hang of any rank stops every rank: progress marks, the failure watch.

        A rendezvous that times out is one UserError: where rank 0's store listened, or what this rank dialled.
        """
        launcher_pid = ranks.launcher_pid()
        if launcher_pid is not None:
            # node 0's launcher is rank 0, which hosts the run's store
            rank = self.node_rank * self.num_processes + self.local_rank
            supervision.watch_launcher(rank, launcher_pid, hosts_store=self.node_rank == 0)
        run_dir = self._run_dir()
        try:
            if not torch.distributed.is_initialized():
                self._before_the_group_forms(run_dir)
                if not (torchrun.active() and self._init_attempt_group()):
                    self._init_bound_group()
            super().setup_distributed()
            self._report_progress()
            supervision.watch_failures(
                self.global_rank,
                self.node_rank,
                self.local_rank,
                self.world_size,
                in_sweep=ranks.in_sweep(),
                hang_timeout_s=self.hang_timeout_s,
                run_dir=run_dir,
                local_world=self.num_processes,
            )
        except torch.distributed.DistError as err:
            env = self.cluster_environment
            where = f"{err}; " if isinstance(err, (RanksMissing, StoreUnreachable)) else ""
            where += f"{self._store_where}; " if self._store_where else ""
            raise UserError(
                f"rank {self.global_rank} (NODE_RANK={self.node_rank}) could not form a process group of "
                f"world size {self.world_size} at MASTER_ADDR:MASTER_PORT={env.main_address}:{env.main_port} "
                f"within {self._timeout.total_seconds():.0f} s: {where}start every node with the same MASTER_ADDR, "
                "MASTER_PORT and trainer.num_nodes, check the address is reachable, "
                f"or raise strategy.timeout_s ({type(err).__name__})"
            ) from err

    def _before_the_group_forms(self, run_dir: str | None) -> None:
        check_open_files(self.global_rank, self.world_size, self.num_processes)
        if self.num_nodes == 1:
            keep_to_loopback()
        if traces_nccl(self.root_device.type) and run_dir is not None:
            heartbeat.switch_on_nccl_trace(run_dir)

    def _run_dir(self) -> str | None:
        trainer = getattr(self._lightning_module, "_trainer", None)
        return getattr(trainer, "default_root_dir", None)

    def _report_progress(self) -> None:
        """Mark where this rank is, first of the callbacks, so a hook that hangs has its place marked already."""
        trainer = getattr(self._lightning_module, "_trainer", None)
        if (
            self.hang_timeout_s
            and trainer is not None
            and not any(type(cb).__name__ == "ProgressReport" for cb in trainer.callbacks)
        ):
            trainer.callbacks.insert(0, heartbeat.progress_callback())

    def _init_bound_group(self) -> None:
        """Form the process group on :func:`rendezvous_store` (Lightning's env:// store listens on every interface)."""
        self.set_world_ranks()
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = LOOPBACK if self.num_nodes == 1 else env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)  # src/resilience/supervision.py's failure record reads both
        bind = self.store_bind if self.num_nodes > 1 else "master_addr"  # one node: loopback only, always
        self._store_where = store_where(self.global_rank, bind)
        store = rendezvous_store(self.global_rank, self.world_size, self._timeout, bind=bind)
        agree_on_world(
            store, self.global_rank, self.node_rank, self.num_nodes, self.num_processes, self._timeout, self.recipe
        )
        self._join(store)

    def _join(self, store: Any) -> None:
        """This rank's process group on ``store``, with the strategy's backend and timeout (and its GPU, on CUDA)."""
        torch.distributed.init_process_group(
            self._get_process_group_backend(),
            rank=self.global_rank,
            world_size=self.world_size,
            store=store,
            timeout=self._timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )

    def _init_attempt_group(self) -> bool:
        """Under torchrun: form the process group on this attempt's own keys (src/launch/torchrun.py says why), once
        every node has the same recipe; False where the agent's store is not at hand, and the group forms as
        elsewhere."""
        self.set_world_ranks()
        store = torchrun.attempt_store(self.global_rank, self._timeout)
        if store is None:
            return False
        # torchrun's agents agree on the counts (src/launch/torchrun.py's launched_shape), not on the command line
        agree_on_world(
            store, self.global_rank, self.node_rank, self.num_nodes, self.num_processes, self._timeout, self.recipe
        )
        self._join(store)
        torchrun.group_formed()
        return True


def traces_nccl(device_type: str) -> bool:
    """Whether a rank's process group is NCCL's, whose watchdog and flight recorder dump into the run dir."""
    return device_type == "cuda"


LOOPBACK = "127.0.0.1"
OPEN_FILES_SPARE = 256  # what a rank opens besides its sockets: libraries, logs, checkpoints, DataLoader pipes


def open_files_needed(rank: int, world_size: int, local_world: int = 1) -> int:
    """The descriptors a rank of ``world_size`` (``local_world`` ranks a node) holds at most: a socket to every other
    rank (gloo's full mesh: the stop agreement's group, and the process group's on the CPU), its own store connections
    (the process group's, and as its node's reporter two more and one to write a failure), and on rank 0, the store's
    host, every rank's process-group connection and three per node (src/resilience/supervision.py)."""
    nodes = -(-world_size // max(1, local_world))
    sockets = 2 * (world_size - 1) + 4 + (world_size + 3 * nodes if rank == 0 else 0)
    return sockets + OPEN_FILES_SPARE


def check_open_files(rank: int, world_size: int, local_world: int = 1) -> None:
    """Raise this process's open-file limit to what ``world_size`` needs, up to the hard limit; past that, one
    line naming the number, before the group forms (a rank out of descriptors fails in gloo or the store with a
    message that does not say why)."""
    import resource

    needed = open_files_needed(rank, world_size, local_world)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard == resource.RLIM_INFINITY or hard >= needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        return
    raise UserError(
        f"rank {rank} of a world of {world_size} needs about {needed} open files (a socket to every rank"
        f"{', and the store of every rank' if rank == 0 else ''}), but ulimit -n allows {hard} at most "
        f"here: raise the hard limit to {needed} or more (limits.conf, the container's --ulimit "
        "nofile=, or srun --propagate=NOFILE after ulimit -n in the batch script)"
    )


def keep_to_loopback() -> None:
    """A run on one node: gloo's and NCCL's own sockets on the loopback interface (they take the hostname's address
    otherwise), unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME already name one."""
    names = [name for _, name in socket.if_nameindex()]
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)


def rendezvous_store(
    rank: int, world_size: int, timeout: timedelta, bind: str = "master_addr"
) -> torch.distributed.TCPStore:
    """The run's rendezvous store at MASTER_ADDR:MASTER_PORT; rank 0 hosts it on MASTER_ADDR's own address only, or
    with ``bind="all"`` (``strategy.store_bind``) on every interface.

    torch's TCPStore binds every interface unless handed a bound socket: 127.0.0.1 on one node, the interface that
    carries MASTER_ADDR across nodes. Where MASTER_ADDR is no address of this node (NAT, a virtual IP) it listens on
    every interface, and says so. Node 0 binds the address *it* resolves MASTER_ADDR to; where the other nodes resolve
    the name to another address of node 0 (``/etc/hosts`` naming the fast interface, DNS the management one), they
    dial where nothing listens: ``all`` is for those clusters.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return store_client(host, port, world_size, timeout)
    listener = None
    if bind == "master_addr":
        listener = ranks.held_port(host, port) or _bound_listener(host, port)
    try:
        return torch.distributed.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=None if listener is None else listener.detach(),
            wait_for_workers=False,  # agree_on_world waits for them, and for a rank whose world differs
        )
    finally:
        if listener is not None and listener.fileno() != -1:
            listener.close()


WORLD_KEY = "cifar10_ddp/world"  # rank 0's trainer.num_nodes x trainer.devices
ARRIVED_KEY = "cifar10_ddp/world_arrived"  # how many of the other ranks have compared theirs with it
DIFFERS_KEY = "cifar10_ddp/world_differs"  # the line of a rank that found its own otherwise
NODES_KEY = "cifar10_ddp/world_nodes"  # "1,5,...": each node's first rank appends its node rank once it has read
LATE_S = 2.0  # how long rank 0 leaves the world's keys, once a rank differs, for the ranks still to read them


# What every node must train alike, by hand as under a launcher: values a node's command line could set otherwise and
# the run would take without a word (paths, the devices and the loggers may differ from node to node).
RECIPE_KEYS = (
    "seed",
    "data",
    "model",
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.min_epochs",
    "trainer.precision",
    "trainer.accumulate_grad_batches",
    "trainer.gradient_clip_val",
    "trainer.limit_train_batches",
    "trainer.limit_val_batches",
    "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch",
    "trainer.deterministic",
    "trainer.sync_batchnorm",
    # how the ranks talk: a gloo rank beside nccl ones, or a DDP that looks for unused parameters beside one that
    # does not, forms a group that hangs or fails at its first collective
    "backend",
    "strategy.find_unused_parameters",
    # the callbacks whose collectives and saves every rank takes part in at the same batches
    "callbacks.graceful_stop",
    "callbacks.last_checkpoint",
    "callbacks.model_checkpoint",
)
PER_NODE_KEYS = (
    "data.root",
    "data.download",
    "data.num_workers",
    "data.multiprocessing_context",
    "data.pin_memory",
    "data.download_url",
)
ABSENT_MEANS = {"strategy.find_unused_parameters": False}  # strategy=auto has no such key: DDP's own default


def training_recipe(cfg: Any) -> dict[str, Any]:
    """``RECIPE_KEYS`` of the composed config, as configured (``auto`` unresolved: each node resolves it for its own
    hardware), flattened to ``key: value``."""
    from omegaconf import OmegaConf

    flat: dict[str, Any] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for name, item in value.items():
                walk(f"{key}.{name}", item)
        elif key not in PER_NODE_KEYS and not key.endswith(".dirpath"):  # a folder: each node names its own mount
            flat[key] = value

    for key in RECIPE_KEYS:
        node = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
        walk(key, OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node)
    for key, value in ABSENT_MEANS.items():
        flat[key] = value if flat.get(key) is None else flat[key]
    return flat


def agree_on_world(
    store: torch.distributed.Store,
    rank: int,
    node_rank: int,
    num_nodes: int,
    devices: int,
    timeout: timedelta,
    recipe: dict[str, Any] | None = None,
) -> None:
    """Stop every rank at once where the nodes count the world differently, or train it differently.

    Started by hand, each node computes the world from its own ``trainer.num_nodes`` and ``trainer.devices``
    (``auto``: its own GPUs). Where they differ (``trainer.devices=auto`` on nodes with 8 and 4 GPUs), rank 0 waited
    for ranks that would never come, and the others for a group of another size: every rank stopped after
    ``strategy.timeout_s`` (300 s) with a line about addresses, though every node had reached the store. And nodes
    started with another ``data.batch_size`` or ``seed`` trained together without a word, each scaling its learning
    rate to a global batch of its own, their shards drawn from splits of their own. Here rank 0 puts its count and
    its ``recipe`` (``training_recipe``) in the store, with its host; every other rank reads them once, leaves its line
    where its own differ, and counts itself; rank 0 waits for them all (a poll of the store every 50 ms), as torch's
    store waited for its workers before, and once a rank has differed ``LATE_S`` for the rest (a node that counts
    fewer started fewer, one that counts more started more), so that each rank still to come reads the keys and says
    its own line. Under
    torchrun the same, under the attempt's prefix: torchrun's agents agree on the counts, not on the command lines.
    Per rank: one read (about 2 KB) and one add, once per run, beside the rendezvous's own, and an append by each node's
    first rank to one key, which tells rank 0 which nodes never came where the wait times out (``RanksMissing``)."""
    mine = f"{num_nodes} x {devices} = {num_nodes * devices}"
    ours = json.loads(json.dumps(recipe or {}, default=str))  # as rank 0's reads back from the store
    if rank != 0:
        theirs = json.loads(store.get(WORLD_KEY))  # waits for rank 0, within the store's timeout
        nodes = (f"NODE_RANK={node_rank} ({socket.gethostname()})", f"node 0 ({theirs['host']})")
        line = _world_differs(*nodes, mine, theirs["world"]) or _recipe_differs(*nodes, ours, theirs["recipe"])
        if line is not None:
            store.set(DIFFERS_KEY, line)  # before it counts itself: rank 0 sees the line once all have come
        if rank == node_rank * devices:  # the node's first rank: which nodes came, for a rendezvous that times out
            store.append(NODES_KEY, f"{node_rank},")
        store.add(ARRIVED_KEY, 1)
        if line is not None:
            raise UserError(f"rank {rank}: {line}")
        return
    store.set(WORLD_KEY, json.dumps({"world": mine, "recipe": ours, "host": socket.gethostname()}))
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        late = None  # once a rank differs: until when the ranks still to come may read the keys, for their lines
        while store.add(ARRIVED_KEY, 0) < num_nodes * devices - 1:
            now = time.monotonic()
            if late is None and store.check([DIFFERS_KEY]):
                late = now + LATE_S
            if late is not None and now > late:
                break  # some never come: a node that counts fewer started fewer
            if late is None and now > deadline:  # the ranks that never came: the rendezvous's own line, with them
                raise RanksMissing(_missing(store, num_nodes, num_nodes * devices - 1))
            time.sleep(0.05)
        if store.check([DIFFERS_KEY]):
            # The ranks this one counts have come, but a node that counts more started more: those still to come read
            # the keys within LATE_S and say their own lines (before, a node's first rank that came after this one had
            # gone waited for the keys until the rank it started gave up, 30 s later)
            time.sleep(max(0.0, late - time.monotonic()) if late is not None else LATE_S)
            raise UserError(f"rank 0: {store.get(DIFFERS_KEY).decode()}")
    finally:  # a store that outlives this run (a sweep's next job, on the same port) starts clean
        for key in (WORLD_KEY, ARRIVED_KEY, DIFFERS_KEY, NODES_KEY):
            store.delete_key(key)


class RanksMissing(torch.distributed.DistStoreError):
    """Rank 0's wait for the other ranks timed out; ``str()``: which nodes never reached the store."""


def _missing(store: torch.distributed.Store, num_nodes: int, others: int) -> str:
    """Which of the other nodes never reached the store (their first ranks' marks), or how many ranks did not."""
    came = {int(n) for n in store.get(NODES_KEY).decode().split(",") if n} if store.check([NODES_KEY]) else set()
    absent = [n for n in range(1, num_nodes) if n not in came]
    if absent:
        named = ", ".join(str(n) for n in absent[:8]) + (f" ... ({len(absent)} in all)" if absent[8:] else "")
        return (
            f"{num_nodes - len(absent)} of {num_nodes} nodes reached its store: NODE_RANK={named} did not (not "
            "started yet, or dialling another address or port)"
        )
    arrived = int(store.add(ARRIVED_KEY, 0))
    return (
        f"every node reached its store, but only {arrived} of the {others} other ranks did (the others' logs say why)"
    )


def _world_differs(node: str, node0: str, mine: str, theirs: str) -> str | None:
    if mine == theirs:
        return None
    return (
        f"{node} counts trainer.num_nodes x trainer.devices as {mine} processes, {node0} as {theirs}: "
        "start every node with the same trainer.num_nodes and trainer.devices (a count, not auto, where the nodes' "
        "GPUs differ)"
    )


def _recipe_differs(node: str, node0: str, ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first three keys of the recipe ``node`` trains otherwise than ``node0``, in one line; None if none."""
    missing = object()
    differ = sorted(k for k in {*ours, *theirs} if ours.get(k, missing) != theirs.get(k, missing))
    if not differ:
        return None

    def said(values: dict[str, Any]) -> str:
        return " ".join(f"{k}={_value(values.get(k))}" for k in differ[:3]) + (" ..." if differ[3:] else "")

    return (
        f"{node} trains with {said(ours)}, {node0} with {said(theirs)}: start every node with the same "
        "command line (the model, the data and how long to train)"
    )


def _value(value: Any) -> str:
    """A config value as the command line writes it (``null``, ``true``)."""
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


def store_where(rank: int, bind: str) -> str:
    """Where the rendezvous store is, as this rank sees it, for the line a rendezvous that times out ends with."""
    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    if rank == 0 and bind == "all":
        return f"node 0's store listened on every interface at port {port} (strategy.store_bind=all)"
    try:
        address = _resolve(host, int(port))[1][0]
    except (socket.gaierror, ValueError):
        return ""  # said elsewhere: MASTER_ADDR that does not resolve is its own error
    if rank == 0:
        return (
            f"node 0's store listened on {address}:{port}, {host} as node 0 resolves it; a node that resolves "
            f"{host} to another address dials where nothing listens: strategy.store_bind=all listens on every "
            "interface"
        )
    return (
        f"this node dialled {address}:{port}, {host} as this node resolves it; node 0 listens where its own "
        f"resolution of {host} points: where the nodes resolve it differently, set strategy.store_bind=all"
    )


def _bound_listener(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``host``'s address at ``port`` (SO_REUSEADDR, as torch binds), or None (every interface,
    with a warning) where this node does not have that address, or a hostname resolves to loopback here only.

    A hostname's IPv4 address comes first: a peer whose resolver lists IPv6 first tries the next address.
    """
    try:
        family, address = _resolve(host, port)
    except socket.gaierror as err:
        raise UserError(
            f"MASTER_ADDR={host} does not resolve to an address ({err.strerror}): set it to node 0's "
            "address or hostname"
        ) from err
    why = None
    if _is_hostname(host) and ipaddress.ip_address(address[0].split("%")[0]).is_loopback:
        why = "resolves to loopback on this node (/etc/hosts' 127.0.1.1, often), which other nodes cannot reach"
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        if why is None:
            listener.bind(address)
            return listener
    except OSError as err:
        if err.errno != errno.EADDRNOTAVAIL:
            listener.close()
            raise UserError(
                f"MASTER_PORT={port} cannot be used on {host} ({err.strerror}): pick a free port, or "
                "unset MASTER_PORT and Lightning picks a free one"
            ) from err
        why = "is not an address of this node"
    listener.close()
    logging.getLogger(__name__).warning(
        "MASTER_ADDR=%s (%s) %s: the rendezvous store listens on every interface at port %s",
        host,
        address[0],
        why,
        port,
    )
    return None


def _resolve(host: str, port: int) -> tuple[int, tuple]:
    """``host``'s address family and socket address as this node resolves it, an IPv4 address first."""
    family, _, _, _, address = min(_addresses(host, port), key=lambda info: info[0] != socket.AF_INET)
    return family, address


def _addresses(host: str, port: int) -> list[tuple]:
    """``socket.getaddrinfo`` for a stream to ``host``:``port``; a name no resolver could take (``node..1``, a label
    of over 63 characters: Python's IDNA codec refuses it, before, a traceback) is a ``gaierror`` like a name that
    does not resolve."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except UnicodeError:
        raise socket.gaierror(
            socket.EAI_NONAME, "not a valid hostname: an empty label, or one of over 63 characters"
        ) from None


class StoreUnreachable(torch.distributed.DistNetworkError):
    """A rank's wait for node 0's store timed out; ``str()``: what it met (a name that does not resolve, a connection
    refused or unanswered)."""


RESOLVE_EVERY_S = 1.0  # at most, between a waiting rank's lookups of MASTER_ADDR (its resolver's, not the store's)
CLIENT_SPARE_S = 60.0  # how much longer torch's client may wait than the rank: the rank has ended, with its line, first


def store_client(host: str, port: int, world_size: int, timeout: timedelta) -> torch.distributed.TCPStore:
    """A rank's connection to node 0's store at ``host``:``port``, made within ``timeout``, or one StoreUnreachable
    saying what was met: a name that does not resolve, a connection refused or unanswered.

    torch's client waited the timeout, then waited it once more (its whole connect retried), printing c10d's warnings
    and two C++ stacks on the way: 20 s of ``strategy.timeout_s`` took 59 s; a name that did not resolve (yet) was
    a warning at each try. Here ``host`` is first looked up until it resolves (a Kubernetes service's name appears
    once node 0's pod is ready): the resolver's work, no connection. Then torch's own client connects as before (the
    same one connection, the same retries while node 0 refuses), on a thread the rank waits for until the timeout
    only: past it the rank stops with its line before the client's timeout, so the client never prints its own.
    """
    import random

    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.05
    while True:
        try:
            _addresses(host, port)
            break
        except socket.gaierror as err:
            if time.monotonic() >= deadline:
                raise StoreUnreachable(
                    f"MASTER_ADDR={host} does not resolve here ({err.strerror}): give node 0's address or hostname"
                ) from None
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(2 * pause, RESOLVE_EVERY_S) * random.uniform(0.75, 1.0)
    made: dict[str, Any] = {}

    def connect() -> None:
        try:
            made["store"] = torch.distributed.TCPStore(
                host,
                port,
                world_size,
                is_master=False,
                timeout=timedelta(seconds=max(1.0, deadline - time.monotonic()) + CLIENT_SPARE_S),
                multi_tenant=True,
                wait_for_workers=False,
            )
        except BaseException as err:  # noqa: BLE001 - raised again in the rank's thread
            made["error"] = err

    client = threading.Thread(target=connect, name="store-client", daemon=True)
    client.start()
    client.join(max(0.0, deadline - time.monotonic()))
    if "store" in made:
        made["store"].set_timeout(timeout)  # its waits for keys take the whole timeout, as the host's do
        return made["store"]
    if "error" in made:
        raise made["error"]
    raise StoreUnreachable(_what_answers(host, port))


def _what_answers(host: str, port: int) -> str:
    """What one connection attempt to ``host``:``port`` meets now, for the line of a rank whose wait timed out."""
    met = f"nothing answered at {host}:{port}"
    try:
        for family, kind, proto, _, address in _addresses(host, port):
            with socket.socket(family, kind, proto) as probe:
                probe.settimeout(2.0)
                try:
                    probe.connect(address)
                except OSError as err:
                    refused = isinstance(err, ConnectionRefusedError)
                    met = f"{address[0]}:{port} {'refused the connection' if refused else 'did not answer'}"
                    continue
                return f"{address[0]}:{port} answered only as the wait ended"
    except socket.gaierror as err:
        return f"MASTER_ADDR={host} does not resolve here ({err.strerror})"
    return f"{met}: node 0 has not started, or cannot be reached from here"


def _is_hostname(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return True
    return False


class HydraJobLauncher(_SubprocessScriptLauncher):
    """Starts local ranks 1..N-1 from this job's overrides (src/launch/ranks.py), when src.train has not already.

    Lightning's own launcher replays ``sys.argv``; under ``-m`` that starts a whole sweep in every
    child (Lightning issue #11300).
    """

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        self.procs, started = ranks.spawn_local_ranks(self.num_processes, env.node_rank())
        supervision.track(self.procs, started)


class HydraSpawnLauncher(_MultiProcessingLauncher):
    """``ddp_spawn``'s launcher: the parent passes a SIGTERM (SIGINT, SIGHUP) on to its ranks (it is no rank
    itself), a rank that stopped on request exits with ``128 + signal`` instead of multiprocessing's 1, and the ranks
    compute with the TF32 settings the parent chose (src/training/trainer.py's hardware_defaults)."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._backend_flags = backend_flags()  # the ranks get them with this launcher, pickled
        self._warning_filters = warning_filters()  # and the warnings this process drops (a resume's, too)
        self._resume = hydra_resume()  # and how a stop or a failure says to go on (src/launch/run_dir.py)
        self._in_sweep = ranks.in_sweep()
        # torch warns "Terminating process N via signal SIGTERM" for every rank it stops after one failed; the
        # failed rank (or, for a death, src/resilience/supervision.py) has said what happened
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        heartbeat.register_stack_dump("ddp_spawn's parent process")  # kill -USR2: the ranks say their own
        spawn = multiprocessing.get_context("spawn")  # shared with the ranks it starts:
        # a rank that kills a stuck one (src/resilience/supervision.py) notes its pid here: the run's own doing
        self._killed = spawn.Value("i", 0)
        # and the first failure line a rank says, for a sweep's record of the job: under ddp the sweep's process is
        # rank 0 and reads it from the group's record, which goes with ddp_spawn's ranks (before: "a rank of this
        # job failed: see its log")
        self._said = spawn.Array("c", SAID_BYTES, lock=False)  # no lock: no semaphore to leak
        # and whether a rank took Ctrl-C before its training steps listened (its setup): it ends quietly, and this
        # process ends the run as one process would (before: the ranks exited 0 without a result, and Lightning
        # waited for one for ever)
        self._interrupted = spawn.Value("b", 0, lock=False)
        self._passed: list[int] = []  # the signals this process passed on to its ranks
        supervision.SPAWNED_SAID.clear()
        if threading.current_thread() is not threading.main_thread():
            return self._launch(function, *args, trainer=trainer, **kwargs)
        # Ctrl-C reaches the ranks from the terminal too; they take a second one within a second for the same. A
        # process that ignores SIGINT (a shell's background job) keeps ignoring it, as its ranks do.
        signums = [signal.SIGTERM] if failure.sigint_ignored() else [signal.SIGTERM, signal.SIGINT]
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # the terminal gone; ignored under nohup
            signums.append(signal.SIGHUP)
        ttys = terminals()  # asked now: a terminal that hung up no longer says it is one

        def pass_on(signum: int, frame: Any) -> None:
            if signum == signal.SIGHUP:
                terminal_gone(ttys)
            self._passed.append(signum)
            self.kill(signum)

        previous = {signum: signal.signal(signum, pass_on) for signum in signums}
        try:
            return self._launch(function, *args, trainer=trainer, **kwargs)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        from torch.multiprocessing import ProcessExitedException

        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessExitedException as err:
            if self._interrupted.value or (err.signal_name == "SIGINT" and signal.SIGINT in self._passed):
                # Ctrl-C before the ranks' steps listened (their setup; or their start, where one died of it)
                raise KeyboardInterrupt from None
            said = self._said.value.decode(errors="replace")
            if said:
                supervision.SPAWNED_SAID[:] = [said]
            if err.error_pid != self._killed.value:
                raise
            # the rank that killed it has said why
            raise ProcessExitedException(str(err), err.error_index, err.error_pid, EXIT_FAILED) from None

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> Any:
        spawned_rank_console(self._warning_filters)
        failure.install_sigint_handler()  # what Lightning puts back after a stage (failure.on_sigint)
        set_backend_flags(self._backend_flags)
        # torch makes a spawned rank get SIGINT when its parent dies; that KeyboardInterrupt races the watch
        # below and ends the rank without a word. One owner: the watch, which says what happened.
        _clear_parent_death_signal()
        rank = self._strategy.node_rank * self._strategy.num_processes + process_idx
        supervision.watch_launcher(rank, multiprocessing.parent_process().pid)
        supervision.KILL_NOTES.append(lambda pid: setattr(self._killed, "value", pid))
        supervision.SAID_NOTES.append(self._keep_said)
        trainer = args[0] if args else None
        note_spawned_resume(self._resume, self._in_sweep)  # how its lines say to go on: it has no Hydra config
        heartbeat.register_stack_dump(f"rank {rank}", getattr(trainer, "default_root_dir", None))
        try:
            result = super()._wrapping_function(process_idx, *args, **kwargs)
        except KeyboardInterrupt:  # Ctrl-C before this rank's steps listen: the parent says it (torch's wrapper
            self._interrupted.value = 1  # took it for its own stop, and the rank exited 0 without a result)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the same Ctrl-C passed on by the parent, late: not again
            # the other ranks end with it (one may wait in a collective for this one), quiet, and its node's board
            # goes with the last of them
            supervision.end_run(None, 128 + signal.SIGINT)
        except Exception as err:  # noqa: BLE001 - any failure of a rank ends the run, told once; a stop on request too
            failure.fail(err, getattr(trainer, "default_root_dir", None), rank_zero=self._strategy.global_rank == 0)
        supervision.stop_watching_failures()
        return result

    def _keep_said(self, line: str) -> None:
        """In a rank: its failure line, for the parent, unless another rank's came first (cut at a character)."""
        if not self._said.value:  # one rank says the run's line (the failure record's first); no lock needed
            self._said.value = line.encode()[: SAID_BYTES - 1].decode(errors="ignore").encode()


def backend_flags() -> dict[str, Any]:
    """This process's float32 matmul precision and cuDNN TF32 and determinism flags.

    Lightning's spawn launcher carries cuDNN autotuning, deterministic algorithms and the random states into the
    ranks (its _GlobalStateSnapshot), not these: a spawned rank would start with torch's defaults (no TF32 matmuls).
    """
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
    }


def set_backend_flags(flags: dict[str, Any]) -> None:
    """Apply what :func:`backend_flags` read in another process (torch's legacy setters, as Lightning reads them)."""
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
    torch.backends.cudnn.allow_tf32 = flags["cudnn_allow_tf32"]
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]


def _clear_parent_death_signal() -> None:
    """Undo torch's prctl(PR_SET_PDEATHSIG, SIGINT) for this process (Linux; elsewhere nothing was set)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0)  # 1: PR_SET_PDEATHSIG, 0: no signal
