"""What only a GPU shows: nccl, bf16, channels-last, compile and the device-resident pipeline on CUDA.

CI has no GPU: every test here skips there, with the reason.
"""

from __future__ import annotations

import json

import pytest
import torch

from src.data.device_batches import DeviceBatches
from tests.conftest import output, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")

GPU_RUN = ["data=synthetic", "data.num_train=640", "data.num_test=64", "data.batch_size=32", "model.arch=resnet18",
           "trainer.accelerator=gpu", "trainer.devices=1", "trainer.max_epochs=1", "trainer.limit_train_batches=8",
           "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "trainer.enable_model_summary=false"]


def test_device_batches_on_the_gpu_are_the_cpu_batches():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (200, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (200,), generator=g)

    def batches(device: str) -> list:
        return list(DeviceBatches(images, labels, 64, device=torch.device(device), seed=3, shuffle=True,
                                  augment=True, drop_last=True))

    for (xc, yc), (xg, yg) in zip(batches("cpu"), batches("cuda")):
        assert xg.is_cuda and xg.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(yc, yg.cpu()) and torch.allclose(xc, xg.cpu(), atol=1e-5)


def test_one_gpu_trains_with_nccl_bf16_channels_last_and_the_device_pipeline(tmp_path):
    result = train(*GPU_RUN, "strategy=ddp", "backend=nccl", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, output(result)[-3000:]
    assert "backend nccl" in output(result) and "precision bf16-mixed" in output(result)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_compiled_model_trains_on_the_gpu_with_one_training_and_one_evaluation_graph(tmp_path):
    result = train(*GPU_RUN, "model.compile=true", "trainer.max_epochs=2", "data.num_test=40",
                   "+callbacks.compile_probe._target_=tests.compile_probe.CompileProbe",
                   f"+callbacks.compile_probe.out={tmp_path}", f"hydra.run.dir={tmp_path}", timeout=900)
    assert result.returncode == 0, output(result)[-3000:]
    marks = json.loads((tmp_path / "compile_rank0.json").read_text())["marks"]
    assert [(m["at"], m["graphs"]) for m in marks] == [("epoch 0", 2), ("epoch 1", 2), ("test", 2)]
