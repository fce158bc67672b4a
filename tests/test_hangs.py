"""A rank that hangs is named, with where it was and its stack, within strategy.hang_timeout_s; a slow but live one
is not; kill -USR2 writes a rank's stacks without stopping it; Ctrl-C stops every rank at one step with last.ckpt
and exit code 130, and a second Ctrl-C quits at once."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests import warm
from tests.conftest import FAST, ROOT, descendants, free_port, output, running, train
from tests.test_supervision import LONG, error_lines, finish, last_step, rank_pids, start_and_wait_for_step

HANG_S = 6
HANG = [*LONG, f"strategy.hang_timeout_s={HANG_S}", "strategy.timeout_s=120"]  # a collective alone would wait 120 s
SLEEP = ["+callbacks.fault._target_=tests.faults.SleepAt", "+callbacks.fault.rank=1", "+callbacks.fault.step=4"]
SLEEP_LINE = next(
    n for n, line in enumerate(Path(ROOT, "tests", "faults.py").read_text().splitlines(), 1) if "# the hang" in line
)


def hang_line(out: str, rank: int) -> str:
    errors = error_lines(out)
    assert len(errors) == 1, out[-3000:]
    assert re.match(
        rf"error: rank {rank} \(host \S+, pid \d+\) made no progress for \d+ s at step \d+ of epoch 0, ", errors[0]
    ), errors[0]
    return errors[0]


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_stopped_with_sigstop_is_named_and_every_process_ends(rank, tmp_path):
    proc = start_and_wait_for_step(tmp_path, 2, *HANG, "strategy=ddp", "trainer.devices=2", ranks=2)
    everyone = [proc.pid, *descendants(proc.pid)]
    victim = rank_pids(proc.pid)[rank]
    os.kill(victim, signal.SIGSTOP)
    out, seconds = finish(proc, everyone, limit_s=HANG_S + 30)
    assert seconds < HANG_S + 30, out[-3000:]
    if rank == 1:
        line = hang_line(out, 1)
        assert proc.returncode == 1 and f"pid {victim})" in line
        assert "it cannot run Python (stopped" in line and "py-spy dump" in line
    else:  # rank 0 hosts the run's store: the others find it silent, say so, and kill it
        assert proc.returncode == -signal.SIGKILL, out[-3000:]
        assert len(error_lines(out)) == 1 and re.match(
            rf"error: rank 0 \(host \S+, pid {victim}\), which hosts the run's store, stopped answering for \d+ s "
            r"\(last seen at step \d+ of epoch 0, .*\): it cannot run \(stopped",
            error_lines(out)[0],
        ), out[-3000:]
    assert not [p for p in everyone if running(p)], "processes were left behind"
    assert last_step(tmp_path) >= 2  # the previous last.ckpt, whole
    assert "Traceback" not in out


def test_the_store_hosts_silence_says_where_rank_0_last_was_even_where_this_rank_judged_it_earlier(tmp_path):
    """The line of the case above, in-process: node 0's rank 1 reported and judged for a few rounds while rank 0 was
    slow to publish (a loaded machine) and kept that early record, without where rank 0 was; when rank 0 stops, the
    line says where rank 0 last was, from rank 0's own record on the node's board. A rank on another node has only
    the judge's record: its step and epoch, where it lacks the place."""
    from src.resilience.node_board import NodeBoard
    from src.resilience.supervision import HangWatch

    def silent_store_line(watch: HangWatch) -> str:
        watch.end = lambda *args, **kwargs: None
        watch._store_host_silent(watch._rank_zero(), 6.0)
        note = watch.board.read("end")
        assert note is not None
        return note["line"]

    rank_0, rank_1 = (NodeBoard("t", 0, local, 2, stale_s=3.0, folder=tmp_path / "node0") for local in (0, 1))
    rank_0.publish({"rank": 0, "where": "at step 7 of epoch 0, in the optimizer step", "step": 7, "epoch": 0})
    host = {"host": "node0", "pid": 42}
    same_node = HangWatch(1, 0, 1, 2, HANG_S, None, rank_1, 1, host=host)
    same_node._seen[0] = {"record": {"where": None, "last": [1, 0]}, "moved": 0.0}  # judged at step 1
    assert (
        "rank 0 (host node0, pid 42), which hosts the run's store, stopped answering for 6 s (last seen at step 7 of "
        "epoch 0, in the optimizer step): it cannot run (stopped"
    ) in silent_store_line(same_node)
    other_node = HangWatch(1, 1, 0, 2, HANG_S, None, NodeBoard("t", 1, 0, 1, 3.0, tmp_path / "node1"), 2, host=host)
    other_node._seen[0] = {"record": {"where": None, "last": [5, 0]}, "moved": 0.0}
    assert "(last seen at step 5 of epoch 0, as its node last reported): it cannot run" in silent_store_line(other_node)


