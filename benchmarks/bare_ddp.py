"""A bare ``torch.distributed`` training loop, written only to be compared with the project (benchmarks/bench.py).

    torchrun --nproc-per-node=2 benchmarks/bare_ddp.py --steps 20 --warmup 3 --batch-size 32 --out result.json

As it comes, what a hand-written DDP script does (the approach of ../shared/seeds/004): a process group from
torchrun's environment, a DistributedSampler + DataLoader with per-image crop/flip/normalise and no workers, the
model wrapped in DistributedDataParallel, SGD. Nothing else: no logging, no checkpoints, no metrics. It trains the
very network and images the project trains (imported from src/). To meet the project at equal settings it also
takes the project's device-resident batches (``--pipeline device``), DataLoader workers, bf16 autocast,
channels-last, ``torch.compile`` (any mode), SGD's fused update and no DDP for one process. Writes images/s and
the time of its first step as JSON; with ``--profile-steps N`` it profiles N steps after the warm-up instead
(benchmarks/profile_step.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

START = time.time()  # as early as Python lets us: the launch overhead is measured to the first step

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # src/ without installing the project

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from src.data.device_batches import DeviceBatches  # noqa: E402
from src.data.in_memory import CIFAR10_MEAN, CIFAR10_STD, ImageTensors, train_transform  # noqa: E402
from src.data.synthetic import make_images  # noqa: E402
from src.models.resnet import build_resnet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--steps", type=int, default=20, help="measured steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before the clock starts")
    parser.add_argument("--images", type=int, default=2560, help="synthetic training images")
    parser.add_argument(
        "--pipeline",
        choices=("dataloader", "device"),
        default="dataloader",
        help="device: the project's device-resident batches (src/data/device_batches.py)",
    )
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--no-ddp", action="store_true", help="one process, the model not wrapped in DDP")
    parser.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's option of that name")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU, or CPU)")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        metavar="MODE",
        help="torch.compile the network, in torch.compile's MODE (default; reduce-overhead: CUDA graphs)",
    )
    parser.add_argument("--fused", action="store_true", help="SGD's fused update (one kernel launch)")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many steps instead of timing")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as the project does
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if args.no_ddp:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            sys.exit("error: --no-ddp trains one process: start it with --nproc-per-node=1")
        rank, world = 0, 1
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)

    epoch = 0
    images, labels = make_images(args.images, 10, 32, seed=0, split_seed=1, noise=0.4)
    sampler = None
    if args.pipeline == "device":
        batches = DeviceBatches(
            images,
            labels,
            args.batch_size,
            device=device,
            rank=rank,
            world_size=world,
            seed=42,
            shuffle=True,
            drop_last=True,
            augment=True,
            mean=CIFAR10_MEAN,
            std=CIFAR10_STD,
            epoch_of=lambda: epoch,
        )
    else:
        dataset = ImageTensors(images, labels, train_transform(32, augment=True))
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=42)
        batches = DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
            pin_memory=cuda,
        )
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = build_resnet(args.arch).to(device, memory_format=memory_format)
    if args.compile:
        model.compile(mode=args.compile)  # in place, as the project's model.compile does, then wrapped in DDP
    cuda_graphs = cuda and args.compile in ("reduce-overhead", "max-autotune")
    if not args.no_ddp:
        model = DistributedDataParallel(
            model, device_ids=[local_rank] if cuda else None, gradient_as_bucket_view=args.gradient_as_bucket_view
        )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=args.fused or None
    )
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    profile = None
    if args.profile_steps:
        from profile_step import StepProfile  # beside this file

        profile = StepProfile(args.profile_steps, cuda)
    span = profile.span if profile else lambda name: contextlib.nullcontext()
    measured = args.profile_steps + 1 if profile else args.steps  # the step after the last profiled one ends it
    total, step, first_step_at, clock = args.warmup + measured, 0, None, None
    while step < total:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in batches:
            if first_step_at is None:
                first_step_at = time.time()
            if profile is not None:
                profile.next_step(step == args.warmup)
            x = x.to(device, non_blocking=True).contiguous(memory_format=memory_format)
            y = y.to(device, non_blocking=True)
            if cuda_graphs:  # the previous step's graph outputs are no longer read
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                with span("forward"):
                    logits = model(x)
                loss = criterion(logits, y)
            optimizer.zero_grad(set_to_none=True)
            with span("backward"):
                loss.backward()
            with span("optimizer"):
                optimizer.step()
            step += 1
            if step == args.warmup:
                if cuda:
                    torch.cuda.synchronize()
                clock = time.perf_counter()
            if step == total:
                break
        epoch += 1
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - clock
    summary = profile.finish() if profile is not None else None
    if rank == 0:
        record = {
            "images_per_second": measured * args.batch_size * world / seconds,
            "seconds": seconds,
            "steps": measured,
            "warmup": args.warmup,
            "world_size": world,
            "batch_size": args.batch_size,
            "start_at": START,
            "first_step_at": first_step_at,
        }
        if summary is not None:
            record["profile"] = summary
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    if not args.no_ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
