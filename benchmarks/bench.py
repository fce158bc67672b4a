"""``make bench``: the project's training against a bare DDP loop, same model, batch, images and steps.

    python benchmarks/bench.py [--arch resnet50] [--batch-size 32] [--steps 12] [--warmup 3] [--processes 1,2]
                               [--repeats 3] [--pipelines device,dataloader] [--compile]

For each world size it runs, one after the other, ``--repeats`` times over (in an order that alternates,
so a slow minute of the machine does not land on one side only; each side's best run counts, as timeit
takes the fastest: on a shared machine the slower runs measure the neighbours):
  project  ``python -m src.train`` as a user runs it: Hydra, Lightning, the default callbacks (checkpoints,
           LR and throughput logging, progress bar, SIGTERM handling), the default data pipeline and the
           default number format (``auto``: what src/fast_path.py picks for this hardware); the rate is
           throughput.json's, over the steps after the warm-up.
  bare     ``torchrun benchmarks/bare_ddp.py``: DistributedSampler + DataLoader, DDP, SGD, nothing else,
           given the number format the project's ``auto`` picked (bf16 autocast, channels-last), so the
           two differ only in the machinery around the loop.
Both train the same ResNet (CIFAR stem) on the same synthetic images with the same crop/flip, and both
time the steps after the same warm-up. The project runs once per data pipeline (``--pipelines``: the
device-resident default; on a GPU also the DataLoader + per-image transforms the bare loop uses).
It prints a table (throughput, and launch overhead: seconds from the command to the first training
step), the throughput ratio at equal settings at the world size where the project does worst, and,
last, what a user gets: the project's defaults against the bare loop's own defaults (fp32,
contiguous; measured at the first world size, where they differ from the project's choice). On a CPU
it compares 1 and 2 processes over gloo; on a GPU one process over nccl (--compile adds torch.compile).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hardware() -> tuple[bool, str]:
    """(CUDA available, 'NVIDIA H100 80GB HBM3' or 'AMD EPYC 7B13 (2 cores)'), named as throughput.json names it."""
    import torch

    from src.callbacks.throughput import device_name

    cuda = torch.cuda.is_available()
    return cuda, device_name(torch.device("cuda" if cuda else "cpu"))


def run(command: list[str], log: Path, timeout: float) -> float:
    """Run ``command`` from the project root, its output into ``log``; return its start time (wall clock)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command[:6])} ... failed ({done.returncode}); see {log}")
    return started


def project(args: argparse.Namespace, processes: int, cuda: bool, out: Path, pipeline: str) -> dict[str, float]:
    run_dir = out / f"project-{processes}-{pipeline}"
    steps = args.warmup + args.steps
    command = [sys.executable, "-m", "src.train", "data=synthetic", f"data.num_train={images_needed(args, processes)}",
               "data.val_size=64", f"data.batch_size={args.batch_size}", f"model.arch={args.arch}",
               f"trainer.devices={processes}", "strategy=ddp" if processes > 1 else "strategy=auto",
               f"backend={'nccl' if cuda else 'gloo'}", "trainer.max_epochs=1", f"trainer.limit_train_batches={steps}",
               "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0", "test=false",
               f"callbacks.throughput_record.warmup_steps={args.warmup}", f"data.pipeline={pipeline}",
               f"hydra.run.dir={run_dir}"]
    command += [] if cuda else ["trainer.accelerator=cpu"]  # precision, channels_last: the defaults (auto)
    command += ["model.compile=true"] if args.compile else []
    started = run(command, out / f"project-{processes}-{pipeline}.log", args.timeout)
    record = json.loads((run_dir / "throughput.json").read_text())
    assert record["steps_measured"] == args.steps, record
    chosen = auto_choice(cuda, args.arch)
    assert (record["precision"], record["channels_last"]) == (chosen.precision, chosen.channels_last), record
    return {"images_per_second": record["samples_per_second"], "launch_s": record["first_step_at"] - started}


def auto_choice(cuda: bool, arch: str):
    """What the project's trainer.precision=auto and model.channels_last=auto pick for ``arch`` on this machine."""
    from src.fast_path import fast_path

    return fast_path("cuda" if cuda else "cpu", arch)


