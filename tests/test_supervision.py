"""A run's processes live and die together: a killed rank or launcher stops the rest at once, naming it;
SIGTERM stops every rank at the same step with a checkpoint and exit code 143."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import FAST, ROOT, cmdline, descendants, free_port, output, running, train

# Long enough that a signal always lands mid-training: 2,000 images, batch 4 per rank.
LONG = [
    *FAST,
    "data.num_train=2000",
    "trainer.limit_train_batches=null",
    "callbacks.last_checkpoint.every_n_train_steps=2",
    "callbacks.progress_bar=null",
    "test=false",
]


def last_step(run_dir: Path) -> int:
    """global_step of ``run_dir``'s last.ckpt, or -1 while there is none."""
    try:
        return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True, mmap=True)[
            "global_step"
        ]
    except (OSError, RuntimeError, EOFError):
        return -1


def start_and_wait_for_step(
    run_dir: Path, step: int, *overrides: str, ranks: int = 1, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Start a training run in the background; return once it has checkpointed ``step`` and all ranks are up."""
    proc = train(*overrides, f"hydra.run.dir={run_dir}", background=True, env=env)
    deadline = time.monotonic() + 180
    while last_step(run_dir) < step or len(rank_pids(proc.pid)) < ranks:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run never reached its first checkpoint"
        time.sleep(0.05)
    return proc


def rank_pids(main: int) -> list[int]:
    """The processes of a run that train (the main one, unless it only spawned them; then its spawned ranks)."""
    spawned = [p for p in descendants(main) if "spawn_main" in cmdline(p)]
    started = [p for p in descendants(main) if "src.train" in cmdline(p)]
    return sorted(spawned) if spawned else [main, *started]


def finish(proc: subprocess.Popen, pids: list[int], limit_s: float) -> tuple[str, float]:
    """Wait for the run (and every process it had) to end; return its output and the seconds that took."""
    start = time.monotonic()
    out, _ = proc.communicate(timeout=limit_s + 30)  # returns once every process holding its output has gone
    while any(running(p) for p in pids) and time.monotonic() - start < limit_s + 30:
        time.sleep(0.1)
    return out, time.monotonic() - start


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_rank_killed_mid_training_stops_every_process_with_one_line_naming_it(strategy, tmp_path):
    """ddp: with loader workers a forkserver started, each rank's server and its workers go too, at once, without a
    word (before, the killed rank's lived on: the server waited for a pipe its own workers held open, and they watched
    only the server; a worker whose rank died fetching a batch printed its sharing thread's traceback)."""
    workers = ["data.pipeline=dataloader", "data.num_workers=1", "data.multiprocessing_context=forkserver"]
    overrides = [*LONG, f"strategy={strategy}", "trainer.devices=2", *(workers if strategy == "ddp" else [])]
    proc = start_and_wait_for_step(tmp_path, 2, *overrides, ranks=2)
    everyone = [proc.pid, *descendants(proc.pid)]
    if strategy == "ddp":  # each rank: its forkserver, and the server's worker for each loader begun
        assert sum("forkserver" in cmdline(p) for p in everyone) >= 4, [cmdline(p)[:200] for p in everyone]
    victim = rank_pids(proc.pid)[1]  # ddp: the started rank 1; ddp_spawn: one of the two spawned ranks
    os.kill(victim, signal.SIGKILL)
    out, seconds = finish(proc, everyone, limit_s=60)
    assert seconds < 60, out[-3000:]
    assert proc.returncode != 0
    assert not [p for p in everyone if running(p)], "processes were left behind"
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    rank = "1" if strategy == "ddp" else "[01]"
    assert len(errors) == 1 and re.fullmatch(
        rf"error: rank {rank} \(pid {victim}\) died: killed by SIGKILL; stopped the other ranks", errors[0]
    ), out[-3000:]
    assert "Traceback" not in out


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_killed_launcher_takes_its_ranks_with_it(strategy, tmp_path):
    proc = start_and_wait_for_step(tmp_path, 2, *LONG, f"strategy={strategy}", "trainer.devices=2", ranks=2)
    everyone = [proc.pid, *descendants(proc.pid)]
    os.kill(proc.pid, signal.SIGKILL)  # the command the user started: ddp's rank 0, or ddp_spawn's parent
    out, seconds = finish(proc, everyone, limit_s=60)
    assert seconds < 60 and proc.returncode == -signal.SIGKILL
    assert not [p for p in everyone if running(p)], "ranks outlived their launcher"
    # ddp_spawn: both ranks find their launcher gone at once, and rank 0, the store's host, may end first; one line,
    # and no rank left retrying the store it hosted (torch's client logs each try, with its C++ stack)
    (error,) = [line for line in out.splitlines() if line.startswith("error:")] or [out[-3000:]]
    assert error.endswith(f"the process that launched it (pid {proc.pid}) died; this rank stopped too"), out[-3000:]
    assert "Traceback" not in out and "[c10d]" not in out, out[-3000:]


@pytest.mark.parametrize(
    "strategy, devices, to", [("auto", 1, "main"), ("ddp", 2, "main"), ("ddp", 2, "rank 1"), ("ddp_spawn", 2, "main")]
)
def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint_and_exit_code_143(strategy, devices, to, tmp_path):
    proc = start_and_wait_for_step(
        tmp_path, 2, *LONG, f"strategy={strategy}", f"trainer.devices={devices}", ranks=devices
    )
    everyone = [proc.pid, *descendants(proc.pid)]
    os.kill(proc.pid if to == "main" else rank_pids(proc.pid)[1], signal.SIGTERM)
    out, seconds = finish(proc, everyone, limit_s=60)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert seconds < 60 and not [p for p in everyone if running(p)]
    stopped = [line for line in out.splitlines() if line.startswith("stopped: SIGTERM after step")]
    assert len(stopped) == 1, out[-3000:]  # rank zero says it, once
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == step > 2  # the step every rank stopped at, mid-epoch
    assert (
        last["epoch"] == 0
        and last["SyntheticDataModule"]["train_position"].items() >= {"epoch": 0, "consumed": step}.items()
    )
    # the run dir, not a checkpoint's path (which made a new run dir: a second run, its best checkpoints apart)
    assert stopped[0].endswith(f"resume with hydra.run.dir={tmp_path} ckpt_path=last"), stopped[0]
    assert "Traceback" not in out
    if strategy == "ddp_spawn":  # as the line says, a step further: the spawned ranks drop what the parent drops
        resumed = train(
            *LONG, f"strategy={strategy}", "trainer.devices=2", f"trainer.max_steps={step + 1}", "ckpt_path=last",
            f"hydra.run.dir={tmp_path}",
        )  # fmt: skip
        assert resumed.returncode == 0, output(resumed)[-3000:]
        # before: Lightning's "Checkpoint directory ... exists and is not empty", from a spawned rank (a new
        # interpreter, without the filters of src/core/console.py's quiet_resume)
        assert "site-packages" not in output(resumed), output(resumed)[-3000:]  # no warning with its source line
        assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step + 1


# A test-only callback that raises on one rank at step 3, before that step's all-reduce (tests/faults.py), a second
# after reaching it: the tests wait for step 2's checkpoint with every rank up, and a step takes 0.03 s
RAISE = ["+callbacks.fault._target_=tests.faults.RaiseAt", "+callbacks.fault.step=3", "+callbacks.fault.delay_s=1"]


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def boards_of(run_dir: Path) -> list[Path]:
    """The node boards in shared memory whose ranks write their stacks into ``run_dir`` (the hang watch's records)."""
    from src.resilience import node_board

    found = []
    for board in (b for b in node_board.root().iterdir() if node_board.BOARD_NAME.fullmatch(b.name)):
        for record in board.glob("r*.json"):
            with contextlib.suppress(OSError, ValueError):
                if str(json.loads(record.read_text()).get("log", "")).startswith(str(run_dir)):
                    found.append(board)
                    break
    return found


@pytest.mark.parametrize("strategy, rank", [("ddp", 0), ("ddp", 1), ("ddp_spawn", 1)])
def test_an_exception_on_any_rank_stops_every_process_within_seconds_with_one_line_naming_it(strategy, rank, tmp_path):
    # last.ckpt at step 2, the failure at step 3
    proc = start_and_wait_for_step(
        tmp_path,
        2,
        *LONG,
        *RAISE,
        f"+callbacks.fault.rank={rank}",
        f"strategy={strategy}",
        "trainer.devices=2",
        ranks=2,
    )
    everyone = [proc.pid, *descendants(proc.pid)]
    assert boards_of(tmp_path)  # the node's board in shared memory, while the run runs
    out, seconds = finish(proc, everyone, limit_s=60)
    assert proc.returncode == 1 and seconds < 30, out[-3000:]
    assert not [p for p in everyone if running(p)], "processes were left behind"
    assert not boards_of(tmp_path), "the failed run left its node's board in shared memory"
    errors = error_lines(out)
    assert len(errors) == 1 and re.fullmatch(
        rf"error: rank {rank}: RuntimeError: injected failure at step 3 \(traceback in \S+\.log\)", errors[0]
    ), out[-3000:]
    logged = Path(errors[0].rsplit("traceback in ", 1)[1].rstrip(")"))
    assert "tests/faults.py" in logged.read_text()  # the traceback went to that rank's log, not the console
    assert "Traceback" not in out and "Callback" not in out  # nor a Hydra callback's complaint
    assert last_step(tmp_path) == 2  # nothing written after the failure


def test_a_failure_on_another_node_stops_this_node_too_and_both_say_which_rank(tmp_path):
    port = free_port()
    args = [*LONG, *RAISE, "+callbacks.fault.rank=1", "strategy=ddp", "trainer.devices=1", "trainer.num_nodes=2"]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    node1 = train(*args, f"hydra.run.dir={tmp_path}", env={**env, "NODE_RANK": "1"}, background=True)
    node0 = start_and_wait_for_step(tmp_path, 2, *args, env={**env, "NODE_RANK": "0"})  # rank 1 fails at step 3
    out0, seconds = finish(node0, [node0.pid], limit_s=60)
    out1, _ = finish(node1, [node1.pid], limit_s=30)  # it had failed first
    assert node0.returncode == node1.returncode == 1 and seconds < 30, (out0[-2000:], out1[-2000:])
    failure = "error: rank 1: RuntimeError: injected failure at step 3"
    assert len(error_lines(out1)) == 1 and error_lines(out1)[0].startswith(failure), out1[-3000:]
    assert len(error_lines(out0)) == 1 and error_lines(out0)[0].startswith(failure), out0[-3000:]
    assert error_lines(out0)[0].endswith("; this node's ranks stopped too")
    assert "Traceback" not in out0 + out1


def test_a_rank_whose_store_host_ends_as_it_connects_records_its_failure_within_seconds(tmp_path, monkeypatch):
    """The store's host (rank 0) answers the plain connect and ends before torch's client has connected (both saw
    the launcher die): torch then tries the refused address again until its timeout, twice. A rank that fails or
    ends connects with END_CONNECT_S, not the 30 s a connection at the start may need."""
    import socket
    import threading

    from src.resilience import supervision
    from src.resilience.node_board import NodeBoard

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def host_that_ends() -> None:  # takes the plain connect, then is gone: every later connect is refused
        conn, _ = listener.accept()
        conn.close()
        listener.close()

    threading.Thread(target=host_that_ends, daemon=True).start()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(supervision, "END_CONNECT_S", 1.0)
    board = NodeBoard("end-connect", 0, 1, 2, stale_s=3.0, folder=tmp_path / "board")
    record = supervision.FailureRecord(1, 0, 1, 2, False, board)
    began = time.monotonic()
    assert record.publish("rank 1: the process that launched it (pid 1) died; this rank stopped too", 1)
    # two tries of END_CONNECT_S, not two of 30 s: 4.3 s once on a loaded 2-core machine, hence the margin
    assert time.monotonic() - began < 2 * 1.0 + 15
    assert board.read("failure")["rank"] == 1  # this node's ranks still read it, from the board


def test_a_rank_the_reporter_counted_stays_off_the_store_and_one_that_counted_itself_is_waited_for(tmp_path):
    """The store's host ends once every rank has read the failure: the rank that wrote it counts itself, the node's
    reporter the others, once each (a file per local rank on the board). A rank ending on its own as the failure
    arrives, which the reporter counted, must not go to the store (its host may be gone: torch's client retries a
    closed store for seconds, printing each try); one that counted itself first is one the host waits for."""
    from datetime import timedelta

    import torch.distributed as dist

    from src.resilience import supervision
    from src.resilience.node_board import NodeBoard

    hosts: list[Any] = []  # a store for each run below
    connects: list[int] = []
    before_connect: dict[int, Callable[[], None]] = {}

    def ranks(run: str, world: int) -> list[supervision.FailureRecord]:
        hosts.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
        port = hosts[-1].port

        def connect(rank: int) -> Callable[[float], Any]:
            def client(timeout_s: float) -> Any:
                connects.append(rank)
                before_connect.pop(rank, lambda: None)()
                return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))

            return client

        board = [NodeBoard(run, 0, r, world, 3.0, tmp_path / run) for r in range(world)]
        board[0].beat()  # local rank 0's pulse: the node's reporter
        return [supervision.FailureRecord(r, 0, r, world, False, board[r], connect(r)) for r in range(world)]

    def seen(record: supervision.FailureRecord) -> int:
        return hosts[-1].add(record._prefix + "seen", 0)

    # rank 0 fails; its node's reporter brings the record to the board and counts ranks 1 and 2 as having read it
    zero, one, _ = ranks("counted", 3)
    assert zero.publish("rank 0: it failed", 1)
    zero._wait()  # the reporter's round: the record is in the store, so it returns at once
    assert seen(zero) == 3  # the host may go now
    connects.clear()
    assert not one.publish("rank 1: the process that launched it (pid 1) died; this rank stopped too", 1)
    assert connects == [] and one.board.read("failure")["rank"] == 0  # not the store: the board, and no line
    # the other order: rank 1 counts itself, and the reporter's round comes as rank 1 connects
    zero, one, _ = ranks("counted-itself", 3)
    assert zero.publish("rank 0: it failed", 1)
    observed: list[int] = []
    before_connect[1] = lambda: (zero._wait(), observed.append(seen(zero)))
    connects.clear()
    assert not one.publish("rank 1: the process that launched it (pid 1) died; this rank stopped too", 1)
    assert observed == [2]  # the reporter counted rank 2 alone: the host waits for rank 1 ...
    assert connects == [1, 0] and seen(zero) == 3  # ... whose own count follows its write (0: the reporter's)


