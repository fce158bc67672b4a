"""benchmarks/: the project-vs-bare benchmark runs end to end and ends with its ratio line (no speed is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_the_benchmark_compares_the_project_with_the_bare_loop_and_ends_with_the_ratio_line(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/bench.py", "--arch=resnet18", "--batch-size=4", "--steps=3",
                             "--warmup=2", "--processes=1", "--repeats=1", "--pipelines=device,dataloader",
                             f"--out={tmp_path}"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    rows = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in lines if line.startswith("| 1 |")}
    assert set(rows) == {"bare DDP loop (DataLoader)", "project, data.pipeline=device",
                         "project, data.pipeline=dataloader"}
    bare = float(rows["bare DDP loop (DataLoader)"][2])
    for row in rows.values():
        rate, ratio, launch = float(row[2]), float(row[4]), float(row[5])
        assert float(row[3]) == rate  # one run: the best is the only one
        assert rate > 0 and launch > 0
        assert abs(ratio - rate / bare) <= ratio * (0.05 / rate + 0.05 / bare) + 0.001  # img/s is rounded to 0.1
    assert re.fullmatch(r"project/bare throughput ratio: \d+\.\d{3} \(project [\d.]+ img/s, bare [\d.]+ img/s, "
                        r".+ \(\d+ cores\), 1 process, gloo\)", lines[-1]), lines[-1]
    # the project's own run went through python -m src.train and left its records
    assert (tmp_path / "run0" / "project-1-device" / "throughput.json").is_file()
    assert (tmp_path / "run0" / "bare-1.json").is_file()
