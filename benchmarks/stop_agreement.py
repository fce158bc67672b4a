"""What the stop agreement (src/callbacks/graceful_stop.py) adds to a training step, at 2 to 32 real gloo ranks.

Each rank is a real process in a real gloo process group, running the project's own GracefulStop callback at every
batch end, as Lightning calls it. A step is ``--step-ms`` of work (a sleep: the device's time) and a small
all-reduce on the default group (DDP's gradient sync, which keeps ranks in step). What is timed is the callback's
own time per batch end: the agreement's send and read. Two designs side by side: an agreement at every batch (the
period held at 1) and the adaptive period. Run it on an idle machine; it prints a markdown table and writes JSON.

    python benchmarks/stop_agreement.py --ranks 2,4,8,16,32 --steps 300 --out outputs/bench/stop-agreement
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.arguments import number, numbers  # noqa: E402 - after the path above


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, fixed: bool, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from src.callbacks import graceful_stop

    torch.set_num_threads(1)
    if fixed:
        graceful_stop.MAX_PERIOD = 1  # an agreement at every batch end
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=rank == 0, timeout=__import__("datetime").timedelta(seconds=120)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60)
    )  # ranks that disagree: an error
    callback = graceful_stop.GracefulStop(period=1 if fixed else args.period)
    trainer = SimpleNamespace(
        world_size=world,
        callbacks=[],
        default_root_dir=str(out),
        is_global_zero=rank == 0,
        # one epoch longer than the run: no batch is an epoch's last
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(is_last_batch=False))),
        num_training_batches=float("inf"),
        global_step=0,
        current_epoch=0,
        save_checkpoint=lambda path, weights_only=False: None,
        _logger_connector=SimpleNamespace(update_train_step_metrics=lambda: None),
    )  # no loggers
    callback.setup(trainer, None, "fit")
    callback.on_train_start(trainer, None)
    grads = torch.zeros(256)
    hook_s, stopped_at = [0.0], -1
    for step in range(args.warmup + args.steps):
        time.sleep(args.step_ms / 1000)
        dist.all_reduce(grads)
        if step == args.ask_longer_at and rank == 0 and not fixed:  # rank 0 alone finds its next reads slow
            slow = [graceful_stop.SLOW_READS]

            def slow_read(waited_s: float, since_send_s: float, real=graceful_stop.slow_read, slow=slow) -> bool:
                slow[0] -= 1
                return slow[0] >= 0 or real(waited_s, since_send_s)

            graceful_stop.slow_read = slow_read
        if step == args.signal_at and rank == world - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # as scancel or a preemption would: one rank's signal
        trainer.global_step += 1  # the step this batch end closes
        started = time.perf_counter()
        try:
            callback.on_train_batch_end(trainer, None, None, None, step)
        except graceful_stop.Terminated:
            stopped_at = trainer.global_step
            break
        if step >= args.warmup:
            hook_s.append(time.perf_counter() - started)
    hook_s = hook_s[1:] or [0.0]
    times = torch.tensor(
        [
            statistics.mean(hook_s),
            sorted(hook_s)[int(0.99 * (len(hook_s) - 1))],
            max(hook_s),
            float(callback._period),
            float(stopped_at),
        ],
        dtype=torch.float64,
    )
    gathered = [torch.zeros_like(times) for _ in range(world)] if rank == 0 else None
    dist.gather(times, gathered, dst=0)
    if rank == 0:
        rows = torch.stack(gathered)
        (out / f"{'fixed' if fixed else 'adaptive'}-{world}.json").write_text(
            json.dumps(
                {
                    "ranks": world,
                    "design": "every batch" if fixed else "adaptive period",
                    "hook_ms_mean": 1000 * float(rows[:, 0].mean()),
                    "hook_ms_p99": 1000 * float(rows[:, 1].max()),
                    "hook_ms_max": 1000 * float(rows[:, 2].max()),
                    "period": int(rows[0, 3]),
                    "step_ms": args.step_ms,
                    "stopped_at": [int(x) for x in rows[:, 4]],
                }
            )
        )
    dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace, fixed: bool, out: Path) -> dict:
    context = multiprocessing.get_context("fork")  # the parent imported torch once; no group exists in it
    port = free_port()
    procs = [context.Process(target=rank_main, args=(r, world, port, args, fixed, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"error: {world} ranks ({'fixed' if fixed else 'adaptive'}): exit codes {[p.exitcode for p in procs]}")
    return json.loads((out / f"{'fixed' if fixed else 'adaptive'}-{world}.json").read_text())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=numbers(1), default="2,4,8,16,32", help="world sizes, comma-separated")
    parser.add_argument("--steps", type=number(1), default=300, help="batch ends timed per run")
    parser.add_argument("--warmup", type=number(0), default=30, help="batch ends before the timing")
    parser.add_argument("--step-ms", type=number(0, float), default=20.0, help="a step's work, in milliseconds")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "stop-agreement")
    parser.add_argument("--period", type=number(1), default=1, help="callbacks.graceful_stop.period: the first period")
    parser.add_argument(
        "--signal-at",
        type=int,
        default=-1,
        help="SIGTERM the last rank at this step: every rank must stop after the same step",
    )
    parser.add_argument("--designs", default="every-batch,adaptive", help="which designs to run")
    parser.add_argument(
        "--ask-longer-at",
        type=int,
        default=-1,
        help="from this step, rank 0 alone finds its next agreements slow (it then asks for twice the period)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import lightning  # noqa: F401
    import torch  # noqa: F401 - once, before the ranks fork

    rows = []
    designs = args.designs.split(",")
    for world in (int(w) for w in args.ranks.split(",")):
        for fixed in (True, False):
            if ("every-batch" if fixed else "adaptive") in designs:
                rows.append(measure(world, args, fixed, args.out))
    import torch as t

    head = (
        f"stop agreement per batch end, {args.steps} batches of {args.step_ms:g} ms after {args.warmup}; "
        f"{cpu_name()} ({os.cpu_count()} cores), torch {t.__version__}, gloo, {time.strftime('%Y-%m-%d')}"
    )
    lines = [
        head,
        "",
        "| ranks | design | mean ms | p99 ms | max ms | period (batches) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['ranks']} | {r['design']} | {r['hook_ms_mean']:.3f} | {r['hook_ms_p99']:.3f} | "
        f"{r['hook_ms_max']:.3f} | {r['period']} |"
        for r in rows
    ]
    if args.signal_at >= 0:  # every rank stopped after one step, whichever was signalled
        for r in rows:
            steps = set(r["stopped_at"])
            if len(steps) != 1 or -1 in steps:
                sys.exit(f"error: {r['ranks']} ranks ({r['design']}) stopped after steps {r['stopped_at']}")
            lines.append(
                f"stop: rank {r['ranks'] - 1} of {r['ranks']} signalled at step {args.signal_at}; every rank "
                f"stopped after step {steps.pop()} ({r['design']}, period {r['period']})"
            )
    (args.out / "stop_agreement.json").write_text(json.dumps({"head": head, "rows": rows}, indent=1))
    (args.out / "stop_agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
