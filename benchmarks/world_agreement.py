"""What the nodes' agreement on the world's size and recipe (src/distributed/strategy.py's ``agree_on_world``) costs
rank 0's store as a run starts, at 16 to 2,048 ranks, and how soon a node that counts the world differently stops
the run.

The project's own function runs here, not a copy: rank 0's call in this process, which hosts one real ``TCPStore``
as rank 0 does in a run; every other rank's call on a thread of its own, in a few processes (each process's few
connections are made first, as the rendezvous makes a rank's, and are not timed: a run's rank has a connection of
its own, but every 25th connection in a few seconds waited 5 s on the machine measured, and the connects are the
rendezvous's, not the agreement's). Every rank's recipe is 2.2 KB of JSON, about the default
config's 2.1. What is counted is each call's requests to the store (a proxy counts them), and what is timed is rank
0's call: from the moment every other rank may start to its return. ``--differ`` repeats the largest size with the
last node counting one device more: how long until rank 0 and that node stop, with the line they stop with.

Under torchrun (``--launch torchrun``) each rank first learns its attempt's key prefix from rank 0
(src/launch/torchrun.py's ``handshake``: each attempt forms its group on keys of its own, in the agent's store, which
outlives attempts) and agrees under that prefix; rank 0 answers from a thread on a connection of its own, whose
requests are counted apart (``rank 0's answers'``). ``--attempts N`` leaves N - 1 earlier attempts' hellos and answers
in the store first, as a run restarted N - 1 times has.

    python benchmarks/world_agreement.py --ranks 16,256,2048 --out outputs/bench/world-agreement
    python benchmarks/world_agreement.py --ranks 16,256,2048 --launch torchrun --attempts 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.arguments import names, number, numbers  # noqa: E402 - after the path above

LAUNCHES = ("by-hand", "torchrun")


# a recipe of 42 keys, 2.2 KB of JSON: about the default config's 2.1 KB (src/distributed/strategy.py's
# training_recipe)
RECIPE = {f"model.optimizer.key{i:02d}": "a value of twenty chars" for i in range(42)}


class Counted:
    """A store whose requests are counted: every method call is one request to the host."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.requests += 1
            return method(*args)

        return call


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def more_files() -> None:
    """A socket a rank: the soft limit of open files raised to the hard one, as a run raises it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def ranks_main(
    port: int,
    ranks: list[int],
    per_node: int,
    nodes: int,
    odd_node: int | None,
    connections: int,
    under_torchrun: bool,
    go: Any,
    out: Any,
) -> None:
    """Some of the other ranks: connect, wait for the start, then (under torchrun: learn the attempt's prefix, and)
    agree, each rank on a thread of its own."""
    import torch.distributed as dist

    from src.core.errors import UserError
    from src.distributed.strategy import agree_on_world
    from src.launch.torchrun import handshake

    more_files()
    shared = [
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        for _ in range(min(len(ranks), connections))
    ]
    stores = {r: Counted(shared[i % len(shared)]) for i, r in enumerate(ranks)}
    out.put(("connected", len(ranks)))
    go.wait()
    lines: list[str] = []
    timeout = timedelta(seconds=60)
    prefixed: dict[int, Counted] = {}  # under torchrun: each rank's store under its attempt's prefix

    def agree(rank: int) -> None:
        node = rank // per_node
        devices = per_node + 1 if node == odd_node else per_node
        store = stores[rank]
        if under_torchrun:
            prefix = handshake(store, rank, timeout)
            store = prefixed[rank] = Counted(dist.PrefixStore(prefix + "pg/", store.store))
        try:
            agree_on_world(store, rank, node, nodes, devices, timeout, RECIPE)
        except UserError as err:
            lines.append(str(err))

    threads = [threading.Thread(target=agree, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    requests = sum(s.requests for s in [*stores.values(), *prefixed.values()])
    out.put(("done", requests, lines, time.monotonic()))


def earlier_attempts(port: int, world: int, attempts: int, connections: int) -> None:
    """The keys ``attempts`` earlier attempts left in the agent's store: each rank's hello, each time, and the
    answers to them (a rank read its answer and went on), left by the real handshake."""
    import torch.distributed as dist

    from src.launch import torchrun

    def connect() -> Any:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))

    shared, answering = [connect() for _ in range(connections)], connect()
    for _ in range(attempts):
        formed = threading.Event()
        torchrun.handshake(shared[0], 0, timedelta(seconds=60), answering=answering, formed=formed)
        threads = [
            threading.Thread(target=torchrun.handshake, args=(shared[rank % len(shared)], rank, timedelta(seconds=60)))
            for rank in range(1, world)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        formed.set()
        time.sleep(0.2)  # the answering thread sees it


def measure(
    world: int, per_node: int, procs: int, connections: int, differ: bool, under_torchrun: bool, attempts: int
) -> dict[str, Any]:
    import torch.distributed as dist

    from src.core.errors import UserError
    from src.distributed.strategy import agree_on_world
    from src.launch.torchrun import handshake

    nodes = -(-world // per_node)
    odd_node = nodes - 1 if differ else None
    port = free_port()
    others = list(range(1, world))
    shares = [others[i::procs] for i in range(procs) if others[i::procs]]
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Event(), ctx.Queue()
    workers = [  # forked before the store is hosted here: no worker holds its listening socket
        ctx.Process(
            target=ranks_main,
            args=(port, share, per_node, nodes, odd_node, connections, under_torchrun, go, out),
            daemon=True,  # a measure that fails takes them with it
        )
        for share in shares
    ]
    for worker in workers:
        worker.start()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    if under_torchrun and attempts > 1:
        earlier_attempts(port, world, attempts - 1, connections)
    connected = 0
    while connected < len(others):
        kind, count = out.get(timeout=300)
        connected += count
    timeout = timedelta(seconds=60)
    rank0 = Counted(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout))
    answering = Counted(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout))
    formed = threading.Event()
    start = time.monotonic()
    go.set()
    line = None
    try:
        store = rank0
        if under_torchrun:
            prefix = handshake(rank0, 0, timeout, answering=answering, formed=formed)
            store = Counted(dist.PrefixStore(prefix + "pg/", rank0.store))
        agree_on_world(store, 0, 0, nodes, per_node, timeout, RECIPE)
    except UserError as err:
        line = str(err)
    rank0_s = time.monotonic() - start
    formed.set()  # the group formed: rank 0's answering thread stops
    rank0_requests = rank0.requests + (store.requests if store is not rank0 else 0)
    requests, lines, ends = rank0_requests + answering.requests, [], []
    for _ in workers:
        _, n, said, ended = out.get(timeout=120)
        requests += n
        lines += said
        ends.append(ended - start)
    for worker in workers:
        worker.join()
    del host
    return {
        "ranks": world,
        "nodes": nodes,
        "differs": differ,
        "requests": requests,
        "rank0_requests": rank0_requests,
        "answering_requests": answering.requests,
        "torchrun": under_torchrun,
        "attempts": attempts if under_torchrun else 1,
        "rank0_s": rank0_s,
        "last_rank_s": max(ends),
        "rank0_line": line,
        "lines": len(lines),
        "a_line": lines[0] if lines else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=numbers(2), default="16,256,2048", help="world sizes, comma-separated")
    parser.add_argument("--per-node", type=number(1), default=8, help="ranks per node")
    parser.add_argument("--procs", type=number(1), default=4, help="processes the other ranks run in")
    parser.add_argument(
        "--connections", type=number(1), default=16, help="store connections in each process, the ranks' turns on them"
    )
    parser.add_argument("--differ", action="store_true", help="also: the last node counts one device more")
    parser.add_argument(
        "--launch",
        type=names(LAUNCHES),
        default="by-hand",
        help="by-hand, torchrun (each rank learns its attempt's prefix first), or both, comma-separated",
    )
    parser.add_argument(
        "--attempts", type=number(1), default=1, help="under torchrun: this attempt's number (earlier ones' keys left)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "world-agreement")
    args = parser.parse_args()
    more_files()
    sizes = [int(n) for n in args.ranks.split(",")]
    shape, rows = (args.per_node, args.procs, args.connections), []
    for launch in args.launch:
        torchrun = launch == "torchrun"
        rows += [measure(n, *shape, differ=False, under_torchrun=torchrun, attempts=args.attempts) for n in sizes]
        if args.differ:
            rows.append(measure(sizes[-1], *shape, differ=True, under_torchrun=torchrun, attempts=args.attempts))
    import torch

    from src.models.fast_path import cpu_model

    lines = [
        f"world agreement: {cpu_model()}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
        "",
        "| launch | ranks | nodes | counts | requests, all ranks | rank 0's requests | rank 0's answers' "
        "| rank 0 done in | last rank done in |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        launch = f"torchrun, attempt {row['attempts']}" if row["torchrun"] else "by hand"
        lines.append(
            f"| {launch} | {row['ranks']} | {row['nodes']} | "
            f"{'the last node differs' if row['differs'] else 'the same'} | "
            f"{row['requests']} | {row['rank0_requests']} | {row['answering_requests']} | "
            f"{row['rank0_s'] * 1000:.0f} ms | {row['last_rank_s'] * 1000:.0f} ms |"
        )
    for row in rows:
        if row["differs"]:
            lines += [
                "",
                f"{'torchrun' if row['torchrun'] else 'by hand'}: rank 0 stopped with: {row['rank0_line']}",
                f"{row['lines']} other rank(s) stopped with it",
            ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "world_agreement.json").write_text(json.dumps(rows, indent=2))
    (args.out / "world_agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
