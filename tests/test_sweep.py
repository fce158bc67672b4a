"""Hydra multirun sweeps over device counts with ddp and ddp_spawn, throughput.json and the scaling report."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import time
import warnings
from pathlib import Path

import matplotlib.image
import pytest
import torch
from PIL import Image

from src.sweeps.report import load_jobs, scaling_mode, write_report
from tests.conftest import FAST, ROOT, output, run_module, train
from tests.faults import hold_sweep_job
from tests.test_security import assert_loopback_only
from tests.test_serving import watch_listeners

SWEEP = [*FAST, "trainer.limit_train_batches=3", "test=false"]


def outputs_snapshot() -> set[Path]:
    """What is under the project's outputs/, but for what make test's other workers write there meanwhile (Slurm
    jobs, torchrun's run dirs)."""
    runs = ROOT / "outputs" / "runs"
    return {
        p
        for p in (ROOT / "outputs").rglob("*")
        if not p.is_relative_to(ROOT / "outputs" / "slurm")
        and "torchrun-" not in str(p)
        and p not in (runs, *runs.glob("*"))
    }  # the date folder a torchrun run dir goes in (what it holds counts)


def assert_no_process_mentions(text: str) -> None:
    found = subprocess.run(["pgrep", "-af", text], capture_output=True, text=True).stdout
    assert not found.strip(), f"processes left behind:\n{found}"


def job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: p.name)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_device_sweep_runs_each_job_with_exactly_its_processes_and_reports(strategy, tmp_path):
    sweep_dir = tmp_path / "sweep"
    before = outputs_snapshot()
    result = train("-m", *SWEEP, "trainer.devices=1,2", f"strategy={strategy}", f"hydra.sweep.dir={sweep_dir}")
    assert result.returncode == 0, output(result)[-4000:]
    assert [p.name for p in job_dirs(sweep_dir)] == ["0", "1"]
    for devices, job in zip((1, 2), job_dirs(sweep_dir)):
        record = json.loads((job / "throughput.json").read_text())
        assert record["world_size"] == record["devices"] == devices == len(set(record["pids"]))
        assert record["strategy"] == strategy and record["backend"] == "gloo"
        assert record["global_batch_size"] == 4 * devices and record["samples_per_second"] > 0
        assert record["steps_measured"] >= 1 and record["peak_memory_mb"] > 0
        assert [p.relative_to(job) for p in job.rglob("last.ckpt")] == [Path("checkpoints/last.ckpt")]
    assert [p.name for p in tmp_path.iterdir()] == ["sweep"]  # nothing created beside the sweep dir
    assert outputs_snapshot() == before  # ... nor under the project's outputs/
    rows = list(csv.DictReader((sweep_dir / "scaling.csv").open()))
    assert [int(r["world_size"]) for r in rows] == [1, 2]
    assert float(rows[0]["speedup"]) == 1.0 and float(rows[1]["speedup"]) > 0
    assert "weak scaling" in (sweep_dir / "scaling.md").read_text()
    assert matplotlib.image.imread(sweep_dir / "scaling.png").shape[2] in (3, 4)
    picture = Image.open(sweep_dir / "scaling.png").text  # the title and legend, as the PNG carries them
    precision = json.loads((job_dirs(sweep_dir)[0] / "throughput.json").read_text())["precision"]
    assert picture["Title"].startswith("resnet18 · 1–2 processes on ")
    assert picture["Title"].endswith(f" · gloo · {precision} · batch 4 per device")
    assert picture["Description"] == "series: measured; ideal linear"
    assert_no_process_mentions(str(sweep_dir))


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_failing_job_is_reported_and_the_sweep_goes_on(strategy, tmp_path):
    """Under ``ddp_spawn`` the sweep's process is no rank, and the group's record of the failure goes with the ranks:
    before, the job's record and the sweep's last line said only ``a rank of this job failed: see its log``."""
    sweep_dir = tmp_path / "sweep"
    # job 0's rank 0 raises at its first step; job 1 names a rank its world of two lacks, so it never does (a value
    # either job refuses as it starts is refused before the first: the test below)
    fault = ["+callbacks.fault._target_=tests.faults.RaiseAt", "+callbacks.fault.step=0", "+callbacks.fault.rank=0,5"]
    result = train("-m", *SWEEP, *fault, "trainer.devices=2", f"strategy={strategy}", f"hydra.sweep.dir={sweep_dir}")
    assert result.returncode == 1, output(result)[-4000:]
    said = "error: 1 of 2 jobs failed: job 0: rank 0: RuntimeError: injected failure at step 0 (traceback in"
    assert said in result.stderr
    failed, ok = job_dirs(sweep_dir)
    assert "injected failure at step 0" in json.loads((failed / "failure.json").read_text())["error"]
    assert len(set(json.loads((ok / "throughput.json").read_text())["pids"])) == 2
    report = (sweep_dir / "scaling.md").read_text()
    assert "## Failed jobs" in report and "job 0" in report
    assert len(list(csv.DictReader((sweep_dir / "scaling.csv").open()))) == 1
    assert_no_process_mentions(str(sweep_dir))


