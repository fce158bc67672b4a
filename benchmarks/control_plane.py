"""The control plane at 16 to 2,048 ranks on one machine: what the failure record and the hang watch cost the
store's host, and whether they still name a stuck rank and stop every rank when one dies.

The project's own classes run here, not copies: ``src.resilience.supervision.FailureRecord`` and ``HangWatch``, one of
each per simulated rank (nodes of ``--per-node`` ranks), each with its own connection to one real ``TCPStore`` in a
process of its own, as rank 0's store is in a run. Each rank's work is what its threads do in a run: a hang-watch round
(``HangWatch._round``) every ``poll_s`` and a look at the failure record (``FailureRecord.follow``) every ``POLL_S``.
Training is replaced by a clock that moves every healthy rank's ``src.resilience.heartbeat.Progress`` a step at a time.

Measured on the store's host, over ``--seconds`` of a healthy run at each size:
- requests/s (counted by the clients: a ``multi_get`` of 2,048 keys is one), and bytes/s in and out of the host
  process (``/proc/PID/io``: the store's socket reads and writes);
- the host's CPU share (its store threads are all the process runs), and its open sockets;
- p50/p99 latency of a ``get`` from a separate probe process;
- how late the simulator ran the ranks' work (p99): past ``poll_s``, this one machine could not generate the load
  the design asks for, and the row says so; the design asks for more than was measured.

Faults (``--faults``), each on a fresh store: a rank stuck in Python in a training step (is it the one named, and
how long after it stopped?), a rank that dies (does every other rank read the failure, and how fast?), and every
node's first rank stalled for a while (``takeover``: the next local rank takes the reporter's role, asking the store
for the failure four times a second; what that costs the host, and whether every node is back to two connections
once the first ranks run again).
``--healthy-s`` runs a healthy simulation that long at the largest size and counts verdicts (there must be none).

The rows are written as markdown and JSON, with an SVG plot of the host's load against ranks; a line projects
16,384 ranks from the measured figures (a fit of requests/s and bytes/s against ranks, and CPU per request).

    python benchmarks/control_plane.py --ranks 16,64,256,1024,2048 --out outputs/bench/control-plane
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.arguments import number, numbers  # noqa: E402
from src.resilience.node_board import NodeBoard  # noqa: E402 - after the path above

TICK_S = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- the store's host


def host_main(port: int) -> None:
    """The store's host: a TCPStore server and nothing else, until its stdin closes."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    store.set("probe", "x" * 64)
    print("ready", flush=True)
    sys.stdin.read()


def probe_main(port: int, seconds: float, every_s: float) -> None:
    """Times a ``get`` against the store every ``every_s`` for ``seconds``; prints the times (ms) as JSON."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    times: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        began = time.perf_counter()
        store.get("probe")
        times.append((time.perf_counter() - began) * 1000)
        time.sleep(every_s)
    print(json.dumps(times), flush=True)


class Host:
    """The store's host process, and what it costs: CPU, bytes in and out, open sockets."""

    def __init__(self) -> None:
        self.port = free_port()
        # the host resolves each client's address as it connects, on its one thread; where DNS drops a query now
        # and then (as it does on some sandboxes) every client waits the resolver's timeout (5 s by default): at
        # most 1 s here, so that setting up thousands of connections ends
        env = {**os.environ, "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:1")}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--host", str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"error: the store's host did not start (exit {self.proc.wait()})")
        self.own_sockets = 0
        self.own_sockets = self.sockets()  # its listening ones: what is counted is the clients'

    def reading(self) -> dict[str, float]:
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        io = dict(line.split(": ") for line in Path(f"/proc/{self.proc.pid}/io").read_text().splitlines())
        return {
            "t": time.monotonic(),
            "cpu_s": (int(stat[11]) + int(stat[12])) / TICK_S,
            "in": int(io["rchar"]),
            "out": int(io["wchar"]),
        }

    def sockets(self) -> int:
        count = 0
        for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                count += os.readlink(f"/proc/{self.proc.pid}/fd/{fd}").startswith("socket:")
            except OSError:
                pass
        return count - self.own_sockets

    def probe(self, seconds: float) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, __file__, "--probe", str(self.port), str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()


