"""Train two variants of a run on the same data for the same epochs and seeds; print their test accuracies.

    python benchmarks/compare_recipes.py [--compare recipes|precision] [--epochs 10] [--arch resnet50]
                                         [--seeds 42] [--root DIR] [-- extra overrides]

By default the data is the 6,000-image CIFAR-10 sample in ../shared/data/cifar10-sample (5,000 training
images, of which 500 are held out for validation, and 1,000 test images). Figures from it are results
on that sample, not CIFAR-10 results; pass --root with the full release for those.

Both variants train the same network (``--arch``, CIFAR stem) through ``python -m src.train`` with the same
per-process batch of 128, augmentation, seeds and epochs; each is tested on the checkpoint with the best
validation accuracy. ``--compare recipes`` (the default) varies only the optimisation:
  default  the project's recipe (conf/model/resnet.yaml): SGD 0.1 x batch/128, Nesterov momentum 0.9,
           weight decay 5e-4 except norms and biases, label smoothing 0.1, 2-epoch warm-up, cosine decay
  seed004  the hand-written DDP script of ../shared/seeds/004: plain SGD at lr 1e-4, no momentum,
           no weight decay, no schedule, no label smoothing
``--compare precision`` varies only the number format, both with the default recipe and channels-last:
  fp32     trainer.precision=32-true
  bf16     trainer.precision=bf16-mixed (bf16 autocast; on a CPU fast only where it has native bf16)
With several ``--seeds`` (each seeds the weights, the augmentation and the train/val split), the spread
between seeds of one variant is the noise a difference between variants has to beat.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.arguments import number, numbers  # noqa: E402 - after the path above

SAMPLE = ROOT.parent / "shared" / "data" / "cifar10-sample"

COMPARISONS = {
    "recipes": {
        "default": [],
        "seed004": [
            "model.optimizer.lr=1e-4",
            "model.optimizer.lr_scaling=none",
            "model.optimizer.momentum=0",
            "model.optimizer.nesterov=false",
            "model.optimizer.weight_decay=0",
            "model.optimizer.decay_norm_and_bias=true",
            "model.label_smoothing=0",
            "model.scheduler.warmup_epochs=0",
            "model.scheduler.decay=none",
        ],
    },
    "precision": {
        "fp32": ["trainer.precision=32-true", "model.channels_last=true"],
        "bf16": ["trainer.precision=bf16-mixed", "model.channels_last=true"],
    },
}


def test_accuracy(run_dir: Path) -> float:
    """``test/acc`` as src.train logged it, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "test/acc" in acc.Tags()["scalars"]:
            return acc.Scalars("test/acc")[-1].value
    raise RuntimeError(f"{run_dir} logged no test/acc: see {run_dir / 'train.log'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="recipes")
    parser.add_argument(
        "--seeds", type=numbers(0), default="42", help="comma-separated; every variant trains once per seed"
    )
    parser.add_argument("--epochs", type=number(1), default=10)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--root", type=Path, default=SAMPLE, help="a folder holding cifar-10-batches-py")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "recipes")
    parser.add_argument("overrides", nargs="*", help="more src.train overrides for both runs (after --)")
    args = parser.parse_args()
    if not (args.root / "cifar-10-batches-py").is_dir():
        print(f"error: --root {args.root} holds no cifar-10-batches-py folder", file=sys.stderr)
        return 2
    sample = args.root.resolve() == SAMPLE.resolve()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    results: dict[str, list[tuple[float, float]]] = {}
    for seed in seeds:  # variants alternate within a seed, so a slow hour of the machine hits both alike
        for name, recipe in COMPARISONS[args.compare].items():
            run_dir = args.out / args.compare / f"{name}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # this comparison's own run of an earlier call: trained anew
            command = [
                sys.executable,
                "-m",
                "src.train",
                f"data.root={args.root}",
                "data.download=false",
                "data.batch_size=128",
                f"model.arch={args.arch}",
                f"trainer.max_epochs={args.epochs}",
                f"seed={seed}",
                "callbacks.progress_bar=null",
                f"hydra.run.dir={run_dir}",
                *recipe,
                *args.overrides,
            ]
            print(f"[{name}, seed {seed}] {' '.join(command[1:])}", flush=True)
            start = time.monotonic()
            done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            results.setdefault(name, []).append((test_accuracy(run_dir), time.monotonic() - start))
    what = "on the 6,000-image CIFAR-10 sample (not a CIFAR-10 result)" if sample else f"on {args.root}"
    print(f"\n| variant | test accuracy per seed ({', '.join(map(str, seeds))}) | mean | wall time per run |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        accs = [acc for acc, _ in runs]
        print(
            f"| {name} | {', '.join(f'{acc:.4f}' for acc in accs)} | {sum(accs) / len(accs):.4f} "
            f"| {sum(s for _, s in runs) / len(runs) / 60:.1f} min |"
        )
    print(
        f"\n{args.arch}, {args.epochs} epochs, batch 128, seeds {args.seeds}, {what}: "
        + ", ".join(f"{name} {sum(a for a, _ in runs) / len(runs):.1%}" for name, runs in results.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
