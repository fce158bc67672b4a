"""trainer.precision=auto and model.channels_last=auto follow the hardware found (src/models/fast_path.py); spawned
ranks keep the parent's TF32 settings."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from tempfile import gettempdir

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from omegaconf import OmegaConf

from src.distributed.strategy import HydraDDPStrategy, backend_flags, set_backend_flags
from src.models import fast_path as fp
from src.models import resnet
from src.models.fast_path import BF16_MIN_SPEEDUP, cpu_bf16_isa, fast_path
from src.training.trainer import hardware_defaults
from tests.conftest import ROOT, free_port
from tests.test_devices import gpus  # noqa: F401 - the fixture: GPUs stood in for, their context makers raising


def cpu_trainer(**overrides):
    return OmegaConf.create(
        {"accelerator": "cpu", "precision": "auto", "benchmark": "auto", "deterministic": False, **overrides}
    )


@pytest.fixture(autouse=True)
def fresh_answers(monkeypatch, tmp_path):
    """Each test decides anew, with a cache of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fast_path.cache_clear()
    yield
    fast_path.cache_clear()


def pretend_cpu(
    monkeypatch, avx512_bf16: bool, amx: bool, speedup: float | None = None, busy: bool = False
) -> list[str]:
    """The stand-ins here: the CPU's instruction set, and what timing its bf16 steps would show (and whether the CPU
    was busy then), neither of which a test can change for real. Returns the networks that were timed."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # the pretended CPU's oneDNN is not capped
        monkeypatch.delenv(name, raising=False)
    timed: list[str] = []

    def measured(arch: str) -> dict:
        timed.append(arch)
        return {
            "speedup": speedup,
            "fp32_img_s": 10.0,
            "bf16_img_s": 10.0 * speedup,
            "threads": 2,
            "busy": busy,
            "cpu_share": 0.4 if busy else 1.0,
        }

    monkeypatch.setattr(fp, "measure_bf16_speedup", measured)
    return timed


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "isa"), [(True, False, "AVX512_BF16"), (True, True, "AMX"), (False, True, "AMX")]
)
def test_a_cpu_whose_native_bf16_measures_faster_trains_in_bf16_and_channels_last(monkeypatch, avx512_bf16, amx, isa):
    pretend_cpu(monkeypatch, avx512_bf16, amx, speedup=2.37)
    chosen = fast_path("cpu", "resnet50")
    assert (chosen.precision, chosen.channels_last) == ("bf16-mixed", True)
    assert chosen.why == (
        f"the CPU has native bf16 ({isa}) and a resnet50 train step measured 2.37x the fp32 rate in bf16 on this CPU"
    )
    assert hardware_defaults(cpu_trainer(), "resnet50") == {"precision": "bf16-mixed", "benchmark": False}


@pytest.mark.parametrize("speedup", [0.79, 1.05])
def test_a_cpu_whose_native_bf16_is_not_faster_stays_32_bit_and_says_what_it_measured(monkeypatch, speedup):
    pretend_cpu(monkeypatch, True, False, speedup=speedup)
    assert speedup < BF16_MIN_SPEEDUP
    chosen = fast_path("cpu", "resnet18")
    assert (chosen.precision, chosen.channels_last) == ("32-true", True)
    assert chosen.why == (
        f"the CPU has native bf16 (AVX512_BF16) but a resnet18 train step measured {speedup:.2f}x "
        "the fp32 rate in bf16 on this CPU"
    )


def test_a_cpu_without_native_bf16_stays_32_bit_without_timing_anything(monkeypatch):
    timed = pretend_cpu(monkeypatch, False, False, speedup=3.0)
    chosen = fast_path("cpu", "resnet50")
    assert chosen.precision == "32-true" and chosen.channels_last and "no native bf16" in chosen.why
    assert hardware_defaults(cpu_trainer(), "resnet50") == {"precision": "32-true", "benchmark": False}
    assert timed == []


@pytest.mark.parametrize("cap", [("ONEDNN_MAX_CPU_ISA", "AVX2"), ("DNNL_MAX_CPU_ISA", "avx512_core_vnni")])
def test_onednn_capped_below_the_cpus_native_bf16_stays_32_bit_without_timing_and_says_why(monkeypatch, cap):
    timed = pretend_cpu(monkeypatch, True, True, speedup=3.0)
    monkeypatch.setenv(*cap)
    chosen = fast_path("cpu", "resnet50")
    assert (chosen.precision, chosen.channels_last) == ("32-true", True)
    assert chosen.why == (
        f"{cap[0]}={cap[1].upper()} keeps oneDNN from the CPU's native bf16 (AMX): bf16 would be emulated"
    )
    assert timed == []  # an answer kept from before the cap (bf16, 3.0x) is not read either


@pytest.mark.parametrize(
    ("cap", "isa"),
    [
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "AVX512_BF16"),  # AMX's tiles off, its AVX512_BF16 kept
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"}, "AMX"),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, "AMX"),  # oneDNN's own word for no cap
        ({"ONEDNN_MAX_CPU_ISA": "AVX10_1_512_AMX_FP16", "DNNL_MAX_CPU_ISA": "AVX2"}, "AMX"),  # ONEDNN_ first
    ],
)
def test_a_cap_that_leaves_native_bf16_to_onednn_times_it_under_its_own_name(monkeypatch, cap, isa):
    timed = pretend_cpu(monkeypatch, True, True, speedup=2.0)
    for name, value in cap.items():
        monkeypatch.setenv(name, value)
    chosen = fast_path("cpu", "resnet18")
    assert chosen.precision == "bf16-mixed" and chosen.why.startswith(f"the CPU has native bf16 ({isa}) and")
    assert timed == ["resnet18"]
    assert [key.split(" | ")[1] for key in json.loads(fp.cache_file().read_text())] == [isa]


def test_onednn_itself_sees_no_bf16_under_the_cap_this_project_reads():
    """A real process: torch's own check of oneDNN's bf16 (its effective ISA) agrees with our reading of the cap."""
    code = (
        "import torch; from src.models.fast_path import cpu_bf16_isa;"
        "print(cpu_bf16_isa(), torch.ops.mkldnn._is_mkldnn_bf16_supported())"
    )
    env = {"PATH": "/usr/bin:/bin", "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1", "TMPDIR": gettempdir()}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["None", "False"]


def test_trainer_devices_minus_one_on_a_cpu_is_the_one_process_auto_runs():
    """trainer.devices=-1, all devices: the project counted one process on a CPU, and Lightning's CPU accelerator
    refused -1 (a TypeError, exit 1, a traceback in the log)."""
    for devices in (-1, "-1"):
        chosen = hardware_defaults(cpu_trainer(precision="32-true", devices=devices), "resnet50")
        assert chosen == {"devices": "auto", "benchmark": False}
    assert "devices" not in hardware_defaults(cpu_trainer(precision="32-true", devices=2), "resnet50")


def test_sync_batchnorm_on_a_cpu_is_refused_in_one_line():
    """torch's SyncBatchNorm runs on CUDA only: DDP refused it on CPUs (a ValueError, exit 1, a traceback)."""
    from src.core.errors import UserError

    with pytest.raises(UserError, match=r"^trainer\.sync_batchnorm=true needs CUDA GPUs"):
        hardware_defaults(cpu_trainer(precision="32-true", sync_batchnorm=True), "resnet50")
    assert hardware_defaults(cpu_trainer(precision="32-true", sync_batchnorm=False), "resnet50") == {"benchmark": False}
    # on GPUs Lightning converts the network's BatchNorm layers, and the run line says so
    import torch

    from src.callbacks.run_summary import _synced_batchnorm
    from src.models.classifier import ImageClassifier

    model = ImageClassifier(arch="resnet18", stem="imagenet", width=16)
    assert not _synced_batchnorm(model)
    assert _synced_batchnorm(torch.nn.SyncBatchNorm.convert_sync_batchnorm(model))


