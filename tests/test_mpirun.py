"""mpirun as a launcher: Debian's Open MPI starting real ranks (gloo, CPU, synthetic data, resnet18), each bound to
a core as mpirun binds them, Lightning reading who is who through mpi4py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import FAST, ROOT, late_python
from tests.test_supervision import RAISE, error_lines


@pytest.fixture(scope="module")
def mpirun() -> str:
    """Open MPI's mpirun, installed from Debian when missing (as the Slurm test cluster installs Slurm)."""
    found = shutil.which("mpirun")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
            "--no-install-recommends -o DPkg::Lock::Timeout=120 openmpi-bin",
            shell=True,
            check=True,
            capture_output=True,
            timeout=600,
        )
        found = shutil.which("mpirun")
    if found is None:
        pytest.skip("mpirun is not installed, and apt-get cannot install openmpi-bin here (root needed)")
    return found


def run_mpirun(
    mpirun: str, *overrides: str, ranks: int = 2, python: str = sys.executable
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # mpirun binds each rank to a core of its own (its default at 2 ranks); --oversubscribe only where there are fewer
    cmd = [mpirun, "-np", str(ranks), "--oversubscribe", python, "-m", "src.train", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_mpiruns_ranks_train_one_world_and_a_failing_rank_stops_the_other_with_one_line(mpirun, tmp_path):
    args = [*FAST, "strategy=ddp", "trainer.devices=2", "strategy.timeout_s=60"]
    # the default run dir's form (timestamped), and rank 1 started 1.2 s after rank 0, as a slow node starts it:
    # before, each rank took its own clock's time, and rank 1 wrote its log into a dir of its own
    late = late_python(tmp_path / "python", "OMPI_COMM_WORLD_RANK", 1)
    result = run_mpirun(mpirun, *args, f"hydra.run.dir={tmp_path}/runs/${{now:%H-%M-%S}}", python=str(late))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    named = [p.name for p in (tmp_path / "runs").iterdir()]  # one dir, named after mpirun's PMIx namespace
    assert len(named) == 1 and named[0].startswith("mpirun-"), named
    run = tmp_path / "runs" / named[0]
    log = (run / "train.log").read_text()
    assert "world size 2 | strategy ddp | backend gloo" in log, log[-3000:]
    assert "test accuracy" in log
    # each rank knew which it was: rank 1 wrote its own log, and rank 0 alone the checkpoints
    assert (run / "train_rank1.log").exists()
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["saved_by"]["world_size"] == 2 and last["global_step"] == 2

    start = time.monotonic()
    result = run_mpirun(
        mpirun,
        *args,
        *RAISE,
        "+callbacks.fault.rank=1",
        "trainer.limit_train_batches=6",
        f"hydra.run.dir={tmp_path}/failing",
    )
    out = result.stdout + result.stderr
    assert result.returncode != 0 and time.monotonic() - start < 60, out[-3000:]
    errors = error_lines(result.stdout + "\n" + result.stderr)
    assert errors and all(re.match(r"error: rank 1: RuntimeError: injected failure at step 3", e) for e in errors), out[
        -3000:
    ]
    assert "Traceback" not in out

    # a mistake in the config, before MPI is initialised: local rank 0 says it, once (before: every rank). The
    # default dir's form, under a folder of the test's own, and rank 0 started 1.2 s late: rank 1 makes the run dir
    # and its parents, rank 0 finds the run dir there and takes back only it, and rank 1, quiet until rank 0 has
    # ended (or mpirun stops it), takes back the parents it made (before: they stayed, empty)
    late0 = late_python(tmp_path / "python0", "OMPI_COMM_WORLD_RANK", 0)
    default = f"hydra.run.dir={tmp_path}/default/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}"
    result = run_mpirun(
        mpirun, *FAST, "strategy=ddp", "trainer.devices=2", "trainer.max_epochs=0", default, python=str(late0)
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert not (tmp_path / "default").exists(), sorted(map(str, (tmp_path / "default").rglob("*")))
    assert error_lines(out) == [
        "error: trainer.max_epochs=0 must be a whole number >= 1: the epochs to train (Lightning's -1, 'forever', "
        "would leave the learning-rate schedule without an end)"
    ], out[-3000:]

    # a world of 2 with trainer.devices=3: before, it trained, its run line saying "1 node(s) x 3 device(s) = world
    # size 2"; now refused before Lightning loads (once MPI is initialised, each rank says it)
    result = run_mpirun(mpirun, *FAST, "strategy=ddp", "trainer.devices=3", f"hydra.run.dir={tmp_path}/mismatch")
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert set(error_lines(out)) == {
        "error: mpirun started 2 processes, but trainer.num_nodes x trainer.devices is 1 x 3 = 3: make them equal "
        "(trainer.devices: the ranks mpirun starts on each node)"
    }, out[-3000:]

    # the world's count right, each node's wrong: 2 ranks on this one node, trainer.devices=1 trainer.num_nodes=2
    # (before: an IndexError and a traceback in rank 1, rank 0 waiting for it)
    # once MPI is initialised each rank says it: rank 1 waits for rank 0 to take the run dir back, then takes back
    # the parents it made
    result = run_mpirun(
        mpirun, *FAST, "strategy=ddp", "trainer.devices=1", "trainer.num_nodes=2", default, python=str(late0)
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert not (tmp_path / "default").exists(), sorted(map(str, (tmp_path / "default").rglob("*")))
    assert set(error_lines(out)) == {
        "error: mpirun started 2 of its 2 processes on this node, but trainer.devices=1: Lightning runs "
        "trainer.devices ranks on every node: place 1 a node (mpirun --map-by ppr:1:node), or make trainer.devices "
        "the ranks each node runs"
    }, out[-3000:]
