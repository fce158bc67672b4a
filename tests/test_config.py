"""The Hydra config tree composes for every group option and builds the objects it names."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import src  # noqa: F401 - registers the resolvers conf/hydra uses
from src.core.errors import UserError
from src.distributed.strategy import HydraDDPStrategy, build_strategy
from src.launch.devices import slurm_detected
from tests.conftest import ROOT

CONF = ROOT / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def make_cfg(tmp_path: Path, *overrides: str, name: str = "train"):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            config_name=name, overrides=[f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path}/run", *overrides]
        )


def test_every_config_group_has_options():
    for group in (
        "data",
        "model",
        "trainer",
        "strategy",
        "callbacks",
        "logger",
        "paths",
        "hydra",
        "experiment",
        "debug",
    ):
        assert options(group), f"conf/{group}/ is empty"


def test_default_run_is_resnet50_on_cifar10_with_the_cifar_stem(tmp_path):
    cfg = make_cfg(tmp_path)
    assert cfg.model.arch == "resnet50" and cfg.model.stem == "cifar"
    assert cfg.data._target_.endswith("CIFAR10DataModule") and cfg.data.val_size == 0.1
    assert cfg.strategy.name == "auto" and cfg.backend == "auto"
    assert cfg.data.root == f"{tmp_path}/data"
    assert cfg.callbacks.model_checkpoint.dirpath == f"{tmp_path}/run/checkpoints"
    assert cfg.callbacks.model_checkpoint.monitor == "val/acc" and cfg.callbacks.last_checkpoint.every_n_minutes > 0


@pytest.mark.parametrize("group", ["data", "strategy", "trainer", "callbacks", "logger", "experiment", "debug"])
def test_each_option_composes_and_resolves(tmp_path, group):
    for option in options(group):
        cfg = make_cfg(tmp_path, f"{group}={option}")
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def test_strategy_options_build_what_they_name(tmp_path):
    cpu = ["trainer.accelerator=cpu", "backend=gloo"]
    ddp = instantiate(make_cfg(tmp_path, "strategy=ddp", *cpu).strategy)
    spawn = instantiate(make_cfg(tmp_path, "strategy=ddp_spawn", *cpu).strategy)
    assert isinstance(ddp, HydraDDPStrategy) and ddp._start_method == "popen"
    assert isinstance(spawn, HydraDDPStrategy) and spawn._start_method == "spawn"
    assert ddp.process_group_backend == "gloo"
    assert ddp._ddp_kwargs["gradient_as_bucket_view"] is False  # auto: off on CPUs (on for CUDA)
    assert (
        instantiate(
            make_cfg(tmp_path, "strategy=ddp", *cpu, "strategy.gradient_as_bucket_view=true").strategy
        )._ddp_kwargs["gradient_as_bucket_view"]
        is True
    )
    assert ddp._timeout.total_seconds() == 300
    assert instantiate(make_cfg(tmp_path, "trainer.accelerator=cpu").strategy) == "auto"  # one device
    auto_two = instantiate(make_cfg(tmp_path, "trainer.accelerator=cpu", "trainer.devices=2").strategy)
    assert isinstance(auto_two, HydraDDPStrategy) and auto_two._start_method == "popen"
    assert (
        instantiate(make_cfg(tmp_path, "strategy=ddp", "trainer.accelerator=cpu").strategy).process_group_backend
        is None
    )  # auto: Lightning's choice, gloo on CPU


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"name": "ddp", "backend": "nccl", "accelerator": "cpu"}, "backend=nccl needs CUDA"),
        ({"name": "ddp", "backend": "mpi"}, "backend=mpi is not known"),
        ({"name": "fsdp"}, "strategy=fsdp is not known"),
    ],
)
def test_bad_strategy_settings_are_user_errors(kwargs, words):
    with pytest.raises(UserError, match=words):
        build_strategy(**kwargs)


@pytest.mark.parametrize(
    "env",
    [{}, {"SLURM_NTASKS": "2"}, {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train"}]
    + [{"SLURM_NTASKS": "2", "SLURM_JOB_NAME": name} for name in ("bash", "interactive")]
    + [{"SLURM_JOB_NAME": "train"}],
)
def test_the_allocation_checks_reading_of_slurm_is_lightnings(monkeypatch, env):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for key in ("SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert slurm_detected() == SLURMEnvironment.detect()
    # but for srun's tasks in an allocation named so, as salloc names its job: one run, not one a task (the real
    # run: tests/slurm/test_one_node.py); one task there (srun --pty bash) is the shell Lightning means
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    for tasks in ("1", "2"):
        monkeypatch.setenv("SLURM_STEP_NUM_TASKS", tasks)
        named = env.get("SLURM_JOB_NAME") in ("bash", "interactive")
        assert slurm_detected() == (SLURMEnvironment.detect() or (named and tasks == "2"))


def imported_modules(stderr: str) -> set[str]:
    """The modules a ``python -X importtime`` process loaded, from what it wrote to stderr."""
    return {row.rsplit("|", 1)[-1].strip() for row in stderr.splitlines() if row.startswith("import time:")}


SRUN_TASK = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}


@pytest.mark.parametrize(
    "task, overrides, line",
    [
        (SRUN_TASK, ["trainer.devices=1"], "the Slurm allocation runs --ntasks-per-node=2 but trainer.devices=1"),
        ({}, ["trainer.devices=2"], "python runs in the Slurm job's batch script without srun"),
    ],
    ids=["srun task", "batch script"],
)
def test_a_slurm_allocation_that_cannot_run_is_one_line_before_lightning_loads(task, overrides, line, tmp_path):
    """Every task of every node would otherwise import Lightning, torchvision and torchmetrics first: seconds from a
    local disk, minutes from a cluster's shared filesystem at thousands of tasks. (torch loads: the device count of
    trainer.accelerator=auto needs it.) tests/slurm/ runs the same two through a real slurmctld. The refused run
    leaves no run dir: neither its timestamped dir nor the folder it made for it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k != "LOCAL_RANK"}
    env.update(
        SLURM_JOB_ID="7", SLURM_JOB_NAME="train", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NUM_NODES="1"
    )
    env.update(task)
    done = subprocess.run(
        [
            *(sys.executable, "-X", "importtime", "-m", "src.train", "data=synthetic", *overrides),
            f"hydra.run.dir={tmp_path}/runs/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}",  # the default's form, in a new folder
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [row for row in done.stderr.splitlines() if not row.startswith("import time:")]
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith(f"error: {line}"), done.stderr[-2000:]
    imported = imported_modules(done.stderr)
    assert "hydra" in imported and not {"lightning", "torchvision", "torchmetrics"} & imported
    assert not (tmp_path / "runs").exists(), sorted(map(str, (tmp_path / "runs").rglob("*")))


def test_srun_without_ntasks_per_node_is_one_line_that_gives_it(monkeypatch):
    """srun -n 2 (or salloc -n 2, then srun): before, Lightning's RuntimeError in every task, exit 1, a traceback in
    each log. The in-process twin of the case above: the same check, before Lightning loads. And tasks spread
    unevenly (a batch script's --ntasks-per-node=2, srun --nodes=2 --ntasks=3: 2 tasks and 1): before, every task
    waited for a fourth (seen on the two-node test cluster)."""
    from src.launch.ranks import check_slurm_allocation

    def refusal() -> str:
        with pytest.raises(UserError) as refused:
            check_slurm_allocation(2, 2)
        return str(refused.value)

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in {**SRUN_TASK, "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "python", "SLURM_NTASKS": "4"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_NNODES", "2")
    assert refusal() == (
        "srun started 4 tasks without --ntasks-per-node, which Lightning needs to tell each rank its place: pass "
        "srun --nodes=2 --ntasks-per-node=2 (sbatch slurm/train.sbatch sets both)"
    )
    monkeypatch.setenv("SLURM_NTASKS", "3")  # not 1 a node, as 3 // 2 said, but the config's 2
    assert "pass srun --nodes=2 --ntasks-per-node=2 (" in refusal()
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    check_slurm_allocation(2, 2)
    monkeypatch.setenv("SLURM_NTASKS", "3")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2,1")
    assert refusal() == (
        "srun started 3 tasks (2,1 a node), but trainer.num_nodes x trainer.devices is 2 x 2 = 4: Lightning runs the "
        "same number on every node: leave --ntasks out, or give --ntasks=4"
    )


@pytest.mark.parametrize("command", ["train", "eval", "export", "predict"])
def test_help_starts_with_the_usage_examples_and_where_the_docs_are_and_ends_with_how_to_see_the_config(command):
    """... and loads neither torch nor Lightning: the page, ``--cfg`` and a mistake in the command line take the
    fraction of a second Hydra takes, not the seconds of their imports."""

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", f"src.{command}", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        imported = imported_modules(done.stderr)
        assert "hydra" in imported and not {"torch", "lightning", "torchvision"} & imported
        return done

    page = run("--help").stdout
    usage, examples = page.splitlines()[0], page.split("\n== Configuration groups ==")[0].splitlines()[1:-1]
    assert usage.startswith(f"python -m src.{command} "), page[:300]
    # each command's own examples (before: src.train's, and a sweep's usage, on every command's page)
    assert examples[0].startswith(f"e.g. python -m src.{command} ") and len(examples) >= 2, page[:600]
    assert ("-m KEY=A,B" in usage) == (command == "train")
    docs = re.findall(r"(docs/\S+\.md|README\.md)", page.split("== Config")[0])
    assert "docs/configuration.md" in docs and "docs/troubleshooting.md" in docs
    assert all((ROOT / doc).is_file() for doc in docs)
    # the groups this command reads and their options (before: every group, the training's on src.predict's page)
    listed = page.split("(group=option)\n\n", 1)[1].split("\n\n== Config ==", 1)[0].splitlines()
    composed = yaml.safe_load((ROOT / "conf" / f"{command}.yaml").read_text())["defaults"]
    groups = [next(iter(d)).split()[-1] for d in composed if isinstance(d, dict) and "hydra" not in d]
    assert [line.split(":")[0] for line in listed] == groups, listed
    for line in listed:
        group, options = line.split(": ")
        assert options.split(", ") == sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
    footer = next(line for line in page.splitlines() if line.startswith("The config as it will run: "))
    assert footer.endswith(f"python -m src.{command} [OVERRIDES] --cfg job --resolve")
    shown = "\n" + run("--cfg", "job", "--resolve").stdout
    assert f"\ntask_name: {command}\n" in shown  # the footer's command works
    # where the run would write (before: output_dir: null, checkpoints: None/checkpoints, the loggers' dirs null)
    run_dir = yaml.safe_load(shown)["paths"]["output_dir"]
    assert run_dir and Path(run_dir).is_absolute() and "/outputs/runs/" in run_dir, shown
    assert "None/" not in shown and "save_dir: null" not in shown, shown


def test_trainer_builds_from_the_composed_config(tmp_path):
    cfg = make_cfg(tmp_path, "trainer.accelerator=cpu", "trainer.max_epochs=1")
    from src.training.trainer import build_trainer

    trainer = build_trainer(cfg, cfg.model.arch)
    assert isinstance(trainer, L.Trainer) and trainer.max_epochs == 1
    names = {type(c).__name__ for c in trainer.callbacks}
    assert {
        "ModelCheckpoint",
        "LastCheckpoint",
        "LearningRateMonitor",
        "ThroughputRecorder",
        "ProgressBar",
        "RunSummary",
        "GracefulStop",
    } <= names
    assert Path(trainer.logger.log_dir) == tmp_path / "run" / "tensorboard"


def test_logger_none_and_callbacks_none_build_trainers_that_keep_their_promise(tmp_path):
    """logger=none: before, LearningRateMonitor refused the fit ("Cannot use LearningRateMonitor callback with
    Trainer that has no logger", exit 2). callbacks=none ("no checkpoints either"): before, Lightning added its own
    ModelCheckpoint, writing into tensorboard/checkpoints/, and its own progress bar, as callbacks.progress_bar=null
    did."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    from src.training.trainer import build_trainer

    cfg = make_cfg(tmp_path, "trainer.accelerator=cpu", "logger=none")
    trainer = build_trainer(cfg, cfg.model.arch)
    assert not trainer.loggers and not any(isinstance(c, LearningRateMonitor) for c in trainer.callbacks)
    assert [type(c).__name__ for c in trainer.checkpoint_callbacks] == ["ModelCheckpoint", "LastCheckpoint"]
    cfg = make_cfg(tmp_path, "trainer.accelerator=cpu", "callbacks=none")
    assert build_trainer(cfg, cfg.model.arch).checkpoint_callbacks == []
    cfg = make_cfg(tmp_path, "trainer.accelerator=cpu", "callbacks=none", "+trainer.enable_checkpointing=true")
    assert len(build_trainer(cfg, cfg.model.arch).checkpoint_callbacks) == 1  # asked for: Lightning's own
    # no progress bar either (Lightning's reads every logged value after every step); asked for, Lightning's
    assert type(trainer.progress_bar_callback).__name__ == "ProgressBar"
    for none in ("callbacks=none", "callbacks.progress_bar=null"):
        cfg = make_cfg(tmp_path, "trainer.accelerator=cpu", none)
        assert build_trainer(cfg, cfg.model.arch).progress_bar_callback is None
    asked = "+trainer.enable_progress_bar=true"
    cfg = make_cfg(tmp_path, "trainer.accelerator=cpu", "callbacks.progress_bar=null", asked)
    assert type(build_trainer(cfg, cfg.model.arch).progress_bar_callback).__name__ == "RichProgressBar"


@pytest.mark.parametrize(
    "users, kept", [(":16:8", ":16:8"), (":4096:8", ":4096:8"), (None, ":4096:8"), (":0:0", ":4096:8")]
)
def test_a_users_deterministic_cublas_workspace_is_kept_and_another_replaced_with_a_warning(
    users, kept, tmp_path, monkeypatch, caplog
):
    """Lightning sets :4096:8 under trainer.deterministic, over whatever the user had."""
    from src.training.trainer import build_trainer

    if users is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", users)
    cfg = make_cfg(tmp_path, "trainer.accelerator=cpu", "trainer.deterministic=true")
    with caplog.at_level("WARNING", logger="src.training.trainer"):
        build_trainer(cfg, cfg.model.arch)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == kept
    warned = [r.getMessage() for r in caplog.records if "CUBLAS_WORKSPACE_CONFIG" in r.getMessage()]
    assert warned == (
        []
        if users != ":0:0"
        else [
            "CUBLAS_WORKSPACE_CONFIG=:0:0 replaced by :4096:8: trainer.deterministic=True needs :4096:8 or :16:8 "
            "(torch refuses other values there)"
        ]
    )


def test_experiment_demo_is_two_cpu_processes_on_synthetic_data(tmp_path):
    cfg = make_cfg(tmp_path, "experiment=demo")
    assert cfg.trainer.devices == 2 and cfg.trainer.accelerator == "cpu" and cfg.backend == "gloo"
    assert cfg.strategy.name == "ddp" and cfg.data._target_.endswith("SyntheticDataModule")


def test_eval_config_needs_a_checkpoint_and_uses_every_device(tmp_path):
    cfg = make_cfg(tmp_path, name="eval")  # each test image counts once at any world size (tests/test_eval_sharding.py)
    assert OmegaConf.is_missing(cfg, "ckpt_path") and cfg.trainer.devices == "auto"


@pytest.mark.parametrize(
    "env, launcher",
    [
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "{rank}", "SLURM_NTASKS": "2"}, "srun"),
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "{rank}", "WORLD_SIZE": "2"}, "torchrun"),
        ({"OMPI_COMM_WORLD_RANK": "{rank}", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun"),
    ],
)
def test_export_and_predict_under_a_launcher_of_several_processes_are_refused_once(
    env, launcher, monkeypatch, tmp_path, request
):
    """Before: srun -n 2 python -m src.export exported twice into the same files, and under torchrun src.predict
    failed in every worker on the config's missing trainer (ConfigAttributeError, a traceback in each log)."""
    from src.launch.ranks import check_one_process

    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_"))]:
        monkeypatch.delenv(key)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    check_one_process("export")  # no launcher
    # a Slurm batch script of a 4-task allocation is one process (some Slurm versions name its step "batch")
    for step in ({}, {"SLURM_STEP_ID": "batch"}, {"SLURM_STEP_ID": "4294967294"}):
        with monkeypatch.context() as batch:
            for key, value in {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4", **step}.items():
                batch.setenv(key, value)
            check_one_process("export")
    other = logging.FileHandler(tmp_path / "other.log")  # an empty log outside the run dir (or /dev/null) stays
    logging.getLogger().addHandler(other)
    request.addfinalizer(lambda: (logging.getLogger().removeHandler(other), other.close()))
    for rank, refusal in (("1", SystemExit), ("0", UserError)):
        for key, value in env.items():
            monkeypatch.setenv(key, value.format(rank=rank))
        with pytest.raises(refusal) as refused:
            check_one_process("predict")
        assert refusal is UserError or refused.value.code == 0
    assert (tmp_path / "other.log").is_file() and os.path.exists(os.devnull)
    # the first says it and exits 2; the others end quietly with 0, so that the launcher does not stop the first
    # before its line is out (torchrun and mpirun stop every process once one fails)
    assert str(refused.value).startswith(
        f"python -m src.predict runs in one process, but {launcher} started 2, each of which would do the same work "
        f"into the same files: start it once, without {launcher}"
    )
