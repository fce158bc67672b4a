"""slurm/train.sbatch on a real one-node Slurm cluster: 2 tasks, requeue + auto-resume, mismatches, sweeps."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, ROOT, late_python
from tests.slurm.conftest import TERMINAL, start_cluster, stop_cluster

CPU = ["--gpus-per-node=0"]
RUN = [*FAST, "test=false"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory, nodes=1)
    yield cluster
    stop_cluster(cluster)


def run_dir(job_id: str) -> Path:
    return ROOT / "outputs" / "slurm" / job_id


def step_cpus(cluster, job: str, timeout: float = 240) -> int:
    """The CPUs of the job's srun step, read while it runs (no accounting here: a step that ended is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"\bCPUs=(\d+)", cluster.run("scontrol", "show", "step", f"{job}.0", check=False).stdout)
        if found:
            return int(found.group(1))
        if cluster.show(job).get("JobState") in TERMINAL:
            break
        time.sleep(0.2)
    raise AssertionError(f"step {job}.0 was not seen running:\n{cluster.log(job)}")


def test_two_tasks_train_one_world_and_sigusr1_requeues_and_the_restart_resumes_from_the_object_store(
    cluster, tmp_path, s3_store
):
    """slurm/train.sbatch on one node, 2 tasks: one world of two in the job's run dir, with the CPUs the script asks
    for each task. The checkpoints in the S3 server (paths.checkpoints=s3://..., its variables exported to the job):
    SIGUSR1 requeues the job, and the restart resumes from there as from a folder, to exactly the epochs asked for."""
    from tests.test_object_store import Store

    steps = 10  # 96 synthetic images, 10% held out, batches of 4 on each of 2 ranks
    mlflow = f"sqlite:///{tmp_path}/mlflow.db"  # the requeued run logs on into the MLflow run it began
    store, url = Store(s3_store), s3_store.url(f"requeue-{tmp_path.name}")
    # rank 0, which writes the logs, ends 2 s after rank 1 (tests/faults.py; within KillWait, 5 s here): srun must not
    # kill it in between. SLURM_EXACT=1: the step holds only the CPUs srun asks for per task, as clusters that bind
    # each task to its cores do (this one binds none, so the tasks' affinity could not tell)
    job = cluster.sbatch(
        "--nodes=1",
        "--ntasks-per-node=2",
        *CPU,
        "--export=ALL,SLURM_EXACT=1," + ",".join(f"{k}={v}" for k, v in s3_store.env.items()),
        "slurm/train.sbatch",
        *RUN,
        f"paths.checkpoints={url}",
        "trainer.limit_train_batches=null",
        "trainer.max_epochs=4",
        "logger=[tensorboard,csv,mlflow]",
        f"logger.mlflow.tracking_uri={mlflow}",
        f"logger.mlflow.artifact_location={tmp_path}/art",
        "+callbacks.slow_end._target_=tests.faults.SlowEnd",
        "+callbacks.slow_end.seconds=2",
    )
    assert step_cpus(cluster, job) == 2 * 8  # the script's --cpus-per-task=8 for each task (Slurm >= 22.05: else 1)
    last = f"{url}/last.ckpt"
    deadline = time.monotonic() + 240
    while not store.exists(last) and time.monotonic() < deadline:  # epoch 0 is done: signal in the middle of epoch 1
        time.sleep(0.2)
    time.sleep(1)
    cluster.run("scancel", "--signal=USR1", job)
    info = cluster.wait(job, timeout=400)
    log = cluster.log(job)
    assert info["JobState"] == "COMPLETED", log
    assert int(info["Restarts"]) == 1, info
    assert "SIGUSR1: requeued Slurm job" in log and "(restart 1)" in log
    assert f"Restoring states from the checkpoint path at {last}" in log
    assert log.count("world size 2 | strategy ddp | backend gloo") == 2, log  # the start and the restart
    record = json.loads((run_dir(job) / "throughput.json").read_text())
    assert record["world_size"] == 2 and len(set(record["pids"])) == 2
    assert (run_dir(job) / "config.yaml").is_file() and (run_dir(job) / "tensorboard").is_dir()
    final = store.load(last)
    assert not (run_dir(job) / "checkpoints").exists()
    assert final["epoch"] == 3 and final["global_step"] == 4 * steps  # no epoch lost, none repeated
    from mlflow import MlflowClient

    client = MlflowClient(mlflow)
    (run,) = client.search_runs([client.get_experiment_by_name("cifar10-ddp").experiment_id])
    assert run.info.status == "FINISHED" and "continuing MLflow run" in log
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/acc")] == [
        (epoch + 1) * steps - 1 for epoch in range(4)
    ]  # one run, every epoch once, across the requeue
    # rank 0's TensorBoard and CSV logs hold every step, those before the stop among them: it was not killed while
    # it wrote them
    from tests.test_train import scalars

    logged = {e.step for e in scalars(run_dir(job))["train/loss"]}
    assert logged == set(range(min(logged), min(logged) + 4 * steps)), (sorted(logged), log)
    rows = list(csv.DictReader((run_dir(job) / "metrics.csv").open()))
    assert {int(r["step"]) for r in rows if r.get("train/loss")} == logged, log


