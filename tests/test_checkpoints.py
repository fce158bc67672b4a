"""Checkpoints: a run killed anywhere resumes to the very weights of an uninterrupted one; a write killed half way
leaves the previous file whole; files that need full unpickling load only on request."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from src.checkpoints import AtomicCheckpointIO, remove_stale_temp_files
from tests.conftest import FAST, output, train
from tests.test_supervision import finish, last_step, start_and_wait_for_step

# Deterministic CPU training, 3 epochs of 12 steps, last.ckpt every 2 steps.
EXACT = [*FAST, "data.num_train=200", "trainer.limit_train_batches=12", "trainer.max_epochs=3", "trainer.deterministic=true",
         "callbacks.last_checkpoint.every_n_train_steps=2", "callbacks.progress_bar=null", "test=false"]
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


def assert_same_training(resumed: dict, reference: dict) -> None:
    assert resumed["global_step"] == reference["global_step"] == 36 and resumed["epoch"] == reference["epoch"]
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
    proc = start_and_wait_for_step(tmp_path, 4, *EXACT, *WORLDS[world], ranks=len(WORLDS[world]))
    os.kill(proc.pid, sig)
    out, _ = finish(proc, [proc.pid], limit_s=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM), out[-3000:]
    stopped_at = last_step(tmp_path)
    assert 4 <= stopped_at < 36 and stopped_at % 12 != 0  # mid-epoch: a step checkpoint, not an epoch's end

    result = train(*EXACT, *WORLDS[world], "ckpt_path=last", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, output(result)[-3000:]
    assert "Restoring states from the checkpoint" in output(result)
    assert_same_training(load(tmp_path / "checkpoints" / "last.ckpt"), uninterrupted[world])


def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_whole(tmp_path):
    """ResNet-50 checkpoints (~280 MB with momentum) take long enough to write that the kill lands inside one."""
    proc = train(*FAST, "model.arch=resnet50", "data.num_train=400", "trainer.limit_train_batches=null",
                 "callbacks.last_checkpoint.every_n_train_steps=1", "callbacks.progress_bar=null", "test=false",
                 f"hydra.run.dir={tmp_path}", background=True)
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


def test_the_atomic_writer_leaves_only_the_final_file(tmp_path):
    AtomicCheckpointIO().save_checkpoint({"weights": torch.ones(3)}, tmp_path / "sub" / "a.ckpt")
    AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(3)}, tmp_path / "sub" / "a.ckpt")  # replaces it
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["a.ckpt"]
    assert torch.equal(load(tmp_path / "sub" / "a.ckpt")["weights"], torch.zeros(3))


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

    trusted = train(*FAST, "trainer.max_epochs=2", f"ckpt_path={unsafe}", "ckpt_trusted=true",
                    f"hydra.run.dir={tmp_path}/trusted")
    assert trusted.returncode == 0, output(trusted)[-3000:]
    assert load(tmp_path / "trusted" / "checkpoints" / "last.ckpt")["global_step"] == 4  # 2 steps more
