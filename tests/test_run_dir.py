"""One run per run dir: a second run pointed at a held dir is refused at once, naming who holds it; the hold goes
with its process, however it ends; timestamped run dirs never collide."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT, output, train


def timed(*overrides: str):
    start = time.monotonic()
    result = train(*overrides)
    return result, time.monotonic() - start


def test_a_failure_says_to_resume_in_its_own_run_dir_and_a_sweeps_job_through_its_sweep(tmp_path, monkeypatch):
    """How a failure's or a stop's line says to go on. Before, a failure's said ``resume with ckpt_path=last``: the
    same command made a new, timestamped run dir, where ``last`` found nothing; a sweep's job's said to resume it as
    a run of its own, without the job's overrides. In-process: Hydra's config as a run's, a sweep job's, a search's."""
    from hydra import compose, initialize_config_dir
    from hydra.types import RunMode
    from omegaconf import read_write

    from src.core.settings import hydra_config_of
    from src.launch import run_dir

    monkeypatch.setattr(run_dir, "_SPAWNED", [])
    assert run_dir.resume_with() == "resume with ckpt_path=last"  # nothing to name: no run in this process
    assert run_dir.resume_with(tmp_path) == f"resume with hydra.run.dir={tmp_path} ckpt_path=last"  # the trainer's
    spaced = tmp_path / "my runs"  # Hydra takes it; a shell takes the words back whole only quoted
    assert run_dir.resume_with(spaced) == f"resume with 'hydra.run.dir={spaced}' ckpt_path=last"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        config = compose(config_name="train", return_hydra_config=True)
    said = {}
    for kind, mode, search in (
        ("run", RunMode.RUN, None),
        ("sweep", RunMode.MULTIRUN, None),
        ("search", RunMode.MULTIRUN, "x"),
    ):
        with read_write(config.hydra):
            config.hydra.mode = mode
            config.hydra.runtime.output_dir = str(tmp_path / kind / "3")
            config.hydra.sweep.dir = str(tmp_path / kind)
            config.hydra.job.num = 3
            config.hydra.runtime.choices["hparams_search"] = search
        with hydra_config_of(config):
            said[kind] = run_dir.resume_with(tmp_path / "elsewhere")  # Hydra's run dir, not a trainer's guess
            parent = run_dir.hydra_resume()
        run_dir.note_spawned_resume(parent)  # a ddp_spawn rank: no Hydra config, its parent's words
        assert run_dir.resume_with(tmp_path / "elsewhere") == said[kind]
        run_dir.note_spawned_resume(None)
    assert said["run"] == f"resume with hydra.run.dir={tmp_path}/run/3 ckpt_path=last"
    assert said["sweep"] == (
        f"run the same command again (with hydra.sweep.dir={tmp_path}/sweep) to resume the sweep: finished jobs are "
        "skipped and job 3 goes on from its last.ckpt"
    )
    assert said["search"].endswith(
        f"(with hydra.sweep.dir={tmp_path}/search) to resume the sweep: the study keeps its "
        "trials and this one goes on from its last.ckpt"
    )