def test_a_precision_the_user_set_is_kept_and_channels_last_auto_times_nothing_and_says_its_own_reason(monkeypatch):
    """Before, channels_last=auto asked the whole fast path: beside a precision the user set, it timed bf16 steps
    that nothing used, and the run line gave that measurement as the layout's reason."""
    from types import SimpleNamespace

    from lightning.pytorch.utilities.parsing import AttributeDict

    from src.callbacks.run_summary import number_format

    timed = pretend_cpu(monkeypatch, True, False, speedup=3.0)
    assert hardware_defaults(cpu_trainer(precision="32-true"), "resnet50") == {"benchmark": False}
    assert fp.channels_last_choice("cpu")[0] is True
    trainer = SimpleNamespace(precision="32-true", strategy=SimpleNamespace(root_device=torch.device("cpu")))
    module = SimpleNamespace(
        memory_format=torch.channels_last, hparams=AttributeDict(arch="resnet50", channels_last="auto")
    )
    assert number_format(trainer, module, "32-true") == (
        "precision 32-true, channels-last (channels_last auto: oneDNN's convolutions run channels-last faster on "
        "CPUs, in fp32 and bf16 alike)"
    )
    assert timed == []
    assert fast_path("cpu", "resnet50").channels_last  # the same layout where auto's precision is timed
    assert timed == ["resnet50"]


