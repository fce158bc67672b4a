"""How soon every rank but rank 0 is connected to node 0's store once it listens, and what the ranks print while
they wait, at 16 to 2,048 ranks: the project's connection (src/distributed/strategy.py's ``store_client``: the name
looked up until it resolves, then torch's client on a thread the rank waits for until its timeout) against torch's
client called as before.

The project's own function runs here, not a copy. The ranks but rank 0 are threads in a few processes (``--procs``),
each with a store connection of its own, as in a run; they start at once, and this process hosts a real
``TCPStore`` ``--late-s`` seconds later, as a node 0 started after the others. Counted: the lookups of the name
while waiting (the resolver's work: no connection), and the lines torch's C++ side wrote to the ranks' stderr.
Timed: from the moment the store listens to the last rank's connection.

    python benchmarks/store_wait.py --ranks 16,256,2048 --late-s 3
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import resource
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.arguments import names, number, numbers  # noqa: E402 - after the path above

WAYS = ("project", "torch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_main(port: int, count: int, way: str, stderr: str, go: Any, out: Any) -> None:
    """``count`` ranks, each on a thread: connect to the store (``project``: ``store_client``; ``torch``: torch's
    client as called before), and say when."""
    import torch.distributed as dist

    from src.distributed import strategy

    with open(stderr, "w") as sink:  # torch's C++ side writes to fd 2: counted afterwards
        os.dup2(sink.fileno(), 2)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tries = [0]
    lock = threading.Lock()
    resolve = strategy._addresses

    def counted(host: str, port: int) -> list[tuple]:  # one a lookup of the name
        with lock:
            tries[0] += 1
        return resolve(host, port)

    strategy._addresses = counted
    timeout = timedelta(seconds=120)
    stores, connected = [], []

    def rank() -> None:
        if way == "project":
            store = strategy.store_client("127.0.0.1", port, 2, timeout)
        else:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout, wait_for_workers=False)
        with lock:
            stores.append(store)
            connected.append(time.monotonic())

    go.wait()
    threads = [threading.Thread(target=rank) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put((tries[0], max(connected), len(connected)))


def measure(world: int, way: str, late_s: float, procs: int, folder: Path) -> dict[str, Any]:
    import torch.distributed as dist

    import src.distributed.strategy  # noqa: F401 - loaded before the ranks' processes fork: they start at once

    port = free_port()
    others = world - 1
    shares = [others // procs + (1 if i < others % procs else 0) for i in range(procs)]
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    logs = [folder / f"{way}-{world}-{i}.stderr" for i in range(procs)]
    workers = [
        ctx.Process(target=ranks_main, args=(port, n, way, str(log), go, out), daemon=True)
        for n, log in zip(shares, logs)
        if n
    ]
    for worker in workers:
        worker.start()
    start = time.monotonic()
    go.set()
    time.sleep(late_s)
    listening = time.monotonic()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    tries, last, connected = 0, 0.0, 0
    for _ in workers:
        n, ended, count = out.get(timeout=600)
        tries, last, connected = tries + n, max(last, ended), connected + count
    for worker in workers:
        worker.join()
    del host
    torch_lines = sum(1 for log in logs if log.exists() for line in log.read_text().splitlines() if line.strip())
    return {
        "ranks": world,
        "way": way,
        "waited_s": listening - start,
        "tries": tries,
        "last_connected_s": last - listening,
        "connected": connected,
        "stderr_lines": torch_lines,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=numbers(2), default="16,256,2048", help="world sizes, comma-separated")
    parser.add_argument("--late-s", type=number(0.5, float), default=3.0, help="seconds until node 0's store listens")
    parser.add_argument("--procs", type=number(1), default=4, help="processes the other ranks run in")
    parser.add_argument(
        "--way", type=names(WAYS), default="project,torch", help="project, torch, or both, comma-separated"
    )
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        if os.environ.get("STORE_WAIT_KEEP"):
            folder = os.environ["STORE_WAIT_KEEP"]
        for world in (int(n) for n in args.ranks.split(",")):
            for way in args.way:
                rows.append(measure(world, way, args.late_s, args.procs, Path(folder)))
    import torch

    from src.models.fast_path import cpu_model

    print(
        f"store wait: {cpu_model()}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, node 0's store up after {args.late_s:g} s\n"
    )
    print(
        "| ranks | connection | lookups of the name | last rank connected after the store listened "
        "| lines on the ranks' stderr |"
    )
    print("|---:|---|---:|---:|---:|")
    for row in rows:
        way = "store_client" if row["way"] == "project" else "torch's client, as before"
        lookups = f"{row['tries']:,}" if row["way"] == "project" else "-"
        print(
            f"| {row['ranks']:,} | {way} | {lookups} | {row['last_connected_s'] * 1000:,.0f} ms "
            f"({row['connected']:,} of {row['ranks'] - 1:,}) | {row['stderr_lines']:,} |"
        )


if __name__ == "__main__":
    main()
