"""Checkpoints: a run killed anywhere resumes to the very weights of an uninterrupted one; a write killed half way
leaves the previous file whole; files that need full unpickling load only on request."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from src.checkpoints.files import AtomicCheckpointIO, remove_stale_temp_files
from src.checkpoints.resume import resume_from
from src.core.errors import StorageError, UserError
from tests.conftest import (
    FAST,
    FAST_RUN,
    descendants,
    output,
    refusal_lines,
    running,
    train,
    without_root_permissions,
)
from tests.test_supervision import LONG, error_lines, finish, last_step, start_and_wait_for_step

# Deterministic CPU training, 2 epochs of 12 steps, last.ckpt every 2 steps.
EXACT = [
    *FAST,
    "data.num_train=200",
    "trainer.limit_train_batches=12",
    "trainer.max_epochs=2",
    "trainer.deterministic=true",
    "callbacks.last_checkpoint.every_n_train_steps=2",
    "callbacks.progress_bar=null",
    "test=false",
]
WORLDS = {"one process": ["trainer.devices=1"], "ddp x2": ["strategy=ddp", "trainer.devices=2"]}


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, dict]:
    """The final last.ckpt of each world size, trained without a stop."""
    finals = {}
    for name, world in WORLDS.items():
        run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
        result = train(*EXACT, *world, f"hydra.run.dir={run_dir}")
        assert result.returncode == 0, output(result)[-3000:]
        finals[name] = load(run_dir / "checkpoints" / "last.ckpt")
    return finals


def assert_same_training(resumed: dict, reference: dict, steps: int = 24) -> None:
    assert resumed["global_step"] == reference["global_step"] == steps and resumed["epoch"] == reference["epoch"]
    weights, expected = resumed["state_dict"], reference["state_dict"]
    assert weights.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(weights[k], expected[k])]
    assert not different, f"{len(different)} of {len(expected)} tensors differ, e.g. {different[:3]}"
    momentum = [s["momentum_buffer"] for s in resumed["optimizer_states"][0]["state"].values()]
    expected_momentum = [s["momentum_buffer"] for s in reference["optimizer_states"][0]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, expected_momentum, strict=True))
    assert resumed["lr_schedulers"][0]["last_epoch"] == reference["lr_schedulers"][0]["last_epoch"]


@pytest.mark.parametrize("world, sig", [("one process", signal.SIGKILL), ("ddp x2", signal.SIGTERM)])
def test_a_run_stopped_mid_epoch_resumes_with_ckpt_path_last_to_the_same_weights(world, sig, uninterrupted, tmp_path):
    # rank 0 waits in step 5, last.ckpt at step 4, until the signal: the stop lands mid-epoch however busy the machine
    # (the narrow network's 8 steps to the epoch's end once took less than a look at last.ckpt under load). The wait
    # changes no computation, and is not in the resume's command
    held = tmp_path.with_name(f"{tmp_path.name}-held")
    hold = [
        "+callbacks.fault._target_=tests.faults.SleepAt",
        "+callbacks.fault.rank=0",
        "+callbacks.fault.step=5",
        "+callbacks.fault.seconds=120",
        "+callbacks.fault.until_signal=true",
        f"+callbacks.fault.once={held}",
    ]
    proc = start_and_wait_for_step(tmp_path, 4, *EXACT, *WORLDS[world], *hold, ranks=len(WORLDS[world]))
    deadline = time.monotonic() + 60
    while not held.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, sig)
    out, _ = finish(proc, [proc.pid], limit_s=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM), out[-3000:]
    stopped_at = last_step(tmp_path)
    assert 4 <= stopped_at < 24 and stopped_at % 12 != 0  # mid-epoch: a step checkpoint, not an epoch's end

    result = train(*EXACT, *WORLDS[world], "ckpt_path=last", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, output(result)[-3000:]
    assert "Restoring states from the checkpoint" in output(result)
    assert "settings other than its own" not in output(result)  # the same command: nothing changed
    assert_same_training(load(tmp_path / "checkpoints" / "last.ckpt"), uninterrupted[world])

    if world != "ddp x2":  # one process: tests/test_object_store.py's resume from another prefix says it
        return
    # its last.ckpt trained on in a new run dir: the best that run keeps is of its own epochs, said once for the run
    # (before: Lightning's warning with its source line from every rank, and a project warning once per rank more)
    other = tmp_path.with_name(f"{tmp_path.name}-on")
    last = tmp_path / "checkpoints" / "last.ckpt"
    on = train(*EXACT, *WORLDS[world], "trainer.max_steps=26", f"ckpt_path={last}", f"hydra.run.dir={other}")
    assert on.returncode == 0, output(on)[-3000:]
    moved = (
        f"ckpt_path={last} was saved by a run that kept its checkpoints in {tmp_path}/checkpoints: this run keeps its "
        f"own in {other}/checkpoints, and its best checkpoint (the one a test uses) is the best of the epochs it "
        f"trains from here; the earlier run's best stays in {tmp_path}/checkpoints"
    )
    assert [line for line in on.stderr.splitlines() if line.startswith("warning:")] == [f"warning: {moved}"], on.stderr
    assert output(on).count(moved) == 1 and "The dirpath has changed" not in output(on), output(on)[-3000:]
    for log in (other / "train.log", *other.glob("train_*local*.log")):  # each rank's log file keeps it
        assert moved in log.read_text(), log


def test_a_resume_in_the_runs_own_dir_names_each_setting_it_changes_and_nothing_else(tmp_path):
    """What ``warn_changed_settings`` puts in its one line (a real resume prints it: the dataloader test below)."""
    from omegaconf import OmegaConf

    from src.checkpoints.resume import changed_settings
    from tests.test_config import make_cfg

    record = tmp_path / "config.yaml"
    first = make_cfg(tmp_path, "data=synthetic", "data.batch_size=4", "model.optimizer.lr=0.05", "trainer.devices=2")
    record.write_text(OmegaConf.to_yaml(OmegaConf.to_container(first, resolve=True)))  # as record_config writes it
    same = ["data=synthetic", "data.batch_size=4", "model.optimizer.lr=0.05"]
    elsewhere = ["trainer.devices=8", "trainer.num_nodes=4", "trainer.max_epochs=60", "model.compile=false"]
    elsewhere += ["data.num_workers=2", "data.num_test=64", "logger=csv", "ckpt_path=last"]
    assert changed_settings(make_cfg(tmp_path, *same, *elsewhere), record) == []  # where and how long: free
    assert changed_settings(make_cfg(tmp_path, "data=synthetic", "data.batch_size=auto", *same[2:]), record) == []
    changed = make_cfg(tmp_path, "data=synthetic", "data.batch_size=8", "model.optimizer.lr=0.05", "seed=7")
    assert changed_settings(changed, record) == [  # not data.seed too: it interpolates seed
        "seed=7 (it trained with 42)",
        "data.batch_size=8 (it trained with 4)",
    ]
    assert changed_settings(make_cfg(tmp_path, "data=cifar10", *same[1:]), record)[0] == (
        "data._target_=src.data.cifar10.CIFAR10DataModule (it trained with src.data.synthetic.SyntheticDataModule)"
    )
    assert changed_settings(changed, tmp_path / "nowhere.yaml") == []  # no record: nothing to compare with


def test_a_resume_refused_for_its_data_leaves_the_runs_record_and_dir_as_they_were(tmp_path):
    """The record a later resume compares with is the run's own, not a refused command's (src/train.py writes it once
    the data is there); the dir, there before the command, stays."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    record = "seed: 42\ndata:\n  batch_size: 4\n"
    (run / "config.yaml").write_text(record)
    offline = ["data=cifar10", "data.download=false", f"data.root={tmp_path}/nowhere"]
    result = train(*FAST_RUN, *offline, "ckpt_path=auto", f"hydra.run.dir={run}")
    assert result.returncode == 2 and "error: CIFAR-10 is not under" in result.stderr, output(result)[-3000:]
    assert (run / "config.yaml").read_text() == record and (run / "checkpoints").is_dir()


