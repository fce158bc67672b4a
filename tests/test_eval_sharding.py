"""Validation and test count every image once at any world size: src.eval of one checkpoint agrees at 1, 2 and 3."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

from src.data.device_batches import DeviceBatches, shard_indices
from tests.conftest import free_port, output, run_module

CPU = torch.device("cpu")
TESTED = 25  # in batches of 4: shards of 13 + 12 images at world size 2, 9 + 8 + 8 at 3; rank 0 has a batch more
EVAL = ["data.batch_size=4", "trainer.accelerator=cpu", "backend=gloo", "logger=csv"]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_evaluation_shards_hold_each_image_once_as_lightnings_unrepeated_sampler_does(world):
    n = 13
    images, labels = torch.zeros(n, 3, 8, 8, dtype=torch.uint8), torch.arange(n)
    seen = []
    for rank in range(world):
        sampler = UnrepeatedDistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)
        assert shard_indices(n, rank, world, epoch=0, seed=0, shuffle=False, pad=False).tolist() == list(sampler)
        batches = DeviceBatches(images, labels, 4, device=CPU, rank=rank, world_size=world, pad_shards=False)
        shard = [label for _, batch in batches for label in batch.tolist()]
        assert len(batches) == -(-len(sampler) // 4)  # its batch count is the one it yields
        seen += shard
    assert sorted(seen) == list(range(n))
    padded = [i for rank in range(world) for i in shard_indices(n, rank, world, 0, 0, shuffle=False).tolist()]
    assert len(padded) == -(-n // world) * world  # training keeps DistributedSampler's equal shards


@pytest.fixture
def small_test_set(sample_root: Path, tmp_path: Path) -> Path:
    """data.root with the sample's training batches and its first TESTED test images as the test set (the test skips
    where the sample is not: a GPU node without ../shared)."""
    folder = tmp_path / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["batches.meta"]:
        (folder / name).symlink_to(sample_root / "cifar-10-batches-py" / name)
    with open(sample_root / "cifar-10-batches-py" / "test_batch", "rb") as f:
        test = pickle.load(f, encoding="latin1")
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"data": test["data"][:TESTED], "labels": test["labels"][:TESTED], "batch_label": "test"}, f)
    return folder.parent


def evaluate(
    checkpoint: Path,
    data_root: Path,
    run_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    background: bool = False,
):
    return run_module(
        "src.eval",
        *EVAL,
        f"data.root={data_root}",
        "data.download=false",
        f"ckpt_path={checkpoint}",
        f"hydra.run.dir={run_dir}",
        *extra,
        env=env,
        background=background,
        timeout=240,
    )


def test_one_checkpoint_gives_the_same_count_accuracy_and_loss_at_world_sizes_1_2_and_3(
    sample_checkpoint, small_test_set, tmp_path
):
    checkpoint = sample_checkpoint / "checkpoints" / "last.ckpt"
    results = {}
    one = evaluate(checkpoint, small_test_set, tmp_path / "1")
    assert one.returncode == 0, output(one)[-4000:]
    results[1] = json.loads((tmp_path / "1" / "test_metrics.json").read_text())
    # two local processes through the DataLoader pipeline (Lightning's sampler replaced by an unrepeated one) ...
    two = evaluate(
        checkpoint, small_test_set, tmp_path / "2", "strategy=ddp", "trainer.devices=2", "data.pipeline=dataloader"
    )
    assert two.returncode == 0, output(two)[-4000:]
    assert (tmp_path / "2" / "eval_node0_local1.log").is_file()  # the second process joined
    results[2] = json.loads((tmp_path / "2" / "test_metrics.json").read_text())
    # ... and three one-process nodes over loopback through the device pipeline: rank 0 tests one batch more
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = ["strategy=ddp", "trainer.devices=1", "trainer.num_nodes=3"]
    others = [
        evaluate(checkpoint, small_test_set, tmp_path / "3", *args, env={**env, "NODE_RANK": str(r)}, background=True)
        for r in (1, 2)
    ]
    three = evaluate(checkpoint, small_test_set, tmp_path / "3", *args, env={**env, "NODE_RANK": "0"})
    for node in others:
        out, _ = node.communicate(timeout=240)
        assert node.returncode == 0, out[-4000:]
    assert three.returncode == 0, output(three)[-4000:]
    assert [(tmp_path / "3" / f"eval_node{r}_local0.log").is_file() for r in (1, 2)] == [True, True]
    assert "sync_dist" not in output(two) + output(three)  # Lightning's advice to reduce reduced values again
    results[3] = json.loads((tmp_path / "3" / "test_metrics.json").read_text())

    assert [r["test/images"] for r in results.values()] == [TESTED] * 3
    correct = [round(r["test/acc"] * r["test/images"]) for r in results.values()]
    assert correct == [correct[0]] * 3 and abs(results[1]["test/acc"] * TESTED - correct[0]) < 1e-4
    assert 0 < correct[0] < TESTED  # a model with something to get right and wrong
    # the mean loss of the same 25 images: in fp32 a logit's last bits differ with the batch's shape (oneDNN picks its
    # kernel by it), 1.4e-6 apart at most seen; one image lost or counted twice moves it by about a hundredth
    assert max(r["test/loss"] for r in results.values()) - min(r["test/loss"] for r in results.values()) <= 1e-5
