"""Every bad input fails fast: exit 2 within 30 s, one ``error:`` line naming what was given and what to do.

Each case is a real ``python -m src.train`` (or ``src.eval``) process. They are started together, a few at a
time, by one module fixture; each test then reads its own process's result and duration.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from src.core.errors import EXIT_FAILED, EXIT_USER_ERROR, USER_FULL_ERROR, report, wants_traceback
from tests.conftest import FAST, FAST_RUN, ROOT, output, run_module, write_cifar_folder

EVAL = ["data=synthetic", "data.num_test=16", "trainer.accelerator=cpu"]
CIFAR_OFFLINE = [*FAST_RUN, "data=cifar10", "data.download=false"]
DDP2 = ["strategy=ddp", "trainer.devices=2"]
SECONDS = 30
PARALLEL = 2  # processes at a time: as many as CI has cores (each case is mostly importing torch)
TARGET = re.compile(r"_target_:\s*(src\.[\w.]+)")  # a class a config builds


@dataclass(frozen=True)
class Case:
    """A command line that must fail; ``{tmp}`` and ``{port}`` are filled in by the fixture."""

    args: list[str]
    words: list[str]  # each one in the error line: what was given, and what to do
    module: str = "src.train"
    env: dict[str, str] = field(default_factory=dict)
    restricted: bool = False  # without root's power over file permissions
    one_core: bool = False  # pinned to one CPU core
    ranks_started: bool = False  # refused once its ranks ran: their logs keep the run dir (else it leaves none)


CASES = {
    # what Hydra rejects before the task runs
    "unknown-group-option": Case(
        [*FAST, "strategy=horovod"], ["strategy=horovod", "config group strategy", "choose one of auto, ddp, ddp_spawn"]
    ),
    "unknown-optional-option": Case(
        [*FAST, "experiment=resnet50"], ["experiment=resnet50", "choose one of cifar10_resnet50, demo"]
    ),
    "misspelled-key": Case(
        [*FAST, "trainer.max_epoch=3"],
        ["trainer.max_epoch is not a key", "did you mean trainer.max_epochs", "+trainer.max_epoch=3"],
    ),
    "unknown-argument": Case([*FAST, "+model.dropout=0.5"], ["model.dropout", "ImageClassifier", "remove it"]),
    "unparsable-override": Case([*FAST, "trainer.devices=[1,"], ["trainer.devices=[1,", "quote"]),
    # an empty value, as KEY=$VAR gives with VAR unset (before: the directory the run started in, or no checkpoint)
    "empty-run-dir": Case([*FAST, "hydra.run.dir="], ["hydra.run.dir is empty", "leave it out for outputs/runs/"]),
    "empty-ckpt-path": Case([*FAST, "ckpt_path="], ["ckpt_path is empty", "a checkpoint, last or auto"]),
    "empty-checkpoints": Case([*FAST, "paths.checkpoints="], ["paths.checkpoints is empty", "s3://BUCKET/PREFIX"]),
    "empty-data-root": Case([*FAST_RUN, "data.root="], ["data.root is empty", "cifar-10-batches-py"]),
    # Hydra's checks of its flags (before: its ValueError, a traceback)
    "config-of-a-sweep": Case(
        ["--cfg", "job", "-m", "trainer.devices=1,2"], ["Only one of --run, --multirun", "drop -m"]
    ),
    "run-and-multirun": Case(["--run", "-m", "trainer.devices=1,2"], ["Only one of --run, --multirun, --cfg"]),
    # a sweep's ranges: before, Hydra's "BasicSweeper does not support sweep type : INTERVAL_SWEEP" traceback, exit 1,
    # and the sweep dir left behind; the search's sweeper alone: "search.storage is not a key of the config"
    "range-in-a-grid-sweep": Case(
        ["-m", *FAST, "model.optimizer.lr=interval(0.01,0.1)", "hydra.sweep.dir={tmp}/runs/range-in-a-grid-sweep"],
        ["model.optimizer.lr=interval(0.01,0.1) is a range", "a grid sweep cannot run", "hparams_search=optuna"],
    ),
    # jobs that share a dir: before, job 1 resumed job 0's finished run (a warning, no training), then a traceback
    "sweep-subdir-shared": Case(
        ["-m", *FAST, "seed=1,2", "hydra.sweep.dir={tmp}/runs/sweep-subdir-shared", "hydra.sweep.subdir=same"],
        ["hydra.sweep.subdir=same puts job 0 in", "leave hydra.sweep.subdir out", "no job of the sweep started"],
    ),
    # a checkpoint missing in the second job: before, job 0 was evaluated, then job 1 failed as it started
    "sweep-checkpoint-missing": Case(
        [
            "-m",
            *EVAL,
            "ckpt_path={tmp}/resnet18.ckpt,{tmp}/missing.ckpt",
            "hydra.sweep.dir={tmp}/runs/sweep-checkpoint-missing",
        ],
        ["job 1 (ckpt_path={tmp}/missing.ckpt)", "does not exist", "no job of the sweep started"],
        module="src.eval",
    ),
    "search-sweeper-alone": Case(
        ["-m", *FAST, "hydra/sweeper=optuna", "hydra.sweep.dir={tmp}/runs/search-sweeper-alone"],
        ["hydra/sweeper=optuna", "pass hparams_search=optuna instead"],
    ),
    "resolve-without-cfg": Case(["--resolve"], ["The --resolve flag can only be used in conjunction with --cfg"]),
    "rerun-of-no-file": Case(["--experimental-rerun", "{tmp}/no.pickle"], ["File {tmp}/no.pickle does not exist"]),
    "broken-interpolation": Case(
        [*FAST, "data.batch_size=${{nope}}"],
        ["data.batch_size: Interpolation key 'nope' not found", "--cfg job --resolve"],
    ),
    "value-the-trainer-rejects": Case(
        [*FAST, "trainer.precision=15"], ["trainer: Precision 15 is invalid", "bf16-mixed", "trainer.* value"]
    ),
    # processes and devices
    "devices-zero": Case([*FAST, "trainer.devices=0"], ["trainer.devices=0", ">= 1"]),
    "devices-negative": Case([*FAST, "trainer.devices=-3"], ["trainer.devices=-3", ">= 1"]),
    "devices-not-a-number": Case([*FAST, "trainer.devices=abc"], ["trainer.devices=abc", "give a count"]),
    "devices-beyond-cpu-cores": Case(
        [*FAST, *DDP2], ["trainer.devices=2", "1 CPU core", "trainer.devices=1 or fewer"], one_core=True
    ),
    "num-nodes-zero": Case([*FAST, "trainer.num_nodes=0"], ["trainer.num_nodes=0", ">= 1"]),
    "unknown-backend": Case([*FAST, "backend=bogus"], ["backend=bogus is not known", "auto, nccl, gloo"]),
    "nccl-on-cpu": Case([*FAST, *DDP2, "backend=nccl"], ["error: backend=nccl needs CUDA", "backend=gloo"]),
    "unknown-accelerator": Case(
        [*FAST, "trainer.accelerator=tpu"], ["trainer.accelerator=tpu", "choose one of auto, cpu, gpu"]
    ),
    "timeout-zero": Case([*FAST, *DDP2, "strategy.timeout_s=0"], ["strategy.timeout_s=0", "> 0"]),
    "master-port-in-use": Case(
        [*FAST, *DDP2],
        ["MASTER_PORT={port}", "Address already in use", "unset MASTER_PORT"],
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"},
    ),
    "master-port-not-a-port": Case(
        [*FAST, *DDP2], ["MASTER_PORT=abc is not a port", "1-65535"], env={"MASTER_PORT": "abc"}
    ),
    "two-nodes-by-hand-without-master": Case(
        [*FAST, "strategy=ddp", "trainer.num_nodes=2"], ["trainer.num_nodes=2", "MASTER_ADDR and MASTER_PORT", "node 0"]
    ),
    "max-epochs-negative": Case([*FAST, "trainer.max_epochs=-1"], ["trainer.max_epochs=-1", ">= 1"]),
    "a-dry-run-of-a-value-lightning-rejects": Case(  # the dry run builds a Trainer as each rank would, to say it too
        [*FAST, "trainer.devices=1", "dry_run=true", "trainer.limit_train_batches=-3"],
        ["invalid value -3 for limit_train_batches"],
    ),
    "precision-whose-package-is-missing": Case(
        [*FAST, "trainer.precision=transformer-engine"],
        ["trainer: Requirement 'transformer_engine", "not met", "install it, or change the trainer.* value"],
    ),
    "unknown-arch": Case([*FAST, "model.arch=resnet7"], ["model.arch=resnet7", "choose one of"]),
    # files: data, checkpoints, the run dir
    "data-root-missing-offline": Case(
        [
            *FAST_RUN,
            "data=cifar10",
            "data.root={tmp}/nowhere",
            "data.download_url=http://127.0.0.1:9/cifar-10-python.tar.gz",
        ],
        ["data.root={tmp}/nowhere", "data=synthetic"],
    ),
    "data-root-unreadable": Case(
        [*CIFAR_OFFLINE, "data.root={tmp}/unreadable"],
        ["data.root={tmp}/unreadable", "cannot be read", "permissions"],
        restricted=True,
    ),
    "truncated-batch-file": Case(
        [*CIFAR_OFFLINE, "data.root={tmp}/truncated"],
        ["{tmp}/truncated/cifar-10-batches-py/data_batch_3 is truncated", "restore the file"],
    ),
    "no-training-step-per-epoch": Case(
        [*FAST, *DDP2, "data.batch_size=64"],
        ["86 training images over 2 processes are 43 per process", "data.batch_size=64", "data.batch_size=43 or less"],
        ranks_started=True,
    ),
    "a-rank-without-a-test-image": Case(
        [*FAST, *DDP2, "data.num_test=1", "test=true"],
        ["1 test images for 2 processes", "every process needs at least one"],
        ranks_started=True,
    ),
    "mpirun-without-mpi4py": Case(
        [*FAST],
        ["mpirun started 4 processes", "No module named 'mpi4py'", "pip install mpi4py", "srun or torchrun"],
        env={"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0", "PYTHONPATH": "{tmp}/no-mpi4py"},
    ),
    "batch-size-zero": Case([*FAST, "data.batch_size=0"], ["data.batch_size=0", ">= 1"]),
    "val-size-not-a-fraction": Case([*FAST, "data.val_size=2.0"], ["data.val_size=2.0", "fraction in (0, 1)"]),
    "ckpt-missing": Case([*FAST, "ckpt_path=/nonexistent.ckpt"], ["ckpt_path=/nonexistent.ckpt does not exist"]),
    "ckpt-random-bytes": Case(
        [*FAST, "ckpt_path={tmp}/random.ckpt"],
        ["ckpt_path={tmp}/random.ckpt is not a checkpoint", "pass an intact .ckpt"],
    ),
    "ckpt-truncated": Case(
        [*FAST, "ckpt_path={tmp}/truncated.ckpt"], ["ckpt_path={tmp}/truncated.ckpt is not a checkpoint", "truncated"]
    ),
    "ckpt-other-arch": Case(
        [*FAST, "ckpt_path={tmp}/resnet18.ckpt", "model.arch=resnet50"],
        ["ckpt_path={tmp}/resnet18.ckpt holds a resnet18", "pass model.arch=resnet18"],
    ),
    "ckpt-other-width": Case(  # FAST's narrow ResNet-18 against torchvision's, of the same stem
        [*FAST, "ckpt_path={tmp}/resnet18.ckpt", "model.stem=cifar"],
        [
            "ckpt_path={tmp}/resnet18.ckpt holds a resnet18 (model.width=64)",
            "builds model.width=16",
            "pass model.width=64",
        ],
    ),
    "ckpt-last-without-one": Case([*FAST, "ckpt_path=last"], ["ckpt_path=last but", "does not exist", "hydra.run.dir"]),
    # a name of over 255 bytes: before, Hydra's warning that the run dir's lock had failed, and the run went on; its
    # parent (the folder every case's run dir is, checked to be gone) made before the failure, then taken back
    "run-dir-name-too-long": Case(
        [*FAST, "hydra.run.dir={tmp}/runs/run-dir-name-too-long/" + "a" * 256 + "/run"],
        ["File name too long", "hydra.run.dir=DIR", "shorten it"],
    ),
    "run-dir-is-a-file": Case(  # before: "... or fix its permissions"
        [*FAST, "hydra.run.dir={tmp}/random.ckpt"], ["{tmp}/random.ckpt: File exists", "move the file in its way"]
    ),
    # before: found at the first save, an epoch in (here: a traceback, NotADirectoryError)
    "checkpoints-under-a-file": Case(
        [*FAST, "paths.checkpoints={tmp}/random.ckpt/checkpoints"],
        ["paths.checkpoints={tmp}/random.ckpt/checkpoints lies under {tmp}/random.ckpt, a file, not a folder"],
    ),
    "run-dir-not-writable": Case(
        [*FAST, "hydra.run.dir={tmp}/readonly/run"],
        ["{tmp}/readonly/run", "Permission denied", "hydra.run.dir=DIR"],
        restricted=True,
    ),
    # optional parts
    "mlflow-server-not-answering": Case(
        [*FAST, *DDP2, "logger=mlflow", "logger.mlflow.tracking_uri=http://127.0.0.1:9"],
        [
            "logger.mlflow.tracking_uri=http://127.0.0.1:9",
            "no MLflow server answers",
            "Connection refused",
            "leave tracking_uri out",
        ],
    ),
    "wandb-online-server-not-answering": Case(
        [*FAST, "logger=wandb"],
        [
            "logger=wandb logs online (an API key is configured)",
            "http://127.0.0.1:9 cannot be reached (Connection refused)",
            "logger.wandb.offline=true",
        ],
        env={"WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_MODE": ""},
    ),
    "eval-without-ckpt": Case([*EVAL], ["ckpt_path=PATH is required"], module="src.eval"),
}
# The same kind of mistakes with HYDRA_FULL_ERROR=1: the user asked for the traceback, one of the task's, one of
# Hydra's.
TRACEBACK_CASES = {
    "task-error": Case([*FAST, "backend=bogus"], ["UserError", "backend=bogus is not known"]),
    "hydra-error": Case([*FAST, "trainer.max_epoch=3"], ["ConfigCompositionException", "trainer.max_epoch"]),
}
# A bug, not a mistake of the user's: its traceback and exit 1, without HYDRA_FULL_ERROR.
BUG_CASES = {
    # Hydra turns an exception of a callback into a warning and goes on: before, this run trained
    "hydra-callback": Case(
        [*FAST, "+hydra.callbacks.fault._target_=tests.hydra_faults.RaiseOnRunStart"],
        ["RuntimeError: a fault of a Hydra callback as the run starts"],
    ),
}


@dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def restricted_prefix() -> list[str] | str:
    """A command prefix under which file permissions hold, or why there is none.

    root reads and writes through any mode bits; without the two DAC capabilities (still uid 0, so the venv
    under /root stays usable) it obeys them like any user.
    """
    if os.geteuid() != 0:
        return []
    caps = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        return "running as root, and setpriv cannot drop CAP_DAC_OVERRIDE here: permissions cannot be tested"
    return prefix


def one_core_prefix() -> list[str] | str:
    if shutil.which("taskset") is None:
        return "taskset is not installed: cannot pin a run to one core"
    return ["taskset", "-c", str(min(os.sched_getaffinity(0)))]


def make_files(tmp: Path) -> None:
    """The bad files the cases point at."""
    from src.models.classifier import ImageClassifier

    (tmp / "random.ckpt").write_bytes(os.urandom(4096))
    model = ImageClassifier(arch="resnet18")
    torch.save(
        {
            "state_dict": model.state_dict(),
            "hyper_parameters": dict(model.hparams),
            "pytorch-lightning_version": "2.6.6",
            "epoch": 0,
            "global_step": 0,
        },
        tmp / "resnet18.ckpt",
    )
    whole = (tmp / "resnet18.ckpt").read_bytes()
    (tmp / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])
    batch = write_cifar_folder(tmp / "truncated") / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:1000])
    write_cifar_folder(tmp / "unreadable").chmod(0o000)
    hide_mpi4py(tmp / "no-mpi4py")
    (tmp / "readonly").mkdir()
    (tmp / "readonly").chmod(0o555)


def hide_mpi4py(folder: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import mpi4py`` fail as where it is not installed."""
    (folder / "mpi4py").mkdir(parents=True)
    (folder / "mpi4py" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mpi4py'\")\n")
    return folder


def launch(case: Case, name: str, tmp: Path, port: int, full_error: str, prefixes: dict) -> Result | str:
    prefix: list[str] = []
    for wanted, kind in ((case.restricted, "restricted"), (case.one_core, "one_core")):
        if wanted:
            if isinstance(prefixes[kind], str):
                return prefixes[kind]  # the reason it cannot run here
            prefix += prefixes[kind]
    args = [a.format(tmp=tmp, port=port) for a in case.args]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={tmp}/runs/{name}")
    env = {"HYDRA_FULL_ERROR": full_error, **{k: v.format(port=port, tmp=tmp) for k, v in case.env.items()}}
    start = time.monotonic()
    try:
        done = run_module(case.module, *args, env=env, timeout=120, prefix=prefix)
    except subprocess.TimeoutExpired as err:
        return Result(None, str(err.stdout or ""), str(err.stderr or ""), time.monotonic() - start)
    return Result(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


@dataclass
class Runs:
    results: dict[str, Result | str]  # by case name: what its process did, or why it could not run here
    tmp: Path
    port: int

    def fill(self, text: str) -> str:
        return text.format(tmp=self.tmp, port=self.port)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    """Every case's process, run PARALLEL at a time while a socket holds the port one of them asks for."""
    assert USER_FULL_ERROR not in os.environ  # set only inside an entry point
    tmp = tmp_path_factory.mktemp("bad-inputs")
    make_files(tmp)
    prefixes = {"restricted": restricted_prefix(), "one_core": one_core_prefix()}
    jobs = [(name, case, "0") for name, case in CASES.items()]
    jobs += [(f"traceback-{name}", case, "1") for name, case in TRACEBACK_CASES.items()]
    jobs += [(f"bug-{name}", case, "0") for name, case in BUG_CASES.items()]
    try:
        with socket.socket() as busy, ThreadPoolExecutor(PARALLEL) as pool:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            futures = {
                name: pool.submit(launch, case, name, tmp, port, full_error, prefixes)
                for name, case, full_error in jobs
            }
            found = {name: future.result() for name, future in futures.items()}
    finally:
        (tmp / "unreadable").chmod(0o755)  # so that pytest can clean up
        (tmp / "readonly").chmod(0o755)
    return Runs(found, tmp, port)


@pytest.mark.parametrize("name", CASES)
def test_a_bad_input_fails_fast_with_one_error_line_naming_it(name, runs):
    result, case = runs.results[name], CASES[name]
    if isinstance(result, str):
        pytest.skip(result)
    text = output(result)
    assert result.returncode == EXIT_USER_ERROR, text[-3000:]
    assert result.seconds < SECONDS, f"took {result.seconds:.1f} s"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text[-3000:]
    for word in case.words:
        assert runs.fill(word) in errors[0], errors[0]
    assert "Traceback" not in text, text[-3000:]
    assert "UserWarning: Callback" not in text, text[-3000:]  # a Hydra callback's error, which Hydra lets go on
    run_dir = runs.tmp / "runs" / name
    left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) if run_dir.exists() else None
    assert (left is not None) == case.ranks_started, f"{run_dir} holds {left}"


@pytest.mark.parametrize("name", TRACEBACK_CASES)
def test_hydra_full_error_keeps_the_traceback(name, runs):
    result = runs.results[f"traceback-{name}"]
    text = output(result)
    assert result.returncode not in (0, None), text[-3000:]
    assert "Traceback (most recent call last)" in text
    for word in TRACEBACK_CASES[name].words:
        assert word in text, text[-3000:]


@pytest.mark.parametrize("name", BUG_CASES)
def test_a_bug_of_a_hydra_callback_ends_the_run_with_its_traceback(name, runs):
    result = runs.results[f"bug-{name}"]
    text = output(result)
    assert result.returncode == EXIT_FAILED, text[-3000:]
    assert "Traceback (most recent call last)" in text
    assert "CallbackError" not in text, text[-3000:]  # the bug's own traceback, not its carrier's
    for word in BUG_CASES[name].words:
        assert word in text, text[-3000:]
    assert not (runs.tmp / "runs" / f"bug-{name}" / "config.yaml").exists()  # the task never ran


def test_every_hydra_callback_of_the_project_ends_the_run_on_an_error():
    """Hydra catches every Exception of a callback's method and goes on with a warning: each method of the callbacks
    conf/hydra/ configures is wrapped (``not_swallowed``) so that its error ends the run, as in the task."""
    import importlib
    import inspect

    from hydra.experimental.callback import Callback

    hooks = [name for name, _ in inspect.getmembers(Callback, inspect.isfunction) if name.startswith("on_")]
    targets = sorted({t for p in (ROOT / "conf" / "hydra").rglob("*.yaml") for t in TARGET.findall(p.read_text())})
    classes = [getattr(importlib.import_module(t.rpartition(".")[0]), t.rpartition(".")[2]) for t in targets]
    classes = [c for c in classes if inspect.isclass(c) and issubclass(c, Callback)]
    assert {c.__name__ for c in classes} >= {"RunDirLock", "EarlierRunCheck", "JobIsolation", "ScalingReport"}
    for cls in classes:
        for name in [name for name in hooks if name in vars(cls)]:
            assert hasattr(vars(cls)[name], "__wrapped__"), f"{cls.__qualname__}.{name} is not not_swallowed"


@pytest.mark.parametrize("seed", ["abc", -1, 2**32, 1.5, True])
def test_a_seed_numpy_would_refuse_is_one_line_naming_it(seed):
    from src.core.errors import UserError
    from src.core.settings import check_seed

    with pytest.raises(UserError, match=rf"^seed={seed} must be a whole number from 0 to 4294967295$"):
        check_seed(seed)
    check_seed(0)
    check_seed(2**32 - 1)
    # before: taken, and the run failed on it once the data split (TypeError, a traceback in the log)
    with pytest.raises(UserError, match=r"^seed=null must be a whole number from 0 to 4294967295, the same for every"):
        check_seed(None)


def test_a_key_given_null_reads_null_in_its_line_not_none():
    """22 lines said KEY=None where the user had written KEY=null (backend, data.augment, model.arch, trainer.devices,
    ...: a fuzz of every key of --cfg job); every UserError now says null. Other words stay as they are."""
    from src.core.errors import UserError

    assert str(UserError("backend=None is not known: choose one of auto, nccl, gloo")) == (
        "backend=null is not known: choose one of auto, nccl, gloo"
    )
    assert str(UserError("data.augment=None must be true or false")) == "data.augment=null must be true or false"
    assert str(UserError("the loader returned None for batch=3")) == "the loader returned None for batch=3"
    assert str(UserError("x=Nonesuch")) == "x=Nonesuch"


@pytest.mark.parametrize("key", ["ckpt_trusted", "test", "dry_run", "model.optimizer.nesterov"])
def test_a_switch_given_a_word_is_one_line_not_true(key):
    """A word is a string to Hydra, and a string is true: ckpt_trusted=no loaded a checkpoint in full (code and all),
    test=off tested, model.optimizer.nesterov=off kept Nesterov on. Every command checks them (src/cli/entry.py)."""
    from omegaconf import OmegaConf

    from src.core.errors import UserError
    from src.core.settings import check_values

    composed = OmegaConf.create({"seed": 42, "ckpt_trusted": False, "test": True, "dry_run": False})
    composed.merge_with({"model": {"optimizer": {"nesterov": True}}})
    check_values(composed)
    for word in ("no", "off", 0, None):
        OmegaConf.update(composed, key, word)
        with pytest.raises(UserError) as refused:
            check_values(composed)
        assert str(refused.value) == f"{key}={'null' if word is None else word} must be true or false"


@pytest.mark.parametrize(
    "key, value, line",
    [
        ("data.seed", None, "data.seed=null must be a whole number from 0 to 4294967295, the same for every process"),
        ("model.label_smoothing", None, "model.label_smoothing=null must be in [0, 1)"),
        ("model.num_classes", None, "model.num_classes=null must be a whole number >= 2 (it follows data.num_classes"),
        ("model.num_classes", 0, "model.num_classes=0 must be a whole number >= 2"),  # a ZeroDivisionError before
    ],
)
def test_a_null_the_data_or_the_network_cannot_take_is_one_line_before_the_run(key, value, line):
    """Each went as far as a TypeError or a ZeroDivisionError (exit 1, a traceback in the log)."""
    from omegaconf import OmegaConf

    from src.core.errors import UserError
    from src.core.settings import check_values
    from src.models.classifier import ImageClassifier

    with pytest.raises(UserError) as refused:
        if key == "data.seed":
            check_values(OmegaConf.create({"seed": 42, "data": {"seed": value}}))
        else:
            ImageClassifier(arch="resnet18", **{key.split(".")[1]: value})
    assert str(refused.value).startswith(line), refused.value


def test_the_users_hydra_full_error_wins_over_the_one_set_for_hydra(monkeypatch):
    """Entry points set HYDRA_FULL_ERROR=1 for Hydra's sake; the user's own value, recorded beside it, decides."""
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setenv(USER_FULL_ERROR, "")
    assert not wants_traceback()  # DDP's local ranks inherit both variables
    monkeypatch.setenv(USER_FULL_ERROR, "1")
    assert wants_traceback()
    monkeypatch.delenv(USER_FULL_ERROR)
    assert wants_traceback()  # no entry point in between: HYDRA_FULL_ERROR as given


def test_the_error_line_and_its_newline_go_in_one_write(monkeypatch):
    """Unbuffered (PYTHONUNBUFFERED, as under Slurm), print() writes a line and its newline apart: a launcher's
    SIGTERM between the two left the line unended, with the launcher's output glued to it."""
    writes: list[str] = []

    class Stderr:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr("sys.stderr", Stderr())
    with pytest.raises(SystemExit) as ended:
        report("data.batch_size=0 must be at least 1:\n  pass a positive count")
    assert ended.value.code == EXIT_USER_ERROR
    assert writes == ["error: data.batch_size=0 must be at least 1: pass a positive count\n"]


# The same messages in-process, for variants that need no process of their own.
@pytest.mark.parametrize(
    "override, words",
    [
        ("data=imagenet", ["data=imagenet is not an option of config group data", "choose one of cifar10, synthetic"]),
        ("modle.arch=resnet34", ["modle.arch is not a key", "did you mean model.arch?", "+modle.arch=resnet34"]),
        ("model.optimizer.lrr=0.2", ["did you mean model.optimizer.lr?"]),
        ("trainer.zzz=1", ["trainer.zzz is not a key", "--cfg job", "+trainer.zzz=1"]),
        ("+trainer.max_epochs=3", ["An item is already at 'trainer.max_epochs'", "trainer.max_epochs=3"]),
    ],
)
def test_hydras_rejections_become_one_line_naming_the_override(override, words, tmp_path):
    from hydra.errors import HydraException

    from src.core.errors import hydra_error_message
    from tests.test_config import make_cfg

    with pytest.raises(HydraException) as caught:
        make_cfg(tmp_path, override)
    message = hydra_error_message(caught.value)
    assert message is not None  # report() prints it as one line
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "key, bad, good",
    [
        *(("max_epochs", v, 1) for v in (-1, 0, -5, "abc", 2.5, True)),
        *(("min_epochs", v, g) for v, g in ((-1, 0), ("abc", None))),
        *(("deterministic", v, g) for v, g in (("maybe", "warn"), (1, True), ("yes", False))),
        *(("accumulate_grad_batches", v, 2) for v in (0, -1, 1.5, True)),
        # max_steps=0 trained nothing and tested the first weights; a negative clip flipped every gradient
        *(("max_steps", v, g) for v, g in ((0, -1), (-2, 5), (2.5, 10))),
        *(("gradient_clip_val", v, g) for v, g in ((-1, 0.5), ("abc", None))),
        # a TypeError deep in the fit (or in the Trainer: benchmark=abc), or taken as every step / every epoch
        *(("log_every_n_steps", v, g) for v, g in (("abc", 10), (-1, None), (0, 1))),
        *(("check_val_every_n_epoch", v, g) for v, g in ((-1, None), (0, 2))),
        *(("num_sanity_val_steps", v, g) for v, g in (("abc", -1), (-2, 0))),
        *(("benchmark", v, g) for v, g in (("abc", "auto"), (-1, True))),
    ],
)
def test_trainer_values_lightning_misreads_or_takes_silently_are_refused_naming_the_key(key, bad, good):
    """What Lightning takes yet misreads (max_epochs=-1: forever), takes without a word (deterministic=maybe: neither
    mode) or fails on only deep inside a fit (accumulate_grad_batches=0: a ZeroDivisionError)."""
    from omegaconf import OmegaConf

    from src.core.errors import UserError
    from src.core.settings import check_trainer_settings

    with pytest.raises(UserError, match=rf"^trainer\.{key}={bad} (must be|is not known)"):
        check_trainer_settings(OmegaConf.create({"accelerator": "cpu", key: bad}))
    check_trainer_settings(OmegaConf.create({"accelerator": "cpu", key: good}))