def test_a_second_run_in_a_held_run_dir_is_refused_at_once_naming_the_dir_host_and_pid(tmp_path):
    run_dir = tmp_path / "run"
    with ThreadPoolExecutor(2) as pool:  # started together, as a script or a job array would
        runs = dict(
            zip(
                (1, 2),
                pool.map(
                    lambda seed: timed(
                        *FAST, "strategy=ddp", "trainer.devices=2", f"seed={seed}", f"hydra.run.dir={run_dir}"
                    ),
                    (1, 2),
                ),
            )
        )
    refused = [seed for seed, (result, _) in runs.items() if result.returncode != 0]
    assert len(refused) == 1, {seed: output(result)[-2000:] for seed, (result, _) in runs.items()}
    loser, winner = refused[0], 3 - refused[0]
    result, seconds = runs[loser]
    holder = json.loads((run_dir / ".lock").read_text())
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert (
        result.returncode == 2
        and seconds < 30
        and errors
        == [
            f"error: hydra.run.dir={run_dir} is in use by another run: pid {holder['pid']} on host "
            f"{socket.gethostname()} holds it (since {holder['started']}); wait for it to end, or pass another "
            "hydra.run.dir=DIR (to continue that run once it has ended: ckpt_path=last)"
        ]
    ), output(result)[-3000:]
    assert "Run:" not in output(result)  # refused before any training

    ok, _ = runs[winner]
    assert ok.returncode == 0, output(ok)[-3000:]
    assert f"seed: {winner}" in (run_dir / "config.yaml").read_text()  # its own files, none of the other's
    assert f"seed={winner}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "error" not in (run_dir / "train.log").read_text().lower()
    assert (run_dir / "throughput.json").is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()

    # the same command again once that run has ended: a new training there would overwrite its checkpoints (and
    # draw its curves over that run's), so it is refused before Hydra or the run writes anything
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != ".lock"}  # held a moment, to look
    again = train(*FAST, "strategy=ddp", "trainer.devices=2", f"seed={loser}", f"hydra.run.dir={run_dir}")
    best = next(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("best-"))
    assert again.returncode == 2 and [line for line in again.stderr.splitlines() if line.startswith("error:")] == [
        f"error: hydra.run.dir={run_dir} holds an earlier run's checkpoints (last.ckpt, {best}), which a new run "
        "would overwrite: to go on with that run, pass ckpt_path=last; to train anew, pass another "
        f"hydra.run.dir=DIR (or remove {run_dir / 'checkpoints'} first)"
    ], output(again)[-3000:]
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != ".lock"} == before


HOLD = """
import sys, time
from pathlib import Path

import pytest
from src.launch.run_dir import lock_run_dir
lock_run_dir(Path(sys.argv[1]))
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold(path: Path, seconds: float, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(seconds)],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )


def test_the_hold_goes_with_its_process_even_after_kill_9(tmp_path):
    holder = hold(tmp_path, 600)
    assert holder.stdout.readline() == "holding\n", holder.stderr.read()
    second = hold(tmp_path, 0)
    _, err = second.communicate(timeout=30)
    assert second.returncode == 2 and f"pid {holder.pid} on host {socket.gethostname()} holds it" in err, err
    holder.kill()  # SIGKILL: no handler, no cleanup
    holder.wait()
    third = hold(tmp_path, 0)
    out, err = third.communicate(timeout=30)
    assert third.returncode == 0 and out == "holding\n", err  # what ckpt_path=last after a crash needs
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == third.pid


def test_a_run_refused_for_a_dir_another_run_holds_takes_nothing_back_even_if_it_saw_the_dir_missing(
    tmp_path, monkeypatch
):
    """Two runs pointed at one new dir at the same instant both find it missing; the one refused must not remove the
    other's lock and record as its own refused run's (the race ``test_a_second_run_in_a_held_run_dir...`` meets by
    chance, forced here: the refused run is told the dir was missing when it looked)."""
    from omegaconf import OmegaConf

    from src.launch import run_dir

    path = tmp_path / "run"
    path.mkdir()
    holder = hold(path, 600)
    try:
        assert holder.stdout.readline() == "holding\n", holder.stderr.read()
        config = OmegaConf.create({"hydra": {"run": {"dir": str(path)}}})
        monkeypatch.setattr(run_dir, "_missing", lambda p: [p])  # as it was an instant before the holder made it
        with pytest.raises(SystemExit) as refused:
            run_dir.hold(config, "run")
        assert refused.value.code == 2
        run_dir.forget_refused_run()  # what src/cli/entry.py does at exit status 2
        assert json.loads((path / ".lock").read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_the_line_for_a_held_run_dir_offers_ckpt_path_last_to_a_training_only(tmp_path, capsys):
    """Before, an eval, export or predict pointed at a dir in use was told to continue that run with
    ckpt_path=last."""
    from omegaconf import OmegaConf

    from src.launch import run_dir

    holder = hold(tmp_path, 600)
    try:
        assert holder.stdout.readline() == "holding\n", holder.stderr.read()
        said = {}
        for command in ("train", "eval", "export", "predict"):
            config = OmegaConf.create({"task_name": command, "hydra": {"run": {"dir": str(tmp_path)}}})
            with pytest.raises(SystemExit) as refused:
                run_dir.hold(config, "run")
            assert refused.value.code == 2
            said[command] = capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert said["train"].rstrip().endswith("hydra.run.dir=DIR (to continue that run once it has ended: ckpt_path=last)")
    for command in ("eval", "export", "predict"):
        assert said[command].rstrip().endswith("wait for it to end, or pass another hydra.run.dir=DIR"), said


def test_runs_started_in_the_same_second_get_a_run_dir_each(tmp_path):
    timestamped = f"hydra.run.dir={tmp_path}/runs/${{now:%Y}}"  # the default is ${now:%H-%M-%S}: this one never ticks
    with ThreadPoolExecutor(2) as pool:  # dry runs: each ends as soon as it said what it would do (a refused run's
        # dir would go with it: tests/test_errors.py)
        results = list(pool.map(lambda _: train(*FAST, "trainer.devices=1", "dry_run=true", timestamped), range(2)))
    assert [r.returncode for r in results] == [0, 0], [output(r)[-2000:] for r in results]
    year = time.strftime("%Y")
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == [year, f"{year}_2"]
    for run in runs.iterdir():  # each its own config and log
        assert (run / ".hydra" / "config.yaml").is_file() and (run / "train.log").is_file()
    assert "${now:" in (ROOT / "conf" / "hydra" / "default.yaml").read_text().split("run:")[1].split("sweep:")[0]


def test_a_run_stopped_with_ctrl_c_before_it_trains_exits_130_in_one_line_and_takes_its_run_dir_back(tmp_path):
    """Ctrl-C while the run waits for CIFAR-10's download (a server that accepted and says nothing): the run had made
    its dir, with Hydra's record, the lock and a log of a line or two, and left it, a run dir that looked like a run.
    The download's staging folder goes too; the data root keeps its lock file, as after any download."""
    import signal
    import threading

    from tests.conftest import FAST_RUN
    from tests.test_hangs import start_in_own_group, wait_for

    run_dir, root = tmp_path / "runs" / "one", tmp_path / "data"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        held: list = []
        threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/cifar-10-python.tar.gz"
        proc = start_in_own_group(
            *FAST_RUN, "data=cifar10", f"data.root={root}", f"data.download_url={url}", f"hydra.run.dir={run_dir}"
        )
        wait_for(lambda: bool(held), proc)  # the download has begun: the run dir is there, and nothing trained
        assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", ".lock", "train.log"]
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at the terminal does
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    assert [line for line in out.splitlines() if line.startswith(("interrupted", "error:"))] == [
        "interrupted (Ctrl-C) outside a training step: nothing more was saved"
    ], out[-3000:]
    assert "Traceback" not in out
    assert not (tmp_path / "runs").exists()
    assert [p.name for p in root.iterdir()] == [".cifar-10-download.lock"]


