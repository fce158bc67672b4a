"""`make demo`, as a new user runs it (shortened): one accuracy story, and no line a user can do nothing about."""

from __future__ import annotations

import os
import re
import subprocess

from tests.conftest import ROOT

NOISE = (
    "`weights_only` was not set",
    "The `srun` command is available",
    "LeafSpec",
    "GPU available",
    "TPU available",
    "Initializing distributed",
    "Seed set to",
    "All distributed processes registered",
    "is not supported by the model summary",  # bf16-mixed: the weights are fp32, the size it gives right
    "fontManager",  # matplotlib's first import on a machine (torchmetrics imports it), at INFO
)


def test_make_demo_tests_one_checkpoint_twice_with_the_same_accuracy_and_prints_no_noise(tmp_path):
    demo = tmp_path / "demo"
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "demo",
            f"DEMO_DIR={demo}",
            # shortened: fewer images, and the tests' narrow network (tests/conftest.py's FAST_RUN)
            "DEMO_ARGS=data.num_train=256 trainer.limit_val_batches=2 model.stem=imagenet model.width=16",
        ],
        cwd=ROOT,
        env={**os.environ, "MPLCONFIGDIR": str(tmp_path / "matplotlib")},  # a new user's: no font cache yet
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]
    stories = [line.split("] - ", 1)[1] for line in text.splitlines() if "test accuracy" in line]
    assert len(stories) == 2, text[-4000:]  # the training's test of its best checkpoint, then src.eval's
    # src.eval is given the checkpoint alone: it tests on the run's data (its config.yaml), the same 256 images
    trained, evaluated = (
        re.fullmatch(
            r"test accuracy ([\d.]+) \| test loss ([\d.]+) \| (\S+) \(epoch (\d+), step "
            rf"(\d+)\){tail}",
            s,
        )
        for s, tail in zip(
            stories,
            (
                r" \| 256 test images of data=synthetic",
                rf", resnet18 \| 256 test images of the run's data=synthetic "
                rf"\({demo}/train/config.yaml\)",
            ),
        )
    )
    assert trained and evaluated, stories
    assert trained.group(1, 3, 4, 5) == evaluated.group(1, 3, 4, 5)  # same accuracy, file, epoch and step
    # the loss, a float mean summed in another order (two ranks there, one here), to its printed digits
    assert abs(float(trained.group(2)) - float(evaluated.group(2))) <= 2e-4
    assert re.search(r"/checkpoints/best-epoch\d{3}-acc[\d.]+\.ckpt$", trained.group(3))
    for noise in NOISE:
        assert noise not in text, noise
    assert "Run: 1 node(s) x 2 device(s) = world size 2 | strategy ddp | backend gloo" in text
