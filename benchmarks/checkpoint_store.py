"""What a checkpoint costs in an object store against a local folder: the project's own writer (AtomicCheckpointIO)
saving a ResNet-50 checkpoint with its momentum (the size src.train writes) ``--saves`` times to each, alternating,
and the read a resume makes (one node-local copy). The store is a real S3 server, SeaweedFS on 127.0.0.1 started here
(tests/s3server.py): the figures are the client's and the protocol's cost on this machine, not a network's.

    python benchmarks/checkpoint_store.py --saves 5 --out outputs/bench/checkpoint-store
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.arguments import number  # noqa: E402 - after the path above


def checkpoint() -> dict:
    """What src.train writes for a ResNet-50 on CIFAR-10, in size: its weights and one momentum buffer each."""
    import torch
    import torchvision

    net = torchvision.models.resnet50(num_classes=10)
    weights = net.state_dict()
    momentum = {i: {"momentum_buffer": p.detach().clone()} for i, p in enumerate(net.parameters())}
    return {"state_dict": weights, "optimizer_states": [{"state": momentum}], "global_step": 1, "epoch": 0,
            "pytorch-lightning_version": "2.6.6", "tensor": torch.zeros(1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=number(1), default=5, help="saves to each side")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "checkpoint-store")
    args = parser.parse_args()

    from src.checkpoints import object_store
    from src.checkpoints.files import LAST, AtomicCheckpointIO
    from src.models.fast_path import cpu_model
    from tests.s3server import start, weed

    state = checkpoint()
    with tempfile.TemporaryDirectory() as scratch:
        server = start(Path(scratch) / "s3", watch=os.getpid())
        try:
            os.environ.update(server.env)
            writer, url, local = AtomicCheckpointIO(), server.url("bench"), Path(scratch) / "local"
            times: dict[str, list[float]] = {"local": [], "s3": []}
            for i in range(args.saves):  # alternating, so a slow moment of the machine hits both
                for side, target in (("local", local / LAST), ("s3", f"{url}/{LAST}"))[:: 1 if i % 2 == 0 else -1]:
                    began = time.perf_counter()
                    writer.save_checkpoint(state, target)
                    times[side].append(time.perf_counter() - began)
            size = (local / LAST).stat().st_size
            began = time.perf_counter()
            object_store.local_copy(f"{url}/{LAST}")
            read_s = time.perf_counter() - began
        finally:
            server.stop()
    import torch

    version = subprocess.run([str(weed()), "version"], capture_output=True, text=True).stdout.split()[2]
    record = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "server": f"SeaweedFS {version} on 127.0.0.1",
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "checkpoint_mb": round(size / 2**20, 1),
        "saves": args.saves,
        "local_s": round(statistics.median(times["local"]), 3),
        "s3_s": round(statistics.median(times["s3"]), 3),
        "s3_read_s": round(read_s, 3),
    }
    record["s3_over_local"] = round(record["s3_s"] / record["local_s"], 2)
    record["s3_mb_per_s"] = round(record["checkpoint_mb"] / record["s3_s"], 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint_store.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"| {record['cpu']}, {record['cores']} cores | {record['server']} | {record['date']} |")
    print(f"| a {record['checkpoint_mb']} MB checkpoint, median of {args.saves} saves | seconds | MB/s |")
    print("|---|---:|---:|")
    print(f"| local folder (temp file, fsync, rename) | {record['local_s']} | "
          f"{record['checkpoint_mb'] / record['local_s']:.0f} |")  # fmt: skip
    print(f"| S3 (stage, server-side copy to last.prev.ckpt, put) | {record['s3_s']} | {record['s3_mb_per_s']} |")
    print(f"| S3 read for a resume (one node-local copy) | {record['s3_read_s']} | "
          f"{record['checkpoint_mb'] / record['s3_read_s']:.0f} |")  # fmt: skip
    print(f"s3 over local: {record['s3_over_local']}x")


if __name__ == "__main__":
    main()