def test_a_stop_at_an_epochs_last_batch_keeps_its_validation_and_resumes_to_the_same_weights(uninterrupted, tmp_path):
    """SIGTERM during epoch 0's last batch: the run stops after that epoch's validation (stopped at the batch's end,
    the epoch's validation and best checkpoint were lost: the resumed run starts the next epoch). One process, where
    the stop lands at the batch it was asked at (under DDP the ranks agree one batch later: the same code then)."""
    stop = ["+callbacks.stop._target_=tests.faults.SignalAt", "+callbacks.stop.step=11"]
    stopped = train(*EXACT, *WORLDS["one process"], *stop, f"hydra.run.dir={tmp_path}")
    assert stopped.returncode == 128 + signal.SIGTERM, output(stopped)[-3000:]
    assert "SIGTERM after step 12: every rank stopped there" in output(stopped)
    assert load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 12
    assert list((tmp_path / "checkpoints").glob("best-epoch000-*.ckpt"))  # epoch 0's validation ran and counted

    result = train(*EXACT, *WORLDS["one process"], "ckpt_path=last", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, output(result)[-3000:]
    assert_same_training(load(tmp_path / "checkpoints" / "last.ckpt"), uninterrupted["one process"])
    from tests.test_train import scalars

    assert sorted(e.step for e in scalars(tmp_path)["val/acc"]) == [11, 23]  # every epoch's validation, once


def test_the_dataloader_pipelines_first_epoch_after_an_epochs_end_resume_draws_its_own_order(tmp_path):
    """data.pipeline=dataloader with workers, ddp x 2: each epoch draws the order torch's own
    ``DistributedSampler(seed, epoch)`` gives rank 0, the two epochs of an uninterrupted run, and the first epoch of
    a run resumed from an epoch's end (not epoch 0's again: Lightning #21938); rank 0's batches, by their labels."""
    from hydra.utils import instantiate
    from torch.utils.data import DistributedSampler

    from src.data.in_memory import fork_can_hang
    from tests.test_config import make_cfg

    args = [
        *FAST,
        "strategy=ddp",
        "trainer.devices=2",
        "data.pipeline=dataloader",
        "data.num_workers=1",
        "trainer.limit_train_batches=4",
        "test=false",
        "callbacks.progress_bar=null",
        "+callbacks.batches._target_=tests.faults.RecordBatches",
        f"+callbacks.batches.path={tmp_path}/batches.txt",
        f"hydra.run.dir={tmp_path}/run",
    ]
    # the resume also smooths its labels otherwise: it says so in one line, and the order of batches is the same
    for epochs, resuming in ((2, []), (3, ["ckpt_path=last", "model.label_smoothing=0.2"])):
        result = train(*args, f"trainer.max_epochs={epochs}", *resuming)
        assert result.returncode == 0, output(result)[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: resuming the run in")]
    assert warnings == [
        f"warning: resuming the run in {tmp_path}/run with settings other than its own: model.label_smoothing=0.2 "
        f"(it trained with 0.1); it goes on with these (to continue it as it was, pass the values "
        f"{tmp_path}/run/config.yaml holds)"
    ], output(result)[-3000:]
    # what torch's sampler gives rank 0 of 2 in each epoch: the first 4 batches of 4 of the run's training images
    data = instantiate(make_cfg(tmp_path, *args[:-2]).data)
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, num_replicas=2, rank=0, shuffle=True, seed=data.seed)
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        labels = data.train_set.labels[list(sampler)[:16]].tolist()
        expected += [f"{epoch} {labels[at : at + 4]}" for at in range(0, 16, 4)]
    assert expected[8:] != [f"2 {line[2:]}" for line in expected[:4]]  # epoch 2 has an order of its own
    assert (tmp_path / "batches.txt").read_text().splitlines() == expected
    # the workers beside the process group started by forkserver where this Python's fork can hang (auto)
    assert (", started by forkserver (auto: " if fork_can_hang() else ", started by fork |") in output(result)


@pytest.mark.parametrize("minutes, last_saves, previous", [("1e-9", 11, 11), ("1e9", 2, 4)])
def test_every_n_minutes_is_agreed_by_both_ranks_and_the_saves_are_timed(minutes, last_saves, previous, tmp_path):
    """Tiny: due at every batch, saved one batch after (the ranks' agreement arrives then); huge: only the first epoch's
    end (a write that works is known early) and the last. Either way one last.ckpt, and the fit line counts every
    save: these and the best checkpoint's, here one per epoch (no monitor: the newest epoch is kept)."""
    result = train(
        *FAST,
        "trainer.limit_train_batches=4",
        "trainer.max_epochs=3",
        "strategy=ddp",
        "trainer.devices=2",
        f"callbacks.last_checkpoint.every_n_minutes={minutes}",
        "callbacks.model_checkpoint.monitor=null",
        "test=false",
        "strategy.timeout_s=60",
        f"hydra.run.dir={tmp_path}",
        timeout=240,
    )
    assert result.returncode == 0, output(result)[-3000:]
    saves = last_saves + 3
    checkpoints = tmp_path / "checkpoints"
    best, *lasts = sorted(p.name for p in checkpoints.iterdir())
    assert best.startswith("best-epoch002-") and lasts == ["last.ckpt", "last.prev.ckpt"]
    assert load(checkpoints / "last.ckpt")["global_step"] == 12
    assert load(checkpoints / "last.prev.ckpt")["global_step"] == previous
    record = json.loads((tmp_path / "throughput.json").read_text())
    assert record["checkpoints_saved"] == saves and 0 < record["checkpoint_save_s"] < record["fit_time_s"]
    assert record["checkpoint_share"] == pytest.approx(record["checkpoint_save_s"] / record["fit_time_s"])
    line = re.search(
        r"fit: 3 epochs, 12 steps in ([\d.]+) s \([\d.]+ img/s\); checkpoints: (\d+) saved in ([\d.]+) s, "
        r"([\d.]+)% of the time",
        output(result),
    )
    assert line and int(line[2]) == saves, output(result)[-3000:]
    assert float(line[4]) == pytest.approx(100 * record["checkpoint_share"], abs=0.06)


def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_whole(tmp_path):
    """ResNet-50 checkpoints (~190 MB with momentum) take long enough to write that the kill lands inside one."""
    proc = train(
        *FAST,
        "model.arch=resnet50",
        "data.num_train=400",
        "trainer.limit_train_batches=null",
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "callbacks.progress_bar=null",
        "test=false",
        f"hydra.run.dir={tmp_path}",
        background=True,
    )
    checkpoints = tmp_path / "checkpoints"
    deadline = time.monotonic() + 240
    killed_mid_write = False
    while not killed_mid_write:
        assert proc.poll() is None and time.monotonic() < deadline, "never caught a write in progress"
        writing = list(checkpoints.glob(".last.ckpt.tmp-*")) if (checkpoints / "last.ckpt").exists() else []
        if writing and writing[0].stat().st_size > 0:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_mid_write = writing[0].exists()  # the rename had not happened yet: the kill was mid-write
            if not killed_mid_write:
                pytest.fail("the write finished before the kill; the test needs a slower write")
        time.sleep(0.005)
    partial = list(checkpoints.glob(".last.ckpt.tmp-*"))
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["last.ckpt"]
    previous = load(checkpoints / "last.ckpt")  # whole: it loads, with every tensor
    assert previous["global_step"] >= 1 and len(previous["state_dict"]) > 300
    assert remove_stale_temp_files(checkpoints) == partial and not partial[0].exists()


def test_a_refused_write_before_any_last_ckpt_says_run_again_not_resume(tmp_path, monkeypatch):
    from src.checkpoints.files import refused_write
    from src.launch import run_dir

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    err = OSError(errno.EROFS, "Read-only file system")
    target = tmp_path / "tensorboard" / "events.out"
    # before: "resume with ckpt_path=last", which is refused while there is no last.ckpt to resume from
    assert refused_write(err, target, checkpoints) == (
        f"cannot write {target} (Read-only file system): there is no intact last.ckpt yet; make {target.parent} "
        "writable and run again"
    )
    torch.save({"global_step": 4}, checkpoints / "last.ckpt")
    assert refused_write(err, target, checkpoints).endswith(
        f"last.ckpt (step 4) is intact; make {target.parent} writable and resume with ckpt_path=last"
    )
    # in a run, its run dir: the same command without it makes a new dir (timestamped), where last finds nothing
    # (as a ddp_spawn rank's parent says it: tests/test_run_dir.py)
    monkeypatch.setattr(run_dir, "_SPAWNED", [f"resume with hydra.run.dir={tmp_path} ckpt_path=last"])
    assert refused_write(err, target, checkpoints).endswith(
        f"writable and resume with hydra.run.dir={tmp_path} ckpt_path=last"
    )
    # of src.eval, which trains nothing: before, the same words of last.ckpt
    assert refused_write(err, target, checkpoints, trains=False) == (
        f"cannot write {target} (Read-only file system): make {target.parent} writable and run again"
    )
    full = OSError(errno.ENOSPC, "No space left on device")
    assert "free space and run again" in refused_write(full, target, checkpoints, trains=False)
    assert "last.ckpt" not in refused_write(full, target, checkpoints, trains=False)


def test_the_atomic_writer_leaves_only_the_final_file(tmp_path):
    AtomicCheckpointIO().save_checkpoint({"weights": torch.ones(3)}, tmp_path / "sub" / "a.ckpt")
    AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(3)}, tmp_path / "sub" / "a.ckpt")  # replaces it
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["a.ckpt"]
    assert torch.equal(load(tmp_path / "sub" / "a.ckpt")["weights"], torch.zeros(3))


