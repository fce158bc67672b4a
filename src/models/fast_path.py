"""What ``trainer.precision=auto`` and ``model.channels_last=auto`` become on the hardware found.

The choice follows what the machine reports and what it measures, never a guess about which machine this is:

- a CUDA GPU: bf16 autocast at compute capability 8.0 and above (Ampere and later), fp16 autocast with a gradient
  scaler below (V100, T4: ``torch.cuda.is_bf16_supported()`` says yes there, by emulation); channels-last (tensor
  cores run convolutions in NHWC). The capability is read with ``torch.cuda.get_device_capability(index)``, which
  creates no CUDA context: ``is_bf16_supported()`` would create one on GPU 0 in every rank, before each selects
  its own;
- a CPU without native bf16 instructions, or one whose oneDNN a user capped below them (``ONEDNN_MAX_CPU_ISA``):
  32-bit, as bf16 autocast is emulated there (a ResNet-50 train step ran at a tenth of the fp32 rate on an AVX2
  AMD EPYC), and channels-last, which oneDNN runs faster;
- a CPU with native bf16 (AVX512_BF16 or AMX, as torch reports them): channels-last, and bf16 autocast only
  where it is faster. Native bf16 alone does not say so: a ResNet-50 train step ran 2.4x the fp32 rate in
  bf16 on an AVX512_BF16 AMD EPYC, and 0.8x on an AVX512_BF16 Intel Xeon without AMX (docs/performance.md,
  "The CPU fast path"). So the network's train step is timed once in both (``measure_bf16_speedup``: pairs of
  steps and their median), and the result kept per CPU model, torch version and network in
  ``~/.cache/cifar10-ddp/cpu-bf16.json`` (``$XDG_CACHE_HOME``; ``$TMPDIR/cifar10-ddp-UID/cifar10-ddp/`` where the
  home folder cannot be written): the processes of a run, and every later run on such a CPU, read the same answer;
  one taken on a busy CPU, the runs of the next ten minutes.

``benchmarks/cpu_fast_path.py`` measures every combination through ``python -m src.train``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from src.core import user_folders
from src.core.errors import UserError
from src.launch.run_dir import locked, read_json, write_json

log = logging.getLogger(__name__)

# torch.compile's modes; model.compile=true is "default" (inductor's kernels, no CUDA graphs)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# model.compile=auto compiles a GPU fit of at least this many optimizer steps: below, the compilation (a minute or
# more the first time, seconds from the cache) costs more than the faster steps save (docs/gpu.md)
COMPILE_MIN_STEPS = 2000
BF16_MIN_SPEEDUP = 1.1  # below this, bf16's rounding is not worth it: a tie within the noise stays 32-bit
PROBE_BATCH, PROBE_PAIRS = 8, 5  # images per timed step; fp32 and bf16 steps timed back to back, in pairs
# A probe of several threads that ran less than this share of their wall time shared the CPU with other work: its
# answer holds for the run that took it (whose ranks start together and must agree), and a run starting
# BUSY_RETRY_S later times the steps again
BUSY_SHARE, BUSY_RETRY_S = 0.8, 600


@dataclass(frozen=True)
class FastPath:
    precision: str  # a Lightning precision
    channels_last: bool
    why: str  # one clause for the run line

    @property
    def label(self) -> str:
        """'bf16-mixed, channels-last': how the run lines, benchmarks and reports name this choice."""
        return f"{self.precision}, {'channels-last' if self.channels_last else 'contiguous'}"


# oneDNN's ISA levels as its ONEDNN_MAX_CPU_ISA names them, and their bits (dnnl_cpu_isa_t): a cap whose bits hold a
# level's bits lets oneDNN use that level's kernels
ONEDNN_ISA_BITS = {
    "SSE41": 0x1,
    "AVX": 0x3,
    "AVX2": 0x7,
    "AVX2_VNNI": 0xF,
    "AVX2_VNNI_2": 0x1F,
    "AVX512_CORE": 0x27,
    "AVX512_CORE_VNNI": 0x67,
    "AVX512_CORE_BF16": 0xE7,
    "AVX10_1_512": 0x1EF,
    "AVX512_CORE_FP16": 0x1EF,
    "AVX10_1_512_AMX": 0xFEF,
    "AVX512_CORE_AMX": 0xFEF,
    "AVX10_1_512_AMX_FP16": 0x1FEF,
    "AVX512_CORE_AMX_FP16": 0x1FEF,
}
# the native bf16 torch reports, widest first: its name, torch.cpu's check, the oneDNN level that uses it
NATIVE_BF16 = (
    ("AMX", "_is_amx_tile_supported", "AVX512_CORE_AMX"),
    ("AVX512_BF16", "_is_avx512_bf16_supported", "AVX512_CORE_BF16"),
)


def onednn_isa_cap() -> tuple[str, int] | None:
    """The cap a user put on oneDNN's kernels, as ``('ONEDNN_MAX_CPU_ISA=AVX2', bits)``, or None. oneDNN reads
    ``ONEDNN_MAX_CPU_ISA``, else ``DNNL_MAX_CPU_ISA``; a name it does not know (``ALL``, ``DEFAULT``, a newer level)
    caps nothing known here."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip().upper()
        if value:
            bits = ONEDNN_ISA_BITS.get(value)
            return None if bits is None else (f"{name}={value}", bits)
    return None


