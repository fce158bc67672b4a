"""logger=csv|mlflow|wandb|many: what each writes, read back with each tool's own reader; resumed runs continue."""

from __future__ import annotations

import csv
import glob
import json
import struct
from pathlib import Path

import pytest

from tests.conftest import FAST, output, train

RUN = [*FAST, "trainer.limit_train_batches=3", "test=false", "callbacks.last_checkpoint.every_n_train_steps=0"]


def assert_ok(result) -> None:
    assert result.returncode == 0, output(result)[-4000:]


def mlflow_runs(uri: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("cifar10-ddp")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def metric(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


def wandb_records(run_file: Path) -> list:
    """The records of a W&B run file (run-<id>.wandb), decoded with W&B's own protobuf schema.

    The file is W&B's transaction log: a 7-byte header (':W&B', a magic number, a version), then LevelDB's log
    framing (32 KiB blocks of chunks: crc32c, length, type), each whole record a ``wandb_internal_pb2.Record``.
    wandb 0.31 reads these files in its Go core only; this is the framing, the content is W&B's reader's.
    """
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    records, pos, buffer, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        buffer += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buffer)
            records.append(record)
            buffer = b""
    return records


def wandb_history(records: list, key: str) -> list[float]:
    values = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            values += [
                json.loads(item.value_json)
                for item in record.history.item
                if (item.key or "/".join(item.nested_key)) == key
            ]
    return values


def test_mlflow_run_is_found_by_mlflows_client_and_a_resumed_run_continues_it_and_metrics_csv(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "run"
    common = [
        *RUN,
        "logger=[csv,mlflow]",
        f"logger.mlflow.tracking_uri={uri}",
        f"hydra.run.dir={run_dir}",
        f"logger.mlflow.artifact_location={tmp_path}/artifacts",
    ]
    first = train(*common, "trainer.max_epochs=1", "logger.mlflow.log_model=true")  # checkpoints as artifacts
    assert_ok(first)
    assert "Creating initial MLflow database tables" not in output(first)  # MLflow's own INFO lines stay quiet
    (run,) = mlflow_runs(uri)
    assert run.info.status == "FINISHED" and run.info.run_name == str(run_dir)
    assert run.data.params["model/arch"] == "resnet18" and run.data.params["data/batch_size"] == "4"  # the config
    assert [step for step, _ in metric(uri, run.info.run_id, "train/loss")] == [0, 1, 2]  # per step
    assert len(metric(uri, run.info.run_id, "train/loss_epoch")) == 1  # per epoch
    assert json.loads((run_dir / "loggers.json").read_text())["mlflow"]["run_id"] == run.info.run_id
    from mlflow import MlflowClient

    (saved,) = [a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)]  # the best checkpoint
    assert saved.startswith("best-epoch000") and f"{saved}/{saved}.ckpt" in [
        a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id, saved)
    ]

    resumed = train(*common, "trainer.max_epochs=2", "ckpt_path=last")  # as a requeued job: the same run dir
    assert_ok(resumed)
    assert f"continuing MLflow run {run.info.run_id}" in output(resumed)
    (again,) = mlflow_runs(uri)  # still one run, with both epochs
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [step for step, _ in metric(uri, run.info.run_id, "train/loss")] == [0, 1, 2, 3, 4, 5]
    assert len(metric(uri, run.info.run_id, "train/loss_epoch")) == 2
    assert again.data.params["trainer/max_epochs"] == "1"  # MLflow keeps a param's first value
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))  # the resumed run kept the earlier rows
    assert [int(r["epoch"]) for r in rows if r["train/loss_epoch"]] == [0, 1]
    assert [int(r["step"]) for r in rows if r["train/loss"]] == [0, 1, 2, 3, 4, 5]


