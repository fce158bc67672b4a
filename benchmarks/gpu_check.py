"""``make gpu-check``: what to run first on a new GPU node. In at most 10 minutes, offline, with the torch installed
there: the GPU tests, a throughput table, and the checks of nccl, determinism, resume, eval and one GPU per rank.

    python benchmarks/gpu_check.py [--only STEP,...] [--skip STEP,...] [--budget-s 600] [--out outputs/gpu-check]
    GPU_CHECK_DEVICE=cpu python benchmarks/gpu_check.py    # the same steps, tiny, on the CPU (how the suite tests it)

Every step runs its commands as processes with a timeout (``python -m src.train`` as a user runs it, pytest,
benchmarks/bench.py); one that fails does not stop the others, and one that would overrun the time budget is
skipped with a note (``--only`` runs it alone). OUT/report.json holds each step's status, seconds, commands,
figures and, for a failure, the last lines of its output; OUT/report.md the same for reading, with the GPU, the
versions and the date. It never calls pip: beside torch it needs the project's pure-Python dependencies.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # src/ without installing the project: a GPU node runs this with its own torch
from benchmarks.arguments import number, numbers  # noqa: E402 - after the path above

# what the runs import (module: the package that provides it), checked before anything starts
NEEDED = {
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "torch": "torch",
    "torchvision": "torchvision",
    "lightning": "lightning",
    "torchmetrics": "torchmetrics",
    "tensorboard": "tensorboard",
    "rich": "rich",
}
STEPS = ("env", "nccl", "deterministic", "resume", "eval", "two-rank", "tests", "throughput", "compile", "bench")
# seconds on one H100 with 16 cores (as measured there, 2026-11-25) and on 2 CPU cores: a step is started only if
# this much of the budget is left
ESTIMATE_S = {
    "env": (25, 0),
    "nccl": (40, 15),
    "deterministic": (55, 25),
    "resume": (50, 25),
    "eval": (20, 10),
    "two-rank": (45, 20),
    "tests": (130, 20),
    "throughput": (155, 40),
    "compile": (100, 120),
    "bench": (60, 25),
}
# the tests step on a GPU in one process (no pytest-xdist, or fewer than 4 cores): 13 tests took 246 s on one H200
SERIAL_GPU_TESTS_S = 270
RUN_ESTIMATE_S = (25, 10)  # one src.train run of the throughput table
COMPILE_RUN_ESTIMATE_S = (110, 120)  # one compiled run, its compilation cold (inductor's cache empty)
COMPILE_MODE = "reduce-overhead"  # what model.compile=auto compiles a long GPU fit with (src/models/fast_path.py)
KILL_GRACE_S = 10  # after SIGTERM at a timeout (a run then writes last.ckpt), before SIGKILL
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# One rank on NCCL with the flight recorder as src.train switches it on; two all-reduces; its dump written and read.
NCCL_TRACE_PROBE = r"""
import os, pickle, socket, sys
import torch, torch.distributed as dist
from src.resilience import heartbeat
heartbeat.switch_on_nccl_trace(sys.argv[1])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
x = torch.ones(1024, device="cuda")
for _ in range(2):
    dist.all_reduce(x)
torch.cuda.synchronize()
path = heartbeat.write_nccl_trace(0)
assert path is not None and path.is_file(), f"no dump written under {sys.argv[1]}"
dump = pickle.loads(path.read_bytes())
print("entries", len(dump.get("entries", [])))
dist.destroy_process_group()
"""

PROBE = r"""
import json, platform, shutil, subprocess
from importlib.metadata import version
import torch  # the others' versions from their metadata: importing Lightning costs seconds and says nothing more
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
        "lightning": version("lightning"), "torchmetrics": version("torchmetrics"),
        "cuda": torch.cuda.is_available(), "gpus": []}
try:
    info["hydra"], info["omegaconf"] = version("hydra-core"), version("omegaconf")
    from src.models.fast_path import cpu_model
    info["cpu"] = cpu_model()
except Exception as err:
    info["cpu"] = f"n/a ({type(err).__name__})"
if info["cuda"]:
    info["cudnn"] = torch.backends.cudnn.version()
    nccl = torch.cuda.nccl.version()
    info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        info["gpus"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                             "memory_gib": round(p.total_memory / 2**30, 1), "uuid": str(getattr(p, "uuid", "n/a"))})
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
        info["driver"] = done.stdout.split()[0] if done.returncode == 0 and done.stdout.strip() else None
    if not info.get("driver"):
        v = torch._C._cuda_getDriverVersion()
        info["driver"] = f"n/a (CUDA driver API {v // 1000}.{v % 1000 // 10})"
