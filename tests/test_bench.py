"""benchmarks/: the project-vs-bare benchmark runs end to end and ends with its ratio line (no speed is asserted); the
benchmarks' arguments are checked before any work."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from src.models.fast_path import fast_path
from tests.conftest import ROOT, run_script


def test_the_benchmark_compares_the_project_with_the_bare_loop_at_equal_settings_and_ends_with_the_ratio_lines(
    tmp_path,
):
    result = run_script(
        "benchmarks/bench.py",
        "--arch=resnet18",
        "--batch-size=4",
        "--steps=3",
        "--warmup=2",
        "--processes=1",
        "--repeats=1",
        "--pipelines=device,dataloader",
        f"--out={tmp_path}",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    rows = {
        tuple(line.strip("| ").split(" | ")[1:3]): line.strip("| ").split(" | ")
        for line in lines
        if line.startswith("| 1 |")
    }
    fmt = fast_path("cpu", "resnet18").label  # the project's defaults here; the bare loop is given the same
    # each data path on both sides; one process: no DDP on either; the bare loop as it comes, once
    loader = "DataLoader, 0 workers"  # data.num_workers=auto on a CPU
    assert set(rows) == {
        ("bare loop", "device"),
        ("project", "device"),
        ("bare loop", loader),
        ("project", loader),
        ("bare loop, its defaults", loader),
    }
    for (run, data), row in rows.items():
        own = run == "bare loop, its defaults"
        assert row[3:6] == (["DDP", "eager", "32-true, contiguous"] if own else ["no DDP", "eager", fmt])
        rate, launch = float(row[6]), float(row[9])
        assert float(row[7]) == rate and rate > 0 and launch > 0  # one run: the best is the only one
        if own:
            assert row[8] == "—"
        else:  # against the bare loop with the same data path
            bare = float(rows["bare loop", data][6])
            ratio = float(row[8])
            assert abs(ratio - rate / bare) <= ratio * (0.05 / rate + 0.05 / bare) + 0.001  # img/s is rounded to 0.1
    assert re.fullmatch(
        r"project/bare throughput ratio at equal settings: \d+\.\d{3} \(project [\d.]+ img/s, bare "
        rf"[\d.]+ img/s, both data.pipeline=device, no DDP, eager, {fmt}, .+ \(\d+ cores\), "
        r"1 process, gloo\)",
        lines[-2],
    ), lines[-2]
    assert re.fullmatch(
        r"what a user gets: project defaults / bare loop defaults: \d+\.\d{3} \(project [\d.]+ img/s "
        rf"with data.pipeline=device, no DDP, eager, {fmt}; bare [\d.]+ img/s with a DataLoader, "
        r"0 workers, DDP, eager, 32-true, contiguous; .+, 1 process, gloo\)",
        lines[-1],
    ), lines[-1]
    summary = json.loads((tmp_path / "bench.json").read_text())  # what make gpu-check reads
    assert f"{summary['ratio']:.3f}" == lines[-2].split(": ")[1].split()[0] and len(summary["rows"]) == 5
    # the project's own run went through python -m src.train and left its records
    assert (tmp_path / "run0" / "project-1-device" / "throughput.json").is_file()
    assert (tmp_path / "run0" / "bare-1-device.json").is_file()


def test_the_step_profile_gives_cpu_times_per_step_of_the_project_and_the_bare_loop_and_no_gpu_figures_on_a_cpu(
    tmp_path,
):
    result = run_script(
        "benchmarks/profile_step.py",
        "--arch=resnet18",
        "--batch-size=4",
        "--steps=3",
        "--warmup=2",
        f"--out={tmp_path}",
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    profile = json.loads((tmp_path / "profile.json").read_text())
    for side in ("project (src.train)", "bare loop"):
        p = profile[side]
        assert p["steps"] == 3 and all(p[f"{name}_ms"] > 0 for name in ("forward", "backward", "optimizer"))
        assert p["outside_ms"] > 0 and p["step_ms"] > p["forward_ms"] + p["backward_ms"] + p["optimizer_ms"]
        assert p["gpu_kernel_ms"] is None and p["host_syncs_per_step"] is None  # n/a on a CPU
    assert profile["bare loop"]["scalar_reads_per_step"] == 0  # it never calls .item()
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| project", "| bare"))]
    assert len(rows) == 2 and all(row.split(" | ")[7:9] == ["n/a", "n/a"] for row in rows)  # GPU kernels, syncs
    table = [line for line in (tmp_path / "profile.md").read_text().splitlines() if line.startswith("|")]
    assert table[2:] == rows  # under the header and its rule


def test_the_precision_comparison_trains_fp32_and_bf16_alike_and_reports_their_test_accuracy(sample_root, tmp_path):
    result = run_script(
        "benchmarks/compare_recipes.py",
        "--compare=precision",
        "--epochs=1",
        "--arch=resnet18",
        "--seeds=7",
        f"--root={sample_root}",
        f"--out={tmp_path}",
        "--",
        "data.batch_size=8",
        "model.width=16",
        "model.stem=imagenet",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=2",
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [
        line.strip("| ").split(" | ") for line in result.stdout.splitlines() if line.startswith(("| fp32", "| bf16"))
    ]
    assert [row[0] for row in rows] == ["fp32", "bf16"]
    for row in rows:
        assert 0 <= float(row[1]) <= 1 and row[1] == row[2]  # one seed: its accuracy is the mean
    assert "not a CIFAR-10 result" in result.stdout.splitlines()[-1]
    for name, precision in (("fp32", "32-true"), ("bf16", "bf16-mixed")):
        record = json.loads((tmp_path / "precision" / f"{name}-seed7" / "throughput.json").read_text())
        assert record["precision"] == precision and record["channels_last"] is True


def test_the_benchmarks_numbers_out_of_range_are_argparses_one_line_before_any_work():
    """Before: control_plane.py --ranks 0 hung after a StopIteration, --ranks abc was a traceback, bench.py
    --batch-size 0 ran its runs to fail in them, and a negative --healthy-s ran. Every benchmark's counts and seconds
    go through these types (benchmarks/arguments.py)."""
    import argparse

    from benchmarks.arguments import names, number, numbers

    assert number(1)("3") == 3 and number(0, float)("0.5") == 0.5 and numbers(2)("16, 64") == "16, 64"
    assert names(("by-hand", "torchrun"))("torchrun, by-hand") == ["torchrun", "by-hand"]
    for parse, text, words in [
        (number(1), "0", "0 must be a whole number >= 1"),
        (number(1), "2.5", "2.5 is not a whole number"),
        (number(0, float), "-1", "-1 must be a number >= 0"),
        (number(0, float), "nan", "nan must be a number >= 0"),
        (numbers(2), "16,0", "0 must be a whole number >= 2"),
        (numbers(2), ",", "give at least one value"),
        (names(("by-hand", "torchrun")), "by-hand,srun", "'by-hand,srun': name by-hand, torchrun or several"),
        (names(("by-hand", "torchrun")), ",", "',': name by-hand, torchrun or several"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(text)
    done = subprocess.run(
        [sys.executable, "benchmarks/control_plane.py", "--ranks", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "control_plane.py: error: argument --ranks: 0 must be a whole number >= 2"
    ), done.stderr[-2000:]
