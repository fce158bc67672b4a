"""torchrun as a launcher: real torchrun agents and workers (gloo, CPU, synthetic data, resnet18)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import warm
from tests.conftest import FAST, ROOT, descendants, free_port, late_python, output, process_environ, running
from tests.test_security import assert_loopback_only
from tests.test_serving import listeners_of

RUNS = ROOT / "outputs" / "runs"


def torchrun(*args: str, background: bool = False, timeout: float = 300, env: dict[str, str] | None = None):
    """``torchrun ARGS`` from the project root, as a user types it (``python -m torch.distributed.run`` is torchrun).
    Started warm where that cannot differ (tests/warm.py): the agent, and its first workers, which it starts as its
    own children in sessions of their own, as torchrun does; ``CIFAR10_DDP_COLD=1`` in ``env``: cold."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    if background:
        return warm.popen(
            cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
    return warm.run(cmd, cwd=ROOT, env=full_env, timeout=timeout)


def torchrun_dirs() -> set[Path]:
    return set(RUNS.glob("*/torchrun-*"))


@pytest.fixture
def new_run_dirs():
    """The torchrun run dirs a test made (removed afterwards)."""
    before, days, runs = torchrun_dirs(), set(RUNS.glob("*")), RUNS.exists()
    yield lambda: sorted(torchrun_dirs() - before)
    for path in torchrun_dirs() - before:
        shutil.rmtree(path, ignore_errors=True)
    # the date's folder and outputs/runs, while empty (only this file's tests run in the checkout's outputs/runs)
    for folder in [*(set(RUNS.glob("*")) - days), *([] if runs else [RUNS])]:
        with contextlib.suppress(OSError):
            folder.rmdir()


def workers(agent_pid: int) -> dict[int, int]:
    """{global rank: pid} of the workers below a torchrun agent."""
    found = {}
    for pid in descendants(agent_pid):
        env = process_environ(pid) or {}
        if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
            found[int(env["RANK"])] = pid
    return found


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"ended before {what}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout:.0f} s")


DEVICES_3 = (
    "error: trainer.devices=3 but torchrun started 2 process(es) on this node (--nproc-per-node=2): leave "
    "trainer.devices out under torchrun, or make them equal"
)


@pytest.mark.parametrize(
    "mistake, attempts, line, given_dir",
    [
        # found as the task starts (src/cli/entry.py's checks, src/resilience/supervision.py's end)
        ("trainer.devices=3", 1, DEVICES_3, False),
        # the same in a hydra.run.dir=DIR, which worker 1 makes first (local rank 0 starts 1.2 s late): local rank 0
        # takes it for a dir that was there before the run and keeps it; worker 1, stopped, takes back its files once
        # local rank 0's lock is free (before: DIR stayed with .lock, .hydra/ and an empty train.log)
        ("trainer.devices=3", 1, DEVICES_3, True),
        (  # a sweep, which every worker would run whole (before: worker 1 said the sweep dir was another run's)
            "-m",
            1,
            "error: a -m sweep runs its jobs from one process, which starts each job's ranks, but torchrun started 2: "
            "start the sweep once, without torchrun (python -m src.train -m ...); on a Slurm cluster, python -m "
            "src.slurm_sweep submits each job",
            False,
        ),
        (  # found by Hydra before any task (src/core/errors.py's report), with a restart that fails the same way
            "trainer.max_epoch=3",
            2,
            "error: trainer.max_epoch is not a key of the config: did you mean trainer.max_epochs or "
            "trainer.min_epochs? (a key the config lacks on purpose is added with +trainer.max_epoch=3)",
            False,
        ),
    ],
)
def test_a_mistake_is_one_line_an_attempt_from_local_rank_0_and_torchruns_report_gives_it(
    mistake, attempts, line, given_dir, new_run_dirs, tmp_path
):
    given = tmp_path / "runs" / "run"
    python = ["--no-python", str(late_python(tmp_path / "python", "LOCAL_RANK", 0))] if given_dir else []
    sweeps = ROOT / "outputs" / "multirun"  # the default sweep dir's (no test of the suite sweeps into it)
    swept = set(sweeps.rglob("*"))
    result = torchrun(
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={attempts - 1}",
        *python,
        "-m",
        "src.train",
        *FAST,
        mistake,
        *([f"hydra.run.dir={given}"] if given_dir else []),
    )
    assert result.returncode != 0
    errors = [text for text in result.stderr.splitlines() if text.startswith("error:")]
    assert errors == [line] * attempts, result.stderr[-3000:]  # not one a worker: the other waits for its stop
    # torchrun's failure report (the last attempt's): its root cause gives the line, and so does every worker that
    # ended with the mistake's status, where each said "To enable traceback see ..."; the quiet worker, stopped by
    # the agent, ended with that status too, or (under load) was stopped before it got as far: "Signal 15 (SIGTERM)"
    at = result.stderr.find("Root Cause (first observed failure):")
    assert at >= 0, result.stderr[-3000:]
    root = result.stderr[at:]
    assert "exitcode  : 2 " in root and f"traceback : {line}" in root, result.stderr[-3000:]
    assert "To enable traceback" not in result.stderr, result.stderr[-3000:]
    assert set(re.findall(r"exitcode  : (\S+)", result.stderr)) <= {"2", "-15"}, result.stderr[-3000:]
    assert str(ROOT / "src") not in output(result)  # no worker's traceback (torchrun adds its own report)
    # no run dir: local rank 0 takes back what the run made (another worker may have made the folders first), the
    # other worker its empty log and any folder it made after local rank 0 had taken them back. Under a full suite's
    # load the agent can stop that worker while it is still starting, before it has met the mistake: its empty log
    # then stays (once in a full run; docs/torchrun.md says so)
    left = [p for d in new_run_dirs() for p in d.rglob("*")]
    assert all(re.fullmatch(r"train_rank1\.log", p.name) and p.stat().st_size == 0 for p in left), left
    assert not given.parent.exists(), list(given.parent.rglob("*"))  # its parent too: worker 1 made it
    assert set(sweeps.rglob("*")) == swept  # the sweep refused before its dir was made


