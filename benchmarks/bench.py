"""``make bench``: the project's training against a bare loop at equal settings: the same model, batch, images and
steps, the same data path, DDP or not on both, the same number format, compiled or not on both.

    python benchmarks/bench.py [--arch resnet50] [--batch-size 32] [--steps 12] [--warmup 3] [--processes 1,2]
                               [--repeats 3] [--pipelines device,dataloader] [--ddp auto|always] [--compile]
                               [--equal-only] [--out outputs/bench]

For each world size and each data path (``--pipelines``) it runs both sides, ``--repeats`` times over (in an
order that alternates, so a slow minute of the machine does not land on one side only; each side's best run
counts, as timeit takes the fastest: on a shared machine the slower runs measure the neighbours):
  project  ``python -m src.train`` as a user runs it: Hydra, Lightning, the default callbacks (checkpoints, LR and
           throughput logging, progress bar, SIGTERM handling) and the default number format (``auto``: what
           src/models/fast_path.py picks for this hardware), with ``data.pipeline`` and (for the DataLoader)
           ``data.num_workers`` set; the rate is throughput.json's, over the steps after the warm-up.
  bare     ``torchrun benchmarks/bare_ddp.py`` (one process without DDP: ``python benchmarks/bare_ddp.py``): the
           same batches (the project's device-resident pipeline, or a DistributedSampler + DataLoader with
           per-image transforms and as many workers), DDP or not, SGD, nothing else, given the number format the
           project's ``auto`` picked (bf16 autocast, channels-last).
DDP: ``--ddp auto`` runs one process without DDP on both sides (the project's ``strategy=auto``; the bare loop with
``--no-ddp``) and more with it; ``--ddp always`` gives one process DDP too (``strategy=ddp``). ``--compile``
compiles the network on both sides. Every row of the table says its data path, DDP or not, compiled or not and
its number format; the ratio line compares equal settings (the first pipeline, at the world size where the
project does worst), and the last line what a user gets: the project's defaults against the bare loop's own (a
DataLoader without workers, DDP, fp32, contiguous, as the seed script has them), at the first world size.
``--equal-only`` leaves that last run out. The results also go to OUT/bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # src/ without installing the project: a GPU node runs this with its own torch
from benchmarks.arguments import number, numbers  # noqa: E402 - after the path above


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
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # bare_ddp.py imports src/
    with open(log, "w") as out:
        done = subprocess.run(
            command,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
        )
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(command[:6])} ... failed ({done.returncode}); see {log}")
    return started


@dataclass(frozen=True)
class Setting:
    """What both sides of a comparison share besides model, batch, images and steps."""

    processes: int
    pipeline: str  # device | dataloader
    workers: int  # DataLoader worker processes (dataloader)
    ddp: bool
    compile: str | None  # a torch.compile mode, or None: eager

    def columns(self) -> list[str]:
        data = "device" if self.pipeline == "device" else f"DataLoader, {self.workers} workers"
        return [data, "DDP" if self.ddp else "no DDP", f"compiled {self.compile}" if self.compile else "eager"]


BARE_DEFAULTS = ["DataLoader, 0 workers", "DDP", "eager"]  # bare_ddp.py as it comes, as the seed script has it


def loader_workers(cuda: bool, processes: int) -> int:
    """What the project's ``data.num_workers=auto`` gives (src/data/in_memory.py): none on CPUs; on GPUs the
    cores per process less one, at most 8. Both sides are given this count."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // processes - 1)) if cuda else 0


def auto_choice(cuda: bool, arch: str):
    """What the project's trainer.precision=auto and model.channels_last=auto pick for ``arch`` on this machine."""
    from src.models.fast_path import fast_path

    return fast_path("cuda" if cuda else "cpu", arch)


def images_needed(args: argparse.Namespace, processes: int) -> int:
    """Enough images for warm-up + measured steps on every rank, in one epoch."""
    return (args.warmup + args.steps + 1) * args.batch_size * processes + 64


def project_command(args: argparse.Namespace, s: Setting, cuda: bool, run_dir: Path) -> list[str]:
    """``python -m src.train`` on synthetic images at setting ``s``; precision and memory format left to ``auto``."""
    command = [
        sys.executable,
        "-m",
        "src.train",
        "data=synthetic",
        f"data.num_train={images_needed(args, s.processes)}",
        "data.val_size=64",
        f"data.batch_size={args.batch_size}",
        f"model.arch={args.arch}",
        f"trainer.devices={s.processes}",
        "strategy=ddp" if s.ddp else "strategy=auto",
        f"backend={'nccl' if cuda else 'gloo'}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={args.warmup + args.steps}",
        "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0",
        "test=false",
        f"callbacks.throughput_record.warmup_steps={args.warmup}",
        f"data.pipeline={s.pipeline}",
        f"data.num_workers={s.workers}",
        f"model.compile={s.compile or 'false'}",
        f"hydra.run.dir={run_dir}",
    ]
    return command + ([] if cuda else ["trainer.accelerator=cpu"])