def test_the_judge_forgets_where_a_rank_was_still_once_its_node_says_it_moved(tmp_path):
    """A node that said its rank was still (on a loaded machine, a start slower than ``detail_after_s``: `at step 0 of
    epoch 0, starting`) and then that it moved: the judge kept that first place, and when the node then stopped
    whole, the line put the rank at step 0, starting, where it had trained on (seen on a 2-core AVX2 EPYC at its
    slower pace, in the real test below). The judge in-process, against torch's in-memory store."""
    from torch.distributed import HashStore

    from src.resilience.node_board import NodeBoard
    from src.resilience.supervision import HangWatch

    class Ended(Exception):
        pass

    def end(line: str, code: int, **kwargs) -> None:
        raise Ended(line)

    store = HashStore()
    judge = HangWatch(0, 0, 0, 2, HANG_S, None, NodeBoard("t", 0, 0, 1, 3.0, tmp_path / "node0"), 2)
    judge.end = end
    waiting = [5, 11, 1, 0.1, 5, 0]  # rank 0: [place, activity, waiting, age, step, epoch], in the all-reduce
    rank_1 = {  # rank 1, as its node said it at each second
        0: [0, 1, 0, 0.1, 0, 0, "at step 0 of epoch 0, starting"],
        1: [5, 12, 0, 0.1, 5, 0],  # moved: a training step at step 5, then its node stops whole (SIGSTOP)
    }
    with pytest.raises(Ended) as ended:
        for now in range(30):
            store.set(f"{judge._prefix}node0", json.dumps({"pulse": now, "by": 0, "ranks": {"0": waiting}}))
            if now in rank_1:
                store.set(f"{judge._prefix}node1", json.dumps({"pulse": now, "by": 1, "ranks": {"1": rank_1[now]}}))
            judge._judge(store, float(now))
    assert "made no progress for " in str(ended.value)
    assert " s at step 5 of epoch 0, as its node last reported, while rank 0 waited for it" in str(ended.value)


def test_a_stopped_one_process_node_is_named_at_the_step_it_last_reported(tmp_path):
    # one rank per node (one GPU a node, or a whole host frozen): the stopped rank is its node's reporter too, so its
    # node never sends where it stopped; the line gives the step its node last reported
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = [*HANG, "strategy=ddp", "trainer.devices=1", "trainer.num_nodes=2", f"hydra.run.dir={tmp_path}"]
    node1 = train(*args, env={**env, "NODE_RANK": "1"}, background=True)
    node0 = start_and_wait_for_step(tmp_path, 2, *args, env={**env, "NODE_RANK": "0"})
    os.kill(node1.pid, signal.SIGSTOP)
    try:
        out, seconds = finish(node0, [node0.pid], limit_s=HANG_S + 30)
    finally:
        if running(node1.pid):
            node1.kill()
    line = hang_line(out, 1)
    assert node0.returncode == 1 and seconds < HANG_S + 30, out[-3000:]
    assert re.search(
        rf"pid {node1.pid}\) made no progress for \d+ s at step \d+ of epoch 0, as its node last reported", line
    )
    assert "it cannot run Python (stopped" in line
    node1.communicate(timeout=30)
    assert node1.returncode == -signal.SIGKILL  # killed by node 0's rank on the same host, not by this test


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_rank_stuck_in_python_writes_its_stack_and_is_named(strategy, tmp_path):
    proc = start_and_wait_for_step(tmp_path, 2, *HANG, *SLEEP, f"strategy={strategy}", "trainer.devices=2", ranks=2)
    out, seconds = finish(proc, [proc.pid], limit_s=HANG_S + 30)  # it sleeps from step 4 on
    assert proc.returncode == 1 and seconds < HANG_S + 30, out[-3000:]
    line = hang_line(out, 1)
    assert "at step 4 of epoch 0, in a training step, while rank 0 waited for it" in line
    log = Path(re.search(r"its Python stack is in (\S+);", line).group(1))
    stacks = log.read_text()
    assert f'File "{ROOT}/tests/faults.py", line {SLEEP_LINE} in on_train_batch_start' in stacks, stacks[-3000:]
    assert f"resume with hydra.run.dir={tmp_path} ckpt_path=last" in line and last_step(tmp_path) == 4
    assert "Traceback" not in out
    assert not [p for p in descendants(proc.pid) if running(p)]