def test_a_value_every_command_checks_refuses_the_sweep_before_its_first_job_and_takes_its_dir_back(tmp_path):
    """Before, job 1's trainer.max_epochs=0 was refused once job 0 had trained, and the sweep dir stayed behind
    a sweep refused before any job (its multirun.yaml and lock). So was a job of two nodes in a Slurm batch script."""
    sweep_dir = tmp_path / "new" / "sweep"
    result = train("-m", *SWEEP, "trainer.max_epochs=1,0", f"hydra.sweep.dir={sweep_dir}")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, output(result)[-3000:]
    assert errors[0].startswith("error: job 1 (trainer.max_epochs=0") and "no job of the sweep started" in errors[0]
    assert "Run:" not in output(result) and not (tmp_path / "new").exists()  # nothing trained; its dirs gone
    # a sweep dir that was there before: kept, as it was; and a value only building the model checks, found before
    # any job too (before: by the job that built it)
    (tmp_path / "mine").mkdir()
    result = train("-m", *SWEEP, "model.optimizer.lr=-0.1,0.1", f"hydra.sweep.dir={tmp_path / 'mine'}")
    said = "error: job 0 (model.optimizer.lr=-0.1): model.optimizer.lr=-0.1 must be a number >= 0; no job of the sweep"
    assert result.returncode == 2 and said in result.stderr, output(result)[-3000:]
    assert "Run:" not in output(result) and (tmp_path / "mine").is_dir()
    # what the job's first process checks as it starts its ranks: before, job 0 trained, then job 1 was refused
    result = train("-m", *SWEEP, "backend=gloo,nccl", f"hydra.sweep.dir={tmp_path}/nccl")
    said = "error: job 1 (backend=nccl): backend=nccl needs CUDA GPUs, but this run is on the CPU"
    assert result.returncode == 2 and result.stderr.startswith(said), output(result)[-3000:]
    assert "Run:" not in output(result) and not (tmp_path / "nccl").exists()
    # the default data, whose folder names ${hydra:runtime.cwd}: before, job 0 was refused for the interpolation
    # ("HydraConfig was not set"), so every -m sweep of CIFAR-10 itself was; its constructor reads nothing
    result = train("-m", "data.batch_size=64,0", "trainer.accelerator=cpu", f"hydra.sweep.dir={tmp_path}/cifar")
    said = "error: job 1 (data.batch_size=0): data.batch_size=0 must be a whole number >= 1"
    assert result.returncode == 2 and result.stderr.startswith(said), output(result)[-3000:]
    # in a Slurm batch script (no srun), a job of two nodes: before, job 0 trained, then job 1 failed
    batch_script = {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "sweep", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "2"}
    result = train("-m", *SWEEP, "trainer.num_nodes=1,2", f"hydra.sweep.dir={tmp_path}/slurm/sweep", env=batch_script)
    said = "error: job 1 (trainer.num_nodes=2): a -m sweep in a Slurm batch script runs its jobs on this one node"
    assert result.returncode == 2 and said in result.stderr and "src.slurm_sweep" in result.stderr, output(result)
    assert "Run:" not in output(result) and not (tmp_path / "slurm").exists()
    # a job's paths.checkpoints that cannot be a folder: before, each job was refused as it started, a line a job
    (tmp_path / "afile").write_text("")
    checkpoints = f"paths.checkpoints={tmp_path}/ok,{tmp_path}/afile/ck"
    result = train("-m", *SWEEP, checkpoints, f"hydra.sweep.dir={tmp_path}/c")
    said = f"error: job 1 (paths.checkpoints={tmp_path}/afile/ck): paths.checkpoints={tmp_path}/afile/ck lies under"
    assert result.returncode == 2 and said in result.stderr and "no job of the sweep" in result.stderr, output(result)
    assert "Run:" not in output(result) and not (tmp_path / "c").exists() and not (tmp_path / "ok").exists()


