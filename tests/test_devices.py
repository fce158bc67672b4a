"""Which GPU each rank trains on: every form of ``trainer.devices``, CUDA_VISIBLE_DEVICES, one GPU per Slurm task.

No GPU here: torch.cuda's answers about the GPUs are stand-ins, and whatever would create a CUDA context raises, so
a test fails if anything does so before Lightning's setup_device selects the rank's own GPU.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.parsing import AttributeDict
from omegaconf import ListConfig

from src.callbacks.run_summary import number_format
from src.core.errors import UserError, user_error_in
from src.distributed.strategy import HydraDDPStrategy, TaskGPU, backend_flags, build_strategy, set_backend_flags
from src.launch import torchrun
from src.launch.devices import local_device_count
from src.training.trainer import build_trainer
from tests.conftest import FAST, output, train
from tests.test_config import make_cfg

# each of these creates a CUDA context on the current device (GPU 0) when called before the rank selects its own
CONTEXT_MAKERS = (
    "current_device",
    "is_bf16_supported",
    "mem_get_info",
    "set_device",
    "synchronize",
    "init",
    "_lazy_init",
)
RANK_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")


def pretend_gpus(monkeypatch, count: int, capability: tuple[int, int] | dict[int, tuple[int, int]] = (9, 0)) -> None:
    """``count`` visible GPUs of compute ``capability`` (or {index: capability}); the context makers raise."""
    capabilities = capability if isinstance(capability, dict) else dict.fromkeys(range(count), capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    def capability_of(device=None):
        index = device.index if isinstance(device, torch.device) else device
        if index is None:  # the current device: a context on GPU 0
            raise AssertionError("get_device_capability() without an index reads the current device")
        return capabilities[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability_of)
    for name in CONTEXT_MAKERS:
        monkeypatch.setattr(torch.cuda, name, _creates_context(name))


def _creates_context(name: str):
    def called(*args, **kwargs):
        raise AssertionError(f"torch.cuda.{name}() creates a CUDA context before the rank selected its GPU")

    return called


@pytest.fixture
def gpus(monkeypatch):
    """pretend_gpus for this test; the global flags building a CUDA Trainer sets (TF32, cuDNN) are put back."""
    for key in RANK_ENV:
        monkeypatch.delenv(key, raising=False)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    flags, benchmark = backend_flags(), torch.backends.cudnn.benchmark
    yield lambda count, capability=(9, 0): pretend_gpus(monkeypatch, count, capability)
    set_backend_flags(flags)
    torch.backends.cudnn.benchmark = benchmark


def gpu_trainer(tmp_path, *overrides: str):
    """The Trainer src.train builds for this config (the real composed config, on CUDA)."""
    cfg = make_cfg(tmp_path, "trainer.accelerator=gpu", "logger=none", "model.arch=resnet18", *overrides)
    return build_trainer(cfg, cfg.model.arch)


@pytest.mark.parametrize(
    ("devices", "count"),
    [([0, 2], 2), (ListConfig([0, 2]), 2), ("0,2", 2), ("1", 1), (3, 3), ("auto", 4), (-1, 4), ("-1", 4)],
)
def test_every_form_of_trainer_devices_counts_its_processes(gpus, devices, count):
    gpus(4)
    assert local_device_count("gpu", devices) == count
    assert local_device_count("auto", devices) == count
    if devices not in ("auto", -1, "-1"):
        assert torchrun._count(devices) == count  # what a torchrun worker matches against --nproc-per-node
    assert isinstance(build_strategy("ddp", accelerator="gpu", devices=devices), HydraDDPStrategy)


@pytest.mark.parametrize("devices", ["[0,2]", "'0,2'"])
def test_local_rank_1_of_gpu_ids_0_and_2_trains_on_cuda_2(gpus, tmp_path, monkeypatch, devices):
    gpus(4, {0: (8, 0), 1: (8, 0), 2: (8, 0), 3: (7, 0)})  # cuda:3 is not among them: it must not decide precision
    for local_rank, device in ((0, "cuda:0"), (1, "cuda:2")):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        trainer = gpu_trainer(tmp_path, "strategy=ddp", f"trainer.devices={devices}")
        assert trainer.strategy.root_device == torch.device(device)
        assert trainer.num_devices == 2 and trainer.precision == "bf16-mixed"
        assert isinstance(trainer.strategy, HydraDDPStrategy)


def test_ids_count_within_cuda_visible_devices_and_one_beyond_them_is_one_line(gpus, tmp_path, monkeypatch):
    gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")  # what the process sees: its GPUs 0 and 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    trainer = gpu_trainer(tmp_path, "strategy=ddp", "trainer.devices=[0,1]")
    assert trainer.strategy.root_device == torch.device("cuda:1")
    with pytest.raises(Exception) as refused:  # noqa: PT011 - Hydra wraps it; src.train's reporting unwraps it
        gpu_trainer(tmp_path, "strategy=ddp", "trainer.devices=[0,2]")
    assert str(user_error_in(refused.value)) == (
        "trainer.devices=[0, 2] names GPU 2, but this node has 2 GPU(s) visible (CUDA_VISIBLE_DEVICES=1,3): ids count "
        "from 0 within the visible GPUs, so use ids 0..1"
    )


@pytest.mark.parametrize(
    ("accelerator", "devices", "message"),
    [
        ("gpu", [1, 1], "trainer.devices=[1, 1] names GPU 1 more than once: every process needs a GPU of its own"),
        (
            "gpu",
            ["a"],
            "trainer.devices=['a'] is not a list of GPU ids: give whole numbers >= 0, e.g. "
            "trainer.devices=[0,2], or a count of devices",
        ),
        (
            "gpu",
            8,
            "trainer.devices=8 asks for 8 GPUs but this node has 4: lower trainer.devices, or use trainer.devices=auto",
        ),
        (
            "cpu",
            "0,1",
            "trainer.devices=0,1 lists GPU ids, but this run is on the CPU (trainer.accelerator=cpu, CUDA "
            "available: True): give a number of processes instead, e.g. trainer.devices=2",
        ),
        (  # before: taken as 2 here, then Lightning's InstantiationException in every rank
            "cpu",
            2.5,
            "trainer.devices=2.5 is not a whole number: give a count >= 1, -1 or auto for all devices, or a list of "
            "GPU ids",
        ),
    ],
)
def test_impossible_gpu_choices_are_one_line_naming_the_key(gpus, accelerator, devices, message):
    gpus(4)
    with pytest.raises(UserError) as refused:
        local_device_count(accelerator, devices)
    assert str(refused.value) == message


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_gpu_run_where_no_cuda_gpu_is_visible_is_one_line_saying_to_run_on_the_cpu(gpus, accelerator):
    gpus(0)  # a machine without one, or CUDA_VISIBLE_DEVICES= empty
    with pytest.raises(UserError) as refused:
        local_device_count(accelerator, 1)
    assert str(refused.value) == (
        f"trainer.accelerator={accelerator} but no CUDA GPU is visible here: use trainer.accelerator=cpu (or auto)"
    )


def test_a_list_of_gpu_ids_for_a_cpu_run_stops_before_training_with_what_to_give_instead(tmp_path):
    result = train(*FAST, "strategy=ddp", "trainer.devices=[0,1]", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, output(result)
    assert output(result).strip().splitlines()[-1] == (
        "error: trainer.devices=[0, 1] lists GPU ids, but this run is on the CPU (trainer.accelerator=cpu, CUDA "
        f"available: {torch.cuda.is_available()}): give a number of processes instead, e.g. trainer.devices=2"
    )
    assert not (tmp_path / "checkpoints").exists()


def srun_task(monkeypatch, local_id: int, per_node: int, nodes: int = 1) -> None:
    """This process as the task srun starts with SLURM_LOCALID=local_id (the variables srun sets for it)."""
    for key, value in {
        "SLURM_JOB_ID": 4242,
        "SLURM_JOB_NAME": "cifar10-ddp",
        "SLURM_STEP_ID": 0,
        "SLURM_NTASKS": per_node * nodes,
        "SLURM_NTASKS_PER_NODE": per_node,
        "SLURM_JOB_NUM_NODES": nodes,
        "SLURM_NNODES": nodes,
        "SLURM_NODEID": 0,
        "SLURM_LOCALID": local_id,
        "SLURM_PROCID": local_id,
        "SLURM_NODELIST": "gpu-node-1",
        "SLURM_JOB_NODELIST": "gpu-node-1",
    }.items():
        monkeypatch.setenv(key, str(value))


def test_srun_tasks_with_one_gpu_each_train_on_their_cuda_0(gpus, tmp_path, monkeypatch):
    """sbatch --ntasks-per-node=4 --gpus-per-task=1: each task sees one GPU, trainer.devices=4 counts the tasks."""
    gpus(1, (7, 0))
    srun_task(monkeypatch, local_id=3, per_node=4)
    trainer = gpu_trainer(tmp_path, "trainer.devices=4")
    assert isinstance(trainer.accelerator, TaskGPU)
    assert trainer.strategy.root_device == torch.device("cuda:0")
    assert (trainer.global_rank, trainer.local_rank, trainer.world_size, trainer.num_devices) == (3, 3, 4, 4)
    assert trainer.strategy.cluster_environment.__class__.__name__ == "SLURMEnvironment"
    assert trainer.precision == "16-mixed"  # read from the task's own GPU, as the run line says
    module = SimpleNamespace(
        memory_format=torch.channels_last, hparams=AttributeDict(arch="resnet18", channels_last="auto")
    )
    assert number_format(trainer, module, "auto") == (
        "precision 16-mixed, channels-last (auto: GPU cuda:0 has compute capability 7.0, below 8.0 bf16 would be "
        "emulated: fp16 with a gradient scaler)"
    )


def test_srun_tasks_that_see_the_nodes_gpus_train_on_cuda_local_rank(gpus, tmp_path, monkeypatch):
    gpus(4)
    srun_task(monkeypatch, local_id=3, per_node=4)
    trainer = gpu_trainer(tmp_path, "trainer.devices=4")
    assert not isinstance(trainer.accelerator, TaskGPU)
    assert trainer.strategy.root_device == torch.device("cuda:3")


def test_one_gpu_is_not_four_outside_srun(gpus):
    """Without srun's tasks, four processes on one GPU is a mistake, told as before."""
    gpus(1)
    with pytest.raises(UserError, match="trainer.devices=4 asks for 4 GPUs but this node has 1"):
        local_device_count("gpu", 4)


BF16_ON_CPU = "Lightning runs bf16-mixed on the cpu, without fp16 AMP"


@pytest.mark.parametrize(
    "asked, runs, note",
    [
        ("16-mixed", "bf16-mixed", f" (trainer.precision=16-mixed: {BF16_ON_CPU})"),
        ("16", "bf16-mixed", f" (trainer.precision=16: {BF16_ON_CPU})"),
        ("bf16", "bf16-mixed", ""),  # Lightning's short name for what runs
        ("32", "32-true", ""),
        ("64-true", "64-true", ""),
    ],
)
def test_the_run_line_says_when_lightning_runs_another_precision_than_asked(asked, runs, note):
    """trainer.precision=16-mixed on a CPU: Lightning runs bf16-mixed, and said so in a raw warning naming its own
    source file; the run line says it instead."""
    trainer = SimpleNamespace(precision=runs, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    module = SimpleNamespace(memory_format=torch.contiguous_format, hparams=AttributeDict(arch="resnet18"))
    assert number_format(trainer, module, asked) == f"precision {runs}, contiguous{note}"