def test_last_ckpt_keeps_its_previous_generation_beside_it(tmp_path):
    io = AtomicCheckpointIO()
    for step in (1, 2, 3):
        io.save_checkpoint({"global_step": step}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.prev.ckpt"]  # no temp file either
    assert load(tmp_path / "last.ckpt")["global_step"] == 3 and load(tmp_path / "last.prev.ckpt")["global_step"] == 2


def test_a_folder_that_turns_read_only_between_the_write_and_the_rename_is_one_line_naming_last_ckpt(
    tmp_path, monkeypatch
):
    """The remount lands after the temp file is open (it stays writable) and before it is renamed: the rename fails,
    and so does the temp file's removal. The line names last.ckpt, not the temp file nor the removal's error."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    folder = tmp_path / "checkpoints"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 4}, folder / "last.ckpt")
    rename = os.replace

    def remount_then_rename(src, dst):
        monkeypatch.setattr(os, "replace", rename)
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        return rename(src, dst)

    monkeypatch.setattr(os, "replace", remount_then_rename)
    try:
        with pytest.raises(StorageError) as raised:
            io.save_checkpoint({"global_step": 8}, folder / "last.ckpt")
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
    assert str(raised.value) == (
        f"cannot write {folder}/last.ckpt (Read-only file system): the previous last.ckpt (step 4) is intact; "
        f"make {folder} writable and resume with ckpt_path=last"
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 10 MB tmpfs of the test's own: room for one checkpoint of FAST's narrow ResNet-18 (5.8 MB), not for writing
    a second."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def stop_by_itself(proc: subprocess.Popen, limit_s: float) -> tuple[str, float, list[int]]:
    """Wait for a run that is expected to fail by itself; return its output, the seconds it took, what is left."""
    everyone = [proc.pid, *descendants(proc.pid)]
    out, seconds = finish(proc, everyone, limit_s=limit_s)
    return out, seconds, [p for p in everyone if running(p)]


def test_a_full_disk_while_writing_last_ckpt_stops_every_rank_with_one_line_and_keeps_the_previous_file(small_disk):
    run_dir = small_disk / "run"
    started = time.monotonic()
    proc = start_and_wait_for_step(run_dir, 2, *LONG, "strategy=ddp", "trainer.devices=2", ranks=2)
    out, _, left = stop_by_itself(proc, limit_s=60)
    assert time.monotonic() - started < 90 and proc.returncode == 1 and not left, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1 and re.fullmatch(
        rf"error: rank 0: no space left on device writing {run_dir}/checkpoints/last.ckpt \(\d+ MB needed, \d+ MB "
        rf"free\): the previous last.ckpt \(step 2\) is intact; free space and resume with hydra.run.dir={run_dir} "
        r"ckpt_path=last",
        errors[0],
    ), out[-3000:]
    assert "Traceback" not in out and "Callback" not in out
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 2  # whole, weights-only
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))


@pytest.mark.parametrize("how", ["read-only", "vanished"])
def test_a_run_dir_that_turns_read_only_or_vanishes_mid_run_stops_the_run_with_one_line(how, tmp_path):
    if how == "read-only" and os.geteuid() != 0:
        pytest.skip("making the run dir read-only under a running process needs root (a read-only bind mount)")
    run_dir = tmp_path / "run"
    proc = start_and_wait_for_step(
        run_dir,
        2,
        *LONG,
        "strategy=ddp",
        "trainer.devices=2",
        "callbacks.last_checkpoint.every_n_train_steps=4",
        ranks=2,
    )
    if how == "read-only":  # files the run holds open stay writable, as on a filesystem remounted read-only
        subprocess.run(["mount", "--bind", str(run_dir), str(run_dir)], check=True)
        try:
            # the kernel refuses to make a mount read-only while a write through it is under way (EBUSY, "mount point
            # is busy"): a file the run opened through the new bind mount in between, a checkpoint's or TensorBoard's
            # (which opens its file again at each flush). Those writes take milliseconds: try again.
            for _ in range(50):
                remounted = subprocess.run(["mount", "-o", "remount,bind,ro", str(run_dir)], capture_output=True)
                if remounted.returncode == 0:
                    break
                time.sleep(0.1)
            assert remounted.returncode == 0, remounted.stderr
            out, seconds, left = stop_by_itself(proc, limit_s=60)
        finally:
            subprocess.run(["umount", "-l", str(run_dir)], check=False)
    else:  # gone at once: a removal file by file raced the run's next checkpoint into the folder being removed
        gone = tmp_path / "gone"
        run_dir.rename(gone)
        shutil.rmtree(gone)
        out, seconds, left = stop_by_itself(proc, limit_s=60)
    assert proc.returncode == 1 and seconds < 30 and not left, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1, out[-3000:]
    if how == "read-only":
        # the next last.ckpt, or TensorBoard's next flush (it opens its file again each time), whichever comes first;
        # the line names the step of the last.ckpt that stays whole: step 4's, or a later one's where the remount's
        # tries outlasted a few steps (seen under a full suite's load: step 8's)
        intact = load(run_dir / "checkpoints" / "last.ckpt")["global_step"]
        assert intact >= 4 and intact % 4 == 0, intact
        assert re.fullmatch(
            rf"error: rank 0: cannot write {run_dir}/(checkpoints/last.ckpt|tensorboard/events\S+) "
            rf"\(Read-only file system\): (the previous )?last.ckpt \(step {intact}\) is intact; "
            rf"make {run_dir}/\w+ writable and resume with hydra.run.dir={run_dir} ckpt_path=last",
            errors[0],
        ), errors[0]
        assert not list((run_dir / "checkpoints").glob(".*tmp*"))
    else:
        assert errors[0].startswith(f"error: rank 0: {run_dir} vanished during the run"), errors[0]
    assert "Traceback" not in out


def test_ckpt_path_auto_passes_over_an_unreadable_last_ckpt_for_the_newest_intact_one(tmp_path):
    run = [
        *FAST,
        "trainer.limit_train_batches=4",
        "callbacks.last_checkpoint.every_n_train_steps=2",
        "callbacks.model_checkpoint=null",
        "test=false",
        f"hydra.run.dir={tmp_path}",
    ]
    assert train(*run).returncode == 0
    last, previous = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "checkpoints" / "last.prev.ckpt"
    assert load(last)["global_step"] == 4 and load(previous)["global_step"] == 2
    with open(last, "r+b") as f:  # what a node lost mid-write on a filesystem without ordered writes leaves
        f.truncate(last.stat().st_size // 2)

    with pytest.raises(UserError, match=f"ckpt_path={last} is not a checkpoint"):  # a path given: that file or nothing
        resume_from(str(last), str(tmp_path / "checkpoints"))

    resumed = train(*run, "trainer.max_epochs=2", "ckpt_path=auto")
    assert resumed.returncode == 0, output(resumed)[-3000:]
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning:")]
    assert (
        len(warnings) == 1
        and warnings[0].startswith(f"warning: {last} cannot be read (")
        and warnings[0].endswith(f"resuming from {previous} (step 2), the newest intact checkpoint of the run dir")
    ), warnings
    assert load(last)["global_step"] == 8  # step 2 to the end of epoch 2: 6 steps, none skipped


def test_a_checkpoint_that_needs_full_unpickling_loads_only_with_ckpt_trusted(tmp_path):
    first = tmp_path / "first"
    result = train(*FAST, f"hydra.run.dir={first}")
    assert result.returncode == 0, output(result)[-3000:]
    checkpoint = torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    checkpoint["note"] = argparse.Namespace(origin="someone else's tool")  # any object beyond tensors and numbers
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save(checkpoint, unsafe)

    refused = train(*FAST, "trainer.max_epochs=2", f"ckpt_path={unsafe}", f"hydra.run.dir={tmp_path}/refused")
    assert refused.returncode == 2 and "Traceback" not in output(refused)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"ckpt_path={unsafe}" in errors[0] and "ckpt_trusted=true" in errors[0], errors

    trusted = train(
        *FAST, "trainer.max_epochs=2", f"ckpt_path={unsafe}", "ckpt_trusted=true", f"hydra.run.dir={tmp_path}/trusted"
    )
    assert trusted.returncode == 0, output(trusted)[-3000:]
    assert load(tmp_path / "trusted" / "checkpoints" / "last.ckpt")["global_step"] == 4  # 2 steps more


def test_a_torch_file_that_lightning_did_not_write_is_one_line_for_train_eval_export_and_predict(tmp_path):
    """What users hand in for a checkpoint: a plain state dict, one tensor, a list; a Lightning-like dict without the
    model's hyperparameters. Before, a file that held no dict ended src.train and the others on a traceback."""
    import torchvision

    from src.checkpoints.files import read_checkpoint
    from src.checkpoints.resume import check_compatible, model_from

    refused = "is not a checkpoint of this project's model"
    dicts = {
        "state_dict.pt": torchvision.models.resnet18(num_classes=10).state_dict(),
        "no_hyper_parameters.pt": {"state_dict": {}, "pytorch-lightning_version": "2.5.0"},
    }
    for name, content in dicts.items():
        path = tmp_path / name
        torch.save(content, path)
        checkpoint = read_checkpoint(path)
        with pytest.raises(UserError, match=f"ckpt_path={path} {refused}"):
            check_compatible(checkpoint, path, {"arch": "resnet18"})  # src.train
        with pytest.raises(UserError, match=f"ckpt_path={path} {refused}"):
            model_from(checkpoint, path)  # src.eval, src.export, src.predict
    for name, content, kind in (("tensor.pt", torch.zeros(3), "Tensor"), ("list.pt", [{"w": torch.zeros(2)}], "list")):
        path = tmp_path / name
        torch.save(content, path)
        for trusted in (False, True):  # every command reads through read_checkpoint
            with pytest.raises(UserError, match=rf"ckpt_path={path} {refused} \(it holds a {kind}, not the dict"):
                read_checkpoint(path, trusted=trusted)


def _refusals(paths: list[str]) -> list[str]:
    from src.checkpoints.files import read_checkpoint
    from src.serving.formats import load_model

    lines = []
    for path in paths:
        for read, given in ((read_checkpoint, Path(path)), (load_model, path)):  # src.train, src.eval; src.predict
            try:
                read(given, trusted=False)
            except UserError as err:  # a refusal for what the file holds ({"state_dict": {}}) comes after the read
                lines.append(str(err) if "cannot be read" in str(err) else "read")
            else:
                lines.append("read")
    return lines


def test_a_checkpoint_behind_permissions_is_one_line_naming_the_file_or_the_folder_that_refused(tmp_path):
    """Another user's checkpoint or run dir. Before, a file in a folder that may not be entered was 'cannot write'
    (the run's storage error), and a folder that may not be listed 'holds no .ckpt file'."""
    torch.save({"state_dict": {}}, tmp_path / "unreadable.ckpt")
    (tmp_path / "unreadable.ckpt").chmod(0o000)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {}}, tmp_path / "run" / "checkpoints" / "last.ckpt")
    (tmp_path / "run").chmod(0o000)
    shut = f"{tmp_path}/run"
    try:
        lines = without_root_permissions(
            _refusals, [f"{tmp_path}/unreadable.ckpt", f"{shut}/checkpoints/last.ckpt", shut]
        )
    finally:
        (tmp_path / "run").chmod(0o755)
    fix = "fix that folder's permissions, or pass another checkpoint"
    assert lines == [
        *[
            f"ckpt_path={tmp_path}/unreadable.ckpt cannot be read (Permission denied): fix its permissions, or pass "
            "another checkpoint"
        ]
        * 2,
        *[f"ckpt_path={shut}/checkpoints/last.ckpt cannot be read (Permission denied on {shut}): {fix}"] * 2,
        *[f"ckpt_path={shut} cannot be read (Permission denied on {shut}): {fix}"] * 2,
    ]
    (tmp_path / "run").chmod(0o111)  # entered, not listed: a file named in it is read; the folder is not searched
    lines = without_root_permissions(_refusals, [f"{shut}/checkpoints/last.ckpt", shut])
    (tmp_path / "run").chmod(0o755)
    assert lines == [
        "read",
        "read",
        *[f"ckpt_path={shut} cannot be read (Permission denied on {shut}): {fix}"] * 2,
    ]