def cpu_bf16_isa(capped: bool = True) -> str | None:
    """'AMX' or 'AVX512_BF16': the widest native bf16 the CPU has (as torch reports it) that oneDNN may use, else
    None. A user's ``ONEDNN_MAX_CPU_ISA`` counts: capped at AVX2 on such a CPU, oneDNN ran a bf16 convolution at a
    fiftieth of the fp32 rate. ``capped=False``: what the CPU has, whatever oneDNN is let use of it."""
    cap = onednn_isa_cap() if capped else None
    for isa, check, level in NATIVE_BF16:
        bits = ONEDNN_ISA_BITS[level]
        if getattr(torch.cpu, check, lambda: False)() and (cap is None or cap[1] & bits == bits):
            return isa
    return None


def cpu_capability() -> str:
    """The widest vector ISA torch's CPU kernels use here: 'AVX2', 'AVX512', ..."""
    return torch.backends.cpu.get_cpu_capability()


def channels_last_choice(device_type: str) -> tuple[bool, str]:
    """What ``model.channels_last=auto`` becomes on a device of ``device_type``, and why, timing nothing (whatever
    the precision): channels-last on CUDA and CPUs, in fp32 and in bf16 alike (docs/performance.md's tables),
    contiguous where no fast path is known."""
    if device_type == "cuda":
        return True, "cuDNN's convolutions run channels-last fastest on tensor cores"
    if device_type == "cpu":
        return True, "oneDNN's convolutions run channels-last faster on CPUs, in fp32 and bf16 alike"
    return False, f"no fast path known for {device_type}"


@functools.cache
def fast_path(device_type: str, arch: str = "resnet50", gpus: tuple[int, ...] = (0,)) -> FastPath:
    """The precision and memory format ``auto`` resolves to for ``arch`` on a device of ``device_type`` here; on CUDA
    for the visible GPUs ``gpus`` this node's ranks train on (each rank reads them all, so all agree)."""
    layout = channels_last_choice(device_type)[0]
    if device_type == "cuda":
        # the lowest capability of the node's GPUs: ranks that scaled their losses and ranks that did not would
        # all-reduce gradients of different scales
        index, (major, minor) = min(
            ((i, torch.cuda.get_device_capability(i)) for i in sorted(set(gpus))), key=lambda g: g[1]
        )
        found = f"GPU cuda:{index} has compute capability {major}.{minor}"
        if major >= 8:
            return FastPath("bf16-mixed", layout, f"{found}: native bf16")
        return FastPath("16-mixed", layout, f"{found}, below 8.0 bf16 would be emulated: fp16 with a gradient scaler")
    if device_type == "cpu":
        isa = cpu_bf16_isa()
        if isa is None:
            cap, found = onednn_isa_cap(), cpu_bf16_isa(capped=False)
            if cap is not None and found is not None:
                why = f"{cap[0]} keeps oneDNN from the CPU's native bf16 ({found}): bf16 would be emulated"
                return FastPath("32-true", layout, why)
            return FastPath(
                "32-true", layout, f"the CPU has no native bf16 ({cpu_capability()}): bf16 would be emulated"
            )
        speedup = bf16_speedup(arch)
        measured = f"a {arch} train step measured {speedup:.2f}x the fp32 rate in bf16 on this CPU"
        if speedup >= BF16_MIN_SPEEDUP:
            return FastPath("bf16-mixed", layout, f"the CPU has native bf16 ({isa}) and {measured}")
        return FastPath("32-true", layout, f"the CPU has native bf16 ({isa}) but {measured}")
    return FastPath("32-true", layout, f"no fast path known for {device_type}")


