"""data.batch_size=auto: the largest per-device batch that fits with a margin (probed on CUDA: tests/test_gpu.py),
the recipe's reference batch on a CPU, and a resumed run's checkpoint batch; said in the run line and config.yaml."""

from __future__ import annotations

import yaml

from src.models.batch_size import MARGIN, largest_fitting
from tests.conftest import FAST, output, train

GIB = 2**30


def test_the_probe_keeps_the_largest_batch_within_the_margin_and_stops_at_the_first_that_is_not():
    def measure(batch: int) -> int:  # 1 GiB fixed + 0.1 GiB per 64 images
        measured.append(batch)
        return GIB + batch // 64 * GIB // 10

    measured: list[int] = []
    capacity = 4 * GIB  # room for 4 x (1 - MARGIN) = 3.4 GiB: 1024 images need 2.6, 2048 need 4.2
    assert largest_fitting(measure, capacity, cap=4096)[0] == 1024
    assert measured == [64, 128, 256, 512, 1024, 2048]  # nothing tried beyond the first that did not fit
    assert largest_fitting(measure, capacity, cap=300)[0] == 256  # the cap (data.max_batch_size) holds
    oom_at_512 = lambda batch: None if batch >= 512 else GIB  # noqa: E731 - out of memory: no peak at all
    assert largest_fitting(oom_at_512, capacity, cap=4096) == (256, {64: GIB, 128: GIB, 256: GIB, 512: None})
    assert largest_fitting(measure, GIB, cap=4096)[0] is None  # not even the first fits
    assert 0 < MARGIN < 0.5


def test_auto_is_the_reference_batch_on_a_cpu_and_a_resumed_run_keeps_its_checkpoints_batch(tmp_path):
    fresh = train(
        *FAST,
        "data.batch_size=auto",
        "data.num_train=300",
        "trainer.limit_train_batches=1",
        "test=false",
        f"hydra.run.dir={tmp_path / 'fresh'}",
    )
    assert fresh.returncode == 0, output(fresh)[-3000:]
    assert "global batch 128 (128 per process; auto: the recipe's reference batch on a CPU" in output(fresh)
    assert yaml.safe_load((tmp_path / "fresh" / "config.yaml").read_text())["data"]["batch_size"] == 128

    run = tmp_path / "resumed"
    first = train(*FAST, "test=false", f"hydra.run.dir={run}")  # data.batch_size=4
    assert first.returncode == 0, output(first)[-3000:]
    resumed = train(
        *FAST, "data.batch_size=auto", "trainer.max_epochs=2", "ckpt_path=last", "test=false", f"hydra.run.dir={run}"
    )
    assert resumed.returncode == 0, output(resumed)[-3000:]
    assert "global batch 4 (4 per process; auto: the checkpoint's batch, as the run resumes)" in output(resumed)
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["batch_size"] == 4