def test_srun_in_an_interactive_allocation_binding_a_core_each_trains_one_world_into_one_default_run_dir(
    cluster, tmp_path
):
    """SLURM_CPU_BIND=cores: each of the 2 tasks runs on a core of its own, with a loader worker each. (This
    machine's 2 cores cannot show a task of several bound cores divided again by the tasks; tests/test_data.py checks
    that arithmetic.) The job is
    named interactive, as salloc names its jobs: before, Lightning took each task for a run of its own (each started
    its own second rank; one ran, the other was refused the run dir). The run dir is the default's form, timestamped,
    as under a bare srun, and task 1 starts 1.2 s after task 0, as a task on a slow node does: before, each task took
    its own clock's time, and task 1 wrote its log into a dir of its own."""
    late = late_python(tmp_path / "python", "SLURM_PROCID", 1, python=f"{ROOT}/.venv/bin/python")
    job = cluster.sbatch(
        "--nodes=1",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        *CPU,
        "--job-name=interactive",
        f"--export=ALL,SLURM_CPU_BIND=cores,PYTHON={late}",
        "slurm/train.sbatch",
        *RUN,
        "data.pipeline=dataloader",
        "data.num_workers=1",
        f"hydra.run.dir={tmp_path}/runs/${{now:%H-%M-%S}}",
    )
    info = cluster.wait(job)
    log = cluster.log(job)
    assert info["JobState"] == "COMPLETED", log
    # the rank's own core counted, and its loader workers started under srun (forkserver where fork can hang)
    assert "| 1 loader workers a process (data.num_workers; 1 core(s) for this rank), started by " in log, log
    assert log.count("world size 2 | strategy ddp | backend gloo") == 1, log
    assert "srun` command is available on your system but is not used" not in log  # Lightning's, there
    # one dir for the run, named after its step, whatever the clock said as each task started
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [f"slurm-{job}.0"]
    run = tmp_path / "runs" / f"slurm-{job}.0"
    assert {"train.log", "train_rank1.log", "checkpoints"} <= {p.name for p in run.iterdir()}
    # one checkpoint folder for the job, rank zero's: not one a task
    assert [p.relative_to(run) for p in run.rglob("last.ckpt")] == [Path("checkpoints/last.ckpt")]


def test_an_allocation_that_does_not_match_the_config_fails_fast_with_what_to_change(cluster):
    start = time.monotonic()
    job = cluster.sbatch("--nodes=1", "--ntasks-per-node=2", *CPU, "slurm/train.sbatch", *RUN, "trainer.devices=1")
    info = cluster.wait(job, timeout=120)
    assert info["JobState"] == "FAILED"
    # said once: the node's other task, quiet, ends once local rank 0 has (before: a line from each task)
    assert cluster.log(job).count("--ntasks-per-node=2 but trainer.devices=1") == 1, cluster.log(job)
    assert time.monotonic() - start < 90


def test_python_without_srun_in_a_multi_task_job_fails_fast(cluster):
    job = cluster.sbatch(
        "--nodes=1",
        "--ntasks-per-node=2",
        *CPU,
        "--output=outputs/slurm/%j.out",
        "--wrap",
        " ".join(
            [
                ".venv/bin/python",
                "-m",
                "src.train",
                *RUN,
                "trainer.devices=2",
                "hydra.run.dir=outputs/slurm/$SLURM_JOB_ID",
            ]
        ),
    )
    info = cluster.wait(job, timeout=120)
    assert info["JobState"] == "FAILED"
    assert "without srun" in cluster.log(job)