print("PROBE " + json.dumps(info))
"""


class SetupError(Exception):
    """Nothing can be checked (no CUDA, a missing package, a wrong option): one line, exit status 2."""


class StepFailed(Exception):
    """A step's check failed: ``str()`` says how; ``log`` is the output of the command that showed it."""

    def __init__(self, message: str, log: Path | None = None, timed_out: bool = False) -> None:
        super().__init__(message)
        self.log, self.timed_out = log, timed_out


class StepSkipped(Exception):
    """The step does not apply here, or would overrun the budget: ``str()`` says why."""


@dataclass(frozen=True)
class Sizes:
    """What the steps train: ResNet-50 in bf16 on a GPU; a tiny network, batch and run on the CPU."""

    cuda: bool
    arch: str
    width: int  # model.width: torchvision's network on a GPU; on the CPU a 16th of its parameters (and checkpoint)
    batches: tuple[int, ...]
    steps: int  # timed steps of a throughput run
    warmup: int
    check_batch: int  # the batch and steps of the nccl, determinism, resume and two-rank runs
    check_steps: int
    precision: str
    command_timeout_s: float
    compile_timeout_s: float

    @property
    def accelerator(self) -> str:
        return "gpu" if self.cuda else "cpu"

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"


def sizes_for(cuda: bool, gpus: list[dict[str, Any]], batches: tuple[int, ...] | None) -> Sizes:
    from src.models.resnet import WIDTH

    if cuda:  # 60 timed steps: over a second of steady state at every batch on an H100
        bf16 = all(int(g["capability"].split(".")[0]) >= 8 for g in gpus)  # Ampere on; below, fp16 and a scaler
        precision = "bf16-mixed" if bf16 else "16-mixed"
        return Sizes(True, "resnet50", WIDTH, batches or (128, 256, 512), 60, 20, 128, 8, precision, 240, 420)
    return Sizes(False, "resnet18", 16, batches or (4, 8), 3, 2, 4, 3, "32-true", 300, 600)


