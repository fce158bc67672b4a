"""``make profile``: where a steady-state training step's time goes, the project's against the bare loop's.

    python benchmarks/profile_step.py [--arch resnet50] [--batch-size 256] [--pipeline device|dataloader]
                                      [--compile [MODE]] [--processes 1] [--ddp auto|always] [--steps 20] [--warmup 30]
                                      [--out outputs/profile]

Both sides run at the equal settings of ``make bench`` (benchmarks/bench.py): the project as ``python -m src.train``
with every default callback plus :class:`StepProfiler` (``+callbacks.step_profile``), the bare loop as ``torchrun
benchmarks/bare_ddp.py --profile-steps`` (one process without DDP: ``python``). torch.profiler records ``--steps``
steps after ``--warmup``; each step is a ``record_function`` range from one batch to the next, and inside it ranges
for the network's forward, the backward and the optimizer's update. Per step it reports CPU time (the whole step,
each range, and what is outside them: data, hooks, logging), the GPU's kernel time (their sum, as busy time), and
the host syncs (cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize / cudaMemcpy calls) and scalar
reads (``aten::_local_scalar_dense``, what ``.item()`` runs) inside the steps. On a CPU the GPU columns are n/a.
Writes OUT/profile.json and OUT/profile.md.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import torch

PREFIX = "profile_step/"  # the ranges' names: apart from every name torch and Lightning give theirs
RANGES = ("forward", "backward", "optimizer")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SCALAR_READS = ("aten::_local_scalar_dense", "aten::item")


class StepProfile:
    """torch.profiler over ``steps`` training steps: a ``step`` range per step and the named ranges inside it,
    opened and closed wherever the loop, or Lightning's hooks, get to them."""

    def __init__(self, steps: int, cuda: bool) -> None:
        self.steps, self.cuda = steps, cuda
        self.profiler: torch.profiler.profile | None = None
        self.open: dict[str, torch.profiler.record_function] = {}
        self.done = 0
        self.summary: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.profiler is not None and self.summary is None

    def begin(self, name: str) -> None:
        if self.active:
            self.end(name)
            self.open[name] = torch.profiler.record_function(PREFIX + name).__enter__()

    def end(self, name: str) -> None:
        span = self.open.pop(name, None)
        if span is not None:
            span.__exit__(None, None, None)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def next_step(self, start: bool = False) -> None:
        """Called as each step begins: ``start`` starts profiling; after ``steps`` whole steps it stops."""
        if start and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if self.cuda else []
            self._drain()  # the warm-up's queued kernels are not the profiled steps'
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            self.begin("step")
        elif self.active:
            self.end("step")
            self.done += 1
            if self.done < self.steps:
                self.begin("step")
            else:
                self.finish()

    def finish(self) -> dict[str, Any] | None:
        """Stop (if still profiling) and return the summary; None if profiling never started."""
        if self.profiler is not None and self.summary is None:
            for name in list(self.open):
                self.end(name)
            self._drain()
            self.profiler.stop()
            self.summary = summarise(self.profiler.events(), self.cuda)
        return self.summary

    def _drain(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def summarise(events: list, cuda: bool) -> dict[str, Any]:
    """Per step: CPU ms of the step and of each range, GPU kernel ms, host syncs and scalar reads."""
    cpu = torch.autograd.DeviceType.CPU
    spans: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    windows = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == cpu and e.name == PREFIX + "step"
    )
    starts = [w[0] for w in windows]
    kernel_us = nccl_us = 0.0
    for e in events:
        if e.device_type == cpu:
            if e.name.startswith(PREFIX):
                spans[e.name[len(PREFIX) :]] += e.time_range.elapsed_us()
            elif e.name in SYNC_CALLS + SCALAR_READS:
                i = bisect.bisect_right(starts, e.time_range.start) - 1
                calls[e.name] += i >= 0 and e.time_range.start <= windows[i][1]  # only those inside a step
        elif not getattr(e, "is_user_annotation", False):  # a range's copy on the GPU's timeline is no kernel
            kernel_us += e.time_range.elapsed_us()
            nccl_us += e.time_range.elapsed_us() if "nccl" in e.name.lower() else 0.0
    steps = len(windows)
    if steps == 0:
        return {"steps": 0}
    ms = {name: spans[name] / steps / 1000 for name in ("step", *RANGES)}
    return {
        "steps": steps,
        "step_ms": ms["step"],
        **{f"{name}_ms": ms[name] for name in RANGES},
        "outside_ms": ms["step"] - sum(ms[name] for name in RANGES),
        "gpu_kernel_ms": kernel_us / steps / 1000 if cuda else None,
        "nccl_kernel_ms": nccl_us / steps / 1000 if cuda else None,
        "host_syncs_per_step": sum(calls[name] for name in SYNC_CALLS) / steps if cuda else None,
        "scalar_reads_per_step": calls["aten::_local_scalar_dense"] / steps,
        "calls_per_step": {name: calls[name] / steps for name in SYNC_CALLS + SCALAR_READS},
    }