def test_two_workers_train_one_world_with_the_launchers_counts_and_a_restart_resumes_in_the_same_run_dir(
    new_run_dirs, tmp_path
):
    """The command a torchrun user types first (no trainer.devices, no strategy, no hydra.run.dir), and
    docs/torchrun.md's restart run, a third of its length (3 epochs of 20 steps, not 60) on the tests' narrow network:
    a worker SIGKILLed after the first last.ckpt (rank 1 holds at step 8 until then, once: not again after the
    restart); torchrun restarts the group once."""
    held = tmp_path / "held"
    # NCCL's environment is set before the group forms (torchrun's is formed first, on its attempt's keys), and a
    # user's dump path under torch's older name is the one both names carry; the probe records it as the group forms
    mine = tmp_path / "my-traces" / "rank_"
    args = [
        *FAST,
        "data.num_train=400",
        "trainer.max_epochs=3",
        "trainer.limit_train_batches=20",
        "test=false",
        "callbacks.last_checkpoint.every_n_train_steps=5",
        "+callbacks.hold._target_=tests.faults.SleepAt",
        "+callbacks.hold.rank=1",
        "+callbacks.hold.step=8",
        "+callbacks.hold.seconds=240",
        f"+callbacks.hold.once={held}",
        "+callbacks.probe._target_=tests.faults.RecordGroupEnv",
        f"+callbacks.probe.folder={tmp_path}",
        "+callbacks.collector._target_=tests.faults.RecordCollector",
        f"+callbacks.collector.folder={tmp_path}",
    ]
    started = time.monotonic()
    agent = torchrun(
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "src.train",
        *args,
        background=True,
        # torchrun's cold start: its agent and workers new interpreters, as every other torchrun under srun is
        env={"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(mine), "CIFAR10_DDP_COLD": "1"},
    )
    listeners: set = set()  # (address, port, pid) the agent and its workers listened on, until the worker is killed

    def listening_until(condition):
        return lambda: listeners.update(listeners_of([agent.pid, *descendants(agent.pid)])) or condition()

    try:
        run_dir = wait_for(listening_until(lambda: next(iter(new_run_dirs()), None)), 120, "run dir", agent)
        wait_for(listening_until(held.exists), 180, "rank 1 held at step 8", agent)
        assert (run_dir / "checkpoints" / "last.ckpt").exists()  # step 5's
        victim = workers(agent.pid)[1]
        os.kill(victim, signal.SIGKILL)
        out, _ = agent.communicate(timeout=300 - (time.monotonic() - started))
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode == 0, out[-4000:]
    assert "world size 2 | strategy ddp | backend gloo" in out
    # the workers (gloo) listen on loopback only; the agent's two stores (the rendezvous and the workers') listen on
    # every interface: torch gives them no address to bind (docs/security.md)
    assert_loopback_only({found for found in listeners if found[2] != agent.pid}, "torchrun's workers")
    assert new_run_dirs() == [run_dir]  # the restart wrote the same dir
    assert re.fullmatch(r"torchrun-[0-9a-f-]{36}", run_dir.name)  # the id --standalone makes
    # the first attempt's failure: the rank that said it gave the agent its line too (its error file, which torchrun's
    # failure report reads)
    said = [line for line in out.splitlines() if line.startswith("error:")]
    run_id = run_dir.name.removeprefix("torchrun-")
    told = [
        json.loads(path.read_text())["message"]["message"]
        for path in Path(os.environ["TMPDIR"]).glob(f"torchelastic_*/{run_id}_*/attempt_0/*/error.json")
    ]
    # one line, which the agent's error file holds too; or none, where the agent's SIGTERM (it polls its workers every
    # 0.1 s) reached rank 0 before rank 0 had said the broken group (about one run in a dozen, with the code before
    # as well): then torchrun's own report names the killed worker
    assert len(said) <= 1 and told == said, (said, told, out[-3000:])
    assert said or re.search(rf"failed \(exitcode: -9\) local_rank: 1 \(pid: {victim}\)", out), out[-3000:]
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["train.log", "train_rank1.log"]
    log = (run_dir / "train.log").read_text()
    resumed = re.findall(r"restart 1 of 1: resuming from step (\d+) of (\S+)", log)
    assert resumed and int(resumed[0][0]) > 0 and resumed[0][1] == str(run_dir / "checkpoints" / "last.ckpt"), log
    assert "world size 2 | strategy ddp" in log
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 60 and last["saved_by"]["world_size"] == 2
    for rank in (0, 1):  # as the restarted group formed
        seen = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert seen["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == seen["TORCH_FR_DUMP_TEMP_FILE"] == str(mine), seen
        assert seen["TORCH_NCCL_TRACE_BUFFER_SIZE"] == seen["TORCH_FR_BUFFER_SIZE"] == "2000"
        assert seen["TORCH_NCCL_DUMP_ON_TIMEOUT"] == seen["TORCH_FR_DUMP_ON_TIMEOUT"] == "1"
        # torchrun's agent gives its workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down), kept as a user's would be
        assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and seen["TORCH_NCCL_ENABLE_MONITORING"] == "1"
        # each worker (python -u -m src.train, started cold by the agent) loaded with the collector off, then turned
        # it on and froze what it had loaded (src/core/startup.py): only a process that paused it freezes anything
        collector = json.loads((tmp_path / f"gc_rank_{rank}.json").read_text())
        assert collector["enabled"] and collector["frozen"] > 100_000, collector
    assert mine.parent.is_dir()  # made, for NCCL to write in


def held_agent(held: Path, step: int, until_signal: bool = False) -> subprocess.Popen:
    """A --standalone agent of two workers training FAST runs of 8 steps, whose rank 0 waits in ``step`` (rank 1 in
    that step's all-reduce) for 120 s, or ``until_signal``; ``held`` is made as the wait begins."""
    return torchrun(
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "src.train",
        *FAST,
        "trainer.limit_train_batches=8",
        "test=false",
        "+callbacks.wait._target_=tests.faults.SleepAt",
        "+callbacks.wait.rank=0",
        f"+callbacks.wait.step={step}",
        "+callbacks.wait.seconds=120",
        f"+callbacks.wait.until_signal={str(until_signal).lower()}",
        f"+callbacks.wait.once={held}",
        background=True,
    )


def test_a_sigterm_to_the_agent_stops_its_workers_at_one_step_and_the_line_says_how_to_resume_either_way(
    new_run_dirs, tmp_path
):
    """scancel, kubectl delete, a preempted VM: SIGTERM to the torchrun agent, which passes it on to its workers and
    ends, with no next attempt. The same SIGTERM from the agent restarts the group when a node joins (the scale-up
    test), so the workers' line gives both ways on; last.ckpt holds the step it names, and no worker is left."""
    held = tmp_path / "held"
    agent = held_agent(held, step=3, until_signal=True)  # rank 0 waits in step 3 until the signal
    try:
        wait_for(held.exists, 120, "rank 0 held at step 3", agent)
        ranks = workers(agent.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(agent.pid, signal.SIGTERM)  # the agent alone, as a container's runtime stops it
        out, _ = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode != 0, out[-4000:]  # torchrun's own report of the signal it got
    (run_dir,) = new_run_dirs()
    path = run_dir / "checkpoints" / "last.ckpt"
    stops = re.findall(
        r"stopped: SIGTERM after step (\d+): every rank stopped there and (\S+) holds that step; (.*)", out
    )
    assert len(stops) == 1, out[-4000:]
    step, named, then = stops[0]
    assert named == str(path)
    assert (
        then == "torchrun's next attempt resumes from there; if torchrun itself was stopped, resume with "
        f"hydra.run.dir={run_dir} ckpt_path=last"
    )
    last = torch.load(path, map_location="cpu", weights_only=True)
    assert last["global_step"] == int(step) >= 3
    assert not [pid for pid in ranks.values() if running(pid)]


def test_an_agent_killed_with_the_store_it_hosts_ends_its_workers_with_their_lines_and_no_broken_wait(
    new_run_dirs, tmp_path
):
    """--standalone: the agent hosts the store the workers use. SIGKILLed, it takes the store with it; its node's
    reporter (src/resilience/supervision.py) asks that store at the board's pace rather than waiting in it, so no
    wait is broken (`TCPStore.cpp ... recvValueWithTimeout failed`, torch's warning with a C++ stack, every time
    before), and no call is made once the agent has begun to exit (``store_host_going``: 0 of 28 runs beside two
    busy loops printed a warning, 10 of 32 when only the parent pid was read): each worker prints its line and
    ends. A short call already in flight at the instant of the kill would still get one warning: at most that."""
    held = tmp_path / "held"
    # rank 0 waits in step 2: the workers' watches and the reporter's store connection have long been up
    agent = held_agent(held, step=2)
    try:
        wait_for(held.exists, 120, "rank 0 held at step 2", agent)
        ranks = workers(agent.pid)
        assert sorted(ranks) == [0, 1]
        time.sleep(1)  # the reporter's first look (every 4th tick of POLL_S) has come
        os.kill(agent.pid, signal.SIGKILL)
        wait_for(lambda: not [pid for pid in ranks.values() if running(pid)], 30, "the workers' end")
        out, _ = agent.communicate(timeout=30)  # the workers wrote to the console they inherited from the agent
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert sorted(errors) == [
        f"error: rank {rank}: its torchrun agent (pid {agent.pid}) died; this rank stopped too" for rank in (0, 1)
    ], out[-4000:]
    assert "recvValueWithTimeout" not in out and "TCPStore::wait" not in out and "Traceback" not in out, out[-4000:]
    assert out.count("frame #0:") <= 1, out[-4000:]


def test_a_node_lost_leaves_the_other_to_finish_alone_with_the_same_global_batch(new_run_dirs, tmp_path):
    """Two agents, --nnodes=1:2; the second is SIGKILLed mid-run: its worker does not outlive it (it stops and says
    why, on the console it inherited from its agent), and the first finishes alone."""
    port, run_id = free_port(), f"elastic{os.getpid()}"
    args = [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--max-restarts=3",
        # last call: the first agent waits 10 s for a second before it starts alone (a second agent joining later
        # would be a scale-up, another test); keep-alive: a lost agent is noticed within 3 s
        "--rdzv-conf=last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3",
        "-m",
        "src.train",
        *FAST,
        "data.num_train=400",
        "trainer.limit_train_batches=30",
        "trainer.max_epochs=2",
        "callbacks.last_checkpoint.every_n_train_steps=3",
        "test=false",
    ]
    first = torchrun(*args, background=True)
    # the agent that binds --rdzv-endpoint hosts the rendezvous, and the rendezvous must stay: the first, which stays
    wait_for(lambda: listening(port), 60, "the first agent's rendezvous", first)
    second = torchrun(*args, background=True)
    try:
        run_dir = wait_for(lambda: next(iter(new_run_dirs()), None), 120, "run dir", first)
        assert run_dir.name == f"torchrun-{run_id}"
        wait_for(lambda: (run_dir / "checkpoints" / "last.ckpt").exists(), 180, "last.ckpt", first)
        (orphan,) = workers(second.pid).values()
        os.kill(second.pid, signal.SIGKILL)  # the agent itself: its worker must not go on as an orphan
        wait_for(lambda: not running(orphan), 30, "end of the killed agent's worker")
        said, _ = second.communicate(timeout=30)  # the worker wrote to the agent's console, which it inherited
        out, _ = first.communicate(timeout=300)
    finally:
        for agent in (first, second):
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert first.returncode == 0, out[-4000:]
    assert f"its torchrun agent (pid {second.pid}) died; this rank stopped too" in said, said[-3000:]
    log = "".join(p.read_text() for p in run_dir.glob("train*.log"))
    assert "world size 2 -> 1: global batch 8 kept (data.batch_size 4 -> 8 per process)" in log, log[-4000:]
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["saved_by"]["world_size"] == 1 and last["saved_by"]["batch_size"] == 8
    assert last["global_step"] == 2 * 30  # as many optimizer steps as at world size 2 throughout


def test_a_node_that_joins_scales_the_run_up_keeping_the_global_batch(new_run_dirs):
    """--nnodes=1:2 started with one agent; a second joins mid-run: torchrun restarts the group at world size 2,
    which resumes from last.ckpt with half the per-process batch. (torch 2.14's agents deadlock on a scale-up
    that shares the rendezvous store with the workers: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: docs/torchrun.md.)"""
    port, run_id = free_port(), f"scaleup{os.getpid()}"
    args = [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--max-restarts=3",
        "--monitor-interval=1",
        "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
        "-m",
        "src.train",
        *FAST,
        "data.num_train=400",
        "data.batch_size=8",
        "trainer.limit_train_batches=30",
        "trainer.max_epochs=2",
        "callbacks.last_checkpoint.every_n_train_steps=3",
        "test=false",
        # alone, the run waits at step 4 until torchrun stops it to take the second node in (a step takes 0.03 s)
        "+callbacks.wait._target_=tests.faults.SleepAt",
        "+callbacks.wait.rank=0",
        "+callbacks.wait.step=4",
        "+callbacks.wait.seconds=120",
        "+callbacks.wait.world_size=1",
        "+callbacks.wait.until_signal=true",
    ]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    first = torchrun(*args, background=True, env=env)
    second = None
    try:
        run_dir = wait_for(lambda: next(iter(new_run_dirs()), None), 120, "run dir", first)
        wait_for(lambda: (run_dir / "checkpoints" / "last.ckpt").exists(), 180, "last.ckpt", first)
        second = torchrun(*args, background=True, env=env)
        out, _ = first.communicate(timeout=300)
        second.wait(timeout=60)
    finally:
        for agent in (first, second):
            if agent is not None and agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert first.returncode == 0 and second.returncode == 0, out[-4000:]
    # the agent stopped its worker with SIGTERM to take the second node in: the worker's line says so
    restarted = r"stopped: SIGTERM after step \d+: .*; torchrun's next attempt resumes from there;"
    assert re.search(restarted, out), out[-4000:]
    log = (run_dir / "train.log").read_text()
    assert re.search(r"torchrun \(re\)formed the group: resuming from step [1-9]\d* of ", log), log[-4000:]
    assert "world size 1 -> 2: global batch 8 kept (data.batch_size 8 -> 4 per process)" in log
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["saved_by"]["world_size"] == 2 and last["global_step"] == 2 * 30


def test_nodes_started_with_unlike_command_lines_stop_at_once_each_naming_both(new_run_dirs):
    """Two agents whose nodes count alike (torchrun agrees on the counts) but train otherwise: another batch size and
    seed on one node. They trained together without a word, each scaling its learning rate to a global batch of its
    own and drawing its shard from a split of its own. (By hand: tests/test_train.py's nodes that count otherwise.)"""
    port, run_id = free_port(), f"unlike{os.getpid()}"
    args = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "-m",
        "src.train",
        *FAST,
    ]
    start = time.monotonic()
    first = torchrun(*args, background=True)
    try:
        wait_for(lambda: listening(port), 60, "the first agent's rendezvous", first)
        second = torchrun(*args, "data.batch_size=8", "seed=2")
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    said = {"first": out, "second": second.stdout + second.stderr}
    assert first.returncode != 0 and second.returncode != 0, said
    # which agent's node is node 0 is the rendezvous's choice: the line names the other's values first
    host, theirs, ours = (
        socket.gethostname(),
        "data.batch_size=8 data.seed=2 seed=2",
        "data.batch_size=4 data.seed=42 seed=42",
    )
    lines = {
        f"NODE_RANK=1 ({host}) trains with {a}, node 0 ({host}) with {b}: start every node with the same command line "
        "(the model, the data and how long to train)"
        for a, b in ((theirs, ours), (ours, theirs))
    }
    errors = {name: [t for t in text.splitlines() if t.startswith("error:")] for name, text in said.items()}
    line = next((line for line in lines if f"error: rank 0: {line}" in errors["first"] + errors["second"]), None)
    assert line is not None, errors
    assert sorted(errors["first"] + errors["second"]) == [f"error: rank 0: {line}", f"error: rank 1: {line}"], errors
    assert all("traceback : error: rank" in text for text in said.values()), said  # torchrun's report gives it
    assert time.monotonic() - start < 100, said  # not strategy.timeout_s (300 s): at once


# -- the rules, in-process (torchrun's environment set by hand; the runs above start the real thing) -----------


@pytest.fixture
def under_torchrun(monkeypatch):
    """This process as worker RANK of a torchrun run: ``world`` processes, ``local`` of them per node."""

    def set_env(world: int, local: int, rank: int = 0) -> None:
        for key, value in {
            "TORCHELASTIC_RUN_ID": "unit",
            "WORLD_SIZE": world,
            "LOCAL_WORLD_SIZE": local,
            "RANK": rank,
            "TORCHELASTIC_RESTART_COUNT": 0,
            "TORCHELASTIC_MAX_RESTARTS": 3,
        }.items():
            monkeypatch.setenv(key, str(value))

    return set_env


def adopted(tmp_path, *overrides: str):
    """The config as a torchrun worker's task sees it (src/cli/entry.py: the agent's counts, then every attempt
    resumes)."""
    from src.checkpoints.resume import resume_own_run_dir
    from src.launch.torchrun import adopt
    from tests.test_config import make_cfg

    cfg = make_cfg(tmp_path, *overrides)
    adopt(cfg, {o.split("=")[0] for o in overrides})
    resume_own_run_dir(cfg)
    return cfg


def test_counts_left_out_become_torchruns_and_a_run_resumes_from_its_dir(under_torchrun, tmp_path):
    under_torchrun(world=8, local=4)
    cfg = adopted(tmp_path)
    assert (cfg.trainer.devices, cfg.trainer.num_nodes, cfg.strategy.devices, cfg.ckpt_path) == (4, 2, 4, "auto")
    assert adopted(tmp_path, "trainer.devices=[0,1,2,3]").trainer.num_nodes == 2  # GPU ids, as many as workers
    assert adopted(tmp_path, "ckpt_path=/from/here.ckpt").ckpt_path == "/from/here.ckpt"  # nothing of its own yet
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert adopted(tmp_path, "ckpt_path=/from/here.ckpt").ckpt_path == "auto"  # the run's own last.ckpt now


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.num_nodes=1"],
            "trainer.num_nodes=1 but torchrun formed a group of 2 node(s) (WORLD_SIZE=8 / "
            "LOCAL_WORLD_SIZE=4): leave trainer.num_nodes out under torchrun",
        ),
        (["trainer.devices='0,1'"], "trainer.devices=0,1 but torchrun started 4 process(es) on this node"),
        (["strategy=ddp_spawn"], "strategy=ddp_spawn starts processes of its own, but torchrun has started them"),
    ],
)
def test_a_config_that_disagrees_with_torchrun_is_one_error(under_torchrun, tmp_path, overrides, message):
    from src.core.errors import UserError

    under_torchrun(world=8, local=4)
    with pytest.raises(UserError, match=re.escape(message)):
        adopted(tmp_path, *overrides)