def test_a_refused_torchrun_run_takes_back_what_its_workers_made_whichever_made_it_first(tmp_path, monkeypatch):
    """Under torchrun every worker makes the run dir (Hydra makes each process's dir and log), and a refused run
    left one behind whenever another worker made it before local rank 0 looked, or made it again after local rank 0
    had taken it back, with .hydra, the lock and empty logs. In-process, in the order the workers meet it; the real
    run: tests/test_torchrun.py."""
    import logging

    from omegaconf import OmegaConf

    from src.launch import run_dir

    monkeypatch.setattr(run_dir, "_made", [])
    monkeypatch.setattr(run_dir, "_held", [])
    monkeypatch.setattr(run_dir, "_found_missing", [])
    monkeypatch.setattr(run_dir, "_found_locked", [])
    root = logging.getLogger()

    def refused_first(path, other_log: str, made_by_other: bool):
        """Local rank 0 of a run whose other worker wrote ``other_log`` (None: no log) and may have made the dir."""
        if made_by_other:
            path.mkdir(parents=True)
        run_dir.hold(OmegaConf.create({"hydra": {"run": {"dir": str(path)}}}), "run", shared=True)
        (path / ".hydra").mkdir()
        (path / ".hydra" / "config.yaml").write_text("seed: 1\n")
        (path / "train_rank1.log").write_text(other_log)
        handler = logging.FileHandler(path / "train.log")
        root.addHandler(handler)
        try:
            run_dir.forget_refused_run()  # what src/cli/entry.py does at exit status 2
        finally:
            root.removeHandler(handler)
            handler.close()
            for fd in run_dir._held:
                os.close(fd)
            run_dir._held.clear()

    for made_by_other in (False, True):
        refused_first(tmp_path / "runs" / "day" / "torchrun-a", "", made_by_other)
        assert not (tmp_path / "runs" / "day" / "torchrun-a").exists()
    assert (tmp_path / "runs" / "day").is_dir()  # local rank 0 found it there: the other worker made it
    # a log with a line in it is the other worker's own account: the dir stays
    refused_first(tmp_path / "runs" / "day" / "torchrun-b", "a warning\n", False)
    assert sorted(p.name for p in (tmp_path / "runs" / "day" / "torchrun-b").iterdir()) == [
        ".hydra",
        ".lock",
        "train.log",
        "train_rank1.log",
    ]
    # an attempt before this one locked the dir: it is not this attempt's to take back
    before = tmp_path / "runs" / "day" / "torchrun-c"
    before.mkdir()
    (before / ".lock").write_text("")
    refused_first(before, "", False)
    assert (before / ".hydra").is_dir()

    # the other worker, stopped by the agent once local rank 0 ended, takes back the folders it found missing as it
    # started, while empty, deepest first: here the date folder local rank 0 found there, and a run dir it made again
    again = tmp_path / "runs" / "late" / "torchrun-d"
    run_dir._found_missing[:] = [again, again.parent]
    again.mkdir(parents=True)
    run_dir.leave_refused_run()
    assert not again.parent.exists() and (tmp_path / "runs").is_dir()
    # one it found missing that is not empty (local rank 0's files, or another run's) stays, and its parents with it
    run_dir._found_missing[:] = [tmp_path / "runs" / "day" / "torchrun-b", tmp_path / "runs" / "day"]
    run_dir.leave_refused_run()
    assert (tmp_path / "runs" / "day" / "torchrun-b" / ".lock").is_file()
    # the run dir it found there, locked by the first, which the first took back as Hydra made it again for this rank
    # (an srun task a moment late: an empty job dir stayed, 1 refusal in 8 by hand): there without the lock now, it
    # goes while empty; one that was there before the run keeps the first's lock file, and stays
    run_dir._found_missing[:] = []
    again = tmp_path / "runs" / "day" / "slurm-1.0"
    again.mkdir()
    run_dir._found_locked[:] = [again]
    run_dir.leave_refused_run()
    assert not again.exists()
    run_dir._found_locked[:] = [tmp_path / "runs" / "day" / "torchrun-b"]
    run_dir.leave_refused_run()
    assert (tmp_path / "runs" / "day" / "torchrun-b" / ".lock").is_file()


