"""What only a GPU shows: nccl, bf16, channels-last, compile and the device-resident pipeline on CUDA; and several
CUDA ranks on one GPU (one-process nodes over gloo): fit, sharded evaluation, a stopped or stuck rank, an out of
memory, Ctrl-C and resume.

CI has no GPU: every test here skips there, with the reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from src.data.device_batches import DeviceBatches
from tests.conftest import ROOT, SAMPLE, free_port, output, running, train
from tests.test_eval_sharding import EVAL, TESTED, small_test_set  # noqa: F401 - a fixture
from tests.test_gpu_failures import OUT_OF_MEMORY
from tests.test_hangs import HANG, HANG_S, SLEEP, SLEEP_LINE, hang_line
from tests.test_supervision import LONG, error_lines, last_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")

GPU_RUN = [
    "data=synthetic",
    "data.num_train=640",
    "data.num_test=64",
    "data.batch_size=32",
    "model.arch=resnet18",
    "trainer.accelerator=gpu",
    "trainer.devices=1",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.enable_model_summary=false",
]


def test_device_batches_on_the_gpu_are_the_cpu_batches():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (200, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (200,), generator=g)

    def batches(device: str) -> list:
        return list(
            DeviceBatches(
                images, labels, 64, device=torch.device(device), seed=3, shuffle=True, augment=True, drop_last=True
            )
        )

    for (xc, yc), (xg, yg) in zip(batches("cpu"), batches("cuda")):
        assert xg.is_cuda and xg.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(yc, yg.cpu()) and torch.allclose(xc, xg.cpu(), atol=1e-5)


def test_one_gpu_trains_with_nccl_bf16_channels_last_and_the_device_pipeline(tmp_path):
    result = train(*GPU_RUN, "strategy=ddp", "backend=nccl", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, output(result)[-3000:]
    assert "backend nccl" in output(result) and "precision bf16-mixed" in output(result)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("mode", ["true", "reduce-overhead"])
def test_compiled_model_trains_on_the_gpu_with_one_training_and_one_evaluation_graph(mode, tmp_path):
    result = train(
        *GPU_RUN,
        f"model.compile={mode}",
        "trainer.max_epochs=2",
        "data.num_test=40",
        "+callbacks.compile_probe._target_=tests.compile_probe.CompileProbe",
        f"+callbacks.compile_probe.out={tmp_path}",
        f"hydra.run.dir={tmp_path}",
        timeout=900,
    )
    assert result.returncode == 0, output(result)[-3000:]
    marks = json.loads((tmp_path / "compile_rank0.json").read_text())["marks"]
    assert [(m["at"], m["graphs"]) for m in marks] == [("epoch 0", 2), ("epoch 1", 2), ("test", 2)]
    assert marks[-1]["cudagraph_skips"] == 0  # reduce-overhead: every graph replayed as a CUDA graph
    assert f"compiled {'default' if mode == 'true' else mode} (model.compile={mode})" in output(result)


# Several CUDA ranks on the one GPU: one-process nodes over loopback, gloo between them (NCCL refuses two ranks on one
# GPU). Every multi-rank path runs on CUDA tensors but NCCL's own transport.
ON_GPU = ["trainer.accelerator=gpu", "backend=gloo"]
NODES = ["strategy=ddp", "trainer.devices=1"]


def on_gpu(overrides: list[str]) -> list[str]:
    """A CPU test's overrides, on the GPU over gloo."""
    return [o for o in overrides if not o.startswith(("trainer.accelerator=", "backend="))] + ON_GPU


def start_nodes(
    count: int, run_dir: Path, *overrides: str, module: str = "src.train", step: int | None = None
) -> list[subprocess.Popen]:
    """``count`` one-process nodes of one run, node 0 first, each as a shell starts a job (SIGINT at its default);
    with ``step``, return once the run's last.ckpt holds that step."""
    port, args = str(free_port()), [*overrides, *NODES, f"trainer.num_nodes={count}", f"hydra.run.dir={run_dir}"]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            env={**base, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(n)},
        )
        for n in range(count)
    ]
    deadline = time.monotonic() + 180
    while step is not None and last_step(run_dir) < step:
        for node in nodes:
            assert node.poll() is None, node.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run never reached its first checkpoint"
        time.sleep(0.05)
    return nodes


