"""``make bench-cpu``: the project's CPU training rate in each number format and memory layout, side by side.

    python benchmarks/cpu_fast_path.py [--arch resnet50] [--batch-size 32] [--steps 4] [--warmup 2]
                                       [--repeats 2] [--variants defaults,fp32,fp32-cl,bf16,bf16-cl]

Every variant is one ``python -m src.train data=synthetic trainer.accelerator=cpu trainer.devices=1`` run;
its rate is throughput.json's (the steps after the warm-up). Runs alternate between variants, ``--repeats``
times, and each variant's best run counts (on a shared machine the slower runs measure the neighbours).
``defaults`` sets neither ``trainer.precision`` nor ``model.channels_last``: what ``auto`` picks here
(src/models/fast_path.py). The table names the CPU and whether it computes bf16 natively; the last line is the
defaults' rate over plain fp32 (contiguous), the figure the CPU fast path is judged by.

On a CPU without native bf16, bf16 autocast is emulated and runs several times slower than fp32: the bf16
variants then take minutes per run (``--variants defaults,fp32,fp32-cl`` leaves them out).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ROOT, run  # noqa: E402

from benchmarks.arguments import number  # noqa: E402 - bench put the project on the path

VARIANTS = {
    "defaults": [],
    "fp32": ["trainer.precision=32-true", "model.channels_last=false"],
    "fp32-cl": ["trainer.precision=32-true", "model.channels_last=true"],
    "bf16": ["trainer.precision=bf16-mixed", "model.channels_last=false"],
    "bf16-cl": ["trainer.precision=bf16-mixed", "model.channels_last=true"],
}


def measure(args: argparse.Namespace, variant: str, out: Path) -> dict:
    run_dir = out / variant
    shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's own run of an earlier call: trained anew
    steps = args.warmup + args.steps + 1  # the epoch's first step is never timed
    command = [
        sys.executable,
        "-m",
        "src.train",
        "data=synthetic",
        f"data.num_train={steps * args.batch_size + 64}",
        "data.val_size=64",
        f"data.batch_size={args.batch_size}",
        f"model.arch={args.arch}",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={steps}",
        "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0",
        "test=false",
        f"callbacks.throughput_record.warmup_steps={args.warmup}",
        "callbacks.progress_bar=null",
        f"hydra.run.dir={run_dir}",
        *VARIANTS[variant],
    ]
    run(command, out / f"{variant}.log", args.timeout)
    return json.loads((run_dir / "throughput.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=number(1), default=32)
    parser.add_argument("--steps", type=number(1), default=4, help="measured steps")
    parser.add_argument("--warmup", type=number(0), default=2, help="steps before the clock starts")
    parser.add_argument("--repeats", type=number(1), default=2, help="runs of each, interleaved; the best counts")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=number(1, float), default=1800, help="seconds allowed for each run")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-cpu")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "fp32" not in variants:
        parser.error(f"--variants must include fp32 and name only {', '.join(VARIANTS)} (got {args.variants})")

    import torch

    from src.callbacks.throughput import device_name
    from src.models.fast_path import cpu_bf16_isa, cpu_capability, fast_path

    records: dict[str, list[dict]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        order = variants if repeat % 2 == 0 else variants[::-1]
        for variant in order:
            records[variant].append(measure(args, variant, args.out / f"run{repeat}"))
            rate = records[variant][-1]["samples_per_second"]
            print(f"[{repeat + 1}/{args.repeats}] {variant}: {rate:.1f} img/s", flush=True)
    best = {v: max(r["samples_per_second"] for r in runs) for v, runs in records.items()}

    isa = cpu_bf16_isa()
    auto = fast_path("cpu", args.arch)
    print(
        f"\n{args.arch} (CIFAR stem), batch {args.batch_size}, one process, {torch.get_num_threads()} threads, "
        f"{args.steps} steps timed after {args.warmup} warm-up steps, best of {args.repeats} interleaved runs, "
        f"{device_name(torch.device('cpu'))}, torch {torch.__version__}, vector ISA {cpu_capability()}, "
        f"native bf16: {isa or 'no'}\n"
    )
    print("| variant | precision | memory format | img/s (best) | img/s (all runs) | vs fp32 |")
    print("|---|---|---|---:|---|---:|")
    for variant, runs in records.items():
        record = runs[0]
        layout = "channels-last" if record.get("channels_last") else "contiguous"
        every = ", ".join(f"{r['samples_per_second']:.1f}" for r in runs)
        print(
            f"| {variant} | {record['precision']} | {layout} | {best[variant]:.1f} | {every} "
            f"| {best[variant] / best['fp32']:.2f} |"
        )
    if "defaults" in best:
        print(
            f"\ndefaults ({auto.label}: {auto.why}) "
            f"/ fp32 contiguous: {best['defaults'] / best['fp32']:.2f}x "
            f"({best['defaults']:.1f} vs {best['fp32']:.1f} img/s, {device_name(torch.device('cpu'))})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