def test_a_rank_stuck_on_another_node_is_named_on_both(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = [*HANG, *SLEEP, "strategy=ddp", "trainer.devices=1", "trainer.num_nodes=2"]
    node1 = train(*args, f"hydra.run.dir={tmp_path}", env={**env, "NODE_RANK": "1"}, background=True)
    node0 = start_and_wait_for_step(tmp_path, 2, *args, env={**env, "NODE_RANK": "0"})
    out0, seconds = finish(node0, [node0.pid], limit_s=HANG_S + 30)
    out1, _ = finish(node1, [node1.pid], limit_s=30)
    assert node0.returncode == node1.returncode == 1, (out0[-2000:], out1[-2000:])
    line = hang_line(out1, 1)
    assert "in a training step" in line and "train_node1_local0.log" in line
    assert error_lines(out0) == [f"{line} [on {socket.gethostname()}]; this node's ranks stopped too"], out0[-3000:]
    assert seconds < HANG_S + 30
    assert f"line {SLEEP_LINE} in on_train_batch_start" in (tmp_path / "train_node1_local0.log").read_text()


def test_a_slow_checkpoint_write_and_a_slow_validation_are_not_a_hang_and_usr2_dumps_stacks(tmp_path):
    slow = [
        "+callbacks.slow_save._target_=tests.faults.SlowCheckpoint",
        "+callbacks.slow_save.seconds=8",
        "+callbacks.slow_val._target_=tests.faults.SlowValidation",
        "+callbacks.slow_val.seconds=2.5",
        "trainer.limit_val_batches=3",
        "trainer.num_sanity_val_steps=0",
    ]
    args = [
        *FAST,
        "data.num_train=400",
        "trainer.limit_train_batches=3",
        "callbacks.progress_bar=null",
        "test=false",
        "strategy.hang_timeout_s=5",
        *slow,
        "strategy=ddp",
        "trainer.devices=2",
        f"hydra.run.dir={tmp_path}",
    ]
    proc = train(*args, background=True)
    log = tmp_path / "train_node0_local1.log"
    deadline = time.monotonic() + 120
    while not (tmp_path / "checkpoints").is_dir() or not log.is_file():  # training has started
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    rank1 = rank_pids(proc.pid)[1]
    os.kill(rank1, signal.SIGUSR2)
    out, seconds = finish(proc, [proc.pid], limit_s=150)
    assert proc.returncode == 0, out[-3000:]  # 8 s of writing and 7.5 s of validation, with 5 s allowed
    assert not error_lines(out)
    assert f"stacks: every thread's Python stack of rank 1 (pid {rank1}) written to {log}" in out
    assert "Thread 0x" in log.read_text() and 'File "' in log.read_text()
    assert last_step(tmp_path) == 3


def start_in_own_group(*overrides: str, cold: bool = False) -> subprocess.Popen:
    """Start a run as a terminal's foreground job would: its own process group, SIGINT at its default; warm unless
    ``cold`` (tests/warm.py: a warm run's ranks are its own children, as they are a cold one's)."""
    env = {"CIFAR10_DDP_COLD": "1"} if cold else None
    return train(*overrides, background=True, start_new_session=True, default_sigint=True, env=env)


def wait_for(condition, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_ctrl_c_stops_every_rank_at_one_step_with_last_ckpt_and_exit_130(strategy, tmp_path):
    """ddp: with the DataLoader pipeline's workers, which the terminal's Ctrl-C reaches too (before: they ended at
    once, and the ranks' next batch failed the run, misread as "cannot write the run dir")."""
    # ddp_spawn's cold start: its ranks spawned as new interpreters by multiprocessing, as they are in every run
    workers = ["data.pipeline=dataloader", "data.num_workers=1"] if strategy == "ddp" else []
    run = [*LONG, f"strategy={strategy}", "trainer.devices=2", *workers, f"hydra.run.dir={tmp_path}"]
    proc = start_in_own_group(*run, cold=strategy == "ddp_spawn")
    wait_for(lambda: last_step(tmp_path) >= 2 and len(rank_pids(proc.pid)) == 2, proc)
    everyone = [proc.pid, *descendants(proc.pid)]
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at the terminal does
    out, seconds = finish(proc, everyone, limit_s=60)
    assert proc.returncode == 130 and seconds < 60, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1, out[-3000:]
    match = re.fullmatch(
        rf"interrupted \(Ctrl-C\) at step (\d+) of epoch 0; {tmp_path}/checkpoints/last.ckpt written; "
        rf"resume with hydra.run.dir={tmp_path} ckpt_path=last",
        lines[0],
    )
    assert match, lines[0]
    assert last_step(tmp_path) == int(match.group(1)) > 2
    assert not [p for p in everyone if running(p)], "processes were left behind"
    assert "Traceback" not in out and not error_lines(out)


def test_a_second_ctrl_c_during_the_save_quits_at_once_and_keeps_the_previous_last_ckpt(tmp_path):
    slow = [
        "+callbacks.slow_save._target_=tests.faults.SlowCheckpoint",
        "+callbacks.slow_save.seconds=120",
        "+callbacks.slow_save.after=1",
    ]  # the save at step 2 is quick, the next ones take two minutes
    proc = start_in_own_group(*LONG, *slow, "strategy=ddp", "trainer.devices=2", f"hydra.run.dir={tmp_path}")
    wait_for(lambda: last_step(tmp_path) >= 2 and len(rank_pids(proc.pid)) == 2, proc)
    everyone = [proc.pid, *descendants(proc.pid)]
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: any(p.name.startswith(".last.ckpt.tmp-") for p in (tmp_path / "checkpoints").iterdir()), proc)
    time.sleep(1.5)  # a second press, not the same one
    os.killpg(proc.pid, signal.SIGINT)
    out, seconds = finish(proc, everyone, limit_s=30)
    assert proc.returncode == 130 and seconds < 15, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("interrupted")]
    assert lines == [
        f"interrupted again (Ctrl-C): quit at once; {tmp_path}/checkpoints/last.ckpt is the previous one "
        f"(step 2); resume with hydra.run.dir={tmp_path} ckpt_path=last"
    ], out[-3000:]
    assert last_step(tmp_path) == 2
    assert not [p for p in everyone if running(p)], "processes were left behind"
    assert "Traceback" not in out and not error_lines(out)


