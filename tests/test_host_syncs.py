"""No steady-state training step makes the host wait for the GPU (tests/host_syncs.py finds such waits on a CPU; on
CUDA the same steps run under torch.cuda.set_sync_debug_mode("error")). A log step may wait, once every
trainer.log_every_n_steps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import FAST_RUN, output, train
from tests.host_syncs import _DispatchLevel, _FunctionLevel, _mark, _Recorder

# 16 steps; steps 3..12 recorded, step 7 a log step (Lightning logs where (step + 1) % 8 == 0). The throughput
# record's first window opens (a sync, once) at its warm-up's end: after step 2, before the recorded steps.
PROBED = [
    "data=synthetic",
    "data.num_train=400",
    "data.num_test=16",
    "data.batch_size=8",
    "model.arch=resnet18",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=16",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=8",
    "trainer.enable_model_summary=false",
    "test=false",
    "callbacks.throughput_record.warmup_steps=2",
    "+callbacks.host_syncs._target_=tests.host_syncs.HostSyncProbe",
    "+callbacks.host_syncs.first_step=3",
    "+callbacks.host_syncs.steps=10",
]


# on a CPU, the tests' narrow network (tests/conftest.py's FAST_RUN): a step's waits come from the code around the
# network, not from its width; the GPU cases keep torchvision's ResNet-18
NARROW = [item for item in FAST_RUN if item.startswith(("model.stem=", "model.width="))]


def test_the_probe_names_every_kind_of_wait_on_device_tensors_and_none_on_host_tensors():
    recorder = _Recorder(torch.device("cpu"))
    recorder.armed = True
    x, labels, host = torch.randn(8), torch.arange(8) % 3, torch.randn(8)
    _mark([x, labels])
    with _FunctionLevel(recorder), _DispatchLevel(recorder):
        y = (x * 2).relu().sum()  # stays on the device: nothing to wait for
        expected_silent = len(recorder.found)
        y.item()
        bool(x.sum() > 0)
        float(y)
        x.nonzero()
        x[x > 0]
        torch.unique(labels)
        torch.bincount(labels)
        torch.equal(x, x)
        torch.masked_select(x, x > 0)
        torch.repeat_interleave(x, labels)
        x.tolist()
        x.numpy()
        x.cpu()
        torch.as_tensor(3.0, device=torch.device("cpu"))
        host.to("cpu")
        host.sum().item(), host.nonzero(), host.tolist(), torch.unique(host)  # host tensors: no device to wait for
        x.to(torch.float64)  # a cast stays on the device
    ops = [found["op"] for found in recorder.found]
    assert expected_silent == 0
    assert [op.split(" (")[0] for op in ops] == [
        "item/bool/int/float of a tensor",
        "item/bool/int/float of a tensor",
        "item/bool/int/float of a tensor",
        "nonzero",
        "index with a boolean mask",
        "unique",
        "bincount",
        "torch.equal",
        "masked_select",
        "repeat_interleave without output_size",
        "Tensor.tolist() of a device tensor",
        "Tensor.numpy() of a device tensor",
        "Tensor.cpu() of a device tensor",
        "torch.as_tensor(<python data>, device=...)",
        "Tensor.to(device) of a host tensor without non_blocking",
    ], ops
    assert all("test_host_syncs.py" in found["stack"][-1] for found in recorder.found)  # the line that waited


@pytest.mark.parametrize(
    "device, layout",
    [
        ("cpu", ["trainer.accelerator=cpu", *NARROW]),
        ("cpu", ["trainer.accelerator=cpu", *NARROW, "strategy=ddp", "trainer.devices=2"]),
        pytest.param(
            "cuda",
            ["trainer.accelerator=gpu", "trainer.devices=1"],
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
        ),
        pytest.param(
            "cuda",
            ["trainer.accelerator=gpu", "trainer.devices=1", "model.compile=reduce-overhead"],
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
        ),
    ],
    ids=["cpu-one-process", "cpu-ddp-2", "cuda-sync-debug-error", "cuda-graphs-sync-debug-error"],
)
def test_steady_state_training_steps_wait_for_the_device_only_at_log_steps(tmp_path, device, layout):
    result = train(*PROBED, *layout, f"hydra.run.dir={tmp_path}", f"+callbacks.host_syncs.out={tmp_path}/syncs.json")
    assert result.returncode == 0, output(result)[-3000:]  # on CUDA a wait raises under set_sync_debug_mode("error")
    reports = sorted(tmp_path.glob("syncs*.json"))
    assert len(reports) == (2 if "trainer.devices=2" in layout else 1)
    for report in reports:
        record = json.loads(report.read_text())
        assert record["device"].startswith(device)
        steps = record["steps"]
        assert [s["step"] for s in steps] == list(range(3, 13))
        assert [s["step"] for s in steps if s["log_step"]] == [7]
        waits = [
            (s["step"], found["op"], "\n    ".join(found["stack"]))
            for s in steps
            if not s["log_step"]
            for found in s["found"]
        ]
        assert not waits, f"{report.name}: a steady-state step waits for the device:\n" + "\n".join(
            f"step {step}: {op}\n    {stack}" for step, op, stack in waits[:5]
        )
        # the probe sees the waits there are: Lightning turns the logged values into numbers at the log step
        assert any(
            found["op"].startswith("item/bool/int/float") for s in steps if s["log_step"] for found in s["found"]
        )


def test_the_training_loss_metric_weighs_every_image_once():
    from src.models.classifier import ImageClassifier

    model = ImageClassifier(arch="resnet18")
    losses, sizes = [torch.tensor(1.0), torch.tensor(4.0)], [3, 1]
    for loss, n in zip(losses, sizes):
        model.train_loss.update(loss.expand(n))
    assert float(model.train_loss.compute()) == pytest.approx(np.average([1.0, 4.0], weights=sizes))
