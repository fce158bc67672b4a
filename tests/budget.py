"""The suite's time budget (docs/development.md, The suite's time), and the inner loop's selection.

The whole suite gets BUDGET_S of pytest on the reference CPU. A slower CPU gets more, by the ratio of the CPU seconds
it takes for a fixed piece of work (a cold ``python -m src.train`` of two ResNet-18 steps: the imports, the
training at this CPU's precision and the checkpoints, what the suite's processes spend their time on) to the
reference CPU's seconds, both measured, never guessed; or by the tests' own pace over the session (``tests_pace``),
where that is larger: the fixed work is measured once, at the end, and a machine's pace can change within the
suite's minutes. A faster one gets no less. Fewer CPUs than the reference's
(its cores, or a cgroup's CPU quota below them: a container's ``--cpus``, a Kubernetes limit, which the fixed
work's CPU seconds do not show) get more by the ratio of the two. A whole-suite session past its budget fails, so
a new slow test has to pay for itself elsewhere.

``tests/durations.json`` holds the reference CPU's seconds for the fixed work and each test's seconds there (setup,
call and teardown, under ``make test``'s workers); ``make test-fast`` runs the tests of at most FAST_S and the
smoke run. ``python -m tests.budget JUNIT_XML CPU [FIXED_WORK_S]`` writes it again from a ``make test`` run's junit
report, on the reference CPU.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

# on the reference CPU: 5 min 33 s to 5 min 57 s measured from fresh clones (three workers; four: no faster there,
# faster on an Intel Xeon with AMX, and make test's default since: docs/development.md), and a quarter for the spread
# between runs
BUDGET_S = 7.5 * 60
DURATIONS = Path(__file__).with_name("durations.json")
FAST_S = 1.0
SMOKE = "tests/test_train.py::test_single_process_run_writes_last_and_best_checkpoints_and_the_resolved_config"
WHOLE_SUITE_MIN_TESTS = 100  # fewer collected: a subset, not judged
PACE_MIN_S = 1.0  # the tests whose seconds give the suite's own pace: those of at least this there
PACE_MIN_TESTS = 30  # fewer of them ran: no pace from the tests
TOOK: dict[str, float] = {}  # this session's seconds of each test (setup, call and teardown), as its reports came
REFERENCE_CPUS = 2  # the reference CPU's cores, where durations.json does not say


def fixed_work_s() -> float:
    """The fixed work, in seconds: what the suite's processes spend their time on, measured the way a user meets
    it. A cold ``python -m src.train`` of two training steps of a ResNet-18 (batch 4) on synthetic data, with its
    validation step, checkpoints and test: the imports, the training at the precision ``auto`` picks on this CPU,
    the files. Its CPU seconds (user and system), not its wall time: the check runs as the suite ends, beside its
    teardown, and the same machine's wall time for it then ranged from 3.4 to 4.3 s (3.0 s idle); beside two busy
    loops its wall time went from 3.8 to 6.4 s and its CPU seconds from 4.0 to 4.2. The best of two."""
    import subprocess
    import tempfile

    from tests.conftest import FAST, ROOT

    best = float("inf")
    for _ in range(2):
        with tempfile.TemporaryDirectory() as run_dir:
            # torch's own count of threads, as a user's run has it (the suite's processes run at one: conftest.py)
            env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
            env.update({"PYTHONUNBUFFERED": "1", "CIFAR10_DDP_COLD": "1"})
            command = [sys.executable, "-m", "src.train", *FAST, f"hydra.run.dir={run_dir}"]
            with subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            ) as proc:
                output = proc.stdout.read() if proc.stdout else ""
                _, status, usage = os.wait4(proc.pid, 0)  # its CPU seconds, which Popen's own wait does not give
                proc.returncode = os.waitstatus_to_exitcode(status)  # reaped: the with's wait returns at once
            if proc.returncode != 0:
                raise RuntimeError(f"the budget's fixed work failed:\n{output[-4000:]}")
            best = min(best, usage.ru_utime + usage.ru_stime)
    return best


def quota_cpus(cgroup: str | None = None, root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs a cgroup's quota lets this process use, the tightest of its cgroup's and their parents' (cgroup v2's
    ``cpu.max``, v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), or None where none is set. ``cgroup``: the
    text of ``/proc/self/cgroup``. A container sees its own cgroup as the root where its path is not mounted."""
    if cgroup is None:
        try:
            cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    tightest: float | None = None
    for line in cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, v2 = root, True
        elif "cpu" in controllers.split(","):
            base, v2 = next((root / n for n in (controllers, "cpu", "cpu,cpuacct") if (root / n).is_dir()), root), False
        else:
            continue
        folder = base / path.lstrip("/")
        for level in [folder, *folder.parents]:
            if not level.is_relative_to(base):
                break
            try:
                if v2:
                    quota, period = (level / "cpu.max").read_text().split()
                else:
                    quota, period = ((level / f"cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period"))
            except (OSError, ValueError):
                continue
            if quota not in ("max", "-1") and int(period) > 0:
                cpus = int(quota) / int(period)
                tightest = cpus if tightest is None else min(tightest, cpus)
    return tightest


