"""What a GPU user meets when something fails: a device out of memory ends the run in one line that names the device,
its memory, the batch and the batch to try; trainer.deterministic=true gets cuBLAS's setting, a pool with a
deterministic backward, and one line for an op without one.

The runs are real processes on the CPU, with a torch.OutOfMemoryError raised where a GPU would raise it
(tests/faults.py); CUDA's device names and memory figures are stood in for in-process (no GPU here).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from src.checkpoints.files import read_checkpoint
from src.core.errors import UserError, user_error_in
from src.resilience.out_of_memory import OutOfMemoryReport, describe
from tests.conftest import FAST, descendants, output, run_module, running
from tests.test_supervision import error_lines, finish, last_step, start_and_wait_for_step

# 2,000 images at batch 4: the run is mid-epoch at step 3; last.ckpt every 2 steps, so step 2's is on disk
LONG = [
    *FAST,
    "data.num_train=2000",
    "trainer.limit_train_batches=null",
    "callbacks.last_checkpoint.every_n_train_steps=2",
    "callbacks.progress_bar=null",
    "test=false",
    "trainer.precision=32-true",
]
OUT_OF_MEMORY = [  # a second after reaching step 3: the test waits for step 2's checkpoint with every rank up
    "+callbacks.fault._target_=tests.faults.RaiseAt",
    "+callbacks.fault.error=torch.OutOfMemoryError",
    "+callbacks.fault.delay_s=1",
]
FIX = (
    "lower data.batch_size (e.g. data.batch_size=2), or trainer.precision=bf16-mixed, which also halves the activations"
)


def assert_intact_at_step_2(run_dir: Path) -> None:
    """last.ckpt is the one written before the failing step, whole: it loads, and resumes from step 2."""
    checkpoint = read_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert checkpoint["global_step"] == 2 and checkpoint["state_dict"]
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))


def test_out_of_memory_in_one_process_is_one_line_naming_the_batch_and_the_fix_and_eval_says_the_same(tmp_path):
    run_dir = tmp_path / "run"
    result = run_module("src.train", *LONG, *OUT_OF_MEMORY, "+callbacks.fault.step=3", f"hydra.run.dir={run_dir}")
    text = output(result)
    assert result.returncode == 1, text[-3000:]
    assert error_lines(text) == [f"error: CUDA out of memory on cpu at data.batch_size=4 per device, step 3; {FIX}"], (
        text[-3000:]
    )
    assert "Traceback" not in text and "OutOfMemoryError" in (run_dir / "train.log").read_text()  # torch's, in the log
    assert_intact_at_step_2(run_dir)

    evaluated = run_module(
        "src.eval",
        f"ckpt_path={run_dir}/checkpoints/last.ckpt",
        "data=synthetic",
        "data.num_test=16",
        "data.batch_size=4",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        *OUT_OF_MEMORY,
        "+callbacks.fault.step=0",
        "+callbacks.fault.stage=test",
        f"hydra.run.dir={tmp_path / 'eval'}",
    )
    text = output(evaluated)
    assert evaluated.returncode == 1, text[-3000:]
    assert error_lines(text) == [
        f"error: CUDA out of memory on cpu at data.batch_size=4 per device, in the test; {FIX}"
    ], text[-3000:]


def test_out_of_memory_on_rank_1_stops_every_process_within_30_s_and_keeps_last_ckpt(tmp_path):
    proc = start_and_wait_for_step(
        tmp_path,
        2,
        *LONG,
        *OUT_OF_MEMORY,
        "+callbacks.fault.step=3",
        "+callbacks.fault.rank=1",
        "strategy=ddp",
        "trainer.devices=2",
        ranks=2,
    )
    everyone = [proc.pid, *descendants(proc.pid)]
    out, seconds = finish(proc, everyone, limit_s=30)
    assert proc.returncode == 1 and seconds < 30, out[-3000:]
    assert not [p for p in everyone if running(p)], "processes were left behind"
    assert error_lines(out) == [
        f"error: rank 1: CUDA out of memory on cpu at data.batch_size=4 per device, step 3; {FIX}"
    ], out[-3000:]
    assert "Traceback" not in out
    assert last_step(tmp_path) == 2
    assert_intact_at_step_2(tmp_path)


@pytest.fixture
def h100(monkeypatch):
    """CUDA as it answers on an H100 with 1 GiB of its 79.1 left (stood in: no GPU here)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(1.0 * 2**30), int(79.1 * 2**30)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(77.9 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_the_line_names_the_gpu_its_memory_the_batch_and_half_of_it(h100, monkeypatch):
    assert describe(torch.device("cuda", 1), 1024, "step 37", "bf16-mixed") == (
        "CUDA out of memory on cuda:1 (NVIDIA H100 80GB HBM3) at data.batch_size=1024 per device, step 37: "
        "78.1 GiB in use of 79.1 GiB; lower data.batch_size (e.g. data.batch_size=512)"
    )
    assert describe(torch.device("cuda", 1), 256, "in the test", "32-true").endswith(
        "in the test: 78.1 GiB in use of 79.1 GiB; lower data.batch_size (e.g. data.batch_size=128), "
        "or trainer.precision=bf16-mixed, which also halves the activations"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100: no native bf16
    assert describe(torch.device("cuda", 1), 256, "step 3", "32-true").endswith(
        "or trainer.precision=16-mixed, which also halves the activations"
    )
    # outside any pass (no callback to say more): what CUDA still knows, and the key to change
    assert describe(None) == (
        "CUDA out of memory on cuda:1 (NVIDIA H100 80GB HBM3): 78.1 GiB in use of 79.1 GiB; lower data.batch_size"
    )


def test_without_a_working_cuda_the_line_says_nothing_of_memory_rather_than_fail(h100, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert describe(torch.device("cuda", 0), 64, "step 5", "bf16-mixed") == (
        "CUDA out of memory on cuda:0 (NVIDIA H100 80GB HBM3) at data.batch_size=64 per device, step 5: "
        "77.9 GiB held by this process; lower data.batch_size (e.g. data.batch_size=32)"
    )
    monkeypatch.setattr(torch.cuda, "memory_reserved", broken)
    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    assert describe(torch.device("cuda", 0), 64, "step 5", "bf16-mixed") == (
        "CUDA out of memory on cuda:0 at data.batch_size=64 per device, step 5; lower data.batch_size "
        "(e.g. data.batch_size=32)"
    )
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a machine where CUDA never started
    assert describe(None, 1, None, "bf16-mixed") == (
        "CUDA out of memory at data.batch_size=1 per device; a batch of "
        "one image does not fit: train a smaller model.arch"
    )


def test_the_callback_reads_the_pass_that_ran_out_before_lightning_tears_down():
    import lightning as L
    from lightning.pytorch.trainer.states import RunningStage

    from src.resilience.out_of_memory import LINE, line_for

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="32-true",
    )
    trainer.state.stage = RunningStage.VALIDATING
    other = RuntimeError("while validating")
    OutOfMemoryReport().on_exception(trainer, None, other)
    assert not hasattr(other, LINE)  # not out of memory: nothing read for it
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    wrapped = RuntimeError("a hook failed")  # what a hook's wrapper may raise from it
    wrapped.__cause__ = error
    OutOfMemoryReport().on_exception(trainer, None, wrapped)
    assert line_for(error) == (
        "CUDA out of memory on cpu in the validation after step 0; lower data.batch_size, or "
        "trainer.precision=bf16-mixed, which also halves the activations"
    )


def test_an_op_without_a_deterministic_kernel_is_one_line_offering_warn():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError) as raised:  # torch's own error, for an op that has no such kernel anywhere
            torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))
    finally:
        torch.use_deterministic_algorithms(previous)
    cause = user_error_in(raised.value)
    assert isinstance(cause, UserError) and "\n" not in str(cause)
    assert str(cause) == (
        "put_ has no deterministic implementation, and trainer.deterministic=true allows no other: "
        "pass trainer.deterministic=warn to run it anyway with a warning (Lightning's mode), or "
        "trainer.deterministic=false"
    )