def test_the_measurement_is_kept_per_network_and_read_back_by_later_processes(monkeypatch):
    timed = pretend_cpu(monkeypatch, True, False, speedup=1.5)
    assert fast_path("cpu", "resnet18").precision == "bf16-mixed"
    fast_path.cache_clear()  # a later process: this one's memory gone, the file kept
    assert fast_path("cpu", "resnet18").precision == "bf16-mixed"
    fast_path("cpu", "resnet50")
    assert timed == ["resnet18", "resnet50"]
    kept = json.loads(fp.cache_file().read_text())
    assert sorted(key.rsplit(" | ", 1)[1] for key in kept) == ["resnet18", "resnet50"]
    assert all(f"torch {torch.__version__}" in key and fp.cpu_model() in key for key in kept)


def test_processes_starting_together_measure_once_and_agree_in_a_home_that_cannot_be_written(tmp_path):
    """Two real processes, no cache yet: the file lock makes one time the steps while the other waits for its answer.
    Their home cannot be written (a container run as a user without one): the answer is kept in the user's node folder
    (src/core/user_folders.py); before, each process timed its own steps, both at once, and could choose otherwise.
    The probe times the FAST runs' narrow network: its real steps, at a fraction of ResNet-18's (and bf16, which the
    CPU is said to have, may be emulated)."""
    code = (
        "import sys; from src.models import fast_path as fp, resnet; fp.cpu_bf16_isa = lambda: 'AVX512_BF16';"
        "build = resnet.build_resnet; resnet.build_resnet = lambda arch, n, stem: build(arch, n, 'imagenet', 16);"
        "timed = []; real = fp.measure_bf16_speedup\n"
        "def measure(arch):\n    timed.append(arch); return real(arch)\n"
        "fp.measure_bf16_speedup = measure; chosen = fp.fast_path('cpu', 'resnet18');"
        "print(chosen.precision, len(timed), fp.bf16_speedup('resnet18'))"
    )
    (tmp_path / "file").write_text("")  # a cache folder under a file: nothing can be made there
    env = {"XDG_CACHE_HOME": str(tmp_path / "file" / "cache"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    env["TMPDIR"] = str(tmp_path / "node")
    (tmp_path / "node").mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    answers = [p.communicate(timeout=600)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(a[1] for a in answers) == ["0", "1"]  # one measured, the other read its answer
    assert answers[0][0] == answers[1][0] and answers[0][2] == answers[1][2]
    kept = json.loads((tmp_path / "node" / f"cifar10-ddp-{os.getuid()}" / "cifar10-ddp" / "cpu-bf16.json").read_text())
    (record,) = kept.values()
    assert record["fp32_img_s"] > 0 and record["bf16_img_s"] > 0 and len(record["pairs"]) == fp.PROBE_PAIRS
    assert record["speedup"] == statistics.median(record["pairs"])
    # one thread each (the suite's): timed by the thread's own CPU time, which no other process adds to
    assert (record["threads"], record["clock"], record["busy"]) == (1, "thread CPU time", False)


def test_the_pairs_median_holds_through_busy_moments():
    """Steps of 1.5 s in fp32 and 1 s in bf16; the machine busy for a whole pair once, and for one step of two
    others: the median of the pairs' ratios is still 1.5, where the best of each format's times would be too."""
    slow = {2: 3.0, 3: 3.0, 5: 4.0, 8: 0.5}  # the n-th step's factor: both of pair 1, pair 2's second, ...
    order = []

    def step(bf16: bool) -> float:
        order.append(bf16)
        return (1.0 if bf16 else 1.5) * slow.get(len(order) - 1, 1.0)

    fp32, bf16 = fp.paired(step, 5)
    assert order == [False, True, True, False, False, True, True, False, False, True]  # which goes first, in turn
    assert statistics.median(a / b for a, b in zip(fp32, bf16)) == 1.5


def test_a_many_thread_probe_on_a_busy_cpu_says_so_and_is_timed_again_by_a_later_run(monkeypatch, caplog):
    """A real probe at two threads beside busy loops, enough of them to leave it at most half its threads' time;
    its answer then serves the run that took it and is taken again BUSY_RETRY_S later."""
    cores = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(1, 2 * cores - 2))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        build = resnet.build_resnet  # the FAST runs' narrow network: the share, not the speedup, is under test
        monkeypatch.setattr(fp, "PROBE_PAIRS", 2)
        monkeypatch.setattr(resnet, "build_resnet", lambda arch, classes, stem: build(arch, classes, "imagenet", 16))
        record = fp.measure_bf16_speedup("resnet18")
    finally:
        torch.set_num_threads(threads)
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert (record["threads"], record["clock"], record["busy"]) == (2, "wall time", True)
    assert record["cpu_share"] < fp.BUSY_SHARE

    timed = pretend_cpu(monkeypatch, True, False, speedup=1.3, busy=True)
    with caplog.at_level("WARNING", logger=fp.__name__):
        assert fast_path("cpu", "resnet18").precision == "bf16-mixed"
    assert "auto: the CPU was busy while timing (the probe's 2 threads ran" in caplog.text
    assert "1.30x holds for this run, and a run starting 10 minutes or more from now times it again" in caplog.text
    cache = fp.cache_file()
    for ago, again in ((60, False), (fp.BUSY_RETRY_S + 60, True)):
        kept = json.loads(cache.read_text())
        (record,) = kept.values()
        record["measured"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - ago))
        cache.write_text(json.dumps(kept))
        timed.clear()
        fast_path.cache_clear()  # a later process
        fast_path("cpu", "resnet18")
        assert timed == (["resnet18"] if again else [])
    kept = json.loads(cache.read_text())
    (record,) = kept.values()
    record.update(busy=False, measured="2001-01-01 00:00:00")  # an idle CPU's answer is kept for good
    cache.write_text(json.dumps(kept))
    timed.clear()
    fast_path.cache_clear()
    fast_path("cpu", "resnet18")
    assert timed == []


def test_an_unwritable_cache_still_answers(monkeypatch, tmp_path):
    timed = pretend_cpu(monkeypatch, True, False, speedup=0.8)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where the cache folder would go
    assert fast_path("cpu", "resnet18").precision == "32-true" and timed == ["resnet18"]


def test_this_machine_is_read_from_what_torch_reports():
    flags = set(open("/proc/cpuinfo").read().split())
    isa = cpu_bf16_isa(capped=False)  # what the CPU has, whatever ONEDNN_MAX_CPU_ISA lets oneDNN use
    assert isa is None or {"AVX512_BF16": "avx512_bf16", "AMX": "amx_tile"}[isa] in flags  # never claimed wrongly
    if "avx512_bf16" in flags:
        assert isa is not None


def gpu_trainer_cfg(devices="auto"):
    return OmegaConf.create(
        {"accelerator": "gpu", "devices": devices, "precision": "auto", "benchmark": "auto", "deterministic": False}
    )


@pytest.mark.parametrize(
    ("capability", "precision"),
    [((7, 0), "16-mixed"), ((7, 5), "16-mixed"), ((8, 0), "bf16-mixed"), ((9, 0), "bf16-mixed")],
)
def test_a_gpu_computes_in_bf16_from_compute_capability_8_and_in_fp16_with_a_scaler_below(gpus, capability, precision):
    """V100 (7.0) and T4 (7.5) emulate bf16, and torch.cuda.is_bf16_supported() says yes there: the capability
    decides, read without creating a CUDA context (the stand-ins of anything that would create one raise)."""
    gpus(2, capability)
    assert hardware_defaults(gpu_trainer_cfg(), "resnet50") == {"precision": precision, "benchmark": True}
    why = fast_path("cuda", "resnet50", (0, 1)).why
    assert why.startswith(f"GPU cuda:0 has compute capability {capability[0]}.{capability[1]}")
    assert ("fp16 with a gradient scaler" in why) == (precision == "16-mixed")
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # TF32 for what stays fp32


def test_the_gpus_of_a_node_agree_on_the_lowest_capability_among_them(gpus):
    """Ranks that scaled their losses (fp16) and ranks that did not (bf16) would all-reduce unlike gradients."""
    gpus(4, {0: (9, 0), 1: (9, 0), 2: (7, 0), 3: (9, 0)})
    assert hardware_defaults(gpu_trainer_cfg([0, 1]), "resnet50")["precision"] == "bf16-mixed"
    assert hardware_defaults(gpu_trainer_cfg("0,2"), "resnet50")["precision"] == "16-mixed"
    assert fast_path("cuda", "resnet50", (0, 2)).why.startswith("GPU cuda:2 has compute capability 7.0")


def test_ddp_spawn_ranks_compute_with_the_tf32_settings_the_parent_chose(monkeypatch):
    """A real spawned rank (Lightning's spawn carries cuDNN autotuning and determinism, not these)."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = HydraDDPStrategy(
        start_method="spawn", parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment()
    )
    strategy._configure_launcher()
    chosen = {"float32_matmul_precision": "high", "cudnn_allow_tf32": False, "cudnn_deterministic": True}
    before = backend_flags()
    assert all(before[key] != value for key, value in chosen.items())  # torch's defaults, which a new process has
    set_backend_flags(chosen)
    try:
        seen = strategy.launcher.launch(backend_flags)
    finally:
        set_backend_flags(before)
    assert seen == chosen


def test_model_compile_auto_uses_cuda_graphs_only_for_long_gpu_fits_and_refuses_unknown_modes():
    from src.core.errors import UserError
    from src.models.classifier import ImageClassifier
    from src.models.fast_path import COMPILE_MIN_STEPS, compile_choice

    assert compile_choice("auto", "cuda", 30 * 351) == ("reduce-overhead", "auto: CUDA graphs on a GPU")
    assert compile_choice("auto", "cuda", None)[0] == "reduce-overhead"  # not a fit: no steps to weigh
    assert compile_choice("auto", "cuda", COMPILE_MIN_STEPS - 1) == (
        None,
        f"auto: {COMPILE_MIN_STEPS - 1} steps are too few to pay for compiling, from 2,000",
    )
    assert compile_choice("auto", "cuda", 10**5, deterministic=True)[0] is None
    assert compile_choice("auto", "cpu", 10**5) == (None, "auto: on a CPU")
    assert compile_choice(True, "cpu") == ("default", "model.compile=true")
    assert compile_choice(False, "cuda", 10**5) == (None, "model.compile=false")
    assert compile_choice("max-autotune", "cpu") == ("max-autotune", "model.compile=max-autotune")
    with pytest.raises(
        UserError,
        match=r"model.compile=fast is not known: choose auto, true, false or a "
        r"torch.compile mode \(default, reduce-overhead",
    ):
        ImageClassifier(arch="resnet18", compile="fast")
    with pytest.raises(UserError, match=r"model.optimizer.fused=yes must be true, false or auto"):
        ImageClassifier(arch="resnet18", optimizer={"fused": "yes"})