def bare(args: argparse.Namespace, processes: int, cuda: bool, out: Path, defaults: bool = False) -> dict[str, float]:
    """The bare loop with the project's number format, or (``defaults``) with its own: fp32, contiguous."""
    name = f"bare-{processes}{'-defaults' if defaults else ''}"
    result = out / f"{name}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               str(ROOT / "benchmarks" / "bare_ddp.py"), f"--arch={args.arch}", f"--batch-size={args.batch_size}",
               f"--steps={args.steps}", f"--warmup={args.warmup}", f"--images={images_needed(args, processes)}",
               f"--out={result}"]
    chosen = auto_choice(cuda, args.arch)
    if not defaults:
        command += ["--bf16"] if chosen.precision == "bf16-mixed" else []
        command += ["--channels-last"] if chosen.channels_last else []
    started = run(command, out / f"{name}.log", args.timeout)
    record = json.loads(result.read_text())
    return {"images_per_second": record["images_per_second"], "launch_s": record["first_step_at"] - started}


def images_needed(args: argparse.Namespace, processes: int) -> int:
    """Enough images for warm-up + measured steps on every rank, in one epoch."""
    return (args.warmup + args.steps + 1) * args.batch_size * processes + 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda, device = hardware()
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=256 if cuda else 32, help="per process")
    parser.add_argument("--steps", type=int, default=200 if cuda else 12, help="measured steps")
    parser.add_argument("--warmup", type=int, default=30 if cuda else 3, help="steps before the clock starts")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved; the best counts")
    parser.add_argument("--processes", default="1" if cuda else "1,2", help="world sizes to compare, e.g. 1,2")
    parser.add_argument("--pipelines", default="device,dataloader" if cuda else "device",
                        help="the project's data.pipeline values to run; the first is the one in the ratio line")
    parser.add_argument("--compile", action="store_true", help="torch.compile the project's model (GPU)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed for each run")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench")
    args = parser.parse_args()
    backend = "nccl" if cuda else "gloo"
    pipelines = args.pipelines.split(",")
    chosen = auto_choice(cuda, args.arch)
    # the bare loop's own defaults differ from the project's choice: measure them too, at the first world size
    bare_defaults_differ = chosen.precision != "32-true" or chosen.channels_last
    first = int(args.processes.split(",")[0])
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    for repeat in range(args.repeats):  # interleaved, so a slow minute of the machine hits both sides alike
        out = args.out / f"run{repeat}"
        for i, processes in enumerate(int(p) for p in args.processes.split(",")):
            runs = [("bare", lambda: bare(args, processes, cuda, out))]
            runs += [(pipeline, lambda pipeline=pipeline: project(args, processes, cuda, out, pipeline))
                     for pipeline in pipelines]
            if bare_defaults_differ and processes == first:
                runs.append(("bare-defaults", lambda: bare(args, processes, cuda, out, defaults=True)))
            for name, measure in runs if (i + repeat) % 2 == 0 else runs[::-1]:
                results.setdefault((processes, name), []).append(measure())
    best = {key: max(r["images_per_second"] for r in runs) for key, runs in results.items()}

    fmt = chosen.label
    print(f"\n{args.arch} (CIFAR stem), batch {args.batch_size} per process, {args.steps} steps timed after "
          f"{args.warmup} warm-up steps, best of {args.repeats} interleaved runs, {backend}, {device}; "
          f"number format: {fmt} ({chosen.why})\n")
    print("| processes | run | img/s (best) | img/s (all runs) | vs bare | launch s (best) |")
    print("|---:|---|---:|---|---:|---:|")
    for (processes, name), runs in results.items():
        label = {"bare": f"bare DDP loop (DataLoader), {fmt}",
                 "bare-defaults": "bare DDP loop (DataLoader), its defaults: 32-true, contiguous"}.get(
            name, f"project, data.pipeline={name}, defaults")
        every = ", ".join(f"{r['images_per_second']:.1f}" for r in runs)
        print(f"| {processes} | {label} | {best[processes, name]:.1f} | {every} "
              f"| {best[processes, name] / best[processes, 'bare']:.3f} | {min(r['launch_s'] for r in runs):.1f} |")
    ratios = {p: best[p, pipelines[0]] / best[p, "bare"] for p, name in results if name == "bare"}
    processes = min(ratios, key=ratios.get)
    mine, theirs = best[processes, pipelines[0]], best[processes, "bare"]
    print(f"\nproject/bare throughput ratio: {ratios[processes]:.3f} (project {mine:.1f} img/s, bare {theirs:.1f} img/s, "
          f"both {fmt}, {device}, {processes} process{'es' if processes > 1 else ''}, {backend})")
    theirs_own = best[first, "bare-defaults" if bare_defaults_differ else "bare"]
    print(f"what a user gets: project defaults / bare loop defaults: {best[first, pipelines[0]] / theirs_own:.3f} "
          f"(project {best[first, pipelines[0]]:.1f} img/s with {fmt}, bare {theirs_own:.1f} img/s with 32-true, "
          f"contiguous, {device}, {first} process{'es' if first > 1 else ''}, {backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
