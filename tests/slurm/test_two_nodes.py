"""slurm/train.sbatch across two Slurm nodes (network namespaces on this machine), one task each."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FAST, ROOT
from tests.slurm.conftest import start_cluster, stop_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory, nodes=2)
    yield cluster
    stop_cluster(cluster)


def test_an_exception_on_the_second_nodes_rank_fails_the_job_at_once_with_one_line(cluster):
    job = cluster.sbatch(
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=0",
        "slurm/train.sbatch",
        *FAST,
        "test=false",
        "data.num_train=2000",
        "trainer.limit_train_batches=null",
        "+callbacks.fault._target_=tests.faults.RaiseAt",
        "+callbacks.fault.rank=1",
        "+callbacks.fault.step=3",
    )
    info = cluster.wait(job, timeout=180)
    log = cluster.log(job)
    assert info["JobState"] == "FAILED", log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: RuntimeError: injected failure at step 3"), log
    assert "Traceback" not in log
    days, _, clock = info["RunTime"].rpartition("-")  # [d-]hh:mm:ss
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    assert not days and hours * 3600 + minutes * 60 + seconds < 90, info["RunTime"]  # at the failure, not epoch's end


def test_srun_torchrun_across_two_nodes_trains_one_world_with_torchruns_ranks(cluster):
    """slurm/torchrun.sbatch: one torchrun agent per node (srun), rendezvous on the first node, Slurm's checks
    out of the way (torchrun started the ranks)."""
    job = cluster.sbatch(
        "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2", "slurm/torchrun.sbatch", *FAST, "test=false"
    )
    info = cluster.wait(job)
    log = cluster.log(job)
    assert info["JobState"] == "COMPLETED", log
    run_dir = ROOT / "outputs" / "slurm" / job
    record = json.loads((run_dir / "throughput.json").read_text())
    assert record["world_size"] == 2 and record["num_nodes"] == 2 and record["hosts"] == ["node1", "node2"]
    assert [p.relative_to(run_dir) for p in run_dir.rglob("last.ckpt")] == [Path("checkpoints/last.ckpt")]
    assert "Run: 2 node(s) x 1 device(s) = world size 2 | strategy ddp" in log
    assert "error:" not in log


def test_a_rank_that_hangs_on_the_second_node_is_named_with_its_stack_within_seconds(cluster):
    job = cluster.sbatch(
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=0",
        "slurm/train.sbatch",
        *FAST,
        "test=false",
        "data.num_train=2000",
        "trainer.limit_train_batches=null",
        "strategy.hang_timeout_s=6",
        "+callbacks.fault._target_=tests.faults.SleepAt",
        "+callbacks.fault.rank=1",
        "+callbacks.fault.step=3",
    )
    info = cluster.wait(job, timeout=180)
    log = cluster.log(job)
    assert info["JobState"] == "FAILED", log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 (host node2, pid "), log
    assert "at step 3 of epoch 0, in a training step, while rank 0 waited for it" in errors[0]
    stacks = ROOT / "outputs" / "slurm" / job / "train_rank1.log"
    assert f"its Python stack is in {stacks};" in errors[0] and "tests/faults.py" in stacks.read_text()
    days, _, clock = info["RunTime"].rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    assert not days and hours * 3600 + minutes * 60 + seconds < 90, info["RunTime"]  # not strategy.timeout_s's 300


@pytest.fixture
def node1_resolves_itself_elsewhere(cluster):
    """node1 as a multi-homed node: a second address, 10.200.1.11 (its fast network, say), that its own /etc/hosts
    gives its name, while node2's /etc/hosts (DNS, say) gives the first, 10.200.0.11. Both addresses reach node1."""
    hosts = cluster.state_dir / "etc" / "hosts.node1"
    before = hosts.read_text()
    commands = [
        ["ip", "-n", "c10-n1", "addr", "add", "10.200.1.11/24", "dev", "c10-v1n"],
        ["ip", "-n", "c10-n2", "route", "add", "10.200.1.0/24", "dev", "c10-v2n"],
    ]
    for command in commands:
        subprocess.run(command, check=True, capture_output=True)
    with open(hosts, "w") as f:  # in place: the file node1's mount namespace has over /etc/hosts
        f.write(before.replace("10.200.0.11 node1", "10.200.1.11 node1"))
    try:
        yield
    finally:
        with open(hosts, "w") as f:
            f.write(before)
        for command in reversed(commands):
            subprocess.run([*command[:3], command[3].replace("add", "del"), *command[4:]], capture_output=True)


def test_a_node_that_resolves_node_0s_name_elsewhere_is_named_and_with_store_bind_all_two_nodes_train_one_world(
    cluster, node1_resolves_itself_elsewhere
):
    """The job that works is the two-node job of slurm/train.sbatch, one task a node, as users submit it, but for
    strategy.store_bind=all: one world of two across the nodes, one checkpoint folder (the exception and hang tests
    above form the same world with the default store_bind=master_addr, and train in it until their faults)."""
    args = ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "slurm/train.sbatch", *FAST, "test=false"]
    # strategy.store_bind=master_addr: node1 listens on 10.200.1.11 only; node2, refused at 10.200.0.11, stops after 5 s
    job = cluster.sbatch(*args, "strategy.timeout_s=5")
    info = cluster.wait(job, timeout=180)
    log = cluster.log(job)
    assert info["JobState"] == "FAILED", log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert any("this node dialled 10.200.0.11:" in e and "set strategy.store_bind=all" in e for e in errors), log
    assert any("10.200.0.11:" in e and "refused the connection" in e for e in errors), log  # what node2 met
    assert any("node 0's store listened on 10.200.1.11:" in e for e in errors), log
    job = cluster.sbatch(*args, "strategy.timeout_s=60", "strategy.store_bind=all")
    info = cluster.wait(job, timeout=180)
    assert info["JobState"] == "COMPLETED", cluster.log(job)
    assert "Run: 2 node(s) x 1 device(s) = world size 2" in cluster.log(job)
    run_dir = ROOT / "outputs" / "slurm" / job
    record = json.loads((run_dir / "throughput.json").read_text())
    assert record["world_size"] == 2 and record["num_nodes"] == 2 and len(set(record["pids"])) == 2
    assert record["hosts"] == ["node1", "node2"]
    assert [p.relative_to(run_dir) for p in run_dir.rglob("last.ckpt")] == [Path("checkpoints/last.ckpt")]