def tail(log: Path | None, lines: int = 40) -> str:
    if log is None or not log.is_file():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def rank_devices(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """throughput.json's per-rank CUDA devices (entries with a GPU UUID), wherever it keeps them; None if absent."""
    for value in record.values():
        entries = list(value.values()) if isinstance(value, dict) else value
        if isinstance(entries, list) and entries and all(isinstance(v, dict) for v in entries):
            if all(any("uuid" in key.lower() for key in v) for v in entries):
                return entries
    return None


class GpuCheck:
    """Runs the steps in order, each time-boxed, and keeps the report up to date after each."""

    def __init__(self, args: argparse.Namespace, cuda: bool, info: dict[str, Any]) -> None:
        self.args, self.cuda, self.info = args, cuda, info
        self.out: Path = args.out
        self.started = time.time()
        self.deadline = self.started + args.budget_s
        self.sizes = sizes_for(cuda, info.get("gpus", []), args.batches)
        self.steps: list[dict[str, Any]] = []
        self.current: subprocess.Popen | None = None
        self.under_way: dict[str, Any] | None = None  # the step running now
        self.env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        self.env["PYTHONUNBUFFERED"] = "1"

    # -- running commands -------------------------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.time()

    def execute(self, step: dict[str, Any], name: str, command: list[str], timeout: float) -> Path:
        """Run ``command`` from the project root into logs/NAME.log, within ``timeout`` and the budget."""
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        step["commands"].append(shlex.join(command))
        if self.left() < 5:
            raise StepFailed(f"{name}: the time budget ran out before it started", timed_out=True)
        limit = min(timeout, self.left())
        with open(log, "w") as output:
            # its own session, so a timeout stops every process it started (local ranks, pytest's runs)
            self.current = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
            pid = self.current.pid
            try:
                code = self.current.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                self.stop_current()
                why = "the time budget ran out" if limit < timeout else f"it ran past its {timeout:.0f} s"
                raise StepFailed(f"{name}: stopped after {limit:.0f} s: {why}", log, timed_out=True) from None
            self.current = None  # (an interrupt leaves it set, for main to stop)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # what it left behind would hold the GPU in the next step
        if code != 0:
            raise StepFailed(f"{name}: exit status {code}", log)
        return log

    def stop_current(self) -> None:
        process = self.current
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # what outlived its leader (a rank that ignored SIGTERM)
        self.current = None

    def train(
        self,
        step: dict[str, Any],
        name: str,
        overrides: list[str],
        timeout: float | None = None,
        module: str = "src.train",
        log: str | None = None,
    ) -> Path:
        """``python -m src.train`` (or src.eval) with ``overrides`` in runs/NAME, its output in logs/LOG (NAME);
        returns the run dir."""
        run_dir = self.out / "runs" / name
        self.execute(
            step,
            log or name,
            [sys.executable, "-m", module, *overrides, f"hydra.run.dir={run_dir}"],
            timeout or self.sizes.command_timeout_s,
        )
        return run_dir

    def base(
        self, batch: int, steps: int, warmup: int | None = None, processes: int = 1, compile: str = "false"
    ) -> list[str]:
        """One epoch of ``steps`` steps of ``batch`` synthetic images per process, no test, one validation batch;
        eager unless ``compile`` names a torch.compile mode (model.compile=auto would stay eager this short anyway)."""
        s = self.sizes
        images = (steps + 1) * batch * processes + batch
        overrides = [
            "data=synthetic",
            f"data.num_train={images}",
            f"data.val_size={batch}",
            f"data.num_test={batch}",
            f"data.batch_size={batch}",
            f"model.arch={s.arch}",
            f"model.width={s.width}",
            f"trainer.accelerator={s.accelerator}",
            "trainer.devices=1",
            f"backend={s.backend}",
            f"trainer.precision={s.precision}",
            "model.channels_last=true",
            "trainer.max_epochs=1",
            f"trainer.limit_train_batches={steps}",
            "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=0",
            "test=false",
            "trainer.enable_model_summary=false",
            f"model.compile={compile}",
        ]
        if warmup is not None:
            overrides.append(f"callbacks.throughput_record.warmup_steps={warmup}")
        return overrides

    @staticmethod
    def record(run_dir: Path) -> dict[str, Any]:
        path = run_dir / "throughput.json"
        if not path.is_file():
            raise StepFailed(f"{path} was not written")
        return json.loads(path.read_text())

    # -- the steps -------------------------------------------------------------------------------------------

    def step_env(self, step: dict[str, Any]) -> None:
        i = self.info
        step["commands"].append(f"{shlex.quote(sys.executable)} -c <the version and GPU probe of gpu_check.py>")
        step["figures"] = dict(i)
        if self.cuda:
            gpus = ", ".join(
                f"{g['index']}: {g['name']} (capability {g['capability']}, {g['memory_gib']} GiB)" for g in i["gpus"]
            )
            step["summary"] = (
                f"torch {i['torch']} (CUDA {i['cuda_build']}, cuDNN {i.get('cudnn')}, NCCL "
                f"{i.get('nccl')}), driver {i.get('driver')}, Lightning {i['lightning']}, torchmetrics "
                f"{i['torchmetrics']}, hydra {i.get('hydra')}, Python {i['python']}; GPUs: {gpus}"
            )
        else:
            step["summary"] = (
                f"CPU mode: {i.get('cpu')}, torch {i['torch']}, Lightning {i['lightning']}, "
                f"torchmetrics {i['torchmetrics']}, hydra {i.get('hydra')}, Python {i['python']}"
            )

    def step_nccl(self, step: dict[str, Any]) -> None:
        s = self.sizes
        run_dir = self.train(
            step, "nccl", [*self.base(s.check_batch, s.check_steps), "strategy=ddp", f"backend={s.backend}"]
        )
        r = self.record(run_dir)
        step["figures"] = {k: r.get(k) for k in ("strategy", "backend", "world_size", "samples_per_second")}
        if (r.get("backend"), r.get("world_size")) != (s.backend, 1):
            raise StepFailed(
                f"throughput.json says backend {r.get('backend')}, world size {r.get('world_size')}: "
                f"expected {s.backend} at world size 1"
            )
        step["summary"] = f"strategy=ddp, backend {r['backend']}, world size 1: trained {s.check_steps} steps"
        if self.cuda:  # NCCL's flight recorder: no such thing on gloo, so the CPU mode leaves it out
            step["summary"] += "; " + self.check_nccl_trace(step, run_dir)

    def check_nccl_trace(self, step: dict[str, Any], run_dir: Path) -> str:
        """The training run switched the flight recorder on (its run dir holds nccl_trace/), and a rank's dump of it
        is written there and read back with the collectives it recorded."""
        if not (run_dir / "nccl_trace").is_dir():
            raise StepFailed(f"{run_dir}/nccl_trace was not made: the flight recorder was not switched on")
        folder = self.out / "runs" / "nccl-trace"
        log = self.execute(step, "nccl-trace", [sys.executable, "-c", NCCL_TRACE_PROBE, str(folder)], 120)
        entries = [line for line in log.read_text().splitlines() if line.startswith("entries ")]
        if not entries or int(entries[-1].split()[1]) < 1:
            raise StepFailed(f"{folder}/nccl_trace/rank_0 holds no collective", log)
        step["figures"]["nccl_trace_entries"] = int(entries[-1].split()[1])
        return f"flight recorder dump {folder}/nccl_trace/rank_0: {entries[-1].split()[1]} collectives"

    def step_deterministic(self, step: dict[str, Any]) -> None:
        import torch

        s = self.sizes
        weights = []
        for name in ("deterministic-a", "deterministic-b"):
            run_dir = self.train(step, name, [*self.base(s.check_batch, s.check_steps), "trainer.deterministic=true"])
            weights.append(
                torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
            )
        differing = [k for k in weights[0] if not torch.equal(weights[0][k], weights[1].get(k, torch.empty(0)))]
        step["figures"] = {"tensors": len(weights[0]), "differing": len(differing), "identical": not differing}
        if differing or weights[0].keys() != weights[1].keys():
            raise StepFailed(
                f"two runs with trainer.deterministic=true and the same seed ended with different weights "
                f"({len(differing)} of {len(weights[0])} tensors differ, e.g. {differing[:3]})"
            )
        step["summary"] = (
            f"trainer.deterministic=true, {s.check_steps} steps, twice: identical weights ({len(weights[0])} tensors)"
        )

    def step_resume(self, step: dict[str, Any]) -> None:
        import torch

        s = self.sizes
        overrides = self.base(s.check_batch, s.check_steps)
        run_dir = self.train(step, "resume", overrides, log="resume-first")
        self.train(step, "resume", [*overrides, "ckpt_path=last", "trainer.max_epochs=2"], log="resume-second")
        last = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        step["figures"] = {
            "first_run_steps": s.check_steps,
            "global_step_after_resume": last.get("global_step"),
            "epoch": last.get("epoch"),
        }
        if last.get("global_step") != 2 * s.check_steps:
            raise StepFailed(
                f"after ckpt_path=last and a second epoch last.ckpt is at step {last.get('global_step')}, "
                f"expected {2 * s.check_steps}"
            )
        step["summary"] = (
            f"ckpt_path=last in the same run dir: resumed at step {s.check_steps}, "
            f"last.ckpt at step {2 * s.check_steps} after the second epoch"
        )

    def step_eval(self, step: dict[str, Any]) -> None:
        s = self.sizes
        ckpt = self.out / "runs" / "resume" / "checkpoints" / "last.ckpt"
        if not ckpt.is_file():
            raise StepSkipped("no checkpoint to evaluate: the resume step wrote none")
        run_dir = self.train(
            step,
            "eval",
            [
                f"ckpt_path={ckpt}",
                "data=synthetic",
                f"data.num_test={s.check_batch * 2}",
                f"data.batch_size={s.check_batch}",
                f"trainer.accelerator={s.accelerator}",
            ],
            module="src.eval",
        )
        metrics = json.loads((run_dir / "test_metrics.json").read_text())
        step["figures"] = metrics
        step["summary"] = (
            f"src.eval on {'CUDA' if self.cuda else 'the CPU'} of the resume step's last.ckpt: "
            f"test accuracy {metrics.get('test/acc', float('nan')):.4f}"
        )

    def step_two_rank(self, step: dict[str, Any]) -> None:
        s = self.sizes
        if self.cuda and len(self.info["gpus"]) < 2:
            raise StepSkipped(f"{len(self.info['gpus'])} GPU here: the 2-rank check needs two")
        run_dir = self.train(
            step,
            "two-rank",
            [*self.base(s.check_batch, s.check_steps, processes=2), "strategy=ddp", "trainer.devices=2"],
        )
        r = self.record(run_dir)
        devices = rank_devices(r)
        step["figures"] = {
            "world_size": r.get("world_size"),
            "backend": r.get("backend"),
            "pids": r.get("pids"),
            "rank_devices": devices if devices is not None else "n/a",
        }
        if r.get("world_size") != 2 or len(set(r.get("pids") or [])) != 2:
            raise StepFailed(
                f"throughput.json says world size {r.get('world_size')}, pids {r.get('pids')}: expected 2 processes"
            )
        if not self.cuda:
            step["summary"] = f"2 processes over {s.backend} (pids {r['pids']}); per-rank GPUs: n/a on the CPU"
            return
        if devices is None:
            raise StepFailed("throughput.json holds no per-rank GPU (index and UUID): which GPU each rank used is n/a")
        uuids = [next(v for k, v in d.items() if "uuid" in k.lower()) for d in devices]
        if len(set(uuids)) != 2:
            raise StepFailed(f"the 2 ranks did not each use their own GPU: UUIDs {uuids}")
        step["summary"] = f"2 ranks over nccl, each on its own GPU: {', '.join(map(str, uuids))}"

    def step_tests(self, step: dict[str, Any]) -> None:
        files = [f for f in self.args.tests.split(",") if f]
        present = [f for f in files if (ROOT / f).is_file()]
        missing = [f for f in files if f not in present]
        if missing:
            step["note"] = f"not in this checkout, left out: {', '.join(missing)}"
        if not present:
            raise StepSkipped(f"none of {', '.join(files)} is in this checkout")
        report = self.out / "tests.xml"
        report.unlink(missing_ok=True)
        try:
            # on a GPU its own cases: the CPU ones (test_host_syncs' cpu-*) are the CPU suite's
            select = ["-k", "not cpu"] if self.cuda else []
            self.execute(
                step,
                "tests",
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    *present,
                    *select,
                    *xdist_options(self.cuda),
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={report}",
                ],
                600,
            )
        finally:  # the counts of a failing run too
            step["figures"] = counts = junit_counts(report)
            step["summary"] = ", ".join(f"{n} {k}" for k, n in counts.items()) + f" ({', '.join(present)})"
        if self.cuda and counts.get("skipped"):
            step["note"] = (step.get("note", "") + f" {counts['skipped']} skipped on a GPU: the log says why").strip()

    def throughput_run(
        self, step: dict[str, Any], pipeline: str, batch: int, compiled: str | None = None
    ) -> dict[str, Any]:
        """One row of the table: eager, or ``compiled`` in that torch.compile mode."""
        s = self.sizes
        name = f"throughput-{pipeline}-{batch}{'-compiled' if compiled else ''}"
        row: dict[str, Any] = {"pipeline": pipeline, "batch": batch, "compiled": compiled or False, "status": "passed"}
        overrides = [
            *self.base(batch, s.warmup + s.steps, warmup=s.warmup, compile=compiled or "false"),
            f"data.pipeline={pipeline}",
        ]
        timeout = s.compile_timeout_s if compiled else s.command_timeout_s
        try:
            r = self.record(self.train(step, name, overrides, timeout))
        except StepFailed as err:
            row.update(status="timeout" if err.timed_out else "failed", note=str(err), output_tail=tail(err.log))
            return row
        row.update(
            images_per_second=r.get("samples_per_second"),
            peak_memory_mb=r.get("peak_memory_mb"),
            checkpoint_share=r.get("checkpoint_share"),
            checkpoint_save_s=r.get("checkpoint_save_s"),
            checkpoints_saved=r.get("checkpoints_saved"),
            fit_time_s=r.get("fit_time_s"),
            steps_measured=r.get("steps_measured"),
            precision=r.get("precision"),
            channels_last=r.get("channels_last"),
            device_name=r.get("device_name"),
            command=step["commands"][-1],
        )
        return row

    def step_throughput(self, step: dict[str, Any]) -> None:
        rows = []
        for pipeline in ("device", "dataloader"):
            for batch in self.sizes.batches:
                if self.left() < RUN_ESTIMATE_S[not self.cuda]:
                    rows.append(
                        {
                            "pipeline": pipeline,
                            "batch": batch,
                            "compiled": False,
                            "status": "skipped",
                            "note": "the time budget ran out",
                        }
                    )
                    continue
                rows.append(self.throughput_run(step, pipeline, batch))
                step["figures"] = {"rows": rows}
        step["figures"] = {"rows": rows}
        self.finish_table(step, rows)

    def step_compile(self, step: dict[str, Any]) -> None:
        """The device pipeline's rows again, compiled as model.compile=auto compiles a long fit on a GPU (CUDA
        graphs), each batch against its eager row; a batch the budget has no room for is skipped."""
        eager = {r["batch"]: r for r in self.table_rows() if r["pipeline"] == "device" and r.get("images_per_second")}
        rows = []
        for batch in self.sizes.batches:
            if self.left() < COMPILE_RUN_ESTIMATE_S[not self.cuda]:
                rows.append(
                    {
                        "pipeline": "device",
                        "batch": batch,
                        "compiled": COMPILE_MODE,
                        "status": "skipped",
                        "note": "the time budget ran out",
                    }
                )
                continue
            row = self.throughput_run(step, "device", batch, compiled=COMPILE_MODE)
            if batch in eager and row.get("images_per_second"):
                row["vs_eager"] = row["images_per_second"] / eager[batch]["images_per_second"]
            rows.append(row)
            step["figures"] = {"rows": rows}
        step["figures"] = {"rows": rows}
        self.finish_table(step, rows)

    def finish_table(self, step: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        done = [r for r in rows if r["status"] == "passed"]
        step["summary"] = "; ".join(
            f"{r['pipeline']} {r['batch']}{' compiled' if r['compiled'] else ''}: "
            f"{fmt(r.get('images_per_second'))} img/s" + (f" ({r['vs_eager']:.2f}x eager)" if "vs_eager" in r else "")
            for r in done
        )
        bad = [r for r in rows if r["status"] in ("failed", "timeout")]
        skipped = [r for r in rows if r["status"] == "skipped"]
        if skipped:
            step["note"] = (
                step.get("note", "") + f" {len(skipped)} of {len(rows)} runs skipped: the time budget ran out"
            ).strip()
        if bad:
            step["output_tail"] = bad[0].get("output_tail", "")
            raise StepFailed("; ".join(r["note"] for r in bad), timed_out=all(r["status"] == "timeout" for r in bad))

    def table_rows(self) -> list[dict[str, Any]]:
        return [
            row
            for st in self.steps
            if st["name"] in ("throughput", "compile")
            for row in st.get("figures", {}).get("rows", [])
        ]

    def step_bench(self, step: dict[str, Any]) -> None:
        s = self.sizes
        out = self.out / "bench"
        batch = 256 if self.cuda else s.check_batch
        self.execute(
            step,
            "bench",
            [
                sys.executable,
                str(ROOT / "benchmarks" / "bench.py"),
                f"--arch={s.arch}",
                f"--batch-size={batch}",
                f"--steps={s.steps}",
                f"--warmup={s.warmup}",
                "--repeats=1",
                "--processes=1",
                "--pipelines=device",
                "--equal-only",
                f"--out={out}",
                f"--timeout={s.command_timeout_s}",
            ],
            2 * s.command_timeout_s + 60,
        )
        result = json.loads((out / "bench.json").read_text())
        step["figures"] = result
        step["summary"] = (
            f"project/bare throughput ratio at equal settings: {result['ratio']:.3f} "
            f"({result['ratio_settings']}, batch {batch}, 1 run of {s.steps} steps each)"
        )

    # -- the report ------------------------------------------------------------------------------------------

    def run(self, chosen: list[str]) -> int:
        for name in STEPS:
            step = {
                "name": name,
                "status": "passed",
                "seconds": 0.0,
                "commands": [],
                "figures": {},
                "summary": "",
                "note": "",
                "output_tail": "",
            }
            self.steps.append(step)
            self.under_way, began = step, time.time()
            estimate = estimate_s(name, self.cuda)
            try:
                if name != "env" and name not in chosen:
                    raise StepSkipped("left out (--only, --skip)")
                if self.left() < estimate:
                    raise StepSkipped(
                        f"would overrun the time budget: {max(0, self.left()):.0f} s left, about "
                        f"{estimate} s needed (--budget-s, or --only {name})"
                    )
                getattr(self, "step_" + name.replace("-", "_"))(step)
            except StepSkipped as why:
                step.update(status="skipped", note=str(why))
            except StepFailed as err:
                step.update(
                    status="timeout" if err.timed_out else "failed", note=(step["note"] + " " + str(err)).strip()
                )
                step["output_tail"] = tail(err.log) or step["output_tail"]
            except Exception as err:  # noqa: BLE001 - a check's own bug, or a file a run did not write: that step fails, not all
                step.update(
                    status="failed", note=f"{type(err).__name__}: {err}", output_tail=traceback.format_exc()[-3000:]
                )
            step["seconds"] = self.info.get("probe_s", 0.0) if name == "env" else round(time.time() - began, 1)
            self.under_way = None
            print(
                f"[{time.time() - self.started:5.0f} s] {name:<13} {step['status']:<8} {step['seconds']:6.1f} s  "
                f"{step['summary'] or step['note']}",
                flush=True,
            )
            self.write_report()
        self.write_report()
        bad = [st["name"] for st in self.steps if st["status"] in ("failed", "timeout")]
        print(
            f"\n{self.headline()}\nreport: {self.out / 'report.md'} and report.json"
            + (f"\nfailed: {', '.join(bad)}" if bad else "")
        )
        return 1 if bad else 0

    def device_label(self) -> str:
        i = self.info
        if not self.cuda:
            return f"{i.get('cpu')} (CPU mode)"
        names = [g["name"] for g in i["gpus"]]
        gpus = f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
        # the host too: the rows a step's host work bounds (eager at small batches) differ between nodes by its CPU
        return f"{gpus} (host: {i.get('cpu')}, {len(os.sched_getaffinity(0))} cores)"

    def versions(self) -> str:
        i = self.info
        cuda = f" (CUDA {i['cuda_build']}), driver {i.get('driver')}" if self.cuda else ""
        return f"torch {i['torch']}{cuda}, Lightning {i['lightning']}, Python {i['python']}"

    def headline(self) -> str:
        counts = {
            status: sum(st["status"] == status for st in self.steps)
            for status in ("passed", "failed", "timeout", "skipped")
        }
        return (
            f"gpu-check on {self.device_label()}: "
            + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            + f" in {time.time() - self.started:.0f} s (budget {self.args.budget_s:.0f} s)"
        )

    def write_report(self) -> None:
        date = time.strftime("%Y-%m-%d", time.localtime(self.started))
        command = shlex.join([Path(sys.executable).name, "benchmarks/gpu_check.py", *sys.argv[1:]])
        mode = "cuda" if self.cuda else "cpu"
        failed = any(st["status"] in ("failed", "timeout") for st in self.steps)
        report = {
            "command": command,
            "mode": mode,
            "date": date,
            "device": self.device_label(),
            **self.info,
            "budget_s": self.args.budget_s,
            "elapsed_s": round(time.time() - self.started, 1),
            "status": "failed" if failed else "passed",
            "steps": self.steps,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        s = self.sizes
        lines = [
            f"# gpu-check: {self.device_label()}, {self.versions()}, {date}",
            "",
            f"`{'GPU_CHECK_DEVICE=cpu ' if not self.cuda else ''}{command}` — {self.headline()}",
            "",
            "| step | status | seconds | result | note |",
            "|---|---|---:|---|---|",
        ]
        for st in self.steps:
            lines.append(
                f"| {st['name']} | {st['status']} | {st['seconds']:.1f} | {st['summary'] or '—'} "
                f"| {st['note'] or '—'} |".replace("\n", " ")
            )
        rows = self.table_rows()
        if rows:
            memory = "peak GPU memory, MiB (allocated)" if self.cuda else "peak memory, MiB (RSS)"
            lines += [
                "",
                f"## Throughput: {s.arch} (CIFAR stem), {s.precision}, channels-last, one "
                f"{'GPU' if self.cuda else 'process'}, {s.steps} steps timed after {s.warmup}; "
                f"{self.device_label()}, {self.versions()}, {date}",
                "",
                f"| data.pipeline | batch per {'GPU' if self.cuda else 'process'} | compiled | img/s | {memory} "
                "| checkpoint share | status |",
                "|---|---:|---|---:|---:|---:|---|",
            ]
            for r in rows:
                lines.append(
                    f"| {r['pipeline']} | {r['batch']} | {r['compiled'] or 'no'} "
                    f"| {fmt(r.get('images_per_second'))} | {fmt(r.get('peak_memory_mb'), 0)} "
                    f"| {fmt(r.get('checkpoint_share'), 3)} | {r['status']} |"
                )
        for st in self.steps:
            if st["status"] in ("failed", "timeout") and st["output_tail"]:
                lines += ["", f"## {st['name']}: {st['status']}", "", st["note"], "", "```", st["output_tail"], "```"]
        (self.out / "report.md").write_text("\n".join(lines) + "\n")


def junit_counts(path: Path) -> dict[str, int]:
    """passed / failed / errors / skipped of a pytest --junitxml report; empty if there is none."""
    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {
        "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }


def missing_packages() -> list[str]:
    """What to install for the modules the runs need and this Python cannot import."""
    missing = []
    for module, package in NEEDED.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(package)
    return missing


def probe(timeout: float = 180) -> dict[str, Any]:
    """Versions and GPUs, asked of torch in a process of its own: this one never holds a CUDA context."""
    began = time.time()
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            return {**json.loads(line[len("PROBE ") :]), "probe_s": round(time.time() - began, 1)}
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"asking torch for its versions and GPUs failed (exit {done.returncode}): {last}")


def xdist_options(cuda: bool) -> list[str]:
    """pytest-xdist's options for the tests step: on a GPU node, a worker per two cores, at most 8. Each GPU test
    starts training processes that mostly wait for the GPU, so they share it well: one after another they took 246 s
    on one H200 (13 tests, 2026-11-27), 8 at a time 96 s. In the CPU mode, or without pytest-xdist, one process."""
    workers = min(8, len(os.sched_getaffinity(0)) // 2)
    if not cuda or workers < 2 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(workers)]


def estimate_s(step: str, cuda: bool) -> int:
    """The seconds a step usually takes here: what the budget must have left for it to start."""
    if step == "tests" and cuda and not xdist_options(cuda):
        return SERIAL_GPU_TESTS_S
    return ESTIMATE_S[step][not cuda]


def step_list(text: str | None, option: str) -> list[str]:
    names = [n for n in (text or "").split(",") if n]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        raise SetupError(f"{option} names unknown steps ({', '.join(unknown)}): the steps are {', '.join(STEPS)}")
    return names


def main() -> int:
    try:
        args, chosen, cuda, info = setup()
    except SetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for stale in ("runs", "logs", "bench"):  # this check's own outputs of an earlier run
        shutil.rmtree(args.out / stale, ignore_errors=True)
    check = GpuCheck(args, cuda, info)
    signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C: the step's processes, in a session of their own, go too
    try:
        return check.run(chosen)
    except KeyboardInterrupt:
        check.stop_current()
        if check.under_way is not None:
            check.under_way.update(status="failed", note="interrupted")
        check.write_report()
        print(f"\ninterrupted: the report so far is in {args.out / 'report.md'}", file=sys.stderr)
        return 130


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def setup() -> tuple[argparse.Namespace, list[str], bool, dict[str, Any]]:
    """The options, the steps chosen, whether the check is on CUDA, and the versions and GPUs found."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help=f"comma-separated steps to run (env always runs): {', '.join(STEPS)}")
    parser.add_argument("--skip", help="comma-separated steps to leave out")
    parser.add_argument(
        "--budget-s",
        type=number(1, float),
        default=None,
        help="seconds for the whole check (default 600 on a GPU, 900 in CPU mode)",
    )
    parser.add_argument(
        "--batches",
        type=lambda t: tuple(int(b) for b in numbers(1)(t).split(",")),
        default=None,
        help="per-GPU batches of the throughput table (default 128,256,512; CPU mode 4,8)",
    )
    parser.add_argument(
        "--tests",
        default="tests/test_gpu.py,tests/test_host_syncs.py",
        help="the test files the tests step runs (those missing are left out)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu-check")
    args = parser.parse_args()
    chosen = step_list(args.only, "--only") or list(STEPS)
    chosen = [n for n in chosen if n not in step_list(args.skip, "--skip")]
    device = os.environ.get("GPU_CHECK_DEVICE", "cuda")
    if device not in ("cuda", "cpu"):
        raise SetupError(f"GPU_CHECK_DEVICE={device} is not known: leave it unset for the GPU, or cpu for the CPU mode")
    missing = missing_packages()
    if missing:
        raise SetupError(
            f"make gpu-check needs {', '.join(missing)}, which {sys.executable} cannot import: "
            f"pip install {' '.join(missing)} (or put them on PYTHONPATH); it installs nothing itself"
        )
    try:
        info = probe()
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        raise SetupError(str(err)) from None
    cuda = device == "cuda"
    if cuda and not info["cuda"]:
        build = f"a CUDA {info['cuda_build']} build" if info["cuda_build"] else "a CPU-only build"
        raise SetupError(
            f"no CUDA GPU is visible here (torch {info['torch']}, {build}): run make gpu-check on "
            "a GPU node, or GPU_CHECK_DEVICE=cpu make gpu-check for its CPU mode"
        )
    if args.budget_s is None:
        args.budget_s = 600.0 if cuda else 900.0
    return args, chosen, cuda, info


if __name__ == "__main__":
    sys.exit(main())