# ------------------------------------------------------------------------------------------------ the clients


class Counted:
    """A store client that counts its requests."""

    def __init__(self, store: Any, counts: dict[str, int], lock: threading.Lock) -> None:
        self._store, self._counts, self._lock = store, counts, lock

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            with self._lock:
                self._counts[name] = self._counts.get(name, 0) + 1
            return method(*args)

        return call


class Ended(BaseException):
    """A simulated rank ended the run (``end_run``): recorded, and its work stops."""


class Simulation:
    """``world`` ranks of the control plane against the host's store; a scheduler runs each rank's periodic work
    on a pool of threads, as late as the machine makes it."""

    def __init__(
        self,
        port: int,
        world: int,
        per_node: int,
        timeout_s: float,
        step_s: float,
        threads: int,
        nodes_here: set[int] | None = None,
        t0: float | None = None,
    ) -> None:
        import torch.distributed as dist

        from src.resilience import heartbeat, supervision

        self.world, self.timeout_s, self.step_s, self.per_node = world, timeout_s, step_s, per_node
        self.t0 = time.monotonic() if t0 is None else t0
        self._stepping = threading.Lock()  # a step of the clock, or the moment a rank sticks
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self.ended: list[dict[str, Any]] = []  # each end_run a rank called: when, which rank, what line
        self.followed: dict[int, float] = {}  # rank -> when it read another rank's failure

        self.connects = 0

        def connect(timeout_s: float) -> Any:
            # now and then a connect waits for the host's name lookup (``Host``): the simulated rank tries again,
            # as a hang watch does at its next round; measuring starts once every connection is made (``settle``)
            self.connects += 1
            for attempt in range(5):
                try:
                    return Counted(
                        dist.TCPStore(
                            "127.0.0.1",
                            port,
                            is_master=False,
                            wait_for_workers=False,
                            timeout=timedelta(seconds=timeout_s),
                        ),
                        self.counts,
                        self._lock,
                    )
                except dist.DistNetworkError:
                    if attempt == 4:
                        raise

        self._boards = tempfile.mkdtemp(prefix="control-plane-")
        nodes = -(-world // per_node)
        self.ranks = [r for r in range(world) if nodes_here is None or r // per_node in nodes_here]
        boards = {
            r: NodeBoard(
                "sim",
                r // per_node,
                r % per_node,
                min(per_node, world - r // per_node * per_node),
                supervision.BOARD_STALE_S,
                folder=Path(self._boards) / f"node{r // per_node}",
            )
            for r in self.ranks
        }
        self.progress = {r: heartbeat.Progress() for r in self.ranks}
        self.failures = {
            r: supervision.FailureRecord(r, r // per_node, r % per_node, world, False, boards[r], connect=connect)
            for r in self.ranks
        }
        host_record = {"id": "sim", "host": socket.gethostname(), "pid": os.getpid()}
        self.hangs = {
            r: supervision.HangWatch(
                r,
                r // per_node,
                r % per_node,
                world,
                timeout_s,
                None,
                boards[r],
                num_nodes=nodes,
                host=host_record,
                progress=self.progress[r],
                connect=connect,
            )
            for r in self.ranks
        }
        self.poll_s = next(iter(self.hangs.values())).poll_s
        for r, watch in self.hangs.items():
            watch.end = self._ender(r)
            boards[r].beat()
        for r, watch in self.hangs.items():  # connect as a run does while it starts, before the work is timed
            if r % per_node == 0:  # each node's reporter (the judge's and the failure wait's connections)
                watch._connect()
                self.failures[r].tick()
            watch._last_ok = time.monotonic()
        self.frozen: set[int] = set()  # ranks whose progress no longer moves
        self.paused: set[int] = set()  # ranks that cannot run Python for now: their pulse ages (``pause``)
        self.gone: set[int] = set()  # ranks that do no work (dead, or stopped after reading a failure)
        self.late: list[float] = []
        self.running = True
        # a rank's periodic work: (period, what); the queue holds (due, rank, index)
        self.work = [(self.poll_s, self._round), (supervision.POLL_S, self._follow)]
        now = time.monotonic()
        self._queue = [(now + period * r / world, r, i) for r in self.ranks for i, (period, _) in enumerate(self.work)]
        heapq.heapify(self._queue)
        self._cv = threading.Condition()
        self._threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(threads)]
        self._clock = threading.Thread(target=self._train, daemon=True)

    def _ender(self, rank: int) -> Callable[..., None]:
        def end(line: str | None, code: int, **_: Any) -> None:
            with self._lock:
                self.ended.append({"t": time.monotonic(), "rank": rank, "line": line, "code": code})
            raise Ended

        return end

    def _round(self, rank: int) -> None:
        if rank in self.paused:
            return
        watch = self.hangs[rank]
        watch._pulse += 1  # what HangWatch._loop does before each round
        watch._round(time.monotonic())

    def _follow(self, rank: int) -> None:
        """What the failure watch does every POLL_S (``FailureRecord.tick``)."""
        if rank in self.paused:
            return
        if self.failures[rank].tick() is not None:
            self.followed[rank] = time.monotonic()
            self.gone.add(rank)

    def _worker(self) -> None:
        while self.running:
            with self._cv:
                while self.running and (not self._queue or self._queue[0][0] > time.monotonic()):
                    wait = self._queue[0][0] - time.monotonic() if self._queue else 0.1
                    self._cv.wait(max(0.0, min(wait, 0.1)))
                if not self.running:
                    return
                due, rank, index = heapq.heappop(self._queue)
            began = time.monotonic()
            if rank in self.gone:
                continue
            try:
                self.work[index][1](rank)
            except Ended:
                self.gone.add(rank)
                continue
            with self._cv:
                self.late.append(began - due)
                period = self.work[index][0]
                heapq.heappush(self._queue, (max(due + period, time.monotonic()), rank, index))
                self._cv.notify()

    def step(self) -> int:
        """The training step every healthy rank is at: one clock for all the processes, as DDP's all-reduce keeps
        a run's ranks in step."""
        return int((time.monotonic() - self.t0) / self.step_s)

    def _train(self) -> None:
        """Every healthy rank takes a step each ``step_s``: a training step's marks, as src.resilience.heartbeat's."""
        while self.running:
            time.sleep(self.step_s)
            with self._stepping:
                step = self.step()
                for r, progress in self.progress.items():
                    if r in self.frozen:
                        continue
                    progress.step, progress.phase = step, "in a training step"
                    progress.tick = progress.position = 2 * step

    def settle(self, least_s: float) -> None:
        """Wait at least ``least_s``, and until no connection has been made for 2 s (for ``least_s``, and at least
        0.5 s, where that is shorter: a short warm-up asks for a small world, whose connections are made at once)."""
        time.sleep(least_s)
        quiet_s = min(2.0, max(0.5, least_s))
        while True:
            made = self.connects
            time.sleep(quiet_s)
            if self.connects == made:
                return

    def start(self) -> None:
        self._clock.start()
        for thread in self._threads:
            thread.start()

    def stick(self, rank: int, step: int) -> float:
        """``rank`` stops in training step ``step``; the others reach its gradient all-reduce and wait there."""
        with self._stepping:
            self.frozen = set(self.ranks)
        for r, progress in self.progress.items():
            progress.step = step
            progress.phase = "in a training step" if r == rank else "waiting for the other ranks (all-reduce)"
            progress.tick = progress.position = 2 * step + (r != rank)
        return time.monotonic()

    def pause(self, local_rank: int | None) -> float:
        """Every node's ``local_rank`` stops running its watches (None: all run again), as a stopped or starved
        process does; the store calls it is in stay where they are."""
        self.paused = {r for r in self.ranks if local_rank is not None and r % self.per_node == local_rank}
        return time.monotonic()

    def kill(self, rank: int) -> float:
        """``rank`` dies: its watcher writes the failure (``end_run(..., dead=1)``), and it does nothing more."""
        self.gone.add(rank)
        self.frozen.add(rank)
        if rank in self.failures:
            self.failures[rank].publish(f"rank {rank} died of SIGKILL; stopped the other ranks", 1, dead=1)
        return time.monotonic()

    def stop(self) -> None:
        self.running = False
        with self._cv:
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(5)
        for record in self.failures.values():
            record._closed = True
            record.board.closed = True
        shutil.rmtree(self._boards, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- a size


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def worker(
    port: int, world: int, args: argparse.Namespace, timeout_s: float, nodes_here: set[int], t0: float, conn: Any
) -> None:
    """One process of the simulation: the ranks of ``nodes_here``, run until the parent says stop."""
    sim = Simulation(port, world, args.per_node, timeout_s, args.step_s, args.threads, nodes_here, t0)
    sim.start()
    sim.settle(args.warmup)
    conn.send(sim.poll_s)
    while True:
        command, arg = conn.recv()
        if command == "counts":
            conn.send((dict(sim.counts), len(sim.late)))
        elif command == "late":
            conn.send(sim.late[arg:])
        elif command == "stick":
            conn.send(sim.stick(*arg))
        elif command == "kill":
            conn.send(sim.kill(arg))
        elif command == "pause":
            conn.send(sim.pause(arg))
        elif command == "report":
            conn.send({"ended": list(sim.ended), "followed": dict(sim.followed), "connects": sim.connects})
        else:
            sim.stop()
            conn.send(None)
            return


class Fleet:
    """The simulated ranks in ``procs`` processes (a node's ranks in one), so that one Python's lock does not
    limit the load: what each reports, put together. Their clocks are the machine's one monotonic clock."""

    def __init__(self, host: Host, world: int, args: argparse.Namespace, timeout_s: float) -> None:
        import multiprocessing

        nodes = -(-world // args.per_node)
        procs = max(1, min(args.procs, nodes))
        context = multiprocessing.get_context("fork")  # nothing of torch is loaded here yet
        self.conns, self.procs = [], []
        self.t0, self.step_s = time.monotonic(), args.step_s
        for k in range(procs):
            ours, theirs = context.Pipe()
            proc = context.Process(
                target=worker,
                args=(host.port, world, args, timeout_s, {n for n in range(nodes) if n % procs == k}, self.t0, theirs),
            )
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)
        self.poll_s = [conn.recv() for conn in self.conns][0]

    def ask(self, command: str, arg: Any = None) -> list[Any]:
        for conn in self.conns:
            conn.send((command, arg))
        return [conn.recv() for conn in self.conns]

    def counts(self) -> tuple[int, list[int]]:
        answers = self.ask("counts")
        return sum(sum(counts.values()) for counts, _ in answers), [late for _, late in answers]

    def report(self) -> dict[str, Any]:
        answers = self.ask("report")
        return {
            "ended": sorted((e for a in answers for e in a["ended"]), key=lambda e: e["t"]),
            "followed": {r: t for a in answers for r, t in a["followed"].items()},
            "connects": sum(a["connects"] for a in answers),
        }

    def stop(self) -> None:
        self.ask("stop")
        for proc in self.procs:
            proc.join(10)


def measure(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """A healthy run of ``world`` ranks: the host's load over ``args.seconds``."""
    host = Host()
    try:
        fleet = Fleet(host, world, args, args.hang_timeout)
        probe = host.probe(args.seconds)
        before, (requests_before, late_from) = host.reading(), fleet.counts()
        time.sleep(args.seconds)
        after, (requests_after, _) = host.reading(), fleet.counts()
        late = []
        for conn, since in zip(fleet.conns, late_from):
            conn.send(("late", since))
            late += conn.recv()
        sockets = host.sockets()
        latencies = json.loads(probe.communicate()[0] or "[]")
        report = fleet.report()
        fleet.stop()
    finally:
        host.stop()
    span = after["t"] - before["t"]
    return {
        "ranks": world,
        "nodes": -(-world // args.per_node),
        "processes": len(fleet.procs),
        "requests_per_s": (requests_after - requests_before) / span,
        "bytes_in_per_s": (after["in"] - before["in"]) / span,
        "bytes_out_per_s": (after["out"] - before["out"]) / span,
        "host_cpu_share": (after["cpu_s"] - before["cpu_s"]) / span,
        "sockets": sockets,
        "get_p50_ms": percentile(latencies, 0.5),
        "get_p99_ms": percentile(latencies, 0.99),
        "late_p99_s": percentile(late, 0.99),
        "kept_up": percentile(late, 0.99) < fleet.poll_s,
        "verdicts": len(report["ended"]),
        "connections_made": report["connects"],
    }


def stuck(world: int, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """A rank stuck in Python in a training step: which rank the line names, and how long after it stopped."""
    host = Host()
    try:
        fleet = Fleet(host, world, args, args.fault_hang_timeout)
        began = min(fleet.ask("stick", (rank, int((time.monotonic() - fleet.t0) / fleet.step_s))))
        deadline = began + args.fault_hang_timeout * 3 + 30
        report = fleet.report()
        while not report["ended"] and time.monotonic() < deadline:
            time.sleep(0.2)
            report = fleet.report()
        fleet.stop()
    finally:
        host.stop()
    first = report["ended"][0] if report["ended"] else None
    return {
        "ranks": world,
        "stuck": rank,
        "named": first["rank"] if first else None,
        "line": first["line"] if first else None,
        "seconds": round(first["t"] - began, 2) if first else None,
    }


def dies(world: int, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """A rank that dies: do the others all read the failure, and how fast."""
    host = Host()
    try:
        fleet = Fleet(host, world, args, args.fault_hang_timeout)
        began = min(fleet.ask("kill", rank))
        deadline = began + 60
        report = fleet.report()
        while len(report["followed"]) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
            report = fleet.report()
        fleet.stop()
    finally:
        host.stop()
    seconds = [t - began for t in report["followed"].values()]
    return {
        "ranks": world,
        "dead": rank,
        "stopped": len(report["followed"]),
        "of": world - 1,
        "p50_s": round(percentile(seconds, 0.5), 3),
        "max_s": round(max(seconds), 3) if seconds else None,
    }


def takeover(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every node's first rank stops running Python for ``--takeover-s`` (its pulse ages past BOARD_STALE_S), then
    runs again: each node's next rank takes the reporter's role and gives it back. The host's load while it lasts
    against the same fleet healthy just before, and its sockets before, during and after."""
    from src.resilience import supervision

    # a first rank silent for half the hang timeout is judged stuck, rightly: this fault is a shorter stall
    hang_timeout_s = max(args.hang_timeout, 4 * (supervision.BOARD_STALE_S + 2.5 + args.takeover_s))
    host = Host()
    try:
        fleet = Fleet(host, world, args, hang_timeout_s)

        def tally() -> tuple[int, int]:
            """Requests made so far, and of them ``check``s (a judge's look for a verdict, a taken-over reporter's
            asking), from one round of the workers' counts."""
            answers = [counts for counts, _ in fleet.ask("counts")]
            return sum(sum(c.values()) for c in answers), sum(c.get("check", 0) for c in answers)

        def load(seconds: float) -> dict[str, float]:
            before, (requests, checks) = host.reading(), tally()
            time.sleep(seconds)
            after, (requests_after, checks_after) = host.reading(), tally()
            span = after["t"] - before["t"]
            return {
                "requests_per_s": (requests_after - requests) / span,
                "checks_per_s": (checks_after - checks) / span,
                "host_cpu_share": (after["cpu_s"] - before["cpu_s"]) / span,
                "sockets": host.sockets(),
            }

        def quiet() -> None:
            """Until no connection is made or closed for 2 s (at most a minute): a host that resolves each new
            client's name (``Host``) makes hundreds of new connections take seconds here."""
            deadline = time.monotonic() + 60
            last = None
            while time.monotonic() < deadline:
                now = (fleet.report()["connects"], host.sockets())
                if now == last:
                    return
                last = now
                time.sleep(2.0)

        healthy = load(args.takeover_s)
        fleet.ask("pause", 0)
        # the first rank's pulse goes stale, and the next one's look at the role comes within a second; it connects
        time.sleep(supervision.BOARD_STALE_S + 1.5)
        quiet()
        taken = load(args.takeover_s)
        fleet.ask("pause", None)
        time.sleep(1.0)  # the first ranks beat again; the others leave the role within POLL_S of that
        quiet()
        after = host.sockets()
        report = fleet.report()
        fleet.stop()
    finally:
        host.stop()
    return {
        "ranks": world,
        "nodes": -(-world // args.per_node),
        "takeover": True,
        "hang_timeout_s": hang_timeout_s,
        "healthy": healthy,
        "taken_over": taken,
        "sockets_after": after,
        "verdicts": len(report["ended"]),
    }


# ------------------------------------------------------------------------------------------------ the report


def projection(rows: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """``ranks`` from the largest three rows the simulator kept up with: each figure as a power of the world size
    fitted through them (the old judges, reading every rank, made the load grow with its square; a node's
    reporter makes it grow with the nodes), the host's CPU from its measured seconds per request."""
    import numpy as np

    kept = [r for r in rows if r["kept_up"]][-3:]
    if len(kept) < 3:
        return {}
    w = np.log([r["ranks"] for r in kept])
    out = {}
    for key in ("requests_per_s", "bytes_out_per_s", "bytes_in_per_s", "sockets"):
        slope, intercept = np.polyfit(w, np.log([max(r[key], 1e-9) for r in kept]), 1)
        out[key] = float(np.exp(intercept) * ranks**slope)
        out[f"{key}_exponent"] = round(float(slope), 2)
    cpu_per_request = statistics.median(r["host_cpu_share"] / r["requests_per_s"] for r in kept if r["requests_per_s"])
    return {
        "ranks": ranks,
        **out,
        "host_cpu_share": out["requests_per_s"] * cpu_per_request,
        "from_rows": [r["ranks"] for r in kept],
    }


def human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"


def table(rows: list[dict[str, Any]], projected: dict[str, Any], faults: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | nodes | requests/s | bytes/s out | bytes/s in | host CPU | sockets | get p50 / p99 ms | "
        "simulator kept up (late p99 s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']:,} | {r['nodes']} | {human(r['requests_per_s'])} | {human(r['bytes_out_per_s'])}B"
            f" | {human(r['bytes_in_per_s'])}B | {r['host_cpu_share']:.0%} | {r['sockets']:,} | "
            f"{r['get_p50_ms']:.2f} / {r['get_p99_ms']:.2f} | {'yes' if r['kept_up'] else 'no'} "
            f"({r['late_p99_s']:.2f}) |"
        )
    if projected:
        lines.append(
            f"| {projected['ranks']:,} (projected) | {projected['ranks'] // 8:,} | "
            f"{human(projected['requests_per_s'])} | {human(projected['bytes_out_per_s'])}B | "
            f"{human(projected['bytes_in_per_s'])}B | {projected['host_cpu_share']:.0%} | "
            f"{projected['sockets']:,.0f} | | |"
        )
    if faults:
        lines += ["", "| fault | ranks | result |", "|---|---|---|"]
        for f in faults:
            if "stuck" in f:
                ok = "right rank" if f["named"] == f["stuck"] else f"WRONG: named {f['named']}"
                lines.append(
                    f"| rank {f['stuck']} stuck in Python | {f['ranks']:,} | {ok}, {f['seconds']} s after it stopped |"
                )
            elif "takeover" in f:
                h, t = f["healthy"], f["taken_over"]
                lines.append(
                    f"| every node's first rank stalled | {f['ranks']:,} | requests/s {human(h['requests_per_s'])} "
                    f"healthy, {human(t['requests_per_s'])} taken over ({human(t['checks_per_s'])} checks/s); host "
                    f"CPU {h['host_cpu_share']:.0%}, {t['host_cpu_share']:.0%}; sockets {h['sockets']:,}, "
                    f"{t['sockets']:,}, {f['sockets_after']:,} after; {f['verdicts']} verdicts |"
                )
            elif "dead" in f:
                lines.append(
                    f"| rank {f['dead']} dies | {f['ranks']:,} | {f['stopped']:,} of {f['of']:,} ranks read "
                    f"it: p50 {f['p50_s']} s, last {f['max_s']} s |"
                )
            else:
                lines.append(f"| none, {f['seconds']:.0f} s healthy | {f['ranks']:,} | {f['verdicts']} verdicts |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """The host's requests/s and bytes/s out against ranks, log-log, as a small SVG."""
    import math

    width, height, pad = 640, 360, 60
    series = [("requests/s", "requests_per_s", "#1f77b4"), ("bytes/s out", "bytes_out_per_s", "#d62728")]
    xs = [math.log10(r["ranks"]) for r in rows]
    ys = [math.log10(max(r[key], 1e-3)) for _, key, _ in series for r in rows]
    x0, x1, y0, y1 = min(xs), max(xs) or 1, math.floor(min(ys)), math.ceil(max(ys))

    def px(x: float, y: float) -> str:
        return (
            f"{pad + (x - x0) / max(x1 - x0, 1e-9) * (width - 2 * pad):.1f},"
            f"{height - pad - (y - y0) / max(y1 - y0, 1e-9) * (height - 2 * pad):.1f}"
        )

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{pad}" y="20">load on the store\'s host against ranks (log-log)</text>',
    ]
    for y in range(int(y0), int(y1) + 1):
        parts.append(f'<text x="5" y="{px(x0, y).split(",")[1]}">1e{y}</text>')
    for r, x in zip(rows, xs):
        parts.append(f'<text x="{px(x, y0).split(",")[0]}" y="{height - pad + 18}">{r["ranks"]}</text>')
    for i, (name, key, colour) in enumerate(series):
        points = " ".join(px(x, math.log10(max(r[key], 1e-3))) for r, x in zip(rows, xs))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
        parts.append(f'<text x="{width - 150}" y="{40 + 16 * i}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ranks", type=numbers(2), default="16,64,256,1024,2048", help="simulated world sizes, comma-separated"
    )
    parser.add_argument("--per-node", type=number(1), default=8, help="ranks per node")
    parser.add_argument(
        "--seconds", type=number(0.1, float), default=20.0, help="measured seconds of a healthy run per size"
    )
    parser.add_argument("--warmup", type=number(0, float), default=3.0, help="seconds before measuring")
    parser.add_argument(
        "--hang-timeout",
        type=number(1, float),
        default=120.0,
        help="strategy.hang_timeout_s of the ranks while the load is measured (its default: 120)",
    )
    parser.add_argument(
        "--fault-hang-timeout",
        type=number(1, float),
        default=10.0,
        help="strategy.hang_timeout_s of the ranks in the fault runs",
    )
    parser.add_argument(
        "--step-s", type=number(0.001, float), default=0.05, help="seconds of a simulated training step"
    )
    parser.add_argument("--threads", type=number(1), default=4, help="threads running the ranks' work, in each process")
    parser.add_argument(
        "--procs",
        type=number(1),
        default=os.cpu_count() or 1,
        help="processes the simulated nodes are spread over (default: one a core)",
    )
    parser.add_argument(
        "--faults", default="stuck,dead,takeover", help="faults to inject at each size: stuck,dead,takeover or none"
    )
    parser.add_argument(
        "--takeover-s",
        type=number(0.1, float),
        default=5.0,
        help="seconds measured healthy, then taken over (--faults=takeover)",
    )
    parser.add_argument(
        "--healthy-s",
        type=number(0, float),
        default=0.0,
        help="also run this long healthy at the largest size and count verdicts (600: ten minutes)",
    )
    parser.add_argument("--project", type=number(2), default=16384, help="world size the line projects to")
    parser.add_argument(
        "--out", default="outputs/bench/control-plane", help="folder for table.md, results.json and load.svg"
    )
    parser.add_argument("--host", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host:
        return host_main(args.host)
    if args.probe:
        return probe_main(int(args.probe[0]), float(args.probe[1]), 0.02)

    unknown = sorted(set(args.faults.split(",")) - {"stuck", "dead", "takeover", "none"})
    if unknown:
        raise SystemExit(f"error: --faults={args.faults}: {', '.join(unknown)} is not one: give stuck, dead, takeover")
    sizes = [int(n) for n in args.ranks.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 4 * max(sizes) + 256  # two connections a rank, and the host's ends of them
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(
            f"error: {max(sizes)} simulated ranks need {needed} open files and the hard limit is {hard}: "
            "raise it (ulimit -Hn) or simulate fewer ranks"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(needed, hard)), hard))

    rows, faults = [], []
    for world in sizes:
        row = measure(world, args)
        rows.append(row)
        print(
            f"{world:>6} ranks: {human(row['requests_per_s'])} requests/s, {human(row['bytes_out_per_s'])}B/s out, "
            f"host CPU {row['host_cpu_share']:.0%}, {row['sockets']} sockets, get p99 {row['get_p99_ms']:.2f} ms"
            f"{'' if row['kept_up'] else ' (the simulator fell behind)'}",
            flush=True,
        )
        kinds = [k for k in args.faults.split(",") if k != "none"]
        if "stuck" in kinds:
            faults.append(stuck(world, args, rank=world // 2 + 1))
            print(
                f"{'':>13}stuck rank {faults[-1]['stuck']}: named {faults[-1]['named']} after "
                f"{faults[-1]['seconds']} s",
                flush=True,
            )
        if "dead" in kinds:
            faults.append(dies(world, args, rank=world - 1))
            print(
                f"{'':>13}dead rank {faults[-1]['dead']}: {faults[-1]['stopped']} of {faults[-1]['of']} stopped, "
                f"last after {faults[-1]['max_s']} s",
                flush=True,
            )
        if "takeover" in kinds:
            faults.append(takeover(world, args))
            h, t = faults[-1]["healthy"], faults[-1]["taken_over"]
            print(
                f"{'':>13}every node's first rank stalled: {human(h['requests_per_s'])} requests/s healthy, "
                f"{human(t['requests_per_s'])} taken over; host CPU {h['host_cpu_share']:.0%}, "
                f"{t['host_cpu_share']:.0%}; sockets {h['sockets']}, {t['sockets']}, {faults[-1]['sockets_after']} "
                "after",
                flush=True,
            )
    if args.healthy_s:
        long = measure(max(sizes), argparse.Namespace(**{**vars(args), "seconds": args.healthy_s}))
        faults.append({"ranks": long["ranks"], "seconds": args.healthy_s, "verdicts": long["verdicts"]})
    projected = projection(rows, args.project)
    import torch

    machine = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(rows, projected, faults)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "args": {k: v for k, v in vars(args).items() if k not in ("host", "probe")},
                "rows": rows,
                "projected": projected,
                "faults": faults,
            },
            indent=1,
        )
    )
    plot(rows, out / "load.svg")
    print()
    print(text)
    print(
        f"\n{machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, torch {machine['torch']}, "
        f"{machine['date']}; written to {out}/table.md, results.json and load.svg"
    )


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
