"""A real Slurm cluster for the tests, started from the project's own slurm/testcluster/ scripts.

Debian's slurmctld, slurmd and munge run as plain daemons with all state in a temp dir: one node,
or two nodes in network namespaces. Jobs run the project's code from this checkout.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

CLUSTER = ROOT / "slurm" / "testcluster"
CLUSTER_LOCK = Path("/tmp/cifar10-ddp-testcluster.lock")
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class Cluster:
    """Submit to, and read back from, one running test cluster."""

    def __init__(self, state_dir: Path, env: dict[str, str], lock) -> None:
        self.state_dir, self.env = state_dir, env
        self.lock = lock  # the flock on CLUSTER_LOCK this cluster holds until stop_cluster
        self.job_ids: list[str] = []

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed: {result.stdout}{result.stderr}")
        return result

    def sbatch(self, *args: str) -> str:
        job_id = self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]
        self.job_ids.append(job_id)
        return job_id

    def show(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.show(job_id)
            if info.get("JobState") in TERMINAL:
                return info
            time.sleep(1)
        self.run("scancel", job_id, check=False)
        raise AssertionError(f"job {job_id} still {info.get('JobState')} after {timeout} s:\n{self.log(job_id)}")

    def log(self, job_id: str) -> str:
        path = ROOT / "outputs" / "slurm" / f"{job_id}.out"
        return path.read_text() if path.exists() else "(no log)"

    def cleanup_outputs(self) -> None:
        for job_id in self.job_ids:
            shutil.rmtree(ROOT / "outputs" / "slurm" / job_id, ignore_errors=True)
            (ROOT / "outputs" / "slurm" / f"{job_id}.out").unlink(missing_ok=True)


def start_cluster(tmp_path_factory, nodes: int):
    if os.geteuid() != 0:
        pytest.skip("the test cluster's daemons run as root")
    state = tmp_path_factory.mktemp(f"slurm{nodes}")
    # one test cluster at a time on this machine (its ports): make test's other worker waits here for the first
    lock = open(CLUSTER_LOCK, "w")  # noqa: SIM115 - held until stop_cluster
    fcntl.flock(lock, fcntl.LOCK_EX)
    started = subprocess.run(
        [str(CLUSTER / "start.sh"), str(state), str(nodes)], capture_output=True, text=True, timeout=600
    )
    if started.returncode != 0:
        subprocess.run([str(CLUSTER / "stop.sh"), str(state)], capture_output=True, timeout=120)
        lock.close()
        raise RuntimeError(f"the Slurm test cluster did not start:\n{started.stdout}{started.stderr}")
    conf = re.search(r"export SLURM_CONF=(\S+)", started.stdout).group(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"SLURM_CONF": conf, "PYTHONUNBUFFERED": "1"})
    return Cluster(state, env, lock)


def stop_cluster(cluster: Cluster) -> None:
    try:
        subprocess.run([str(CLUSTER / "stop.sh"), str(cluster.state_dir)], capture_output=True, timeout=180)
        cluster.cleanup_outputs()
    finally:
        cluster.lock.close()