def finish_nodes(nodes: list[subprocess.Popen], limit_s: float) -> tuple[list[str], float]:
    """Every node's output once all have ended, and the seconds that took."""
    start = time.monotonic()
    outs = [node.communicate(timeout=limit_s + 30)[0] for node in nodes]
    return outs, time.monotonic() - start


# the sample's real images: 97 held out for validation, in batches of 16 shards of 49 + 48 images (4 and 3 batches)
SAMPLE_FIT = [
    "data=cifar10",
    f"data.root={SAMPLE}",
    "data.download=false",
    "data.val_size=97",
    "data.batch_size=16",
    "model.arch=resnet18",
    "model.stem=imagenet",
    "model.optimizer.lr=0.05",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=40",
    "trainer.enable_model_summary=false",
    "callbacks.progress_bar=null",
]


def test_two_cuda_ranks_fit_validate_and_test_and_one_checkpoint_evaluates_alike_on_1_2_and_3(small_test_set, tmp_path):
    fit = tmp_path / "fit"
    outs, _ = finish_nodes(start_nodes(2, fit, *on_gpu(SAMPLE_FIT)), 300)
    assert all("error:" not in out and "Traceback" not in out for out in outs), outs[0][-3000:] + outs[1][-3000:]
    assert "Run: 2 node(s) x 1 device(s) = world size 2 | strategy ddp | backend gloo | device cuda" in outs[0]
    record = json.loads((fit / "throughput.json").read_text())
    assert [d["device"] for d in record["rank_devices"]] == ["cuda", "cuda"]
    assert len({d["uuid"] for d in record["rank_devices"]}) == 1  # both on the one GPU
    assert re.search(r"test accuracy [\d.]+ \| .* \| 1000 test images of data=cifar10", outs[0]), outs[0][-3000:]

    checkpoint = fit / "checkpoints" / "last.ckpt"
    results = {}
    for world in (1, 2, 3):
        run_dir = tmp_path / f"eval{world}"
        args = on_gpu(
            [
                *EVAL,
                f"data.root={small_test_set}",
                "data.download=false",
                f"ckpt_path={checkpoint}",
                "trainer.precision=32-true",
            ]
        )
        nodes = start_nodes(world, run_dir, *args, module="src.eval")
        outs, _ = finish_nodes(nodes, 240)
        assert [n.returncode for n in nodes] == [0] * world, outs[0][-3000:]
        results[world] = json.loads((run_dir / "test_metrics.json").read_text())
    # every image once, on CUDA, with float64 loss sums; the accuracy the same; the loss alike: cuDNN picks its
    # convolutions per batch shape, the ranks' batches differ, and on CUDA float32 convolutions run in TF32 (10-bit
    # mantissa: torch's default for cuDNN), so the logits agree to TF32 rounding, not bits (an H100: 2.7e-4 apart)
    assert [r["test/images"] for r in results.values()] == [TESTED] * 3
    correct = [round(r["test/acc"] * TESTED) for r in results.values()]
    assert correct == [correct[0]] * 3
    losses = [r["test/loss"] for r in results.values()]
    assert losses == [pytest.approx(losses[0], rel=1e-3)] * 3


GPU_LONG = on_gpu(LONG)
GPU_HANG = on_gpu(HANG)


def test_a_sigstopped_cuda_rank_is_named_and_killed(tmp_path):
    node0, node1 = start_nodes(2, tmp_path, *GPU_HANG, step=2)
    os.kill(node1.pid, signal.SIGSTOP)
    try:
        outs, seconds = finish_nodes([node0], HANG_S + 30)
    finally:
        if running(node1.pid):
            node1.kill()
    out = outs[0]
    assert node0.returncode == 1 and seconds < HANG_S + 30, out[-3000:]
    line = hang_line(out, 1)
    assert f"pid {node1.pid})" in line and "it cannot run Python (stopped" in line
    node1.communicate(timeout=30)
    assert node1.returncode == -signal.SIGKILL  # killed by the ranks of its host, not by this test
    assert last_step(tmp_path) >= 2 and "Traceback" not in out