def test_wandb_runs_offline_without_an_api_key_and_a_resumed_run_continues_the_same_run(tmp_path):
    run_dir = tmp_path / "run"
    env = {"HOME": str(tmp_path / "home"), "WANDB_API_KEY": "", "WANDB_MODE": "", "WANDB_DIR": ""}
    common = [*RUN, "logger=wandb", f"hydra.run.dir={run_dir}"]
    first = train(*common, "trainer.max_epochs=1", env=env)
    assert_ok(first)
    assert "offline" in output(first) and "anonymous setting" not in output(first)
    (run_file,) = map(Path, glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb"))
    records = wandb_records(run_file)
    (start,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert start.display_name == str(run_dir) and start.project == "cifar10-ddp"
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["model"]["arch"] == "resnet18"  # the resolved config
    assert len(wandb_history(records, "train/loss")) == 3 and len(wandb_history(records, "train/loss_epoch")) == 1
    assert json.loads((run_dir / "loggers.json").read_text())["wandb"] == {
        "id": start.run_id,
        "project": "cifar10-ddp",
        "mode": "offline",
    }

    resumed = train(*common, "trainer.max_epochs=2", "ckpt_path=last", env=env)
    assert_ok(resumed)
    second = [Path(p) for p in glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb") if Path(p) != run_file]
    assert len(second) == 1 and second[0].name == run_file.name  # the same run id: `wandb sync` joins them
    records = wandb_records(second[0])
    assert [r.run.run_id for r in records if r.WhichOneof("record_type") == "run"] == [start.run_id]
    assert len(wandb_history(records, "train/loss_epoch")) == 1  # epoch 1, after the epoch 0 of the first file


def test_only_rank_zero_logs_logger_many_with_mlflow_and_wandb_under_ddp(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "run"
    result = train(
        *RUN,
        "strategy=ddp",
        "trainer.devices=2",
        "logger=[many,mlflow,wandb]",
        f"logger.mlflow.tracking_uri={uri}",
        f"logger.mlflow.artifact_location={tmp_path}/artifacts",
        f"hydra.run.dir={run_dir}",
        env={"HOME": str(tmp_path / "home"), "WANDB_API_KEY": "", "WANDB_MODE": ""},
    )
    assert_ok(result)
    assert len(glob.glob(f"{run_dir}/wandb/offline-run-*")) == 1  # one W&B run for the two ranks
    assert not (tmp_path / "artifacts").exists()  # checkpoints become artifacts only when asked (log_model)
    (run,) = mlflow_runs(uri)  # one MLflow run for the two ranks
    losses = metric(uri, run.info.run_id, "train/loss_epoch")
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [float(r["train/loss_epoch"]) for r in rows if r["train/loss_epoch"]] == pytest.approx(
        [value for _, value in losses]
    )
    assert len(list((run_dir / "tensorboard").glob("events.*"))) == 1


@pytest.mark.parametrize(("logger", "package"), [("mlflow", "mlflow"), ("[many,wandb]", "wandb")])
def test_a_logger_whose_package_is_missing_is_one_line_naming_the_extra(tmp_path, logger, package):
    """The package is made missing the way Python sees it: a finder that answers 'no module named ...'."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Missing:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {package!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Missing())\n"
    )
    result = train(
        *RUN,
        "strategy=ddp",
        "trainer.devices=2",
        f"logger={logger}",
        f"hydra.run.dir={tmp_path}/run",
        env={"PYTHONPATH": str(tmp_path)},
        timeout=120,
    )
    assert result.returncode == 2, output(result)[-3000:]
    assert result.stderr.strip() == (
        f"error: logger={package} needs the {package} package, which is not installed: "
        f'pip install -e ".[{package}]" (or pip install {package})'
    )
    assert not (tmp_path / "run" / "train_node0_local1.log").exists()  # no other rank was started


def _open_store(uri: str, run_dir: str) -> None:
    from src.tracking.loggers import MLFlowLogger

    MLFlowLogger(run_dir=run_dir, tracking_uri=uri)


def test_processes_opening_a_new_mlflow_store_at_once_do_not_collide(tmp_path):
    # Every rank builds the logger, and opening a SQLite store creates its tables: without the lock beside the
    # store, 13 of 15 processes started three at a time failed here ("table _alembic_tmp_params already exists").
    import multiprocessing

    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    # forked from one server that has imported MLflow and the logger once, the three start within an instant of
    # each other (three new interpreters importing them side by side took 12 CPU seconds)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["mlflow", "src.tracking.loggers", __name__])
    processes = [context.Process(target=_open_store, args=(uri, str(tmp_path / "run"))) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [process.exitcode for process in processes] == [0, 0, 0]
    assert mlflow_runs(uri) == []  # the store opens; no run exists until rank zero logs