def check_compile(value: object) -> None:
    """``model.compile``: auto, true, false or one of torch.compile's modes; anything else is one line."""
    if not (isinstance(value, bool) or value == "auto" or value in COMPILE_MODES):
        raise UserError(
            f"model.compile={value} is not known: choose auto, true, false or a torch.compile mode "
            f"({', '.join(COMPILE_MODES)})"
        )


def compile_choice(
    value: bool | str, device_type: str, steps: float | None = None, deterministic: bool = False
) -> tuple[str | None, str]:
    """What ``model.compile=value`` becomes: the torch.compile mode to compile the network with, or None (eager), and
    why, for the run line. ``steps``: the optimizer steps the fit will take (None: not a fit).

    ``auto`` compiles with CUDA graphs (``reduce-overhead``) on a CUDA GPU: eager ResNet-50 at batch 128 waits for
    the host to launch its kernels, and a graph replay launches them all at once. It stays eager on CPUs, under
    ``trainer.deterministic`` (inductor picks among kernel variants by timing them, which may sum in another order
    in the next process) and for fits too short to pay for the compilation.
    """
    check_compile(value)
    if value is False:
        return None, "model.compile=false"
    if value is not True and value != "auto":
        return value, f"model.compile={value}"
    if value is True:
        return "default", "model.compile=true"
    if device_type != "cuda":
        return None, f"auto: on {'a CPU' if device_type == 'cpu' else device_type.upper()}"
    if deterministic:
        return None, "auto: trainer.deterministic, and inductor chooses its kernels by timing them"
    if steps is not None and steps < COMPILE_MIN_STEPS:
        return None, f"auto: {steps:.0f} steps are too few to pay for compiling, from {COMPILE_MIN_STEPS:,}"
    return "reduce-overhead", "auto: CUDA graphs on a GPU"


