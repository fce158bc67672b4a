"""benchmarks/: the project-vs-bare benchmark runs end to end and ends with its ratio line (no speed is asserted)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from src.fast_path import fast_path
from tests.conftest import ROOT


def test_the_benchmark_compares_the_project_with_the_bare_loop_and_ends_with_the_ratio_line(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/bench.py", "--arch=resnet18", "--batch-size=4", "--steps=3",
                             "--warmup=2", "--processes=1", "--repeats=1", "--pipelines=device,dataloader",
                             f"--out={tmp_path}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    rows = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in lines if line.startswith("| 1 |")}
    chosen = fast_path("cpu", "resnet18")  # the project's defaults here; the bare loop is given the same
    fmt = chosen.label
    own_defaults = {"bare DDP loop (DataLoader), its defaults: 32-true, contiguous"} if fmt != "32-true, contiguous" else set()
    assert set(rows) == {f"bare DDP loop (DataLoader), {fmt}", "project, data.pipeline=device, defaults",
                         "project, data.pipeline=dataloader, defaults", *own_defaults}
    bare = float(rows[f"bare DDP loop (DataLoader), {fmt}"][2])
    for row in rows.values():
        rate, ratio, launch = float(row[2]), float(row[4]), float(row[5])
        assert float(row[3]) == rate  # one run: the best is the only one
        assert rate > 0 and launch > 0
        assert abs(ratio - rate / bare) <= ratio * (0.05 / rate + 0.05 / bare) + 0.001  # img/s is rounded to 0.1
    assert re.fullmatch(r"project/bare throughput ratio: \d+\.\d{3} \(project [\d.]+ img/s, bare [\d.]+ img/s, "
                        rf"both {fmt}, .+ \(\d+ cores\), 1 process, gloo\)", lines[-2]), lines[-2]
    assert re.fullmatch(r"what a user gets: project defaults / bare loop defaults: \d+\.\d{3} \(project [\d.]+ img/s "
                        rf"with {fmt}, bare [\d.]+ img/s with 32-true, contiguous, .+, 1 process, gloo\)",
                        lines[-1]), lines[-1]
    # the project's own run went through python -m src.train and left its records
    assert (tmp_path / "run0" / "project-1-device" / "throughput.json").is_file()
    assert (tmp_path / "run0" / "bare-1.json").is_file()


def test_the_precision_comparison_trains_fp32_and_bf16_alike_and_reports_their_test_accuracy(sample_root, tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/compare_recipes.py", "--compare=precision", "--epochs=1",
                             "--arch=resnet18", "--seeds=7", f"--root={sample_root}", f"--out={tmp_path}", "--",
                             "data.batch_size=8", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
                             "trainer.limit_test_batches=2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in result.stdout.splitlines() if line.startswith(("| fp32", "| bf16"))]
    assert [row[0] for row in rows] == ["fp32", "bf16"]
    for row in rows:
        assert 0 <= float(row[1]) <= 1 and row[1] == row[2]  # one seed: its accuracy is the mean
    assert "not a CIFAR-10 result" in result.stdout.splitlines()[-1]
    for name, precision in (("fp32", "32-true"), ("bf16", "bf16-mixed")):
        record = json.loads((tmp_path / "precision" / f"{name}-seed7" / "throughput.json").read_text())
        assert record["precision"] == precision and record["channels_last"] is True