def requeue_with(scontrol: str | None, tmp_path, monkeypatch, caplog) -> list[str]:
    """SlurmRequeue's SIGUSR1 work on rank zero of job 4242, in-process, with ``scontrol`` (a shell script) the one
    on PATH (None: none there); the lines it logged. No cluster needed."""
    from src.callbacks import slurm_requeue

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    if scontrol is not None:
        (bin_dir / "scontrol").write_text(f"#!/bin/sh\n{scontrol}\n")
        (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    with caplog.at_level("WARNING", logger=slurm_requeue.__name__):
        slurm_requeue.SlurmRequeue._requeue(types.SimpleNamespace(is_global_zero=True))
    return [record.getMessage() for record in caplog.records]


def test_the_requeues_answer_survives_slurm_stopping_the_job_before_scontrol_exits(tmp_path, monkeypatch, caplog):
    """Slurm stops every process of the job as soon as slurmctld takes the requeue, scontrol too where it has not
    exited yet: on the loaded test cluster the job was requeued and resumed while its log said the requeue had
    failed. The stand-in scontrol gets that SIGTERM before it answers, as the real one then did."""
    said = requeue_with('kill -TERM $$; echo "$@" > "${0%/*}/asked"', tmp_path, monkeypatch, caplog)
    assert (tmp_path / "bin" / "asked").read_text() == "requeue 4242\n"
    assert said == ["SIGUSR1: requeued Slurm job 4242; it will resume from checkpoints/last.ckpt"]


def test_a_requeue_that_cannot_run_or_gets_no_answer_is_one_line_not_an_exception_or_a_wait(
    tmp_path, monkeypatch, caplog
):
    """No scontrol on PATH raised in the signal handler, in the middle of a training step; an scontrol that never
    answers held rank zero there, and with it every rank, until the hang watch ended the run."""
    [said] = requeue_with(None, tmp_path, monkeypatch, caplog)
    assert said.startswith("SIGUSR1: scontrol requeue 4242 failed: ") and said.endswith("scontrol: not found"), said
    caplog.clear()
    monkeypatch.setattr("src.callbacks.slurm_requeue.ANSWER_S", 0.5)
    assert requeue_with("exec /bin/sleep 30", tmp_path / "slow", monkeypatch, caplog) == [
        "SIGUSR1: scontrol requeue 4242 gave no answer in 0.5 s: the job is not known to be requeued"
    ]


def test_a_search_in_one_job_starts_each_trials_ranks_itself_and_a_requeue_ends_with_exactly_n_trials(
    cluster, tmp_path
):
    from tests.test_search import study, trained_with

    sweep = tmp_path / "search"
    job = cluster.sbatch(
        "--nodes=1",
        *CPU,
        "--cpus-per-task=2",
        f"--export=ALL,SWEEP_DIR={sweep}",
        "slurm/search.sbatch",
        *RUN,
        "strategy=ddp",
        "trainer.devices=2",
        "hydra.sweeper.n_trials=2",
        "trainer.max_epochs=3",
        "trainer.limit_train_batches=null",
        # trial 1 (10 steps an epoch) waits in step 15 until the requeue's SIGTERM, and the signal is sent once it
        # waits there: 30 steps took 1.3 s, and a signal sent when its first last.ckpt appeared once came after the
        # trial had ended, with nothing to resume (and, sent before step 15, it left the resumed trial to wait)
        "+callbacks.wait._target_=tests.faults.SleepAt",
        "+callbacks.wait.rank=0",
        "+callbacks.wait.job=1",
        "+callbacks.wait.step=15",
        "+callbacks.wait.seconds=300",
        "+callbacks.wait.until_signal=true",
        f"+callbacks.wait.once={tmp_path / 'held'}",
    )
    last = sweep / "1" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while not (tmp_path / "held").exists() and time.monotonic() < deadline:  # trial 1 waits in step 15
        time.sleep(0.2)
    cluster.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:SIGUSR1@120 sends before the limit
    info = cluster.wait(job, timeout=400)
    log = cluster.log(job)
    assert info["JobState"] == "COMPLETED", log
    assert int(info["Restarts"]) == 1 and "SIGUSR1: requeued Slurm job" in log and "(restart 1)" in log, log
    trials = study(sweep).trials
    assert [t.number for t in trials] == [0, 1] and all(t.state.name == "COMPLETE" for t in trials), log
    assert f"Restoring states from the checkpoint path at {last}" in (sweep / "1" / "train.log").read_text()
    for trial in trials:  # both ranks of every trial were started by the search, with its values
        job_dir = sweep / str(trial.number)
        lines = trained_with(job_dir / "train.log") + trained_with(job_dir / "train_node0_local1.log")
        assert {n for n, _ in lines} == {trial.number} and len({v for _, v in lines}) == 1, lines
        record = json.loads((job_dir / "throughput.json").read_text())
        assert record["world_size"] == 2 and len(set(record["pids"])) == 2
        final = torch.load(job_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert final["epoch"] == 2  # the requeued trial too: no epoch lost
    assert "Best of 2 trials" in log and not [line for line in log.splitlines() if line.startswith("error:")], log


def sweep_ids(stdout: str) -> tuple[dict[int, str], str]:
    """{job number: Slurm job id} of the jobs a src.slurm_sweep run submitted, and its report job's id."""
    ids = {
        int(line.split()[1].rstrip(":")): line.split("Slurm job ")[1].split(":")[0]
        for line in stdout.splitlines()
        if line.startswith("job ") and "not submitted" not in line
    }
    report_id = next(
        line.split("Slurm job ")[1].split(",")[0] for line in stdout.splitlines() if line.startswith("report:")
    )
    return ids, report_id


def test_a_sweep_submits_one_job_per_device_count_sized_to_match_reports_and_resumes(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    command = [
        "env",
        f"SWEEP_DIR={sweep}",
        ".venv/bin/python",
        "-m",
        "src.slurm_sweep",
        *CPU,
        "--",
        "trainer.devices=1,2",
        *RUN,
    ]
    ids, report_id = sweep_ids(cluster.run(*command).stdout)
    cluster.job_ids.extend([*ids.values(), report_id])
    assert [cluster.show(ids[k])["NumTasks"] for k in (0, 1)] == ["1", "2"]
    cluster.run("scancel", ids[1])  # job 1 never runs: cancelled (or lost) before it ends
    assert cluster.wait(ids[0])["JobState"] == "COMPLETED", cluster.log(ids[0])
    assert cluster.wait(report_id)["JobState"] == "COMPLETED", (sweep / "report.out").read_text()
    assert [int(r["world_size"]) for r in csv.DictReader((sweep / "scaling.csv").open())] == [1]

    again = cluster.run(*command).stdout  # the same command: only job 1 is submitted again
    assert f"job 0: finished in an earlier run of this sweep ({sweep}/0/result.json): not submitted again" in again
    ids, report_id = sweep_ids(again)
    cluster.job_ids.extend([*ids.values(), report_id])
    assert list(ids) == [1] and cluster.show(ids[1])["NumTasks"] == "2"
    assert cluster.wait(ids[1])["JobState"] == "COMPLETED", cluster.log(ids[1])
    assert cluster.wait(report_id)["JobState"] == "COMPLETED", (sweep / "report.out").read_text()
    rows = list(csv.DictReader((sweep / "scaling.csv").open()))
    assert sorted(int(r["world_size"]) for r in rows) == [1, 2]  # the report covers both runs of the sweep
    for k, world in enumerate((1, 2)):
        assert len(set(json.loads((sweep / str(k) / "throughput.json").read_text())["pids"])) == world
    recorded = json.loads((sweep / "jobs.json").read_text())["jobs"]
    assert [j["slurm_job"] for j in recorded][1] == ids[1]


def test_srun_torchrun_is_not_refused_by_the_allocation_check_and_trains_like_srun(cluster):
    """One agent (--ntasks-per-node=1) starting two workers: the Slurm check would have read 1 task vs 2 devices."""
    job = cluster.sbatch(
        "--nodes=1", *CPU, "--cpus-per-task=2", "--export=ALL,NPROC_PER_NODE=2", "slurm/torchrun.sbatch", *RUN
    )
    info = cluster.wait(job)
    log = cluster.log(job)
    assert info["JobState"] == "COMPLETED", log
    record = json.loads((run_dir(job) / "throughput.json").read_text())
    assert record["world_size"] == 2 and len(set(record["pids"])) == 2
    assert [p.relative_to(run_dir(job)) for p in run_dir(job).rglob("last.ckpt")] == [Path("checkpoints/last.ckpt")]
    assert "world size 2 | strategy ddp | backend gloo" in log and "error:" not in log


def run_batch_script(tmp_path: Path, script: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``slurm/SCRIPT`` under bash, as Slurm runs it from the project's folder (no cluster needed), with stand-ins for
    srun, scontrol and the project's python; srun and python record their arguments in the file returned (absent:
    neither was called)."""
    bin_dir, said = tmp_path / "bin", tmp_path / "arguments"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for tool, does in (
            ("srun", f'echo "$@" >> {said}'),
            ("python", f'echo "$@" >> {said}'),
            ("scontrol", "echo localhost"),
        ):
            (bin_dir / tool).write_text(f"#!/bin/sh\n{does}\n")
            (bin_dir / tool).chmod(0o755)
    said.unlink(missing_ok=True)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHON": str(bin_dir / "python"),
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NTASKS_PER_NODE": "1",
        **env,
    }
    result = subprocess.run(["bash", str(ROOT / "slurm" / script)], env=env, capture_output=True, text=True, timeout=60)
    return result, said


@pytest.mark.parametrize("script", ["train.sbatch", "torchrun.sbatch", "search.sbatch"])
def test_a_python_that_is_not_there_stops_the_script_in_one_line_before_srun(tmp_path, script):
    result, said = run_batch_script(
        tmp_path, script, PYTHON="/nonexistent/python", SLURM_NTASKS_PER_NODE="2", SLURM_CPUS_PER_TASK="8"
    )
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"error: PYTHON=/nonexistent/python is not an executable here ({ROOT}): run make install in {ROOT}, or pass "
        "--export=ALL,PYTHON=/path/to/python"
    ]
    assert not said.exists()  # srun was not called


@pytest.mark.parametrize(
    "script, folder", [("train.sbatch", ""), ("torchrun.sbatch", ""), ("search.sbatch", "search-")]
)
def test_a_job_given_an_earlier_jobs_id_moves_that_jobs_dir_aside_and_a_requeue_keeps_its_own(tmp_path, script, folder):
    """A controller whose state was reset gives job ids again: the new job's default dir (outputs/slurm/<id>) held
    the earlier job's checkpoints or study, and ckpt_path=auto went on from them. Slurm says a restart in
    SLURM_RESTART_COUNT (unset in a job's first run, 1 after a requeue: seen on the test cluster)."""
    job = f"9{os.getpid()}"
    mine = ROOT / "outputs" / "slurm" / f"{folder}{job}"

    def run(**more: str) -> subprocess.CompletedProcess:
        result, said = run_batch_script(tmp_path, script, SLURM_JOB_ID=job, **more)
        assert result.returncode == 0, result.stdout + result.stderr
        key = "hydra.sweep.dir" if folder else "hydra.run.dir"
        assert f"{key}=outputs/slurm/{folder}{job}" in said.read_text().split(), said.read_text()
        return result

    mine.mkdir(parents=True)
    (mine / "last.ckpt").write_text("the earlier job's")
    try:
        run(SLURM_RESTART_COUNT="1")  # this job, requeued: its own dir, as it is
        assert (mine / "last.ckpt").read_text() == "the earlier job's"
        result = run()  # a job's first run: the dir is another job's
        (aside,) = mine.parent.glob(f"{mine.name}.earlier-*")
        assert (aside / "last.ckpt").read_text() == "the earlier job's" and not mine.exists()
        assert (
            f"job {job}: outputs/slurm/{folder}{job} held the files of an earlier job {job} (the controller gave "
            f"this id again): moved to outputs/slurm/{aside.name}"
        ) in result.stdout.splitlines(), result.stdout
        run(**{"SWEEP_DIR" if folder else "RUN_DIR": f"outputs/slurm/{folder}{job}"})  # a dir given: the user's
    finally:
        for path in [mine, *mine.parent.glob(f"{mine.name}.earlier-*")]:
            shutil.rmtree(path, ignore_errors=True)