def bf16_speedup(arch: str) -> float:
    """A train step's rate in bf16 autocast over fp32 (both channels-last) for ``arch`` on this CPU.

    Measured once per CPU model, torch version and network; the processes of a run that start together
    wait for the first one's measurement (a file lock) rather than time their steps against each other.
    """
    key = f"{cpu_model()} | {cpu_bf16_isa()} | torch {torch.__version__} | {arch}"
    cache = cache_file()
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(locked(cache.with_suffix(".lock")))
        except OSError:  # no writable cache here: measure in this process, keep nothing
            return measure_bf16_speedup(arch)["speedup"]
        known = read_json(cache) or {}  # none yet, or cut off: measure again
        if key not in known or stale(known[key]):
            from src.launch.ranks import is_launch_rank_zero

            talk = is_launch_rank_zero()
            if talk:
                log.info(
                    "auto: timing a %s train step in bf16 and in fp32 on this CPU (once; the result is kept in %s)",
                    arch,
                    cache,
                )
            known[key] = {**measure_bf16_speedup(arch), "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
            if talk and known[key].get("busy"):
                log.warning(
                    "auto: the CPU was busy while timing (the probe's %d threads ran %.0f%% of the time): %.2fx "
                    "holds for this run, and a run starting %d minutes or more from now times it again",
                    known[key]["threads"],
                    100 * known[key]["cpu_share"],
                    known[key]["speedup"],
                    BUSY_RETRY_S // 60,
                )
            try:
                write_json(cache, known, sort_keys=True)
            except OSError:  # a full or read-only home: the answer holds for this process all the same
                pass
        return float(known[key]["speedup"])


def stale(record: dict) -> bool:
    """Whether a kept measurement is to be taken again: one from a busy CPU, BUSY_RETRY_S after it was taken (or
    one whose time cannot be read)."""
    if not record.get("busy"):
        return False
    try:
        taken = time.mktime(time.strptime(str(record.get("measured")), "%Y-%m-%d %H:%M:%S"))
    except (ValueError, OverflowError):
        return True
    return time.time() - taken >= BUSY_RETRY_S


def measure_bf16_speedup(arch: str) -> dict[str, object]:
    """Time ``arch``'s train step (CIFAR stem, SGD) in fp32 and in bf16 autocast: PROBE_PAIRS pairs of steps, each
    pair's two back to back (in turn which first), and the median of the pairs' ratios.

    What a step takes: with one thread, the thread's own CPU time, which other processes on a busy machine do
    not add to (a ResNet-18 probe read 1.56 to 1.64 beside two busy loops on 2 cores and 1.57 alone, where its
    wall time read 1.40 to 1.61; the best of two rounds by wall time once read 0.68 under a test suite's load).
    Several threads wait for each other, and a thread another process holds back stalls the rest while they spin:
    their wall time then, with the share of the CPU the probe had (``cpu_share``) saying whether it ran alone
    (``busy`` below BUSY_SHARE).
    """
    from src.models.resnet import build_resnet

    threads = torch.get_num_threads()
    clock = time.thread_time if threads == 1 else time.perf_counter
    with torch.random.fork_rng(devices=[]):  # the run's own random stream stays as seeded
        torch.manual_seed(0)
        net = build_resnet(arch, 10, "cifar").to(memory_format=torch.channels_last)
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        images = torch.randn(PROBE_BATCH, 3, 32, 32).contiguous(memory_format=torch.channels_last)
        labels = torch.arange(PROBE_BATCH) % 10

        def step(bf16: bool) -> float:
            began = clock()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = torch.nn.functional.cross_entropy(net(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return clock() - began

        step(False), step(True)  # warm-up: oneDNN builds its kernels for each format
        wall, cpu = time.perf_counter(), time.process_time()
        took = paired(step, PROBE_PAIRS)
        share = (time.process_time() - cpu) / (time.perf_counter() - wall) / threads
    pairs = [fp32 / bf16 for fp32, bf16 in zip(*took)]
    return {
        "speedup": round(statistics.median(pairs), 3),
        "pairs": [round(ratio, 3) for ratio in pairs],
        "fp32_img_s": round(PROBE_BATCH / statistics.median(took[0]), 2),
        "bf16_img_s": round(PROBE_BATCH / statistics.median(took[1]), 2),
        "threads": threads,
        "clock": "thread CPU time" if threads == 1 else "wall time",
        "cpu_share": round(share, 2),
        "busy": threads > 1 and share < BUSY_SHARE,
    }


def paired(step: Callable[[bool], float], pairs: int) -> tuple[list[float], list[float]]:
    """``step(bf16)``'s seconds in fp32 and in bf16, pair by pair: each pair's two steps back to back, so a busy
    moment of the machine falls on both, and the one that goes first in turn."""
    took: tuple[list[float], list[float]] = ([], [])
    for i in range(pairs):
        for bf16 in (False, True) if i % 2 == 0 else (True, False):
            took[bf16].append(step(bf16))
    return took


def cache_file() -> Path:
    """Where measurements are kept: ``$XDG_CACHE_HOME/cifar10-ddp/cpu-bf16.json`` (``~/.cache`` by default); where
    the home folder cannot be written, in this user's node folder (src/core/user_folders.py), so that the ranks of a
    node still measure once and agree."""
    return user_folders.cache_folder("cifar10-ddp") / "cpu-bf16.json"


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ('Intel(R) Xeon(R) Processor', 'AMD EPYC 9R14 ...')."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "CPU")
    except OSError:
        return "CPU"