def test_no_end_to_training_is_refused_and_an_end_in_steps_or_time_is_taken():
    """max_epochs=null with max_steps=-1: Lightning trained 1000 epochs, its warning saying to set max_epochs=-1,
    which is refused; and a min_epochs past max_epochs."""
    from omegaconf import OmegaConf

    from src.core.errors import UserError
    from src.core.settings import check_trainer_settings

    with pytest.raises(UserError, match=r"^trainer\.max_epochs=null with trainer\.max_steps=-1 sets no end"):
        check_trainer_settings(OmegaConf.create({"max_epochs": None, "max_steps": -1}))
    check_trainer_settings(OmegaConf.create({"max_epochs": None, "max_steps": 500}))
    check_trainer_settings(OmegaConf.create({"max_epochs": None, "max_steps": -1, "max_time": "00:01:00:00"}))
    # min_epochs past max_epochs: Lightning ended at max_epochs without a word
    with pytest.raises(UserError, match=r"^trainer\.min_epochs=2 is more than trainer\.max_epochs=1, where it ends"):
        check_trainer_settings(OmegaConf.create({"min_epochs": 2, "max_epochs": 1}))
    check_trainer_settings(OmegaConf.create({"min_epochs": 2, "max_epochs": 2}))


def test_a_default_root_dir_other_than_the_run_dir_is_refused_naming_hydra_run_dir(tmp_path):
    """trainer.default_root_dir elsewhere (or null: the directory the run starts in) split a run in two: its
    throughput.json (and a failure's record) there, its checkpoints, logs and lock in the run dir, where a sweep's
    report looked for throughput.json."""
    from src.core.errors import UserError
    from src.core.settings import check_values
    from tests.test_config import make_cfg

    for value, words in ((tmp_path / "elsewhere", f"hydra.run.dir={tmp_path / 'elsewhere'} instead"), ("null", "=DIR")):
        with pytest.raises(UserError, match=rf"^trainer\.default_root_dir={value} is not the run dir.*{words}"):
            check_values(make_cfg(tmp_path, f"trainer.default_root_dir={value}"))
    for same in ((), (f"trainer.default_root_dir={tmp_path}/run",)):  # the default, or the run dir given again
        check_values(make_cfg(tmp_path, *same))