class StepProfiler(L.Callback):
    """Profiles ``steps`` training steps of a src.train run after ``warmup``; rank zero writes the summary to ``out``.

    The ranges come from hooks torch and Lightning already call: the LightningModule's forward (pre and post
    hooks), on_before/after_backward, and on_before_optimizer_step to the optimizer's own post-step hook.
    """

    def __init__(self, out: str, steps: int = 20, warmup: int = 10) -> None:
        self.out, self.steps, self.warmup = Path(out), steps, warmup
        self.profile = StepProfile(steps, cuda=False)
        self.seen = 0
        self._handles: list = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profile = profile = StepProfile(self.steps, trainer.strategy.root_device.type == "cuda")
        self._handles = [
            pl_module.register_forward_pre_hook(lambda *_: profile.begin("forward")),
            pl_module.register_forward_hook(lambda *_: profile.end("forward")),
        ]
        self._handles += [o.register_step_post_hook(lambda *_: profile.end("optimizer")) for o in trainer.optimizers]

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.profile.next_step(start=self.seen == self.warmup)
        self.seen += 1

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.profile.begin("backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profile.end("backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.profile.begin("optimizer")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        summary = self.profile.finish()
        if trainer.is_global_zero:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps({"profile": summary or {"steps": 0}}, indent=2) + "\n")


def cell(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown table: one row per side."""
    lines = [
        "| run | steps | step ms | forward ms | backward ms | optimizer ms | outside ms | GPU kernels ms "
        "| host syncs / step | scalar reads / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, p in results.items():
        lines.append(
            f"| {side} | {p['steps']} | {cell(p.get('step_ms'))} | {cell(p.get('forward_ms'))} "
            f"| {cell(p.get('backward_ms'))} | {cell(p.get('optimizer_ms'))} | {cell(p.get('outside_ms'))} "
            f"| {cell(p.get('gpu_kernel_ms'))} | {cell(p.get('host_syncs_per_step'), 2)} "
            f"| {cell(p.get('scalar_reads_per_step'), 2)} |"
        )
    return lines


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import ROOT, Setting, auto_choice, bare_command, hardware, loader_workers, project_command, run  # noqa: E402

    from benchmarks.arguments import number  # bench put the project on the path

    cuda, device = hardware()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=number(1), default=256 if cuda else 32, help="per process")
    parser.add_argument("--pipeline", choices=("device", "dataloader"), default="device")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        metavar="MODE",
        help="torch.compile the network on both sides, in torch.compile's MODE",
    )
    parser.add_argument("--processes", type=number(1), default=1)
    parser.add_argument(
        "--ddp",
        choices=("auto", "always"),
        default="auto",
        help="auto: DDP from 2 processes on; always: one process too",
    )
    parser.add_argument("--steps", type=number(1), default=20, help="profiled steps")
    parser.add_argument("--warmup", type=number(0), default=30 if cuda else 3, help="steps before profiling")
    parser.add_argument("--timeout", type=number(1, float), default=900, help="seconds allowed for each run")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "profile")
    args = parser.parse_args()
    workers = loader_workers(cuda, args.processes) if args.pipeline == "dataloader" else 0
    s = Setting(args.processes, args.pipeline, workers, args.processes > 1 or args.ddp == "always", args.compile)
    # bench's commands with room for the profiled steps and the one whose start ends the last of them
    sized = argparse.Namespace(arch=args.arch, batch_size=args.batch_size, warmup=args.warmup, steps=args.steps + 2)
    out = args.out
    project_json, bare_json = out / "project.json", out / "bare.json"
    for stale in (project_json, bare_json):
        stale.unlink(missing_ok=True)
    run(
        project_command(sized, s, cuda, out / "project")
        + [
            "+callbacks.step_profile._target_=benchmarks.profile_step.StepProfiler",
            f"+callbacks.step_profile.out={project_json}",
            f"+callbacks.step_profile.steps={args.steps}",
            f"+callbacks.step_profile.warmup={args.warmup}",
        ],
        out / "project.log",
        args.timeout,
    )
    run(bare_command(sized, s, cuda, bare_json) + [f"--profile-steps={args.steps}"], out / "bare.log", args.timeout)
    results = {
        "project (src.train)": json.loads(project_json.read_text())["profile"],
        "bare loop": json.loads(bare_json.read_text())["profile"],
    }
    chosen = auto_choice(cuda, args.arch)
    heading = (
        f"{args.arch} (CIFAR stem), batch {args.batch_size} per process, {args.processes} "
        f"process{'es' if args.processes > 1 else ''}, data.pipeline={s.pipeline}"
        f"{f' ({workers} workers)' if workers else ''}, {', '.join(s.columns()[1:])}, {chosen.label}; "
        f"{device}, torch {torch.__version__}, Lightning {L.__version__}, {time.strftime('%Y-%m-%d')}"
    )
    command = "python benchmarks/profile_step.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Step profile: {heading}",
        "",
        f"`{command.strip()}`: {args.steps} steps after {args.warmup} "
        "warm-up steps, per step; CPU ms of the whole step and of the ranges in it, 'outside' is the rest "
        "(data, hooks, logging); GPU kernels: the sum of kernel times",
        "",
        *table(results),
    ]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    (out / "profile.json").write_text(
        json.dumps({"setting": heading, "command": command.strip(), **results}, indent=2) + "\n"
    )
    print("\n".join(lines[2:]))
    print(f"\n{heading}\nwritten: {out / 'profile.md'}, {out / 'profile.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