def cpus_factor(reference_cpus: float) -> tuple[float, str]:
    """How many times fewer CPUs this process may use than the reference had (at least 1), and what says so."""
    cores = len(os.sched_getaffinity(0))
    quota = quota_cpus()
    here = cores if quota is None else min(cores, quota)
    said = f"{cores} cores" if quota is None or quota >= cores else f"a CPU quota of {quota:.3g} of {cores} cores"
    return max(1.0, reference_cpus / here), said


def recorded() -> dict:
    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def mark_fast(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Mark ``fast`` the tests of at most FAST_S on the reference CPU that share no costly fixture, and the smoke
    run; a test not measured yet is not fast."""
    for item in items:
        if item.nodeid == SMOKE or (seconds.get(item.nodeid, FAST_S + 1) <= FAST_S and not shares_a_fixture(item)):
            item.add_marker(pytest.mark.fast)


def scope(nodeid: str) -> str:
    """What one worker of make test takes whole: a test file, or every file of ``tests/slurm/`` (they take turns on
    one test cluster: on two workers, the second would wait for the first's cluster to stop, its core idle)."""
    file = nodeid.split("::")[0]
    return "tests/slurm" if file.startswith("tests/slurm/") else file


def longest_files_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Order the files by their recorded seconds, the longest first, each file's tests in their own order: make
    test's workers take whole files (``--dist loadfile``) in this order, so no long file starts last while the
    other workers have nothing left (a file not measured yet goes first)."""
    per_scope: dict[str, float] = {}
    for nodeid, took in seconds.items():
        unit = scope(nodeid)
        per_scope[unit] = per_scope.get(unit, 0.0) + took
    position = {id(item): i for i, item in enumerate(items)}

    def order(item: pytest.Item) -> tuple[float, str, int]:
        unit = scope(item.nodeid)
        return -per_scope.get(unit, float("inf")), unit, position[id(item)]

    items.sort(key=order)


def shares_a_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module- or session-wide fixture of the suite's own (a trained checkpoint, a batch
    of bad command lines): its seconds are charged to the first test that uses it, not to this one."""
    info = getattr(item, "_fixtureinfo", None)
    for definitions in info.name2fixturedefs.values() if info is not None else ():
        for definition in definitions:
            code = getattr(definition.func, "__code__", None)
            if (
                definition.scope != "function"
                and code is not None
                and Path(code.co_filename).is_relative_to(Path(__file__).parent)
            ):
                return True
    return False


def whole_suite(session: pytest.Session) -> bool:
    config = session.config
    option = config.option
    tests = Path(__file__).parent
    paths = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    return (
        session.testscollected >= WHOLE_SUITE_MIN_TESTS
        and not option.collectonly
        and not option.keyword
        and not option.markexpr
        and not getattr(option, "deselect", None)
        and not getattr(option, "lf", False)
        and all(p == tests for p in paths)
    )


def tests_pace(took: dict[str, float], reference: dict[str, float]) -> tuple[float, int] | None:
    """How many times their seconds on the reference CPU the tests took here: the median of the ratios of the tests
    of at least PACE_MIN_S there, each weighed by its seconds there, and how many; None where too few ran. Measured
    over the whole session, where the fixed work is measured once at its end: on one 2-core AMD EPYC with AVX2 the
    fixed work read 2.38 times the reference's CPU seconds, and the suite took 2.53 times its 7.5 minutes. A test
    not measured there (a new one) counts nothing here, so its seconds come on top; a median, so one slower test
    does not move it."""
    ratios = sorted(
        (took[nodeid] / there, there)
        for nodeid, there in reference.items()
        if there >= PACE_MIN_S and took.get(nodeid, 0) > 0
    )
    if len(ratios) < PACE_MIN_TESTS:
        return None
    half = sum(there for _, there in ratios) / 2
    weights = itertools.accumulate(there for _, there in ratios)
    return next(ratio for (ratio, _), weight in zip(ratios, weights) if weight >= half), len(ratios)


def record_took(report: pytest.TestReport) -> None:
    """``pytest_runtest_logreport``: add a test's phase to its seconds (in the session's own process, where every
    worker's reports come)."""
    TOOK[report.nodeid] = TOOK.get(report.nodeid, 0.0) + report.duration


def judge(session: pytest.Session, took_s: float) -> None:
    """In the session that ran the whole suite (not a subset, not an xdist worker): fail it past its budget."""
    record = recorded()
    reference = record.get("reference_work_s")
    if (
        hasattr(session.config, "workerinput")
        or not reference
        or not whole_suite(session)
        or os.environ.get("CIFAR10_DDP_NO_BUDGET") == "1"
    ):
        return
    here = fixed_work_s()
    fewer, cpus = cpus_factor(record.get("reference_cpus", REFERENCE_CPUS))
    pace = tests_pace(TOOK, record.get("tests", {}))
    factor = max(1.0, here / reference * fewer, pace[0] if pace else 0.0)  # the tests' pace holds the cores' too
    budget = BUDGET_S * factor
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    tests = f"the tests x {pace[0]:.2f} (the median of {pace[1]}), " if pace else ""
    line = (
        f"time budget: {took_s / 60:.1f} min of pytest against {budget / 60:.1f} min ({BUDGET_S / 60:g} min on "
        f"{record['reference_cpu']} x {factor:.2f}: {tests}the fixed work x {here / reference:.2f} ({here:.3f} s "
        f"here, {reference:.3f} s there)" + (f" x {fewer:.2f} for {cpus}" if fewer > 1 else "") + ")"
    )
    if reporter is not None:
        reporter.write_sep("-", line)
    if took_s > budget and session.exitstatus == 0:
        if reporter is not None:
            reporter.write_line(
                "error: the suite ran past its time budget: make the new slow test pay for itself "
                "elsewhere (docs/development.md, The suite's time), or CIFAR10_DDP_NO_BUDGET=1 "
                "to run without the check",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def write(junit: Path, cpu: str, work_s: float | None = None) -> dict:
    """tests/durations.json from a junit report of ``make test``: each test's seconds, and the fixed work's here:
    ``work_s``, the seconds that run's budget line gave (measured at its end, as every run measures it), or
    measured now."""
    tests = {}
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = case.get("name", "")
        if module:
            tests[f"{module}.py::{name}"] = round(float(case.get("time") or 0), 2)
    data = {
        "reference_cpu": cpu,
        "reference_work_s": round(work_s if work_s is not None else fixed_work_s(), 4),
        "reference_cpus": len(os.sched_getaffinity(0)),
        "measured": time.strftime("%Y-%m-%d"),
        "tests": dict(sorted(tests.items())),
    }
    DURATIONS.write_text(json.dumps(data, indent=1) + "\n")
    return data


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(
            "usage: python -m tests.budget JUNIT_XML 'CPU NAME, N cores' [FIXED_WORK_S of its budget line] (on the "
            "reference CPU)"
        )
    written = write(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]) if len(sys.argv) == 4 else None)
    print(f"{DURATIONS}: {len(written['tests'])} tests, fixed work {written['reference_work_s']} s")