def test_a_rank_that_took_the_reporters_role_asks_the_store_and_gives_the_role_back_at_once(tmp_path):
    """Local rank 0's pulse went stale (stopped, starved, slow to start): local rank 1 reports for the node. It
    asks the store for the run's failure every POLL_S rather than waiting in it, so that it leaves the role within
    a round of rank 0's next beat: its wait held a second connection to the store beside rank 0's for up to 24 h,
    and printed torch's C++ stack if the store's host died meanwhile. Asking, it still brings a failure to the
    board within a round."""
    from datetime import timedelta

    import torch.distributed as dist

    from src.resilience import supervision
    from src.resilience.node_board import NodeBoard

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def connect(timeout_s: float) -> Any:
        return dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=timeout_s))

    boards = [NodeBoard("takeover", 1, local, 2, 3.0, tmp_path / "node1") for local in (0, 1)]
    records = [supervision.FailureRecord(2 + local, 1, local, 4, False, boards[local], connect) for local in (0, 1)]
    boards[0].publish({"rank": 2})

    def take_over() -> Any:
        old = time.time() - 10
        os.utime(tmp_path / "node1" / "r0.json", (old, old))  # local rank 0 stopped: its pulse ages
        for _ in range(4):  # a look at the role every fourth tick
            assert records[1].tick() is None
            if records[1]._waiter is not None and records[1]._waiter.is_alive():
                return records[1]._waiter
        raise AssertionError("local rank 1 never took the reporter's role")

    waiter = take_over()
    time.sleep(2 * supervision.POLL_S)
    assert waiter.is_alive()  # no failure yet: it goes on asking
    boards[0].beat()  # rank 0 runs again, and reports
    waiter.join(2 * supervision.POLL_S + 1)
    assert not waiter.is_alive(), "the rank that took over still waits in the store beside local rank 0"
    waiter = take_over()
    other_node = NodeBoard("takeover", 0, 0, 2, 3.0, tmp_path / "node0")
    assert supervision.FailureRecord(0, 0, 0, 4, False, other_node, connect).publish("rank 0: it failed", 1)
    waiter.join(2 * supervision.POLL_S + 1)
    assert not waiter.is_alive() and boards[0].read("failure")["rank"] == 0


