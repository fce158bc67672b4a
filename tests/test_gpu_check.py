"""benchmarks/gpu_check.py (make gpu-check): its CPU mode runs every step end to end and reports each with a status;
without CUDA, or without a package it needs, it says so in one line; a step that would overrun the budget is skipped
and one that runs past its time is stopped with every process it started."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from benchmarks.gpu_check import (
    ESTIMATE_S,
    SERIAL_GPU_TESTS_S,
    STEPS,
    GpuCheck,
    StepFailed,
    estimate_s,
    tail,
    xdist_options,
)
from src.models.fast_path import cpu_model
from tests.conftest import ROOT, cmdline, descendants, run_script, running


def gpu_check(*args: str, device: str | None = "cpu", timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_DEVICE"}
    env.update({"GPU_CHECK_DEVICE": device} if device else {})
    return run_script("benchmarks/gpu_check.py", *args, env=env, timeout=timeout)


def test_the_cpu_mode_runs_every_step_and_reports_each_with_its_status_seconds_commands_and_figures(tmp_path):
    # compile (inductor on 2 cores: over a minute) and bench (tests/test_bench.py runs it) are left out to save time
    started = time.strftime("%Y-%m-%d")
    result = gpu_check(f"--out={tmp_path}", "--batches=4", "--skip=compile,bench", "--tests=tests/test_gpu.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["mode"], report["status"], report["torch"]) == ("cpu", "passed", torch.__version__)
    # the day the check began or the next (a check that runs past midnight)
    assert report["date"] in (started, time.strftime("%Y-%m-%d")) and cpu_model() in report["device"]
    steps = {step["name"]: step for step in report["steps"]}
    assert list(steps) == list(STEPS)
    for name, step in steps.items():
        assert step["status"] == ("skipped" if name in ("compile", "bench") else "passed"), step
        assert step["seconds"] >= 0 and step["summary" if step["status"] == "passed" else "note"]
        assert bool(step["commands"]) == (step["status"] == "passed")
    assert steps["compile"]["note"] == "left out (--only, --skip)"
    figures = {name: step["figures"] for name, step in steps.items()}
    assert (figures["nccl"]["backend"], figures["nccl"]["world_size"]) == ("gloo", 1)  # CPU mode: gloo for nccl
    assert figures["deterministic"]["identical"] and figures["deterministic"]["tensors"] > 0
    assert figures["resume"]["global_step_after_resume"] == 2 * figures["resume"]["first_run_steps"]
    assert 0 <= figures["eval"]["test/acc"] <= 1
    assert figures["two-rank"]["world_size"] == 2 and len(set(figures["two-rank"]["pids"])) == 2
    tests = figures["tests"]
    assert tests["failed"] == tests["errors"] == 0 and tests["skipped"] > 0  # test_gpu.py skips without CUDA
    rows = figures["throughput"]["rows"]
    assert [(r["pipeline"], r["batch"], r["status"]) for r in rows] == [
        ("device", 4, "passed"),
        ("dataloader", 4, "passed"),
    ]
    for row in rows:
        assert row["images_per_second"] > 0 and row["steps_measured"] == 3
        assert (row["precision"], row["channels_last"]) == ("32-true", True)  # the GPU's bf16 does not apply
        assert row["checkpoint_share"] is None or 0 <= row["checkpoint_share"] < 1
        assert f"data.pipeline={row['pipeline']}" in row["command"]
    md = (tmp_path / "report.md").read_text()
    assert md.startswith(f"# gpu-check: {report['device']}, torch {torch.__version__}")
    for name, step in steps.items():
        assert f"| {name} | {step['status']} |" in md
    assert "| device | 4 | no |" in md and "| dataloader | 4 | no |" in md
    assert result.stdout.splitlines()[-2].startswith("gpu-check on ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_without_cuda_it_says_so_in_one_line_and_exits_2():
    result = gpu_check(device=None, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: no CUDA GPU is visible here (torch ")
    assert "GPU_CHECK_DEVICE=cpu" in result.stderr


def test_a_missing_hydra_is_one_line_naming_what_to_install_and_nothing_runs(tmp_path):
    script = (
        "import runpy, sys; sys.modules['hydra'] = None; sys.argv = ['benchmarks/gpu_check.py', "
        f"'--out={tmp_path}']; sys.exit(runpy.run_path('benchmarks/gpu_check.py', run_name='__main__'))"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: make gpu-check needs hydra-core, ")
    assert "pip install hydra-core" in result.stderr and not (tmp_path / "report.json").exists()


def test_it_runs_where_the_project_is_not_installed(tmp_path):
    # a GPU node runs it with its own torch, from a clone: this venv's editable install of the project is hidden
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "GPU_CHECK_DEVICE": "cpu"}
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--only=env", f"--out={tmp_path / 'out'}"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    steps = {s["name"]: s["status"] for s in json.loads((tmp_path / "out" / "report.json").read_text())["steps"]}
    assert steps["env"] == "passed"
    hidden = subprocess.run([sys.executable, "-c", "import src"], cwd=tmp_path, env=env, capture_output=True)
    assert hidden.returncode == 1  # the project was not importable but through the script's own path


def test_an_unknown_step_or_device_is_one_line_before_anything_runs(tmp_path):
    for args, device, line in (
        (["--only=speed"], "cpu", "error: --only names unknown steps (speed): the steps are env, "),
        (["--skip=nccl,speed"], "cpu", "error: --skip names unknown steps (speed): "),
        ([], "tpu", "error: GPU_CHECK_DEVICE=tpu is not known: "),
    ):
        result = gpu_check(f"--out={tmp_path}", *args, device=device, timeout=60)
        assert result.returncode == 2 and result.stdout == "", result.stderr
        assert result.stderr.count("\n") == 1 and result.stderr.startswith(line), result.stderr
    assert not (tmp_path / "report.json").exists()


def test_a_step_that_would_overrun_the_budget_is_skipped_with_a_note(tmp_path):
    result = gpu_check(f"--out={tmp_path}", "--only=nccl", "--budget-s=5", timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = {step["name"]: step for step in json.loads((tmp_path / "report.json").read_text())["steps"]}
    assert steps["env"]["status"] == "passed"
    assert steps["nccl"]["status"] == "skipped" and steps["nccl"]["note"].startswith("would overrun the time budget")
    assert "--only nccl" in steps["nccl"]["note"] and not steps["nccl"]["commands"]
    assert all(
        step["note"] == "left out (--only, --skip)" for name, step in steps.items() if name not in ("env", "nccl")
    )


def test_on_a_gpu_the_tests_run_on_a_worker_per_two_cores_and_the_budget_plans_for_how_they_run(monkeypatch):
    for cores, cuda, options in ((16, True, ["-n", "8"]), (64, True, ["-n", "8"]), (6, True, ["-n", "3"])) + (
        (3, True, []),  # one worker: no pytest-xdist
        (16, False, []),  # the CPU mode, a test of the CPU suite: one process
    ):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert xdist_options(cuda) == options, (cores, cuda)
        # the budget plans the step by how it will run: one process on a GPU takes about twice as long
        serial = cuda and not options
        assert estimate_s("tests", cuda) == (SERIAL_GPU_TESTS_S if serial else ESTIMATE_S["tests"][not cuda])
        assert estimate_s("nccl", cuda) == ESTIMATE_S["nccl"][not cuda]


def test_a_command_past_its_time_is_stopped_with_every_process_it_started(tmp_path):
    args = argparse.Namespace(out=tmp_path, budget_s=120, batches=None, tests="")
    check = GpuCheck(args, cuda=False, info={})
    step = {"commands": []}
    began = time.time()
    with pytest.raises(StepFailed) as stopped:  # a child that starts its own child, as src.train starts its ranks
        check.execute(step, "sleeper", ["bash", "-c", "sleep 300 & echo $!; wait"], timeout=2)
    assert stopped.value.timed_out and "ran past its 2 s" in str(stopped.value)
    assert time.time() - began < 30
    grandchild = int(tail(stopped.value.log).split()[0])
    gone_by = time.monotonic() + 5  # killed by then: a signal lands when the process next runs
    while running(grandchild) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not running(grandchild)
    assert step["commands"] == ["bash -c 'sleep 300 & echo $!; wait'"]


def test_sigterm_stops_the_check_and_the_run_under_way_and_keeps_the_report(tmp_path):
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu"}
    check = subprocess.Popen(
        [sys.executable, "benchmarks/gpu_check.py", "--only=deterministic", f"--out={tmp_path}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (runs := [p for p in descendants(check.pid) if "src.train" in cmdline(p)]) and time.time() < deadline:
        time.sleep(0.2)
    assert runs, "no src.train run started"
    check.send_signal(signal.SIGTERM)
    _, err = check.communicate(timeout=60)
    assert check.returncode == 130 and err.startswith("\ninterrupted: the report so far is in ")
    assert not any(running(p) for p in runs)
    steps = {step["name"]: step for step in json.loads((tmp_path / "report.json").read_text())["steps"]}
    assert (steps["deterministic"]["status"], steps["deterministic"]["note"]) == ("failed", "interrupted")
