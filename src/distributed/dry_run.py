"""``python -m src.train ... dry_run=true``: a run of any world size, seen from one of its ranks, on this machine.

Nothing is launched and nothing trains. The process joins torch's ``fake`` process group as rank r of the world the
config asks for (``trainer.num_nodes`` x ``trainer.devices``), builds the run's datamodule and model from the same
config, and prints what that rank would do: the global batch and peak learning rate, the steps per epoch, its
training, validation and test shards, the checkpoint cadence and the open files it needs. On a GPU it also runs a
few real training steps of its batch under DDP over the fake group and gives their peak memory. The same checks a
real run makes before any rank trains decide the last line: ``ready``, or what will not work (exit status 2).
"""

from __future__ import annotations

import logging
import math
import resource
from typing import Any

from omegaconf import DictConfig

from src.core.errors import UserError

STEPS_ON_A_GPU = 3  # real steps whose peak memory a dry run on a GPU gives


def world_of(cfg: DictConfig) -> tuple[int, int]:
    """(nodes, processes per node) the config asks for, as counts: the cluster's, not this machine's."""
    nodes, devices = cfg.trainer.num_nodes, cfg.trainer.devices
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        devices = len(devices)
    try:
        per_node = int(devices)
    except (TypeError, ValueError):
        raise UserError(
            f"dry_run=true needs trainer.devices as a count (the devices of each node), not trainer.devices={devices}"
        ) from None
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or per_node < 1:
        raise UserError(f"dry_run=true needs trainer.num_nodes and trainer.devices >= 1 (given {nodes} and {devices})")
    return nodes, per_node


def shard(count: int, rank: int, world: int) -> int:
    """Images of ``count`` that rank ``rank`` evaluates (unpadded shards: each image once)."""
    return len(range(rank, count, world))