@pytest.mark.parametrize("deterministic", [True, "warn"])
def test_deterministic_sets_cublas_workspace_config_when_the_trainer_is_built(deterministic, monkeypatch):
    """Lightning sets it in every process that builds a Trainer (every rank: the local ranks build their own,
    ddp_spawn's inherit it), before fit runs the first matmul: cuBLAS reads it once, at its first use."""
    import lightning as L

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # so that monkeypatch restores what was there
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        L.Trainer(accelerator="cpu", devices=1, logger=False, deterministic=deterministic)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() == (deterministic == "warn")
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


@pytest.mark.parametrize(
    "deterministic, task, expected",
    [
        (False, ["trainer.devices=1,2"], None),
        (True, [], ":4096:8"),
        (False, ["trainer.deterministic=false,true"], ":4096:8"),
    ],
)
def test_a_sweep_with_deterministic_jobs_sets_cublas_workspace_config_before_its_first_job(
    deterministic, task, expected, monkeypatch
):
    """A sweep runs its jobs in one process: a later deterministic job would find cuBLAS set up by an earlier one."""
    from omegaconf import OmegaConf

    from src.sweeps.sweep import JobIsolation

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # so that monkeypatch restores what was there
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    JobIsolation().on_multirun_start(
        OmegaConf.create({"trainer": {"deterministic": deterministic}, "hydra": {"overrides": {"task": task}}})
    )
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == expected