def _checkpoint_folder_refusals(folders: list[str]) -> list[str]:
    from omegaconf import OmegaConf

    from src.core.settings import check_checkpoint_folder

    return refusal_lines(
        lambda folder: check_checkpoint_folder(
            OmegaConf.create({"task_name": "train", "paths": {"checkpoints": folder}})
        ),
        folders,
    )


def test_a_checkpoint_folder_that_cannot_be_made_or_written_is_one_line_as_the_run_starts(tmp_path):
    """Before, found at the first save, an epoch in (hours, for a long one): 'cannot write .../best-....ckpt'; a file
    in the folder's way ended the run there on a traceback. tests/test_errors.py runs one of these as a command."""
    (tmp_path / "file").write_text("x")
    for name in ("shut", "read-only"):
        (tmp_path / name / "in").mkdir(parents=True)
    (tmp_path / "read-only").chmod(0o555)
    (tmp_path / "shut").chmod(0o000)
    given = [
        *(f"{tmp_path}/{name}" for name in ("new/deep", "file", "file/x", "read-only", "read-only/x", "shut/in/x")),
        "s3://bucket/run",  # the object store's own checks
    ]
    try:
        lines = without_root_permissions(_checkpoint_folder_refusals, given)
    finally:
        (tmp_path / "shut").chmod(0o755)
        (tmp_path / "read-only").chmod(0o755)
    fix = "pass paths.checkpoints=DIR somewhere you can write, or fix its permissions"
    assert lines == [
        "taken",
        f"paths.checkpoints={tmp_path}/file is a file, not a folder: pass paths.checkpoints=DIR (or leave it out: "
        "the run dir's checkpoints/)",
        f"paths.checkpoints={tmp_path}/file/x lies under {tmp_path}/file, a file, not a folder: pass "
        "paths.checkpoints=DIR (or leave it out: the run dir's checkpoints/)",
        f"paths.checkpoints={tmp_path}/read-only cannot be written (Permission denied on {tmp_path}/read-only): {fix}",
        f"paths.checkpoints={tmp_path}/read-only/x cannot be written (Permission denied on {tmp_path}/read-only): "
        f"{fix}",
        f"paths.checkpoints={tmp_path}/shut/in/x cannot be written (Permission denied on {tmp_path}/shut): {fix}",
        "taken",
    ]
    assert not (tmp_path / "new").exists()  # nothing made