def plan(cfg: DictConfig, rank: int, datamodule: Any, model: Any, world: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` would do; ``problems``: what will not work, as a real run would say it."""
    from src.data.in_memory import shard_problems
    from src.distributed.strategy import open_files_needed
    from src.models.batch_size import CPU_DEFAULT
    from src.models.classifier import extreme_lr_warning, scaled_lr

    n_train, n_val, n_test = len(datamodule.train_set), len(datamodule.val_set), len(datamodule.test_set)
    batch = datamodule.batch_size
    batch_note = ""
    if batch == "auto":
        batch, batch_note = CPU_DEFAULT, " (data.batch_size=auto: the reference batch; a GPU run probes its own)"
    accumulate = int(cfg.trainer.accumulate_grad_batches or 1)
    opt = model.hparams.optimizer
    global_batch = batch * world * accumulate
    lr = scaled_lr(opt["lr"], opt["lr_scaling"], global_batch, opt["reference_batch_size"])
    train_images = -(-n_train // world)  # shards padded to equal length
    steps = train_images // batch // accumulate
    limit = cfg.trainer.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        steps = min(steps, limit // accumulate)
    elif isinstance(limit, float):
        steps = int(steps * limit)
    val, test = shard(n_val, rank, world), shard(n_test, rank, world)
    last = cfg.callbacks.get("last_checkpoint") or {}
    cadence = []
    if last.get("every_n_train_steps"):
        cadence.append(f"every {last['every_n_train_steps']} steps")
    if last.get("every_n_minutes"):
        cadence.append(f"every {last['every_n_minutes']} minutes")
    problems = shard_problems(world, batch, train=n_train, val=n_val, test=n_test if cfg.test else None)
    warning = extreme_lr_warning(opt, global_batch)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return {
        "rank": rank,
        "world_size": world,
        "batch_size": batch,
        "batch_note": batch_note,
        "accumulate": accumulate,
        "global_batch": global_batch,
        "peak_lr": lr,
        "steps_per_epoch": steps,
        "max_epochs": cfg.trainer.max_epochs,
        "max_steps": cfg.trainer.get("max_steps", -1),
        "train_images": train_images,
        "val_images": val,
        "val_batches": math.ceil(val / batch),
        "test_images": test,
        "test_batches": math.ceil(test / batch),
        "last_checkpoint": ", ".join(cadence) or "at the first and last epoch's end",
        "open_files": open_files_needed(
            rank, world, cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else 1
        ),
        "open_files_here": "unlimited" if hard == resource.RLIM_INFINITY else hard,
        "problems": problems,
        "warnings": [] if warning is None else [warning],
    }


def gpu_peak_memory(model: Any, batch: int, image_size: int) -> float | None:
    """Peak GiB of ``STEPS_ON_A_GPU`` real training steps of ``batch`` images under DDP over the fake group."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", 0)
    net = DistributedDataParallel(model.net.to(device).to(memory_format=torch.channels_last), device_ids=[0])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(STEPS_ON_A_GPU):
        images = torch.randn(batch, 3, image_size, image_size, device=device).to(memory_format=torch.channels_last)
        labels = torch.randint(0, 10, (batch,), device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(net(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def _length(p: dict[str, Any]) -> str:
    """How long the fit runs: ``x 30 epochs``, ``x 30 epochs, at most 500 steps``, or ``500 steps in all``
    (``trainer.max_epochs=null``)."""
    steps = p.get("max_steps", -1)
    if p["max_epochs"] is None:
        return f"{steps} steps in all"
    return f"x {p['max_epochs']} epochs" + (f", at most {steps} steps" if steps != -1 else "")


def report(p: dict[str, Any], nodes: int, per_node: int, gpu_gib: float | None) -> list[str]:
    lines = [
        f"dry run: rank {p['rank']} of {p['world_size']} ({nodes} node(s) x {per_node}), on torch's fake process group",
        f"  global batch     {p['global_batch']} = {p['batch_size']} per process x {p['world_size']} processes"
        + (f" x {p['accumulate']} accumulated" if p["accumulate"] > 1 else "")
        + p["batch_note"],
        f"  peak lr          {p['peak_lr']:.4g}",
        f"  steps per epoch  {p['steps_per_epoch']} ({_length(p)})",
        f"  this rank        {p['train_images']} training images an epoch; {p['val_images']} validation images "
        f"({p['val_batches']} batches); {p['test_images']} test images ({p['test_batches']} batches)",
        f"  last.ckpt        {p['last_checkpoint']}, and on SIGTERM",
        f"  open files       about {p['open_files']} (ulimit -Hn here: {p['open_files_here']})",
    ]
    if gpu_gib is not None:
        lines.append(f"  GPU memory       {gpu_gib:.2f} GiB at the peak of {STEPS_ON_A_GPU} real steps of its batch")
    lines += [f"  will not work:   {x}" for x in p["problems"]]
    lines += [f"warning: {w}" for w in p["warnings"]]
    return lines


def check_trainer(cfg: DictConfig) -> None:
    """What every rank's Trainer and callbacks refuse as they are built (a ``trainer.*`` value Lightning rejects, such
    as ``limit_train_batches=-3``; a checkpoint cadence): they are built here too, for one CPU process that runs
    nothing, so the dry run's verdict says it as a real run would. What they would print or warn about this machine
    (no GPU here) is not the cluster's, and stays unsaid. Its cluster environment is given, as build_trainer's is:
    Lightning's own search ends in MPIEnvironment.detect(), which imports mpi4py's MPI (MPI_Init in this process, or
    a RuntimeError where mpi4py is installed and no MPI library is)."""
    import warnings

    from hydra.utils import instantiate
    from lightning.fabric.plugins.environments import LightningEnvironment

    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    precision = cfg.trainer.precision
    logging.disable(logging.WARNING)  # Lightning's lines on this machine's devices
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            instantiate(
                cfg.trainer,
                accelerator="cpu",
                devices=1,
                num_nodes=1,
                strategy="auto",
                precision="32-true" if precision == "auto" else precision,
                benchmark=False,
                logger=False,
                callbacks=callbacks,
                plugins=[LightningEnvironment()],
            )
    finally:
        logging.disable(logging.NOTSET)


def run(cfg: DictConfig) -> None:
    """Print the plan of ``cfg.dry_run_rank`` (default: rank 0, and the last rank, whose shards are the smallest)
    and end with one line: ready, or (a UserError: exit status 2) what will not work."""
    import torch.distributed as dist
    from hydra.utils import instantiate
    from torch.testing._internal.distributed.fake_pg import FakeStore

    nodes, per_node = world_of(cfg)
    world = nodes * per_node
    ranks = [cfg.dry_run_rank] if cfg.get("dry_run_rank") is not None else sorted({0, world - 1})
    for rank in ranks:
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise UserError(f"dry_run_rank={rank} is not a rank of a world of {world}: give 0 to {world - 1}")
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()  # data that is not there fails here, as in a real run
    datamodule.setup("fit")
    model = instantiate(cfg.model)
    check_trainer(cfg)
    problems: list[str] = []
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            p = plan(cfg, rank, datamodule, model, world)
            gpu = None
            if not p["problems"] and rank == ranks[0]:
                gpu = gpu_peak_memory(model, p["batch_size"], datamodule.train_set.images.shape[-1])
        finally:
            dist.destroy_process_group()
        lines = report(p, nodes, per_node, gpu)
        print("\n".join(line for line in lines if rank == ranks[0] or not line.startswith("warning: ")), flush=True)
        problems += [x for x in p["problems"] if x not in problems]
    if problems:  # the last line, as error: ..., and exit status 2
        raise UserError(
            f"dry run: will not work: {problems[0]}"
            + (f" (and {len(problems) - 1} more above)" if len(problems) > 1 else "")
        )
    print(
        f"dry run: ready: {world} processes ({nodes} node(s) x {per_node}), global batch {p['global_batch']}, "
        f"peak lr {p['peak_lr']:.4g}, {p['steps_per_epoch']} steps per epoch",
        flush=True,
    )
