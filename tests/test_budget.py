"""The suite's time budget reads the CPUs it may use: a cgroup's CPU quota (a container's ``--cpus``, a Kubernetes
limit) is invisible to the fixed work's CPU seconds, yet the suite's workers share it. At a third of the reference's
two cores (a quota of 0.67 CPU), ``make test`` took 2.97 times as long, and the budget now allows for that."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests import budget
from tests.conftest import ROOT


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_quota_is_the_tightest_of_the_cgroup_and_its_parents_in_either_cgroup_version(tmp_path):
    v2 = tmp_path / "v2"
    write(v2 / "cpu.max", "max 100000\n")
    write(v2 / "ci" / "cpu.max", "150000 100000\n")
    write(v2 / "ci" / "job" / "cpu.max", "max 100000\n")
    assert budget.quota_cpus("0::/ci/job\n", v2) == 1.5
    write(v2 / "ci" / "job" / "cpu.max", "50000 100000\n")
    assert budget.quota_cpus("0::/ci/job\n", v2) == 0.5
    assert budget.quota_cpus("0::/\n", v2) is None  # the root's max: no quota

    v1 = tmp_path / "v1"
    for folder, quota in ((v1 / "cpu,cpuacct", "-1"), (v1 / "cpu,cpuacct" / "slow", "66667")):
        write(folder / "cpu.cfs_quota_us", f"{quota}\n")
        write(folder / "cpu.cfs_period_us", "100000\n")
    write(v1 / "memory" / "cpu.cfs_quota_us", "1\n")  # another controller's hierarchy is not read
    hybrid = "4:memory:/slow\n2:cpu,cpuacct:/slow\n0::/\n"  # v1 controllers beside an empty v2 hierarchy
    assert budget.quota_cpus(hybrid, v1) == pytest.approx(0.66667)
    # a container's own cgroup mounted as the root: the path it is given is not there, its root's quota is
    write(v1 / "cpu,cpuacct" / "cpu.cfs_quota_us", "100000\n")
    assert budget.quota_cpus("2:cpu,cpuacct:/docker/0123abcd\n", v1) == 1.0
    assert budget.quota_cpus("2:cpu,cpuacct:/\n", tmp_path / "nothing") is None


def test_a_process_under_a_real_cpu_quota_reads_it_and_its_budget_grows_by_the_cpus_it_lacks():
    """A child process in a real cgroup v1 ``cpu`` hierarchy with a quota of half a CPU: it reads the quota from its
    own /proc/self/cgroup, and the budget grows by the reference's two cores over that half."""
    hierarchy = Path("/sys/fs/cgroup/cpu")
    if not (hierarchy / "cpu.cfs_quota_us").is_file() or not os.access(hierarchy, os.W_OK):
        pytest.skip("needs a writable cgroup v1 cpu hierarchy (root, cgroup v1)")
    group = hierarchy / f"cifar10-ddp-budget-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
        code = "from tests import budget; print(budget.quota_cpus(), *budget.cpus_factor(2), sep='|')"
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=lambda: (group / "tasks").write_text(str(os.getpid())),
        )
    finally:
        group.rmdir()
    assert result.returncode == 0, result.stderr
    cores = len(os.sched_getaffinity(0))
    assert result.stdout.strip().split("|") == ["0.5", str(2 / min(cores, 0.5)), f"a CPU quota of 0.5 of {cores} cores"]


def test_the_tests_pace_is_the_weighted_median_of_the_measured_tests_and_a_new_test_counts_nothing():
    """The budget's second measure of this machine's pace (the larger of the two counts): the tests' own seconds
    against the reference's, over the whole session."""
    reference = {f"t{i}": 2.0 for i in range(40)} | {"tiny": 0.1, "slower": 30.0, "faster": 10.0}
    took = {f"t{i}": 6.0 for i in range(40)} | {"tiny": 5.0, "slower": 300.0, "faster": 10.0, "new": 100.0}
    # x 3 for most; a test ten times slower than the rest does not move it, nor a tiny one, nor one not measured there
    assert budget.tests_pace(took, reference) == (3.0, 42)
    # weighed by the reference's seconds: a long test at its own pace outweighs shorter ones
    assert budget.tests_pace(took | {"faster": 200.0}, reference | {"faster": 200.0}) == (1.0, 42)
    assert budget.tests_pace({"t1": 6.0}, reference) is None  # a subset: too few to tell
