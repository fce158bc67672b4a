"""A bare ``torch.distributed`` training loop, written only to be compared with the project (benchmarks/bench.py).

    torchrun --nproc-per-node=2 benchmarks/bare_ddp.py --steps 20 --warmup 3 --batch-size 32 --out result.json

What a hand-written DDP script does (the approach of ../shared/seeds/004): a process group from
torchrun's environment, a DistributedSampler + DataLoader with per-image crop/flip/normalise, the
model wrapped in DistributedDataParallel, SGD. Nothing else: no logging, no checkpoints, no metrics.
It trains the very network and images the project trains (imported from src/), so the two differ
only in the machinery around the loop. Writes images/s and the time of its first step as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

START = time.time()  # as early as Python lets us: the launch overhead is measured to the first step

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from src.data.in_memory import ImageTensors, train_transform  # noqa: E402
from src.data.synthetic import make_images  # noqa: E402
from src.models.resnet import build_resnet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--steps", type=int, default=20, help="measured steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before the clock starts")
    parser.add_argument("--images", type=int, default=2560, help="synthetic training images")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU, or CPU)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.backends.cudnn.benchmark = True
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)

    images, labels = make_images(args.images, 10, 32, seed=0, split_seed=1, noise=0.4)
    dataset = ImageTensors(images, labels, train_transform(32, augment=True))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, num_workers=0,
                        pin_memory=cuda)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = build_resnet(args.arch).to(device, memory_format=memory_format)
    model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    total, step, first_step_at, clock = args.warmup + args.steps, 0, None, None
    epoch = 0
    while step < total:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if first_step_at is None:
                first_step_at = time.time()
            x = x.to(device, non_blocking=True).contiguous(memory_format=memory_format)
            y = y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
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
    if rank == 0:
        record = {"images_per_second": args.steps * args.batch_size * world / seconds, "seconds": seconds,
                  "steps": args.steps, "warmup": args.warmup, "world_size": world, "batch_size": args.batch_size,
                  "start_at": START, "first_step_at": first_step_at}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