def test_the_default_run_dir_under_a_launcher_is_named_after_the_launch_every_process_knows(monkeypatch, tmp_path):
    """srun's tasks and mpirun's ranks each read their own clock as they start; the real runs: tests/slurm and
    tests/test_mpirun.py. A requeued job is a new run (its own dir, as a new timestamp was); a batch script, one
    process or a launcher without a shared id keep the timestamp. A process that starts after midnight finds the
    launch's dir under the day before."""
    from src.launch.ranks import launch_name

    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_"))]:
        monkeypatch.delenv(key)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert launch_name() is None  # python -m src.train
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    for key, value in step.items():
        monkeypatch.setenv(key, value)
    assert launch_name() == "slurm-7.3"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert launch_name() == "slurm-7.3-restart2"
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert launch_name() is None  # one task
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_ID", "batch")
    assert launch_name() is None  # the batch script of a 2-task job (python without srun)
    for key in step:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert launch_name() is None  # an MPI without PMIx: each rank its own time, as before
    monkeypatch.setenv("PMIX_NAMESPACE", "701038593")
    assert launch_name() == "mpirun-701038593"
    # a process that starts after midnight finds the dir the launch's first made the day before
    from src.launch.run_dir import launch_dir

    runs = tmp_path / "runs"
    after = runs / "2026-11-25" / "00-00-01"
    assert launch_dir(after, "slurm-7.3") == runs / "2026-11-25" / "slurm-7.3"  # the first: today's
    (runs / "2026-11-24" / "slurm-7.3").mkdir(parents=True)
    (runs / "2026-11-25").mkdir()
    assert launch_dir(after, "slurm-7.3") == runs / "2026-11-24" / "slurm-7.3"
    assert launch_dir(after, "slurm-8.0") == runs / "2026-11-25" / "slurm-8.0"  # another launch: its own