@pytest.mark.parametrize(
    "node, key, bad, words",
    [
        # Lightning's own refusals, which named no key before (or a bare "save_top_k=-2")
        ("lr_monitor", "logging_interval", "hour", "callbacks.lr_monitor: logging_interval should be"),
        ("model_checkpoint", "save_top_k", -2, "callbacks.model_checkpoint: Invalid value for save_top_k=-2"),
        # the project's callbacks' values, taken before (no step left out; the bar drawn at every chance)
        ("throughput_record", "warmup_steps", -1, "callbacks.throughput_record.warmup_steps=-1 must be"),
        ("progress_bar", "min_interval_s", -1, "callbacks.progress_bar.min_interval_s=-1 must be"),
        ("last_checkpoint", "every_n_minutes", float("nan"), "callbacks.last_checkpoint.every_n_minutes=nan must be"),
        # null, which each took as far as a TypeError (InstantiationException, exit 1, a traceback in the log)
        (
            "model_checkpoint",
            "save_top_k",
            None,
            "callbacks.model_checkpoint: '<' not supported between instances of "
            "'NoneType' and 'int' (raised by lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint): a "
            "callbacks.model_checkpoint.* value is null where it needs one: give it a value, or leave it out",
        ),
        ("last_checkpoint", "dirpath", None, "callbacks.last_checkpoint.dirpath=null must be a folder or s3://"),
        ("last_checkpoint", "every_n_train_steps", None, "callbacks.last_checkpoint.every_n_train_steps=null must be"),
        # a value of another type than the class uses (a TypeError there too)
        (
            "model_checkpoint",
            "dirpath",
            -1,
            "callbacks.model_checkpoint: expected str, bytes or os.PathLike object, "
            "not int (raised by lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint): change the offending "
            "callbacks.model_checkpoint.* value",
        ),
    ],
)
def test_a_callbacks_value_its_class_refuses_is_one_line_naming_the_callback(node, key, bad, words, tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from src.core.errors import user_error_in

    callbacks = OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml")
    cfg = OmegaConf.create({"callbacks": {node: callbacks[node]}})
    if "dirpath" in cfg.callbacks[node]:
        cfg.callbacks[node].dirpath = str(tmp_path)
    instantiate(cfg.callbacks[node])  # the default is taken
    cfg.callbacks[node][key] = bad
    with pytest.raises(Exception) as refused:
        instantiate(cfg.callbacks[node])
    error = user_error_in(refused.value)
    assert error is not None and str(error).startswith(words), refused.value


def test_a_run_dir_write_that_fills_the_disk_names_no_none_and_says_free_space():
    """Hydra's own writes of the run dir (its .hydra files) fail on a full disk at a stream's flush, whose OSError
    names no file: before, "cannot write the run dir: None: No space left on device: ... or fix its permissions"."""
    import errno

    from src.core.errors import unwritable_run_dir

    assert unwritable_run_dir(OSError(errno.ENOSPC, "No space left on device")) == (
        "cannot write the run dir: No space left on device: pass hydra.run.dir=DIR (hydra.sweep.dir=DIR with -m) "
        "somewhere you can write, or free space there"
    )
    assert unwritable_run_dir(OSError(errno.EACCES, "Permission denied", "/x/run")).startswith(
        "cannot write the run dir: /x/run: Permission denied: pass hydra.run.dir=DIR"
    )


def small_shm(size: str) -> list[str]:
    """A command prefix: the command sees a /dev/shm of ``size`` of its own (a mount namespace, as a container's
    64 MB one); the test skips where this process may not make one (not root)."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m is refused here (needs root): no /dev/shm of a test's own size")
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"', "sh"]


def test_a_full_dev_shm_is_one_line_whether_the_workers_dataset_or_their_queues_meet_it(tmp_path):
    """A container's small /dev/shm: forkserver's workers get the dataset through it (6 MB here, in 1 MB), one line
    and no word after it (before: Lightning's "Please call `iter(combined_loader)` first", raised as it tore down,
    and multiprocessing's warning of leaked semaphores); the semaphores of a loader's queues live there too, and
    their error names no file (before: "no space left on device writing the run dir")."""
    result = run_module(
        "src.train",
        *FAST,
        "data.num_train=2000",
        "data.pipeline=dataloader",
        "data.num_workers=1",
        "data.multiprocessing_context=forkserver",
        f"hydra.run.dir={tmp_path}",
        prefix=small_shm("1m"),
    )
    assert result.returncode == EXIT_FAILED, output(result)[-3000:]
    (line,) = result.stderr.strip().splitlines() or [output(result)[-3000:]]
    assert re.fullmatch(
        r"error: the data loader's workers ran out of shared memory: /dev/shm \(\d\.\d MB free of 1\.0 MB\) holds "
        r"the batches they hand over, and the dataset where they start by forkserver or spawn "
        r"\(data\.multiprocessing_context\); give it more \(docker run --shm-size=8g, a Kubernetes emptyDir of "
        r"medium Memory\), use fewer data\.num_workers, or data\.pipeline=device \(no workers\)",
        line,
    ), output(result)[-3000:]
    locks = (
        "import multiprocessing, src.core.errors as e\n"
        "held = []\n"
        "try:\n"
        "    while True: held.append(multiprocessing.get_context('fork').Lock())\n"
        "except OSError as err: print(len(held) > 0, e.shared_memory_full_in(err) is err)"
    )
    full = subprocess.run([*small_shm("8k"), sys.executable, "-c", locks], capture_output=True, text=True, cwd=ROOT)
    assert full.stdout.split() == ["True", "True"], full.stdout + full.stderr


def test_a_data_loader_worker_gone_as_its_rank_fetched_a_batch_is_its_own_line_not_the_run_dirs(tmp_path):
    """A worker killed (the OOM killer) while its rank fetched a batch from it: torch raises "DataLoader worker ...
    exited unexpectedly" from the rank's connect to the worker's socket, gone, an ENOENT that names no file (before:
    "cannot write the run dir (No such file or directory): ... make . writable")."""
    from multiprocessing.connection import Client

    from src.resilience import failure

    with pytest.raises(RuntimeError) as raised:
        try:
            Client(str(tmp_path / "gone"), family="AF_UNIX")  # what torch's rebuild of a batch's storage meets
        except FileNotFoundError as gone:
            raise RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly") from gone
    line, code = failure.describe(raised.value, str(tmp_path))
    assert code == EXIT_FAILED
    assert re.fullmatch(r"DataLoader worker \(pid\(s\) 4242\) exited unexpectedly \(traceback in \S+\)", line), line


@pytest.mark.parametrize(
    "in_the_way, first, line",
    [
        (  # a run dir removed as the run started
            None,
            True,
            "cannot write the run dir: {run}/train_rank1.log: No such file or directory: pass hydra.run.dir=DIR "
            "(hydra.sweep.dir=DIR with -m) somewhere you can write, or leave it in place (something removed it as it "
            "was written)",
        ),
        (  # under torchrun, srun, mpirun: the run dir taken back by the first process, refused by the same mistake, as
            # this one opened its log there (before: logging's "ValueError: Unable to configure handler 'file'", a
            # traceback, in torchrun's failure report too)
            None,
            False,
            "the run dir went as this process started ({run}/train_rank1.log: No such file or directory): the run's "
            "first process ended before the run began and took it back; its line says why",
        ),
        (
            "folder",
            True,
            "cannot write the run dir: {run}/train_rank1.log: Is a directory: pass hydra.run.dir=DIR "
            "(hydra.sweep.dir=DIR with -m) somewhere you can write, or move the folder in its way",
        ),
    ],
)
def test_a_log_file_hydra_cannot_open_in_the_run_dir_is_one_line(in_the_way, first, line, tmp_path):
    """Hydra's ``configure_log`` with the project's file handler, in a child (logging's configuration closes every
    handler of the process it runs in): its ValueError, whose cause is the OSError of the open, is one line."""
    run = tmp_path / "run"
    if in_the_way:
        (run / "train_rank1.log").mkdir(parents=True)
    log = str(run / "train_rank1.log")
    script = (
        "from hydra.core.utils import configure_log\n"
        "from omegaconf import OmegaConf\n"
        "from src.core.errors import hydra_error_message\n"
        "conf = OmegaConf.create({'version': 1, 'disable_existing_loggers': False, 'root': {'handlers': ['file']},\n"
        f"    'handlers': {{'file': {{'class': 'logging.FileHandler', 'filename': {log!r}}}}}}})\n"
        "try:\n"
        "    configure_log(conf)\n"
        "except ValueError as err:\n"
        f"    print(hydra_error_message(err, first={first}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, line.format(run=run) + "\n"), done