def test_ctrl_c_while_ddp_spawns_ranks_set_up_ends_the_run_at_once_with_its_line(tmp_path):
    """Ctrl-C once the spawned ranks have started, before their training steps listen (their setup). Before, torch's
    wrapper took the rank's KeyboardInterrupt for a stop of its own, the ranks exited 0 without a result, and
    Lightning's launcher waited for one for ever: the run hung, and printed nothing."""
    marker = tmp_path / "setting-up"
    hold = ["+callbacks.hold._target_=tests.faults.HoldInSetup", f"+callbacks.hold.marker={marker}"]
    proc = start_in_own_group(*LONG, "strategy=ddp_spawn", "trainer.devices=2", *hold, f"hydra.run.dir={tmp_path}/run")
    wait_for(marker.exists, proc)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, seconds = finish(proc, [proc.pid], limit_s=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and seconds < 60, out[-3000:]
    assert out.count("interrupted (Ctrl-C) outside a training step: nothing more was saved") == 1, out[-3000:]
    assert "Traceback" not in out and not error_lines(out), out[-3000:]


@pytest.mark.parametrize(
    "world", [[], ["strategy=ddp_spawn", "trainer.devices=2"]], ids=["one process", "ddp_spawn x2"]
)
def test_ctrl_c_in_a_sweep_stops_the_job_and_says_the_same_command_resumes_it(world, tmp_path):
    """Under ``ddp_spawn`` the sweep's process is no rank: before, it took its ranks' stop for a failed job
    (`error: job 0 (...): a rank of this job failed: see its log`) and went on to job 1."""
    proc = start_in_own_group("-m", *LONG, *world, "trainer.max_epochs=1,2", f"hydra.sweep.dir={tmp_path}")
    job = tmp_path / "0"
    wait_for(lambda: last_step(job) >= 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = finish(proc, [proc.pid], limit_s=60)
    assert proc.returncode == 130, out[-3000:]
    # the job's line ends there: before, it went on "resume with hydra.run.dir=JOB_DIR ckpt_path=last", a run of
    # its own without the job's overrides; the sweep's line says how the sweep resumes
    stopped = rf"^interrupted \(Ctrl-C\) at step \d+ of epoch 0; {job}/checkpoints/last.ckpt written$"
    assert re.search(stopped, out, re.M), out[-3000:]
    assert (
        f"the sweep stopped at job 0: run the same command again (with hydra.sweep.dir={tmp_path}) to resume the "
        "sweep: finished jobs are skipped and job 0 goes on from its last.ckpt"
    ) in out
    assert out.count("the sweep stopped") == 1 and not error_lines(out), out[-3000:]
    assert not (tmp_path / "1").exists() and "Traceback" not in out


def test_a_terminal_that_hangs_up_stops_every_rank_at_one_step_with_last_ckpt_and_its_line_in_the_log(tmp_path):
    """SIGHUP: an SSH session dropped, a terminal window closed. Before, every process died of it at once, the steps
    since the last ``last.ckpt`` lost, and nothing said so anywhere. The hangup as the kernel makes it: the terminal's
    master side closed (its output goes nowhere from then on), then SIGHUP to its foreground process group; the run
    is that group's, its output a pseudo-terminal's."""
    master, slave = os.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    overrides = [*LONG, "strategy=ddp", "trainer.devices=2", f"hydra.run.dir={tmp_path}"]
    # an interactive shell's job has SIGHUP at its default; this session's may ignore it (started under nohup), and a
    # run started so rightly trains on through a hangup
    ignored = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with os.fdopen(slave, "wb", buffering=0) as terminal:
            proc = warm.popen(
                [sys.executable, "-m", "src.train", *overrides],
                env={**env, "PYTHONUNBUFFERED": "1"},
                cwd=ROOT,
                stdout=terminal,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    finally:
        signal.signal(signal.SIGHUP, ignored)
    shown, stop = [], threading.Event()

    def show() -> None:  # the terminal's screen: read, so that the run never waits on a full one
        while not stop.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    shown.append(os.read(master, 1 << 16))
                except OSError:
                    return

    screen = threading.Thread(target=show, daemon=True)
    screen.start()
    try:
        wait_for(lambda: last_step(tmp_path) >= 2 and len(rank_pids(proc.pid)) == 2, proc)
        everyone = [proc.pid, *descendants(proc.pid)]
    finally:
        stop.set()
        screen.join()
        os.close(master)
    os.killpg(proc.pid, signal.SIGHUP)
    proc.wait(60)
    assert proc.returncode == 128 + signal.SIGHUP, b"".join(shown)[-3000:]
    log = (tmp_path / "train.log").read_text()
    step = last_step(tmp_path)
    assert (
        f"stopped: SIGHUP after step {step}: every rank stopped there and {tmp_path}/checkpoints/last.ckpt holds that "
        f"step; resume with hydra.run.dir={tmp_path} ckpt_path=last"
    ) in log, log[-3000:]
    assert step > 2 and "Traceback" not in log
    deadline = time.monotonic() + 30
    while [p for p in everyone if running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in everyone if running(p)], "processes were left behind"


def test_a_run_started_with_ctrl_c_ignored_trains_on_through_a_ctrl_c_to_its_process_group(tmp_path):
    """A job a shell starts in the background (``python -m src.train ... &`` in a script) has SIGINT ignored: the
    terminal's Ctrl-C reaches the script's whole process group, and is not for that job. Python keeps SIGINT ignored,
    and so does the run: ddp_spawn's parent and both ranks train on through fit and test, and exit 0."""
    ctrl_c = [
        "+callbacks.ctrl_c._target_=tests.faults.SignalAt",
        "+callbacks.ctrl_c.step=1",
        "+callbacks.ctrl_c.signal=SIGINT",
        "+callbacks.ctrl_c.group=true",
    ]
    proc = train(
        *FAST,
        "trainer.limit_train_batches=4",
        *ctrl_c,
        "strategy=ddp_spawn",
        "trainer.devices=2",
        f"hydra.run.dir={tmp_path}",
        background=True,
        start_new_session=True,  # the signal reaches this group only
        ignore_sigint=True,
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "SignalAt: SIGINT to process group" in out and "test accuracy" in out, out[-3000:]
    assert "interrupted" not in out and "Traceback" not in out and not error_lines(out)
    assert last_step(tmp_path) == 4


# 9 validation images at batch 4: rank 0's shard has 2 batches, rank 1's has 1 (the sanity check's too); 4 steps an
# epoch
UNEVEN = [
    *FAST,
    "data.num_train=41",
    "data.val_size=9",
    "trainer.limit_val_batches=null",
    "trainer.limit_train_batches=null",
    "trainer.max_epochs=5",
    "callbacks.last_checkpoint.every_n_train_steps=2",
    "callbacks.progress_bar=null",
    "test=false",
    f"strategy.hang_timeout_s={HANG_S}",
    "strategy.timeout_s=120",
]


@pytest.mark.parametrize("rank", [0, 1])  # the larger validation shard (and the store's host), the smaller
def test_uneven_validation_shards_over_epochs_do_not_blame_a_waiting_rank(rank, tmp_path):
    proc = start_and_wait_for_step(
        tmp_path,
        2,
        *UNEVEN,
        "+callbacks.fault._target_=tests.faults.SleepAt",
        f"+callbacks.fault.rank={rank}",
        "+callbacks.fault.step=10",
        "strategy=ddp",
        "trainer.devices=2",
        ranks=2,
    )
    out, seconds = finish(proc, [proc.pid], limit_s=HANG_S + 60)
    assert proc.returncode == 1 and seconds < HANG_S + 60, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1 and re.match(
        rf"error: rank {rank} \(host \S+, pid \d+\) made no progress for \d+ s at step "
        rf"10 of epoch 2, in a training step, while rank {1 - rank} waited for it",
        errors[0],
    ), out[-3000:]


def test_a_sweeps_ddp_job_that_tests_leaves_no_watch_behind_to_end_the_next_job(tmp_path):
    """Lightning sets the process group up again for the test stage: the watchers stay the fit's, and none is left
    running once the job's store is gone. The single-process job after it (strategy=auto: no process group of its
    own) runs well past hang_timeout_s, and sits still in a step for longer than that (step 40: only the second job,
    of 54 steps, gets there; the first has 27)."""
    result = train(
        "-m",
        *FAST,
        "data.num_train=240",
        "trainer.limit_train_batches=null",
        "test=true",
        "callbacks.progress_bar=null",
        "trainer.devices=2,1",
        "strategy.timeout_s=60",
        "strategy.hang_timeout_s=3",
        "+callbacks.sleep._target_=tests.faults.SleepAt",
        "+callbacks.sleep.rank=0",
        "+callbacks.sleep.step=40",
        "+callbacks.sleep.seconds=7",
        f"hydra.sweep.dir={tmp_path}",
        timeout=300,
    )
    out = output(result)
    assert result.returncode == 0, out[-3000:]
    assert out.count("] - test accuracy ") == 2, out[-3000:]  # both jobs trained and tested
    fit = json.loads((tmp_path / "1" / "throughput.json").read_text())["fit_time_s"]
    assert fit > 3 + 3, f"job 1 trained for {fit:.1f} s only: not past hang_timeout_s"


def test_hang_timeout_must_be_a_positive_number_below_timeout_s():
    from src.core.errors import UserError
    from src.distributed.strategy import check_hang_timeout

    assert check_hang_timeout(None, 300) is None and check_hang_timeout(120, 300) == 120.0
    # auto stays below a collective timeout the user lowered, instead of refusing a value they never set
    assert check_hang_timeout("auto", 300) == 120.0 and check_hang_timeout("auto", 60) == 30.0
    for bad in (0, -1, "abc", True):
        with pytest.raises(UserError, match=rf"strategy.hang_timeout_s={bad} must be a number of seconds > 0"):
            check_hang_timeout(bad, 300)
    with pytest.raises(UserError, match="strategy.hang_timeout_s=300 must be below strategy.timeout_s=60"):
        check_hang_timeout(300, 60)


def test_a_cuda_rank_gets_nccl_watchdog_and_flight_recorder_dumping_into_the_run_dir(tmp_path, monkeypatch):
    from src.resilience import heartbeat

    for key in list(os.environ):
        if key.startswith(("TORCH_NCCL_", "TORCH_FR_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")  # the user's own value stays
    folder = heartbeat.switch_on_nccl_trace(tmp_path)
    assert folder == tmp_path / "nccl_trace" and folder.is_dir()
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == os.environ["TORCH_FR_DUMP_ON_TIMEOUT"] == "1"
    prefix = str(folder / "rank_")
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == os.environ["TORCH_FR_DUMP_TEMP_FILE"] == prefix
    # the user's value under the older name is given to the newer too, which torch reads first
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == os.environ["TORCH_FR_BUFFER_SIZE"] == "100"
    assert heartbeat.write_nccl_trace(0) is None  # no CUDA process group here: nothing to write, no error
    if not torch.cuda.is_available():
        assert not list(folder.iterdir())


def test_a_ctrl_c_that_comes_after_the_stop_ends_the_process_with_the_stops_status_and_its_line_once():
    """``ddp_spawn``'s parent passes the terminal's Ctrl-C on to its ranks. On a busy machine it came after a rank had
    stopped and Lightning's teardown had put back the handler it found at fit's start: that rank died 'killed by
    SIGINT', and the run ended with exit 1 instead of 130. The handler found there is the project's own
    (src/resilience/failure.py); a real process here, with Lightning's record and restore of it."""
    code = (
        "import os, signal, sys, time\n"
        "from src.resilience import failure\n"
        "failure.install_sigint_handler()\n"
        "found = signal.getsignal(signal.SIGINT)  # what Lightning records at fit's start and puts back at its end\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
        "except KeyboardInterrupt:\n"
        "    print('before a stop: KeyboardInterrupt', flush=True)\n"
        "signal.signal(signal.SIGINT, lambda *_: None)  # GracefulStop's own, while the steps run\n"
        "err = failure.stopping(failure.Terminated(signal.SIGINT, 'interrupted (Ctrl-C) at step 4'), True)\n"
        "signal.signal(signal.SIGINT, found)  # Lightning's teardown\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
        "print('not reached', flush=True)\n"
    )
    result = subprocess.run(  # SIGINT at its default, as a terminal's job has it (pytest-xdist's workers ignore it)
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert (result.returncode, result.stdout) == (130, "before a stop: KeyboardInterrupt\n"), result.stderr[-2000:]
    assert result.stderr == "interrupted (Ctrl-C) at step 4\n"
    # a shell's background job ignores SIGINT: it keeps ignoring it
    ignored = subprocess.run(
        [
            sys.executable,
            "-c",
            "import signal; from src.resilience import failure; failure.install_sigint_handler();"
            "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert ignored.stdout == "True\n", ignored.stderr[-2000:]