def bare_command(args: argparse.Namespace, s: Setting, cuda: bool, result: Path, defaults: bool = False) -> list[str]:
    """``torchrun benchmarks/bare_ddp.py`` at setting ``s`` with the project's number format, or (``defaults``) as the
    script comes: DataLoader without workers, DDP, fp32, contiguous, eager. One process without DDP starts as
    ``python benchmarks/bare_ddp.py``, as the project's side starts: it has no process group for torchrun to set up,
    and the launch times then compare like with like."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={s.processes}"]
    command = [
        sys.executable,
        *(launcher if s.ddp or defaults else []),
        str(ROOT / "benchmarks" / "bare_ddp.py"),
        f"--arch={args.arch}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--images={images_needed(args, s.processes)}",
        f"--out={result}",
    ]
    if defaults:
        return command
    chosen = auto_choice(cuda, args.arch)
    command += [f"--pipeline={s.pipeline}", f"--workers={s.workers}"]
    command += [] if s.ddp else ["--no-ddp"]
    command += [f"--compile={s.compile}"] if s.compile else []
    command += ["--fused"] if cuda else []  # the project's model.optimizer.fused=auto: on CUDA
    command += ["--bf16"] if chosen.precision == "bf16-mixed" else []
    command += ["--channels-last"] if chosen.channels_last else []
    # the project's strategy.gradient_as_bucket_view=auto: on for CUDA (src/distributed/strategy.py)
    command += ["--gradient-as-bucket-view"] if s.ddp and cuda else []
    return command


def project(args: argparse.Namespace, s: Setting, cuda: bool, out: Path) -> dict[str, float]:
    name = f"project-{s.processes}-{s.pipeline}"
    shutil.rmtree(out / name, ignore_errors=True)  # this benchmark's own run of an earlier call: a new training
    started = run(project_command(args, s, cuda, out / name), out / f"{name}.log", args.timeout)
    record = json.loads((out / name / "throughput.json").read_text())
    assert record["steps_measured"] == args.steps, record
    chosen = auto_choice(cuda, args.arch)
    assert (record["precision"], record["channels_last"]) == (chosen.precision, chosen.channels_last), record
    return {"images_per_second": record["samples_per_second"], "launch_s": record["first_step_at"] - started}


def bare(args: argparse.Namespace, s: Setting, cuda: bool, out: Path, defaults: bool = False) -> dict[str, float]:
    """The bare loop at setting ``s``, or (``defaults``) as it comes."""
    name = f"bare-{s.processes}-defaults" if defaults else f"bare-{s.processes}-{s.pipeline}"
    result = out / f"{name}.json"
    started = run(bare_command(args, s, cuda, result, defaults), out / f"{name}.log", args.timeout)
    record = json.loads(result.read_text())
    return {"images_per_second": record["images_per_second"], "launch_s": record["first_step_at"] - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda, device = hardware()
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=number(1), default=256 if cuda else 32, help="per process")
    parser.add_argument("--steps", type=number(1), default=200 if cuda else 12, help="measured steps")
    parser.add_argument("--warmup", type=number(0), default=30 if cuda else 3, help="steps before the clock starts")
    parser.add_argument("--repeats", type=number(1), default=3, help="runs of each, interleaved; the best counts")
    parser.add_argument(
        "--processes", type=numbers(1), default="1" if cuda else "1,2", help="world sizes to compare, e.g. 1,2"
    )
    parser.add_argument(
        "--pipelines",
        default="device,dataloader" if cuda else "device",
        help="data paths, each run on both sides; the first is the one in the ratio line",
    )
    parser.add_argument(
        "--ddp",
        choices=("auto", "always"),
        default="auto",
        help="auto: DDP from 2 processes on (the project's strategy=auto); always: one process too",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        metavar="MODE",
        help="torch.compile the network on both sides, in torch.compile's MODE (default; "
        "reduce-overhead: with CUDA graphs)",
    )
    parser.add_argument("--equal-only", action="store_true", help="leave out the bare loop's own defaults")
    parser.add_argument("--timeout", type=number(1, float), default=600, help="seconds allowed for each run")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench")
    args = parser.parse_args()
    backend = "nccl" if cuda else "gloo"
    pipelines = args.pipelines.split(",")
    world_sizes = [int(p) for p in args.processes.split(",")]
    chosen = auto_choice(cuda, args.arch)
    first = world_sizes[0]
    settings = {
        (p, pipeline): Setting(
            p,
            pipeline,
            loader_workers(cuda, p) if pipeline == "dataloader" else 0,
            p > 1 or args.ddp == "always",
            args.compile,
        )
        for p in world_sizes
        for pipeline in pipelines
    }
    results: dict[tuple[int, str, str], list[dict[str, float]]] = {}
    for repeat in range(args.repeats):  # interleaved, so a slow minute of the machine hits both sides alike
        out = args.out / f"run{repeat}"
        for i, processes in enumerate(world_sizes):
            runs = []
            for pipeline in pipelines:
                s = settings[processes, pipeline]
                runs += [
                    (("bare", pipeline), lambda s=s, out=out: bare(args, s, cuda, out)),
                    (("project", pipeline), lambda s=s, out=out: project(args, s, cuda, out)),
                ]
            if processes == first and not args.equal_only:
                runs.append(
                    (
                        ("bare-defaults", ""),
                        lambda s=settings[first, pipelines[0]], out=out: bare(args, s, cuda, out, defaults=True),
                    )
                )
            for (side, pipeline), measure in runs if (i + repeat) % 2 == 0 else runs[::-1]:
                results.setdefault((processes, side, pipeline), []).append(measure())
    best = {key: max(r["images_per_second"] for r in runs) for key, runs in results.items()}

    fmt = chosen.label
    print(
        f"\n{args.arch} (CIFAR stem), batch {args.batch_size} per process, {args.steps} steps timed after "
        f"{args.warmup} warm-up steps, best of {args.repeats} interleaved runs, {backend}, {device}; "
        f"number format: {fmt} ({chosen.why})\n"
    )
    print(
        "| processes | run | data | DDP | compiled | number format | img/s (best) | img/s (all runs) | vs bare "
        "| launch s (best) |"
    )
    print("|---:|---|---|---|---|---|---:|---|---:|---:|")
    rows = []
    for (processes, side, pipeline), runs in results.items():
        if side == "bare-defaults":
            label, columns, number_format = "bare loop, its defaults", BARE_DEFAULTS, "32-true, contiguous"
            vs_bare = None
        else:
            label = "bare loop" if side == "bare" else "project"
            columns, number_format = settings[processes, pipeline].columns(), fmt
            vs_bare = best[processes, side, pipeline] / best[processes, "bare", pipeline]
        every = ", ".join(f"{r['images_per_second']:.1f}" for r in runs)
        launch = min(r["launch_s"] for r in runs)
        ratio = "—" if vs_bare is None else f"{vs_bare:.3f}"
        print(
            f"| {processes} | {label} | {' | '.join(columns)} | {number_format} | "
            f"{best[processes, side, pipeline]:.1f} | {every} | {ratio} | {launch:.1f} |"
        )
        rows.append(
            {
                "processes": processes,
                "run": label,
                "data": columns[0],
                "ddp": columns[1] == "DDP",
                "compiled": columns[2].startswith("compiled"),
                "number_format": number_format,
                "images_per_second": best[processes, side, pipeline],
                "all_runs": [r["images_per_second"] for r in runs],
                "vs_bare": vs_bare,
                "launch_s": launch,
            }
        )
    ratios = {p: best[p, "project", pipelines[0]] / best[p, "bare", pipelines[0]] for p in world_sizes}
    processes = min(ratios, key=ratios.get)
    s = settings[processes, pipelines[0]]
    mine, theirs = best[processes, "project", pipelines[0]], best[processes, "bare", pipelines[0]]
    equal = f"data.pipeline={s.pipeline}, {', '.join(s.columns()[1:])}, {fmt}"
    print(
        f"\nproject/bare throughput ratio at equal settings: {ratios[processes]:.3f} (project {mine:.1f} img/s, "
        f"bare {theirs:.1f} img/s, both {equal}, {device}, {processes} process{'es' if processes > 1 else ''}, "
        f"{backend})"
    )
    summary = {
        "device": device,
        "arch": args.arch,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "backend": backend,
        "number_format": fmt,
        "rows": rows,
        "ratio": ratios[processes],
        "ratio_processes": processes,
        "ratio_settings": equal,
        "ratios": {str(p): r for p, r in ratios.items()},
    }
    if not args.equal_only:
        mine = best[first, "project", pipelines[0]]
        theirs_own = best[first, "bare-defaults", ""]
        s = settings[first, pipelines[0]]
        print(
            f"what a user gets: project defaults / bare loop defaults: {mine / theirs_own:.3f} (project "
            f"{mine:.1f} img/s with data.pipeline={s.pipeline}, {', '.join(s.columns()[1:])}, {fmt}; bare "
            f"{theirs_own:.1f} img/s with a {', '.join(BARE_DEFAULTS)}, 32-true, contiguous; {device}, "
            f"{first} process{'es' if first > 1 else ''}, {backend})"
        )
        summary["user_ratio"] = mine / theirs_own
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