@pytest.mark.parametrize(
    "arch, stem, size", [("resnet18", "cifar", 32), ("resnet18", "imagenet", 64), ("resnet18", "cifar", 40)]
)
def test_the_resnet_pool_is_adaptive_average_pooling_with_a_deterministic_backward(arch, stem, size):
    from src.models.resnet import GlobalAveragePool, build_resnet

    torch.manual_seed(0)
    net = build_resnet(arch, 10, stem)
    assert isinstance(net.avgpool, GlobalAveragePool)
    reference = nn.AdaptiveAvgPool2d((1, 1))
    for memory_format in (torch.contiguous_format, torch.channels_last):
        features = torch.randn(4, 512, size // 8, size // 8).to(memory_format=memory_format).requires_grad_()
        ours = net.avgpool(features)
        theirs = reference(features)
        assert ours.shape == theirs.shape == (4, 512, 1, 1)
        assert torch.allclose(ours, theirs, atol=1e-6)
        grad = torch.randn_like(ours)
        assert torch.allclose(*(torch.autograd.grad(out, features, grad)[0] for out in (ours, theirs)), atol=1e-7)
    # the whole network, against the same weights with torchvision's pool: same logits, same weight gradients
    images = torch.randn(2, 3, size, size)
    twin = build_resnet(arch, 10, stem)
    twin.load_state_dict(net.state_dict())
    twin.avgpool = reference
    net.eval(), twin.eval()
    logits, twin_logits = net(images), twin(images)
    assert torch.allclose(logits, twin_logits, atol=1e-5)
    logits.sum().backward(), twin_logits.sum().backward()
    assert torch.allclose(net.fc.weight.grad, twin.fc.weight.grad, atol=1e-5)


def test_the_pool_keeps_the_state_dict_keys_so_earlier_checkpoints_load():
    from torchvision import models

    from src.models.resnet import build_resnet

    ours = build_resnet("resnet50", 10, "imagenet")
    torchvision = models.resnet50(weights=None, num_classes=10)
    assert list(ours.state_dict()) == list(torchvision.state_dict())
    ours.load_state_dict(torchvision.state_dict())  # strict: a checkpoint written before the change loads