def test_nodes_with_unlike_counts_of_workers_are_one_line_on_each_node(under_torchrun, tmp_path, monkeypatch):
    """torchrun --nnodes=2 with --nproc-per-node=1 on one node and 2 on the other (a world of 3): the 2-worker node's
    ranks failed on Lightning's ValueError (exit 1, a traceback in the log), and the other node's waited out the
    process group's timeout (300 s). Seen with two real agents: each node now stops in seconds with this line."""
    from src.core.errors import UserError

    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    for local in (1, 2):
        under_torchrun(world=3, local=local)
        with pytest.raises(
            UserError,
            match=re.escape(
                f"torchrun started {local} process(es) on this node and 3 in all over 2 nodes: Lightning runs the same "
                "number on every node: give every node the same --nproc-per-node"
            ),
        ):
            adopted(tmp_path)
    under_torchrun(world=4, local=2)
    assert adopted(tmp_path).trainer.num_nodes == 2


def test_a_worker_whose_local_rank_0_did_not_fail_says_its_own_line_after_the_quiet_wait(
    under_torchrun, tmp_path, monkeypatch
):
    """The fallback of the real runs above: a mistake only local rank 1 meets. It waits QUIET_S for the agent's stop,
    then returns to say its line, its signals as they were; local rank 0 does not wait. Each tells the agent."""
    from src.launch import torchrun

    under_torchrun(world=2, local=2)
    monkeypatch.setattr(torchrun, "QUIET_S", 0.3)
    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    for local_rank, waits in (("1", True), ("0", False)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error{local_rank}.json"))
        started = time.monotonic()
        torchrun.before_error_line("data.root=/x holds no CIFAR-10", 2)
        assert (time.monotonic() - started >= 0.3) == waits
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
        said = json.loads((tmp_path / f"error{local_rank}.json").read_text())["message"]
        assert said["message"] == "error: data.root=/x holds no CIFAR-10" and int(said["extraInfo"]["timestamp"]) > 0
    started = time.monotonic()
    monkeypatch.setenv("LOCAL_RANK", "1")
    torchrun.before_error_line("rank 1 died", 1)  # a failure, not a mistake every worker meets: no wait
    assert time.monotonic() - started < 0.3

    def cut_short(obj, file):  # the agent's SIGTERM in the middle of the write
        file.write('{"message": {"mess')
        raise OSError("stopped")

    cut = tmp_path / "cut.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(cut))
    monkeypatch.setattr(torchrun.json, "dump", cut_short)
    torchrun.tell_agent("data.root=/x holds no CIFAR-10")
    assert not cut.exists()  # no half file, which the agent failed to parse: it ended on a traceback, no report


def test_a_global_batch_the_new_world_cannot_divide_becomes_the_nearest_and_says_so():
    from types import SimpleNamespace

    from src.launch.torchrun import keep_global_batch

    data = SimpleNamespace(batch_size=5)
    saved = {"saved_by": {"world_size": 2, "batch_size": 5, "accumulate": 1}}
    assert keep_global_batch(saved, data, 3, 1) == (
        "world size 2 -> 3: global batch 10 cannot be split over 3 "
        "process(es): it is now 9 (data.batch_size 5 -> 3 per process); "
        "the learning rate and its schedule follow the global batch"
    )
    assert data.batch_size == 3
    same = SimpleNamespace(batch_size=5)
    assert keep_global_batch(saved, same, 2, 1) is None and same.batch_size == 5  # the same world: nothing to do


def test_every_worker_finds_the_run_dir_its_rendezvous_id_already_has(under_torchrun, tmp_path):
    from src.launch.torchrun import run_dir_for

    under_torchrun(world=2, local=1)
    today = tmp_path / "runs" / "2026-11-24" / "00-00-01"
    assert run_dir_for(today) == tmp_path / "runs" / "2026-11-24" / "torchrun-unit"
    (tmp_path / "runs" / "2026-11-23" / "torchrun-unit").mkdir(parents=True)  # begun before midnight
    assert run_dir_for(today) == tmp_path / "runs" / "2026-11-23" / "torchrun-unit"