def test_sweeping_the_strategy_reports_one_series_per_strategy(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result, listeners = watch_listeners(
        train(
            "-m", *SWEEP, "trainer.devices=2", "strategy=ddp,ddp_spawn", f"hydra.sweep.dir={sweep_dir}", background=True
        )
    )
    assert result.returncode == 0, output(result)[-4000:]
    assert_loopback_only(listeners, "a sweep's ddp and ddp_spawn jobs")  # rendezvous and gloo: tests/test_security.py
    report = (sweep_dir / "scaling.md").read_text()
    assert "## strategy=ddp:" in report and "## strategy=ddp_spawn:" in report
    # the report is rebuilt from the throughput.json files alone
    for name in ("scaling.csv", "scaling.md", "scaling.png"):
        (sweep_dir / name).unlink()
    rebuilt = run_module("src.sweeps.report", str(sweep_dir))
    assert rebuilt.returncode == 0, output(rebuilt)
    assert (sweep_dir / "scaling.md").read_text() == report


def fake_job(sweep: Path, num: int, overrides: list[str], world: int, per_device: int, rate: float) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    record = {
        "num_nodes": 1,
        "devices": world,
        "world_size": world,
        "strategy": "ddp",
        "backend": "nccl",
        "precision": "bf16-mixed",
        "device_name": "GPU",
        "accelerator": "cuda",
        "arch": "resnet50",
        "hosts": ["n1"],
        "per_device_batch_size": per_device,
        "global_batch_size": per_device * world,
        "samples_per_second": rate,
        "samples_per_second_per_device": rate / world,
        "step_time_s": 0.1,
        "epoch_time_s": 1.0,
        "peak_memory_mb": 1.0,
        "pids": list(range(world)),
    }
    (job / "throughput.json").write_text(json.dumps(record))


def test_report_computes_speedup_and_efficiency_per_series_and_names_the_scaling_mode(tmp_path):
    fake_job(tmp_path, 0, ["trainer.devices=1", "data.batch_size=64"], 1, 64, 1000.0)
    fake_job(tmp_path, 1, ["trainer.devices=4", "data.batch_size=64"], 4, 64, 3000.0)
    fake_job(tmp_path, 2, ["trainer.devices=1", "data.batch_size=128"], 1, 128, 1200.0)
    fake_job(tmp_path, 3, ["trainer.devices=4", "data.batch_size=128"], 4, 128, 4800.0)
    write_report(tmp_path)
    rows = {r["job"]: r for r in csv.DictReader((tmp_path / "scaling.csv").open())}
    assert float(rows["1"]["speedup"]) == pytest.approx(3.0) and float(rows["1"]["efficiency"]) == pytest.approx(0.75)
    assert float(rows["3"]["speedup"]) == pytest.approx(4.0) and float(rows["3"]["efficiency"]) == pytest.approx(1.0)
    assert rows["1"]["series"] == "data.batch_size=64"
    md = (tmp_path / "scaling.md").read_text()
    assert (
        "## data.batch_size=64: weak scaling" in md and "| 1 | 1 | 4 | 4 | 256 | 3,000.0 | 750.0 | 3.00x | 75% |" in md
    )
    picture = Image.open(tmp_path / "scaling.png").text
    assert picture["Title"] == "resnet50 · 1–4 x GPU · nccl · bf16-mixed"  # the batch differs: the legend names it
    assert picture["Description"] == (
        "series: data.batch_size=64; ideal linear (data.batch_size=64); "
        "data.batch_size=128; ideal linear (data.batch_size=128)"
    )


def test_a_report_of_failed_jobs_alone_lists_them_and_draws_no_empty_picture(tmp_path):
    (tmp_path / "0" / ".hydra").mkdir(parents=True)
    (tmp_path / "0" / ".hydra" / "overrides.yaml").write_text("- trainer.max_epochs=-1\n")
    (tmp_path / "0" / "failure.json").write_text(json.dumps({"error": "trainer.max_epochs=-1 must be >= 1"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend"
        write_report(tmp_path)
    assert "job 0 (trainer.max_epochs=-1): trainer.max_epochs=-1 must be >= 1" in (tmp_path / "scaling.md").read_text()
    assert not (tmp_path / "scaling.png").exists()


def test_a_report_that_cannot_be_written_is_one_line_naming_the_command_that_writes_it_again(tmp_path, capsys):
    """A full disk as the sweep ended: Hydra made the report's OSError a warning and the sweep exited 0 (then, its
    traceback and exit 1). Here ``scaling.csv`` is /dev/full, where every write fails with ENOSPC, as on a full disk."""
    from omegaconf import OmegaConf

    from src.sweeps.report import main
    from src.sweeps.sweep import ScalingReport

    fake_job(tmp_path, 0, ["trainer.devices=1"], 1, 64, 1000.0)
    fake_job(tmp_path, 1, ["trainer.devices=2"], 2, 64, 1800.0)
    (tmp_path / "scaling.csv").symlink_to("/dev/full")
    line = (
        f"error: cannot write the scaling report into {tmp_path} (No space left on device): each job's results stay in "
        f"its dir; free space there, then python -m src.sweeps.report {tmp_path}\n"
    )
    config = OmegaConf.create(
        {"hydra": {"runtime": {"choices": {}}, "sweep": {"dir": str(tmp_path)}, "job": {"name": "train"}}}
    )
    with pytest.raises(SystemExit) as ended:
        ScalingReport().on_multirun_end(config)
    assert ended.value.code == 1 and capsys.readouterr().err == line
    with pytest.raises(SystemExit) as ended:
        main([str(tmp_path)])
    assert ended.value.code == 1 and capsys.readouterr().err == line
    (tmp_path / "scaling.csv").unlink()  # space again: the same command writes it
    assert main([str(tmp_path)]) == 0 and (tmp_path / "scaling.png").is_file()


def test_report_recognises_strong_scaling(tmp_path):
    fake_job(tmp_path, 0, ["trainer.devices=1", "data.batch_size=256"], 1, 256, 1000.0)
    fake_job(tmp_path, 1, ["trainer.devices=2", "data.batch_size=128"], 2, 128, 1800.0)
    jobs = load_jobs(tmp_path)
    assert scaling_mode(jobs) == "strong scaling (global batch fixed)"


def test_report_of_a_folder_that_is_no_sweep_says_so(tmp_path):
    result = run_module("src.sweeps.report", str(tmp_path))
    assert result.returncode == 2 and "no job dirs" in result.stderr


def test_a_sweep_killed_in_its_second_job_resumes_it_and_skips_the_first_when_run_again(tmp_path):
    sweep_dir = tmp_path / "sweep"
    command = [
        "-m",
        *FAST,
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=3",
        "test=false",
        "callbacks.last_checkpoint.every_n_train_steps=0",
        # job 1 sits in its second epoch's first step until the kill (a step takes 0.03 s), and only the first time
        *hold_sweep_job(1, f"{tmp_path}/slept"),
        "model.optimizer.lr=0.1,0.05",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    sweep = run_module("src.train", *command, background=True)
    second = sweep_dir / "1" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not (tmp_path / "slept").exists():  # job 1 has trained its first epoch and sits in its second
        # (not its last.ckpt: a kill between that and the sleep left the sleep to the rerun, 120 s)
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.stdout.read()[-4000:]
        time.sleep(0.2)
    sweep.send_signal(signal.SIGKILL)
    sweep.communicate(timeout=60)
    first_result = (sweep_dir / "0" / "result.json").read_text()
    assert not (sweep_dir / "1" / "result.json").exists()

    again = run_module("src.train", *command)
    assert again.returncode == 0, output(again)[-4000:]
    assert "#0 : " in output(again) and "finished in an earlier run of this sweep" in output(again)
    assert (sweep_dir / "0" / "result.json").read_text() == first_result  # job 0 was not run again
    assert (sweep_dir / "0" / "train.log").read_text().count("Run: ") == 1
    log1 = (sweep_dir / "1" / "train.log").read_text()
    assert f"Restoring states from the checkpoint path at {second}" in log1  # job 1 went on from its last.ckpt
    final = torch.load(second, map_location="cpu", weights_only=True)
    assert final["epoch"] == 1 and final["global_step"] == 6  # the two epochs, none twice
    rows = list(csv.DictReader((sweep_dir / "scaling.csv").open()))
    assert sorted(int(r["job"]) for r in rows) == [0, 1]  # the report covers both runs of the sweep

    other = run_module("src.train", *command[:-2], "model.optimizer.lr=0.1,0.02", f"hydra.sweep.dir={sweep_dir}")
    assert other.returncode == 2
    assert other.stderr.strip().startswith(
        f"error: hydra.sweep.dir={sweep_dir} holds another sweep: its job 1 ran "
        "with model.optimizer.lr=0.05 where this sweep's job 1 has "
        "model.optimizer.lr=0.02"
    )


def test_slurm_sweep_refuses_a_sweep_dir_of_another_sweep_before_submitting(tmp_path):
    # The check comes before any sbatch: no cluster needed. The resume itself runs on a real cluster (tests/slurm).
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    jobs = sweep_dir / "jobs.json"
    jobs.write_text(json.dumps({"jobs": [{"num": 0, "overrides": ["trainer.devices=4"], "slurm_job": "17"}]}))
    result = run_module(
        "src.slurm_sweep", "--", "trainer.devices=1,2", env={"SWEEP_DIR": str(sweep_dir), "PATH": "/nonexistent"}
    )
    assert result.returncode == 2, output(result)
    assert result.stderr.strip() == (
        f"error: SWEEP_DIR={sweep_dir} holds another sweep ({jobs} lists other jobs): pass "
        "a new SWEEP_DIR to start another sweep, or the same overrides to go on with that one"
    )
    assert json.loads(jobs.read_text())["jobs"][0]["overrides"] == ["trainer.devices=4"]  # left as it was


def test_slurm_sweep_checks_every_jobs_size_first_and_says_a_failed_sbatch_in_one_line(tmp_path, monkeypatch, capsys):
    """Before: trainer.devices=0 went to sbatch; sbatch's four lines for a controller out of reach were four lines of
    the error, and the new sweep dir stayed behind empty. In-process, with an sbatch that fails as an unreachable
    controller's does."""
    from hydra.core.hydra_config import HydraConfig

    from src import slurm_sweep

    before = HydraConfig.instance().cfg  # the checks set it to compose each job, and put it back
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\necho 'sbatch: error: fetch_config: DNS SRV lookup failed' >&2\n"
        "echo 'sbatch: fatal: Could not establish a configuration source' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setenv("SWEEP_DIR", str(tmp_path / "sweep"))
    assert slurm_sweep.main(["--", "trainer.devices=1,0"]) == 2
    assert capsys.readouterr().err == (
        "error: trainer.devices=0 / trainer.num_nodes=1: a Slurm sweep needs whole numbers >= 1\n"
    )
    # every job's config composed and checked first (before: each a job that queued for its allocation, then failed)
    for overrides, said in (
        (["trainer.max_epoch=1,2"], "error: job 0 (trainer.max_epoch=1): trainer.max_epoch is not a key of the config"),
        (["trainer.devices=1", "strategy=ddp,horovod"], "error: job 1 (strategy=horovod): strategy=horovod is not an"),
        (["trainer.max_epochs=1,0"], "error: job 1 (trainer.max_epochs=0): trainer.max_epochs=0 must be a whole"),
        # what building the data and the model checks (before: found as the job started, after its queue's wait)
        (["data.batch_size=64,0"], "error: job 1 (data.batch_size=0): data.batch_size=0 must be a whole number >= 1"),
        (["model.arch=resnet18,resnet99"], "error: job 1 (model.arch=resnet99): model.arch=resnet99 is not a"),
        # a path every command checks as it starts (its folder is not: the jobs' nodes may have their own)
        (["data.batch_size=8,16", "paths.checkpoints="], "error: job 0 (data.batch_size=8): paths.checkpoints is em"),
    ):
        assert slurm_sweep.main(["--", *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith(said) and err.endswith("; no job was submitted\n") and err.count("\n") == 1, err
    assert HydraConfig.instance().cfg is before  # left set, it broke later in-process tests of the same worker
    # a range a search draws from: before, "cannot expand the sweep: BasicSweeper does not support sweep type"
    assert slurm_sweep.main(["--", "model.optimizer.lr=interval(0.01,0.1)"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: model.optimizer.lr=interval(0.01,0.1) is a range for a search to draw from, which a grid sweep cannot"
    )
    assert slurm_sweep.main(["--", "trainer.devices=1,2"]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and said.endswith(
        "failed: sbatch: error: fetch_config: DNS SRV lookup failed; sbatch: fatal: Could not establish a "
        "configuration source\n"
    ), said
    assert not (tmp_path / "sweep").exists()


def test_slurm_sweep_help_says_its_usage_and_an_sbatch_option_after_the_overrides_is_one_line():
    helped = run_module("src.slurm_sweep", "--help", env={"PATH": "/nonexistent"})  # no cluster asked
    assert helped.returncode == 0, output(helped)
    assert helped.stdout.startswith("python -m src.slurm_sweep [sbatch options] -- OVERRIDES: a Hydra sweep")
    assert "python -m src.slurm_sweep -- trainer.devices=1,2,4 trainer.max_epochs=5" in helped.stdout
    misplaced = run_module("src.slurm_sweep", "--gpus-per-node=0", "trainer.devices=1,2", env={"PATH": "/nonexistent"})
    assert misplaced.returncode == 2 and misplaced.stderr.strip() == (
        "error: --gpus-per-node=0 is not an override: sbatch options go before --, the overrides after it: "
        "python -m src.slurm_sweep [sbatch options] -- trainer.devices=1,2 ..."
    ), output(misplaced)


def test_the_next_job_of_a_sweep_starts_without_the_previous_jobs_model(tmp_path):
    # One process runs both jobs (strategy=auto). Lightning's trainer, module and callbacks refer to each other, and a
    # failed job's traceback to all of them: the first job's model (on a GPU, its memory) lived on into the second
    # until the sweep freed it at the job's end. Job 0 fails at its first step; job 1 counts the models alive.
    sweep_dir = tmp_path / "sweep"
    result = train(
        "-m",
        *SWEEP,
        "+callbacks.alive._target_=tests.faults.CountAlive",
        "+callbacks.alive.path=${paths.output_dir}/alive.json",
        "+callbacks.fault._target_=tests.faults.RaiseAt",
        "+callbacks.fault.step=1",
        "+callbacks.fault.rank=0,1",
        f"hydra.sweep.dir={sweep_dir}",
    )  # rank 1 never exists: job 1 runs
    assert result.returncode == 1 and "error: 1 of 2 jobs failed: job 0: RuntimeError" in result.stderr, output(result)[
        -4000:
    ]
    assert json.loads((sweep_dir / "1" / "alive.json").read_text()) == {"alive": 1}


def test_a_sweep_of_eval_export_or_predict_counts_only_its_failed_jobs_and_writes_no_scaling_report(tmp_path, capsys):
    """Before: `python -m src.eval -m ... data.batch_size=16,32` ended "error: 2 of 2 jobs failed: no throughput.json"
    with exit 1 after both jobs passed: the scaling report looked for the training's record in every sweep."""
    from omegaconf import OmegaConf

    from src.sweeps.sweep import ScalingReport

    for num in (0, 1):
        (tmp_path / str(num) / ".hydra").mkdir(parents=True)
        (tmp_path / str(num) / "test_metrics.json").write_text("{}")
    config = OmegaConf.create(
        {"hydra": {"runtime": {"choices": {}}, "sweep": {"dir": str(tmp_path)}, "job": {"name": "eval"}}}
    )
    ScalingReport().on_multirun_end(config)  # both passed: no line, no exit, no scaling.md
    assert capsys.readouterr().err == "" and not (tmp_path / "scaling.md").exists()
    (tmp_path / "1" / "failure.json").write_text(json.dumps({"job": 1, "error": "images=x.png does not exist"}))
    with pytest.raises(SystemExit) as ended:
        ScalingReport().on_multirun_end(config)
    assert ended.value.code == 1
    assert capsys.readouterr().err == "error: 1 of 2 jobs failed: job 1: images=x.png does not exist\n"
