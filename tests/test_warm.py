"""tests/warm.py: a warm start is the cold start without the imports: the same output and exit status, its own pid,
its test's process group, its command line where the tests read one; what cannot start warm starts cold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests import warm
from tests.conftest import FAST, ROOT, cmdline, descendants, parent_pid, process_environ, running, train

BAD = ["data=nope", *FAST[1:]]  # Hydra's own error for an unknown group option, after every import


def test_a_warm_start_prints_and_exits_as_the_cold_start_does():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "src.train", *BAD]
    assert warm.warm_possible(cmd, env) and not warm.warm_possible(cmd, {**env, "CIFAR10_DDP_COLD": "1"})
    threads = "2" if env.get("OMP_NUM_THREADS") == "1" else "1"  # another count than the parent's
    assert not warm.warm_possible(cmd, {**env, "OMP_NUM_THREADS": threads})  # read when torch loads
    assert not warm.warm_possible(["python3", *cmd[1:]], env)
    hot = warm.run(cmd, env=env, cwd=ROOT, timeout=120)
    cold = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert hot.returncode != 0 and "nope" in hot.stderr


def test_a_warm_run_is_a_process_of_its_own_in_the_tests_process_group_and_its_ranks_are_its_children(tmp_path):
    proc = train(*FAST, "strategy=ddp", "trainer.devices=2", "test=false", f"hydra.run.dir={tmp_path}", background=True)
    assert isinstance(proc, warm.WarmProcess) and proc.pid != os.getpid()
    assert os.getpgid(proc.pid) == os.getpgrp()
    ranks = []
    while proc.poll() is None and not ranks:
        ranks = [p for p in descendants(proc.pid) if "src.train" in cmdline(p)]
        time.sleep(0.05)
    assert ranks, proc.communicate()[0][-3000:]
    assert cmdline(proc.pid).startswith(f"{sys.executable} -m src.train ")
    assert parent_pid(ranks[0]) == proc.pid  # the rank's parent is the run itself
    # what the run gave its rank, as /proc/PID/environ shows a cold rank's (/proc shows the warm parent's here)
    given, parent = process_environ(ranks[0]), process_environ(proc.pid)
    assert given is not None and parent is not None and given["LOCAL_RANK"] == "1" and "LOCAL_RANK" not in parent
    assert given["MASTER_PORT"].isdigit() and given["WORLD_SIZE"] == "2"
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "world size 2" in out and not any(running(p) for p in ranks)


def test_a_warm_ddp_spawn_runs_spawned_ranks_are_its_spares_given_every_descriptor_multiprocessing_passes(tmp_path):
    """multiprocessing's spawn passes a spawned rank a descriptor for each tensor of its arguments: ResNet-50's, over
    300, take more than one message to a spare."""
    from src.models.resnet import build_resnet

    assert len(build_resnet("resnet50", width=16).state_dict()) > warm.FDS_PER_MESSAGE
    overrides = [item for item in FAST if not item.startswith("model.arch=")]
    proc = train(
        *overrides,
        "model.arch=resnet50",
        "strategy=ddp_spawn",
        "trainer.devices=2",
        "test=false",
        f"hydra.run.dir={tmp_path}",
        background=True,
    )
    assert isinstance(proc, warm.WarmProcess)
    ranks: list[int] = []
    while proc.poll() is None and len(ranks) < 2:
        ranks = [p for p in descendants(proc.pid) if "spawn_main" in cmdline(p)]
        time.sleep(0.05)
    assert len(ranks) == 2, proc.communicate()[0][-3000:]
    for rank in ranks:
        assert cmdline(rank).startswith(f"{sys.executable} ") and cmdline(rank).endswith(" --multiprocessing-fork ")
        with open(f"/proc/{rank}/cmdline") as raw:
            assert " -m tests.warm " in raw.read().replace("\0", " ")  # a fork of the run: no new interpreter
        assert parent_pid(rank) == proc.pid  # the run's child, as spawn makes it
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "world size 2 | strategy ddp_spawn" in out and not any(running(p) for p in ranks)
    assert sorted(json.loads((tmp_path / "throughput.json").read_text())["pids"]) == sorted(ranks)  # they trained


def test_each_rank_of_a_warm_ddp_run_starts_its_loaders_forkserver_from_a_spare(tmp_path):
    """The DataLoader's forkserver (src/data/workers.py) is a spare of its rank, as a new interpreter would be its
    child: no second import of torch and torchvision a rank (about 2.3 CPU s saved at the reference CPU's pace); its
    workers fork from it and train."""
    proc = train(
        *FAST,
        "strategy=ddp",
        "trainer.devices=2",
        "data.pipeline=dataloader",
        "data.num_workers=1",
        "data.multiprocessing_context=forkserver",
        "test=false",
        f"hydra.run.dir={tmp_path}",
        background=True,
    )
    assert isinstance(proc, warm.WarmProcess)
    servers: dict[int, int] = {}  # pid: its parent
    while proc.poll() is None and len(servers) < 2:
        for pid in descendants(proc.pid):
            parent = parent_pid(pid)
            if "from multiprocessing.forkserver import main;" in cmdline(pid) and parent is not None:
                servers[pid] = parent
        time.sleep(0.05)
    assert len(servers) == 2, proc.communicate()[0][-3000:]
    for pid in servers:
        with open(f"/proc/{pid}/cmdline") as raw:
            assert " -m tests.warm " in raw.read().replace("\0", " ")  # a fork of its rank: no new interpreter
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    ranks = json.loads((tmp_path / "throughput.json").read_text())["pids"]
    assert sorted(servers.values()) == sorted(ranks)  # each rank's own child
    assert "1 loader workers a process (data.num_workers; " in out and ", started by forkserver" in out, out[-3000:]
    deadline = time.monotonic() + 10  # each server ends as it sees its rank gone (its pipe's end), as a cold one does
    while any(running(p) for p in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(p) for p in servers)


def test_a_rank_has_a_spare_for_its_forkserver_where_its_loaders_workers_may_start_by_one():
    from src.data.workers import fork_can_hang

    loader = ["data.pipeline=dataloader", "data.num_workers=2"]
    assert warm.forkservers([*loader, "data.multiprocessing_context=forkserver"]) == 1
    assert warm.forkservers([*loader, "data.multiprocessing_context=fork"]) == 0
    assert warm.forkservers(loader) == int(fork_can_hang())  # auto: forkserver where this Python's fork can hang
    assert warm.forkservers(["data.num_workers=2", "data.multiprocessing_context=forkserver"]) == 0  # device batches
    assert warm.forkservers(["data.pipeline=dataloader", "data.multiprocessing_context=forkserver"]) == 0  # no workers
    assert warm.forkservers([*loader, "data.multiprocessing_context=forkserver", "strategy=ddp_spawn"]) == 0
    assert warm.local_ranks(["strategy=ddp", "trainer.devices=2"]) == 1  # its rank's; the forkserver's apart


def test_a_variable_set_in_process_by_one_test_1_of_2():
    os.environ["TORCH_CIFAR10_DDP_LEAK_CHECK"] = "1"  # as src.resilience.heartbeat sets TORCH_NCCL_* in-process


def test_a_variable_set_in_process_by_one_test_is_gone_for_the_next_2_of_2():
    """Left there, it would make every later run of the worker start cold (it is read when torch loads)."""
    assert "TORCH_CIFAR10_DDP_LEAK_CHECK" not in os.environ
    assert warm.warm_possible([sys.executable, "-m", "src.train"], {**os.environ, "PYTHONUNBUFFERED": "1"})


def test_a_torchrun_agent_has_a_spare_for_each_worker_of_each_attempt_it_may_start():
    train = ["-m", "src.train", *FAST]
    assert warm.torchrun_workers(["--standalone", "--nproc-per-node=2", *train]) == 2
    assert warm.torchrun_workers(["--nproc-per-node", "2", "--max-restarts=1", *train]) == 4  # a restart's too
    assert warm.torchrun_workers(["--nproc-per-node=2", "--max-restarts", "0", *train]) == 2
    assert warm.torchrun_workers(["--nnodes=1:2", "--nproc-per-node=1", *train]) == 2  # a node that joins restarts
    assert warm.torchrun_workers(["--nnodes=2", "--nproc-per-node=8", "--max-restarts=3", *train]) == warm.SPARES_MAX
    assert warm.torchrun_workers(["--nproc-per-node=2", "--no-python", "python", *train]) == 0  # another program
    assert warm.torchrun_workers(["--rdzv-endpoint", "host:29500", *train]) == 0  # a value apart: cold, unread


def test_a_run_past_its_limit_fails_then_even_where_a_process_it_left_holds_its_pipes(tmp_path):
    """run() at its timeout kills the process and waits for it, not for its output's end, which a process it left
    behind may never bring (a data loader's worker stuck in its fork held a run's pipes, and the test hung)."""
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run(["bash", "-c", "sleep 20 & sleep 60"], env=dict(os.environ), cwd=tmp_path, timeout=1)
    assert time.monotonic() - start < 10