def test_a_store_hosting_launcher_that_has_begun_to_exit_is_going_before_its_children_get_a_new_parent(tmp_path):
    """A launcher that hosts the store (torchrun's agent) closes its sockets as it exits, and only then do its
    children get another parent: a rank that read only its parent pid slipped store calls into that gap and torch
    printed each broken one with a C++ stack. Here the launcher's main thread exits while another lives on (the
    process exiting, its children still its own): the rank sees it going, though its parent pid has not moved."""
    launcher = (
        "import ctypes, os, subprocess, sys, threading, time\n"
        "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
        "threading.Thread(target=child.wait).start()\n"
        "while not os.path.exists(sys.argv[2]) and child.poll() is None:  # the rank has looked once\n"
        "    time.sleep(0.01)\n"
        "ctypes.CDLL(None).pthread_exit(None)  # the main thread (the pid's) ends: the process has begun to exit\n"
    )
    rank = (
        "import json, os, sys, time\n"
        "from src.resilience import supervision\n"
        "supervision._launcher = (0, os.getppid(), 'its launcher', True)  # as watch_launcher sets it\n"
        "before = supervision.store_host_going()\n"
        "open(sys.argv[1], 'w').close()\n"
        "deadline = time.monotonic() + 10\n"
        "while not supervision.store_host_going() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(json.dumps([before, supervision.store_host_going(), supervision.launcher_gone() is not None,\n"
        "                  os.getppid() == supervision._launcher[1]]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", launcher, rank, str(tmp_path / "looked")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # seen going (its launcher's line), though the parent pid has not moved
    assert result.stdout.strip() == "[false, true, true, true]", result.stdout + result.stderr[-3000:]


def test_local_ranks_leave_a_mistake_before_the_group_to_their_launcher_and_end_with_it(tmp_path):
    """A mistake the ranks meet before their group forms (nodes that count the world differently) is the same in
    every local rank of a node: local rank 0, the launcher, says it. Before, a rank it started said it too where it
    came to its line first (a loaded node: two lines from one node, once in a full run). Real processes: a launcher
    that starts two ranks, says its line once they are at theirs, stops one (as its end does) and leaves the other."""
    rank = (
        "import sys\n"
        "from src.resilience import supervision\n"
        "open(sys.argv[1], 'w').close()\n"
        "supervision.end_run('rank 1: the nodes count the world differently', 2)\n"
    )
    launcher = (
        "import os, subprocess, sys, time\n"
        "from pathlib import Path\n"
        "env = {**os.environ, 'CIFAR10_DDP_LAUNCHER_PID': str(os.getpid())}\n"
        "marks = [Path(sys.argv[2], str(k)) for k in (1, 2)]\n"
        "ranks = [subprocess.Popen([sys.executable, '-c', sys.argv[1], str(m)], env=env) for m in marks]\n"
        "while not all(m.exists() for m in marks):\n"
        "    time.sleep(0.05)\n"
        "time.sleep(1.0)  # both at their line\n"
        "print('error: rank 0: the nodes count the world differently', flush=True)\n"
        "ranks[0].terminate()\n"
        "print('stopped:', ranks[0].wait(), 'left:', ranks[1].pid, flush=True)\n"
        "sys.exit(2)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", launcher, rank, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,  # the ranks hold the pipe too: run returns once the one left has ended
    )
    out = proc.stdout
    assert proc.returncode == 2 and re.findall("^error: .*", out, re.M) == [
        "error: rank 0: the nodes count the world differently"
    ], out
    left = int(re.search(r"^stopped: 2 left: (\d+)$", out, re.M).group(1))  # the stopped one: the mistake's status
    deadline = time.monotonic() + 10  # its files close as it exits, a moment before it is gone
    while running(left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(left)  # it ended once its launcher had, without a word


def test_a_rank_whose_launcher_died_before_its_watch_began_ends_at_once_naming_it(tmp_path):
    """A local rank's launcher killed in the seconds of the rank's start, before the rank's watch begins (as its
    process group forms): the watch still has the launcher to watch, and ends the rank at once with the line, where
    it once had none and the rank went on to a rendezvous with the dead launcher's store. A process the rank starts,
    which inherits the variable, is nobody's rank."""
    loaded = tmp_path / "loaded"
    rank = (
        "import os, subprocess, sys, time\n"
        "from src.launch import ranks\n"
        "open(sys.argv[1], 'w').close()\n"
        "while os.getppid() == int(os.environ['CIFAR10_DDP_LAUNCHER_PID']):\n"
        "    time.sleep(0.05)\n"
        "below = 'from src.launch import ranks; print(ranks.launcher_pid())'\n"
        "below = subprocess.run([sys.executable, '-c', below], capture_output=True, text=True).stdout.strip()\n"
        "print('below:', below, flush=True)\n"
        "from src.resilience import supervision\n"
        "pid = ranks.launcher_pid()\n"
        "if pid is not None:  # as setup_distributed does\n"
        "    supervision.watch_launcher(1, pid)\n"
        "time.sleep(30)\n"
    )
    launcher = (
        "import os, subprocess, sys, time\n"
        "env = {**os.environ, 'CIFAR10_DDP_LAUNCHER_PID': str(os.getpid())}\n"
        "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], env=env)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, rank, str(loaded)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not loaded.exists():  # the rank has loaded src.launch.ranks, as every rank's start does
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.kill()
    began = time.monotonic()
    out, _ = proc.communicate(timeout=60)  # once the rank, which holds the pipe too, has ended
    assert time.monotonic() - began < 20, out  # not its 30 s of sleep
    assert f"error: rank 1: the process that launched it (pid {proc.pid}) died; this rank stopped too" in out, out
    assert "below: None" in out


class _Pipe:
    """Where a rank's stdout and stderr meet, as in a launcher's pipe: one list of writes. ``pauses``: the first write
    that starts with each text makes its writer wait that many seconds after it (the moment another thread's write
    would land); ``paused``: the first such write happened."""

    def __init__(self, pauses: dict[str, float]) -> None:
        self.writes: list[str] = []
        self.pauses = dict(pauses)
        self.paused = threading.Event()

    def write(self, text: str) -> int:
        self.writes.append(text)
        pause = next((p for p in self.pauses if text.startswith(p)), None)
        if pause is not None:
            self.paused.set()
            time.sleep(self.pauses.pop(pause))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_a_failures_line_is_a_line_of_its_own_while_the_progress_bar_draws_its_last(monkeypatch):
    """Seen under the suite's load: a rank's failure watch printed ``error: ...`` while its main thread's progress bar
    drew its last (in a pipe, the bar's text and its newline are two writes): the line was glued to the bar, and a
    reader of ``error:`` lines (tests/test_hangs.py's, a user's grep) found none. Here the failure's newline and its
    line have a pause between them, the bar begins to stop in that pause, and its text and newline have a longer one:
    the bar waits for the console, or its text would land between the failure's newline and its line."""
    from lightning.pytorch.callbacks.progress.rich_progress import CustomProgress
    from rich.console import Console

    from src.callbacks.progress import ProgressBar
    from src.resilience import supervision

    pipe = _Pipe({"\n": 0.3, "Epoch": 0.6})
    monkeypatch.setattr(sys, "stderr", pipe)
    monkeypatch.setattr(supervision, "OPEN_LINES", [])
    bar = ProgressBar()
    assert len(supervision.OPEN_LINES) == 1
    bar.progress = CustomProgress(*bar.configure_columns(None), console=Console(file=pipe), auto_refresh=False)
    bar.progress.start()
    bar.progress.add_task("Epoch 0/0", total=225, completed=4)
    saying = threading.Thread(target=supervision.say_error, args=("rank 1 made no progress",))
    saying.start()
    assert pipe.paused.wait(10)  # the newline before the failure's line is out, its line not yet
    bar._stop_progress()
    saying.join(10)
    out = "".join(pipe.writes)
    assert "\nerror: rank 1 made no progress\n" in out, repr(out)
    assert any(line.startswith("Epoch 0/0") and "4/225" in line for line in out.splitlines()), repr(out)


def test_a_forked_child_has_its_own_console_turn_while_its_parents_is_held_by_another_thread():
    """A warm start, or a spare rank, is a fork; a turn its parent's other thread held at that moment would have kept
    the child's every line waiting CONSOLE_WAIT_S."""
    from src.core.errors import console_turn

    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with console_turn():
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:
            start = time.monotonic()
            with console_turn():
                pass
            os._exit(0 if time.monotonic() - start < 1 else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        holder.join()
    assert os.waitstatus_to_exitcode(status) == 0


def terminal_screen(output: str, width: int) -> list[str]:
    """What a terminal ``width`` columns wide shows once ``output`` is written to it: text, carriage returns,
    newlines, long lines wrapped, and the two moves a rich live display redraws itself with (a line cleared, the
    cursor up); colours and the cursor's showing dropped."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]", output):
        if token == "\r":
            col = 0
        elif token == "\n":
            row += 1
        elif token.startswith("\x1b["):
            if token == "\x1b[2K":
                rows[row] = []
            elif token.endswith("A"):
                row = max(0, row - int(token[2:-1] or 1))
        else:
            if col >= width:
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = token
            col += 1
        while len(rows) <= row:
            rows.append([])
    return ["".join(line).rstrip() for line in rows]


def test_in_a_terminal_another_ranks_error_line_is_not_wiped_by_the_progress_bars_next_drawing(tmp_path):
    """Seen in a terminal: rank 1 printed its error line on the terminal rank 0's live progress bar was drawn on,
    and the bar's next drawing (clear the lines it drew, from where the cursor is) wiped it: the run ended with exit
    status 1 and no line. Rank 0, whose bar it is, says the line again, above its bar."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    from tests import warm

    width = 220
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, width, 0, 0))
    args = [
        *LONG[:-2],  # the project's bar on
        "test=false",
        "strategy=ddp",
        "trainer.devices=2",
        "+callbacks.fault._target_=tests.faults.RaiseAt",
        "+callbacks.fault.rank=1",
        "+callbacks.fault.step=12",
        f"hydra.run.dir={tmp_path}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with os.fdopen(slave, "wb", closefd=True) as terminal:
        proc = warm.popen(
            [sys.executable, "-m", "src.train", *args], cwd=ROOT, env=env, stdout=terminal, stderr=terminal
        )
    written, deadline = b"", time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # every process that held the terminal has ended
                    break
                if not chunk:
                    break
                written += chunk
            elif proc.poll() is not None and not any(running(p) for p in descendants(proc.pid)):
                break
    finally:
        os.close(master)
    assert proc.wait(30) == 1, written[-3000:]
    shown = terminal_screen(written.decode(errors="replace"), width)
    said = [line for line in shown if line.startswith("error: rank 1: RuntimeError: injected failure at step 12")]
    assert said, "\n".join(shown[-15:])