def test_a_cuda_rank_stuck_in_python_is_named_with_its_stack(tmp_path):
    node0, node1 = start_nodes(2, tmp_path, *GPU_HANG, *SLEEP, step=2)
    (out0, out1), seconds = finish_nodes([node0, node1], HANG_S + 30)
    assert node0.returncode == node1.returncode == 1 and seconds < HANG_S + 30, (out0[-2000:], out1[-2000:])
    line = hang_line(out1, 1)
    assert "at step 4 of epoch 0, in a training step, while rank 0 waited for it" in line
    assert f"line {SLEEP_LINE} in on_train_batch_start" in (tmp_path / "train_node1_local0.log").read_text()
    assert error_lines(out0) == [f"{line} [on {socket.gethostname()}]; this node's ranks stopped too"], out0[-3000:]


def test_a_cuda_out_of_memory_on_rank_1_is_one_line_naming_the_gpu_and_the_batch(tmp_path):
    node0, node1 = start_nodes(
        2, tmp_path, *GPU_LONG, *OUT_OF_MEMORY, "+callbacks.fault.step=3", "+callbacks.fault.rank=1", step=2
    )
    (out0, out1), seconds = finish_nodes([node0, node1], 60)
    assert node0.returncode == node1.returncode == 1 and seconds < 30, (out0[-2000:], out1[-2000:])
    name = re.escape(torch.cuda.get_device_name(0))
    oom = (
        rf"error: rank 1: CUDA out of memory on cuda:0 \({name}\) at data\.batch_size=4 per device, step 3: "
        r"[\d.]+ GiB in use of [\d.]+ GiB; lower data\.batch_size \(e\.g\. data\.batch_size=2\)"
    )
    assert len(error_lines(out1)) == 1 and re.fullmatch(oom, error_lines(out1)[0]), out1[-3000:]
    assert len(error_lines(out0)) == 1 and re.match(oom, error_lines(out0)[0]), out0[-3000:]
    assert error_lines(out0)[0].endswith("; this node's ranks stopped too")
    assert "Traceback" not in out0 + out1 and last_step(tmp_path) == 2


def test_ctrl_c_on_cuda_ranks_writes_last_ckpt_exits_130_and_the_run_resumes(tmp_path):
    nodes = start_nodes(2, tmp_path, *GPU_LONG, step=2)
    for node in nodes:  # what srun does with a Ctrl-C: every task gets SIGINT
        os.kill(node.pid, signal.SIGINT)
    (out0, out1), seconds = finish_nodes(nodes, 60)
    assert [n.returncode for n in nodes] == [130, 130] and seconds < 60, (out0[-2000:], out1[-2000:])
    lines = [line for line in out0.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1, out0[-3000:]
    stopped = int(re.match(r"interrupted \(Ctrl-C\) at step (\d+) of epoch 0; .*last\.ckpt written", lines[0]).group(1))
    assert last_step(tmp_path) == stopped > 2 and not error_lines(out0 + out1)

    outs, _ = finish_nodes(
        start_nodes(2, tmp_path, *GPU_LONG, "ckpt_path=last", f"trainer.max_steps={stopped + 3}"), 240
    )
    assert [n for n in outs if "error:" in n] == [], outs[0][-3000:]
    assert last_step(tmp_path) == stopped + 3


def test_nccl_at_world_size_1_dumps_its_flight_recorder_into_the_run_dir_and_gpu_check_reads_it(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--only=env,nccl", f"--out={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    nccl = next(s for s in report["steps"] if s["name"] == "nccl")
    assert done.returncode == 0 and nccl["status"] == "passed", done.stdout[-3000:] + done.stderr[-3000:]
    assert nccl["figures"]["nccl_trace_entries"] >= 2, nccl  # the probe's two all-reduces, read back from the dump


def test_batch_size_auto_probes_the_gpu_and_the_batch_it_picks_trains(tmp_path):
    result = train(
        *[o for o in GPU_RUN if not o.startswith(("data.batch_size=", "data.num_train="))],
        "data.num_train=20000",
        "data.batch_size=auto",
        "data.max_batch_size=256",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, output(result)[-3000:]
    found = re.search(
        r"global batch (\d+) \((\d+) per process; auto: the largest power of two up to 256 that fits bf16-mixed "
        r"training in 85% of [\d.]+ GiB \(peak [\d.]+ GiB; probed 64: [\d.]+, 128: [\d.]+, 256: [\d.]+ GiB in "
        r"[\d.]+ s\)\)",
        output(result),
    )
    assert found and found.group(1) == found.group(2) == "256", output(result)[-3000:]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["batch_size"] == 256
    assert json.loads((tmp_path / "throughput.json").read_text())["per_device_batch_size"] == 256
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
