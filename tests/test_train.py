"""`python -m src.train` and `python -m src.eval` as real processes: one CPU, DDP x2, two nodes, resume, errors."""

from __future__ import annotations

import csv
import errno
import inspect
import json
import re
import socket
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.callbacks import throughput
from src.callbacks.throughput import ThroughputRecorder
from src.checkpoints.files import AtomicCheckpointIO
from src.checkpoints.last import LastCheckpoint
from src.models.fast_path import fast_path
from tests.conftest import FAST, FAST_RUN, descendants, free_port, output, process_environ, run_module, train


def checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def scalars(run_dir: Path) -> dict[str, list]:
    """Every scalar in the run's TensorBoard event files, read with TensorBoard's own reader."""
    found: dict[str, list] = {}
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, []).extend(acc.Scalars(tag))
    return found


def assert_ok(result) -> None:
    assert result.returncode == 0, output(result)[-4000:]


def only_last_ckpt(run_dir: Path) -> Path:
    lasts = list(run_dir.rglob("last.ckpt"))
    assert [p.relative_to(run_dir) for p in lasts] == [Path("checkpoints/last.ckpt")]
    return lasts[0]


# the single run and those that resume from it: the network users train, torchvision's ResNet-18 with the CIFAR stem
# (FAST has the cheaper ImageNet stem and a narrow width)
SINGLE = [*FAST, "model.stem=cifar", "model.width=64"]
HOST = socket.gethostname()  # the nodes by hand below are this machine's processes


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("single") / "run"
    result = train(
        *SINGLE,
        "trainer.limit_train_batches=12",
        "trainer.max_epochs=2",
        "model.scheduler.warmup_epochs=1",
        f"hydra.run.dir={run_dir}",
    )
    assert_ok(result)
    assert "Run: 1 node(s) x 1 device(s) = world size 1 | strategy single-device" in output(result)
    chosen = fast_path("cpu", "resnet18")  # what auto resolves to on this machine's CPU, and the run line says why
    assert f"| precision {chosen.label} (auto: {chosen.why}) |" in output(result)
    record = json.loads((run_dir / "throughput.json").read_text())
    assert (record["precision"], record["channels_last"], record["arch"]) == (
        chosen.precision,
        chosen.channels_last,
        "resnet18",
    )
    return run_dir


STEP_S, VALIDATION_S = 0.02, 0.25  # what a training step and a validation take at least


class Sleepy(L.LightningModule):
    """Steps and validations of known least duration: what the measured windows must and must not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_S)
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0 and not self.trainer.sanity_checking:
            time.sleep(VALIDATION_S)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def sleepy_trainer(tmp_path: Path, log_every_n_steps: int) -> L.Trainer:
    """2 epochs of Sleepy's 10 steps, a validation batch each, the throughput recorder with 2 warm-up steps."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        log_every_n_steps=log_every_n_steps,
        limit_val_batches=1,
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="", version=""),
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=tmp_path,
        callbacks=[ThroughputRecorder(warmup_steps=2), LastCheckpoint(tmp_path, every_n_minutes=0)],
    )


def fit_sleepy(trainer: L.Trainer) -> None:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(20, 4)), batch_size=2)
    trainer.fit(Sleepy(), train_dataloaders=data, val_dataloaders=data)


def test_throughput_is_timed_in_windows_synchronised_only_at_their_edges(monkeypatch, tmp_path):
    """20 steps in 2 epochs, 2 warm-up steps, log every 4: the windows hold the 17 steps after the warm-up and
    after each epoch's first, no validation, and the device waits only where a window opens or closes."""
    syncs: list[tuple[str, int]] = []
    monkeypatch.setattr(
        throughput, "synchronize", lambda device: syncs.append((inspect.stack()[2].function, trainer.global_step))
    )  # the hook that asked, and the step
    trainer = sleepy_trainer(tmp_path, log_every_n_steps=4)
    fit_sleepy(trainer)

    edges = [
        ("on_train_batch_end", 2),
        ("on_train_batch_end", 4),
        ("on_train_batch_end", 8),
        ("on_validation_start", 10),
        ("on_train_epoch_end", 10),
        ("on_train_batch_end", 11),
        ("on_train_batch_end", 12),
        ("on_train_batch_end", 16),
        ("on_train_batch_end", 20),
        ("on_validation_start", 20),
        ("on_train_epoch_end", 20),
        ("on_train_end", 20),
    ]
    assert syncs == edges  # no step between them waits
    record = json.loads((tmp_path / "throughput.json").read_text())
    assert record["steps_measured"] == 17 and record["steps"] == 20 and record["epochs"] == 2
    assert record["measured_s"] == pytest.approx(17 * record["step_time_s"])
    assert record["step_time_s"] >= STEP_S and record["samples_per_second"] == pytest.approx(2 / record["step_time_s"])
    assert record["measured_s"] <= record["fit_time_s"] - 2 * VALIDATION_S  # the validations are not in a window
    assert record["rank_devices"] == [{"host": record["hosts"][0], "device": "cpu"}]
    assert record["checkpoints_saved"] == 2 and 0 < record["checkpoint_save_s"] < record["fit_time_s"]
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows if r.get("train/samples_per_sec")] == [4, 8, 12, 16, 20]  # log steps


def test_with_no_step_logged_the_throughput_is_still_timed_between_the_edges(tmp_path):
    """trainer.log_every_n_steps=0, Lightning's "log no step": the recorder divided by it (a ZeroDivisionError at the
    first step after the warm-up)."""
    fit_sleepy(sleepy_trainer(tmp_path, log_every_n_steps=0))
    record = json.loads((tmp_path / "throughput.json").read_text())
    assert record["steps_measured"] == 17 and record["steps"] == 20
    metrics = tmp_path / "metrics.csv"  # written only if anything was logged
    assert not metrics.exists() or not [r for r in csv.DictReader(metrics.open()) if r.get("train/samples_per_sec")]


def test_the_device_waited_for_is_the_ranks_own_cuda_device_and_never_a_cpu(monkeypatch):
    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: type("Props", (), {"uuid": f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd"}),
    )
    throughput.synchronize(torch.device("cpu"))
    throughput.synchronize(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]
    assert throughput.device_identity(torch.device("cuda", 1)) == {
        "device": "cuda",
        "index": 1,
        "uuid": "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd",
    }
    assert throughput.device_identity(torch.device("cpu")) == {"device": "cpu"}


def test_single_process_run_writes_last_and_best_checkpoints_and_the_resolved_config(single_run):
    last = checkpoint(only_last_ckpt(single_run))
    assert last["global_step"] == 24 and last["epoch"] == 1
    assert last["saved_by"].items() >= {"global_rank": 0, "world_size": 1}.items()
    hp = last["hyper_parameters"]
    assert (hp["arch"], hp["stem"], hp["width"]) == ("resnet18", "cifar", 64)
    best = [p.name for p in (single_run / "checkpoints").glob("best-*.ckpt")]
    assert len(best) == 1
    config = (single_run / "config.yaml").read_text()
    assert "${" not in config and f"output_dir: {single_run}" in config  # resolved
    assert (single_run / "train.log").is_file() and (single_run / ".hydra" / "overrides.yaml").is_file()


def test_tensorboard_holds_step_and_epoch_scalars_lr_throughput_and_hyperparameters(single_run):
    found = scalars(single_run)
    assert [e.step for e in found["train/loss"]] == list(range(24))  # one per step
    assert len(found["train/acc"]) == 24
    epoch_loss = found["train/loss_epoch"]  # one per epoch: the mean of the epoch's steps
    assert len(epoch_loss) == 2 and len(found["train/acc_epoch"]) == 2
    assert epoch_loss[0].value == pytest.approx(sum(e.value for e in found["train/loss"][:12]) / 12, rel=1e-4)
    assert len(found["val/loss"]) == 2 and len(found["val/acc"]) == 2  # one per epoch
    assert len(found["test/loss"]) == 1 and 0 <= found["test/acc"][0].value <= 1
    lrs = [e.value for e in found["lr-SGD/pg1"]]  # pg1: decayed weights; pg2: norms and biases, same rate
    assert lrs[0] < max(lrs) and lrs[-1] < max(lrs)  # warm-up, then decay
    assert all(e.value > 0 for e in found["train/device/samples_per_sec"])
    hparams = (single_run / "tensorboard" / "hparams.yaml").read_text()
    assert "arch: resnet18" in hparams and "backend: gloo" in hparams


def test_resume_from_last_continues_the_global_step(single_run, tmp_path):
    result = train(
        *SINGLE,
        "trainer.limit_train_batches=12",
        "trainer.max_epochs=3",
        f"ckpt_path={single_run}/checkpoints/last.ckpt",
        f"hydra.run.dir={tmp_path}",
    )
    assert_ok(result)
    assert "Restoring states from the checkpoint" in output(result)
    assert "nothing is left to train" not in output(result)  # 3 epochs asked, 2 trained
    resumed = checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert resumed["global_step"] == 36 and resumed["epoch"] == 2
    assert [e.step for e in scalars(tmp_path)["train/loss"]] == list(range(24, 36))


def test_a_resume_of_a_checkpoint_that_trained_every_epoch_asked_says_nothing_is_left_to_train(single_run, capsys):
    """Before, a finished run resumed into a new dir with its trainer.max_epochs trained nothing, silently, and
    tested the checkpoint's weights as if it had. The single run's own last.ckpt: 2 epochs, 24 steps."""
    from src.checkpoints.resume import warn_nothing_to_train

    path = only_last_ckpt(single_run)
    saved = checkpoint(path)
    warn_nothing_to_train(saved, path, 2, -1)
    assert capsys.readouterr().err == (
        f"warning: ckpt_path={path} has trained 2 epoch(s), 24 step(s), and this run asks for trainer.max_epochs=2: "
        "nothing is left to train, and the test runs on its weights; to train on, pass trainer.max_epochs above 2 "
        "(the learning-rate schedule ends with trainer.max_epochs)\n"
    )
    warn_nothing_to_train(saved, path, 3, 24)
    assert "asks for trainer.max_steps=24: nothing is left" in capsys.readouterr().err
    for max_epochs, max_steps in ((3, -1), (3, 25), (None, -1)):  # something left to train
        warn_nothing_to_train(saved, path, max_epochs, max_steps)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "saved, now, keep",
    [
        ((8, 64, 1), (4, 64, 1), "pass data.batch_size=128"),
        ((2, 3, 1), (4, 3, 1), "make data.batch_size x trainer.accumulate_grad_batches x 4 process(es) 6"),
        ((4, 16, 2), (2, 16, 1), "pass data.batch_size=64"),
    ],
)
def test_the_global_batch_line_gives_the_batch_that_keeps_it(saved, now, keep, capsys):
    """A resume at another world size that trains another global batch says so (before, a resume on another device
    count said nothing; torchrun's restarts keep it themselves). A real resume says it in
    tests/test_object_store.py's truncated-checkpoint test: two ranks' checkpoint, one process."""
    from src.checkpoints.resume import warn_global_batch_change

    world, batch, accumulate = saved
    warn_global_batch_change({"world_size": world, "batch_size": batch, "accumulate": accumulate}, *now)
    assert capsys.readouterr().err.rstrip().endswith(f"to keep them, {keep}")
    for unchanged in ((world, batch, accumulate), (world * 2, batch, accumulate / 2), (1, "auto", 1)):
        warn_global_batch_change({"world_size": world, "batch_size": batch, "accumulate": accumulate}, *unchanged)
    warn_global_batch_change(None, *now)  # an earlier version's checkpoint
    assert capsys.readouterr().err == ""


def test_eval_reports_test_loss_and_accuracy_of_a_checkpoint_on_the_data_of_its_run(single_run, tmp_path):
    # no data=: the run's own (data=synthetic, 16 test images), as src.export validates on; before, data=cifar10
    result = run_module(
        "src.eval",
        "trainer.accelerator=cpu",
        f"ckpt_path={single_run}/checkpoints/last.ckpt",
        f"hydra.run.dir={tmp_path}",
    )
    assert_ok(result)
    assert "test loss" in output(result) and "test accuracy" in output(result) and "resnet18" in output(result)
    assert f"| 16 test images of the run's data=synthetic ({single_run}/config.yaml)" in output(result)
    tested = OmegaConf.load(tmp_path / "config.yaml").data
    assert tested == OmegaConf.load(single_run / "config.yaml").data  # the record says what was tested
    metrics = json.loads((tmp_path / "test_metrics.json").read_text())
    assert set(metrics) == {"test/loss", "test/acc", "test/images"} and 0 <= metrics["test/acc"] <= 1


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_two_processes_train_into_one_run_dir_and_rank_zero_writes_the_one_checkpoint(strategy, tmp_path):
    run_dir = tmp_path / "run"
    # an epoch shorter than log_every_n_steps (Lightning's 50): no value per step, yet the epoch's loss is there
    logger = "many" if strategy == "ddp" else "tensorboard"  # many: TensorBoard and metrics.csv
    result = train(
        *FAST,
        f"strategy={strategy}",
        "trainer.devices=2",
        "trainer.log_every_n_steps=50",
        f"logger={logger}",
        f"hydra.run.dir={run_dir}",
    )
    assert_ok(result)
    assert f"world size 2 | strategy {strategy} | backend gloo" in output(result)
    for noise in (
        "`weights_only` was not set",
        "The `srun` command is available",
        "LeafSpec",
        "GPU available",
        "Initializing distributed",
        "Seed set to",
    ):  # nothing a user can act on reaches the console
        assert noise not in output(result), output(result)[-4000:]
    assert "Seed set to 42" in (run_dir / "train.log").read_text()  # ... the log file keeps Lightning's lines
    assert "global batch 8 (4 per process)" in output(result)
    assert checkpoint(only_last_ckpt(run_dir))["saved_by"].items() >= {"global_rank": 0, "world_size": 2}.items()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no rank made a dir of its own
    record = json.loads((run_dir / "throughput.json").read_text())  # each rank says what it trained on
    assert [r["device"] for r in record["rank_devices"]] == ["cpu", "cpu"] and len(set(record["pids"])) == 2
    assert len(list((run_dir / "tensorboard").glob("events.*"))) >= 1
    found = scalars(run_dir)
    assert "train/loss" not in found and len(found["train/loss_epoch"]) == 1 and found["train/loss_epoch"][0].value > 0
    if strategy == "ddp":  # local rank 1 re-entered src.train and logged into the same dir
        assert (run_dir / "train_node0_local1.log").is_file()
        rows = list(csv.DictReader((run_dir / "metrics.csv").open()))  # only rank zero wrote it
        assert [float(r["train/loss_epoch"]) for r in rows if r.get("train/loss_epoch")] == pytest.approx(
            [found["train/loss_epoch"][0].value]
        )


def test_the_port_the_launcher_picks_is_held_until_rank_zeros_store_listens_on_it(tmp_path):
    """From the moment local rank 1 is started with MASTER_PORT, no other process can bind that port (torch's own
    store binds with SO_REUSEADDR, as this probe does): picked and released, it stayed free while the ranks started."""
    proc = train(*FAST, "strategy=ddp", "trainer.devices=2", f"hydra.run.dir={tmp_path}/run", background=True)
    port, deadline = None, time.monotonic() + 60
    while port is None and proc.poll() is None and time.monotonic() < deadline:
        port = next(
            (
                int(env["MASTER_PORT"])
                for pid in descendants(proc.pid)
                if "MASTER_PORT" in (env := process_environ(pid) or {})
            ),
            None,
        )
    assert port is not None, "local rank 1 never started"
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError) as taken:
            probe.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


def test_logger_csv_writes_metrics_csv_in_the_run_dir_with_every_epochs_training_loss(tmp_path):
    result = train(*FAST, "trainer.max_epochs=2", "logger=csv", f"hydra.run.dir={tmp_path}")
    assert_ok(result)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["epoch"]) for r in rows if r["train/loss_epoch"]] == [0, 1]
    assert [int(r["step"]) for r in rows if r["train/loss"]] == [0, 1, 2, 3]  # log_every_n_steps=1: each step
    assert any(r["test/acc"] for r in rows) and not (tmp_path / "tensorboard").exists()


def test_two_nodes_of_one_process_each_over_loopback(tmp_path):
    port = free_port()
    args = [*FAST, "strategy=ddp", "trainer.devices=1", "trainer.num_nodes=2", f"hydra.run.dir={tmp_path}"]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    node1 = train(*args, env={**env, "NODE_RANK": "1"}, background=True)
    node0 = train(*args, env={**env, "NODE_RANK": "0"})
    out1, _ = node1.communicate(timeout=300)
    assert_ok(node0)
    assert node1.returncode == 0, out1[-4000:]
    assert "Run: 2 node(s) x 1 device(s) = world size 2" in output(node0)
    assert checkpoint(only_last_ckpt(tmp_path))["saved_by"].items() >= {"global_rank": 0, "world_size": 2}.items()
    assert (tmp_path / "train_node1_local0.log").is_file()


def test_nodes_that_count_the_world_differently_each_stop_at_once_naming_both_counts(tmp_path):
    """Node 1 with trainer.devices=2 where node 0 has 1 (devices=auto on nodes with different GPUs): both waited
    out strategy.timeout_s (300 s) and blamed the addresses, though both had reached the store. (Nodes that count
    alike but train otherwise: tests/test_torchrun.py's, under torchrun, and tests/test_scale.py's benchmark.)"""
    port = free_port()
    args = [*FAST, "strategy=ddp", "trainer.num_nodes=2", f"hydra.run.dir={tmp_path}"]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    start = time.monotonic()
    node1 = train(*args, "trainer.devices=2", env={**env, "NODE_RANK": "1"}, background=True)
    node0 = train(*args, "trainer.devices=1", env={**env, "NODE_RANK": "0"})
    out1, _ = node1.communicate(timeout=300)
    line = (
        f"NODE_RANK=1 ({HOST}) counts trainer.num_nodes x trainer.devices as 2 x 2 = 4 processes, node 0 ({HOST}) as "
        "2 x 1 = 2: start "
        "every node with the same trainer.num_nodes and trainer.devices"
    )
    assert node0.returncode == 2 and f"error: rank 0: {line}" in output(node0), output(node0)[-3000:]
    # whichever of node 1's ranks found it first: one line
    assert node1.returncode == 2 and len(re.findall(rf"error: rank [23]: {re.escape(line)}", out1)) == 1, out1[-3000:]
    assert "Traceback" not in output(node0) + out1
    assert time.monotonic() - start < 150  # not the 300 s of strategy.timeout_s


def test_a_rank_of_a_node_that_counts_more_that_comes_after_rank_0_had_its_count_still_says_its_line():
    """Node 0 counts 2 x 1 ranks, node 1 2 x 2: node 1's first rank to come (here its second, rank 3) meets rank 0's
    count, and rank 2 comes a second later. Before, rank 0 had gone with the world's keys by then, and rank 2 waited
    for them until the rank it started gave up (30 s; the test above, in one run of three in the suite); now it reads
    them and says its own line. One real TCPStore, a thread a rank."""
    import threading
    from datetime import timedelta

    from src.core.errors import UserError
    from src.distributed.strategy import agree_on_world

    wait = timedelta(seconds=20)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait)
    said: dict[int, str | None] = {}

    def rank(number: int, node: int, devices: int, late_s: float) -> None:
        time.sleep(late_s)
        client = store if number == 0 else torch.distributed.TCPStore("127.0.0.1", store.port, timeout=wait)
        try:
            agree_on_world(client, number, node, 2, devices, wait)
            said[number] = None
        except UserError as err:
            said[number] = str(err)
        except Exception as err:  # noqa: BLE001 - the test names what else it met
            said[number] = f"{type(err).__name__}: {err}"

    start = time.monotonic()
    ranks = [threading.Thread(target=rank, args=args) for args in ((0, 0, 1, 0.0), (3, 1, 2, 0.0), (2, 1, 2, 1.0))]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=60)
    line = (
        f"NODE_RANK=1 ({HOST}) counts trainer.num_nodes x trainer.devices as 2 x 2 = 4 processes, node 0 ({HOST}) as "
        "2 x 1 = 2: start every node with the same trainer.num_nodes and trainer.devices (a count, not auto, where the "
        "nodes' GPUs differ)"
    )
    assert said == {0: f"rank 0: {line}", 3: f"rank 3: {line}", 2: f"rank 2: {line}"}, said
    assert time.monotonic() - start < 10  # rank 0 stays LATE_S (2 s) once a rank differs, not the store's 20 s


def test_the_real_cifar10_sample_trains(sample_root, tmp_path):
    result = train(
        *FAST_RUN, "data=cifar10", f"data.root={sample_root}", "data.download=false", f"hydra.run.dir={tmp_path}"
    )
    assert_ok(result)
    assert "not the canonical release" in output(result)
    only_last_ckpt(tmp_path)


def assert_user_error(result, *words: str, seconds: float | None = None) -> None:
    text = output(result)
    assert result.returncode != 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    for word in words:
        assert word in text, text[-3000:]


def test_a_rank_whose_peers_never_arrive_fails_after_the_timeout_naming_the_rendezvous(tmp_path):
    port = free_port()

    def alone(node_rank: int):  # one node of two, by hand, whose peer never starts
        return train(
            *FAST,
            "strategy=ddp",
            "trainer.devices=1",
            "trainer.num_nodes=2",
            "strategy.timeout_s=5",
            f"hydra.run.dir={tmp_path}/node{node_rank}",
            env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node_rank)},
            timeout=120,
        )

    start = time.monotonic()
    assert_user_error(
        alone(0),
        f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}",
        "NODE_RANK=0",
        "world size 2",
        "within 5 s",
        # which nodes never came (at 256 nodes, the one to look at)
        "within 5 s: 1 of 2 nodes reached its store: NODE_RANK=1 did not (not started yet, or dialling another "
        f"address or port); node 0's store listened on 127.0.0.1:{port}",
        "strategy.store_bind=all",
    )
    assert time.monotonic() - start < 60
    # node 1's side, node 0 never started: before, torch's client waited the timeout twice (20 s took 59 s) and
    # printed c10d's warnings and two C++ stacks
    start = time.monotonic()
    result = alone(1)
    assert_user_error(
        result,
        f"error: rank 1 (NODE_RANK=1) could not form a process group of world size 2 at MASTER_ADDR:MASTER_PORT="
        f"127.0.0.1:{port} within 5 s: 127.0.0.1:{port} refused the connection: node 0 has not started",
    )
    assert "c10d" not in output(result) and "frame #" not in output(result), output(result)[-3000:]
    assert time.monotonic() - start < 40


def test_a_rank_waits_for_node_0s_store_to_answer_and_says_what_it_met_when_it_never_does():
    """The wait of node 1's ranks (src/distributed/strategy.py's store_client): a store that starts listening a
    moment later (node 0 late) is met, and its waits for keys take the whole timeout; a name no resolver takes
    (before, a traceback from Python's IDNA codec) and a port nobody listens on end the wait at its timeout, not twice
    it, saying which."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from src.distributed.strategy import StoreUnreachable, store_client

    port = free_port()
    hosts = []
    threading.Timer(
        0.5,
        lambda: hosts.append(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)),
    ).start()
    start = time.monotonic()
    client = store_client("127.0.0.1", port, 2, timedelta(seconds=20))
    assert 0.5 <= time.monotonic() - start < 10
    client.set("k", "v")
    assert hosts[0].get("k") == b"v" and client.timeout == timedelta(seconds=20)
    port = free_port()
    for host, met in (
        ("127.0.0.1", f"127.0.0.1:{port} refused the connection: node 0 has not started"),
        ("node..1", "MASTER_ADDR=node..1 does not resolve here (not a valid hostname: an empty label"),
    ):
        start = time.monotonic()
        with pytest.raises(StoreUnreachable) as refused:
            store_client(host, port, 2, timedelta(seconds=2))
        assert str(refused.value).startswith(met), str(refused.value)
        assert 2 <= time.monotonic() - start < 5


def test_ckpt_path_auto_means_the_run_dirs_last_checkpoint_if_there_is_one(tmp_path):
    from src.checkpoints.files import UnreadableCheckpoint
    from src.checkpoints.resume import resume_from
    from src.core.errors import UserError

    assert resume_from("auto", str(tmp_path / "checkpoints")) == (None, None)  # nothing yet: start fresh
    with pytest.raises(UserError, match="ckpt_path=last but .* does not exist"):
        resume_from("last", str(tmp_path / "checkpoints"))  # last, though, must exist
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    torch.save({"global_step": 7}, last)
    for given in ("auto", "last", str(last)):
        path, checkpoint = resume_from(given, str(tmp_path / "checkpoints"))
        assert path == str(last) and checkpoint["global_step"] == 7
    assert resume_from(None, str(tmp_path / "checkpoints")) == (None, None)
    last.write_bytes(b"x")  # broken, and nothing intact beside it: no silent fresh start
    with pytest.raises(UnreadableCheckpoint, match="is not a checkpoint"):
        resume_from("auto", str(tmp_path / "checkpoints"))


def test_resume_with_ckpt_path_last_in_the_same_run_dir(single_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(single_run / "checkpoints", run_dir / "checkpoints")
    result = train(
        *SINGLE,
        "trainer.limit_train_batches=12",
        "trainer.max_epochs=3",
        "ckpt_path=last",
        "test=false",
        f"hydra.run.dir={run_dir}",
    )
    assert_ok(result)
    assert checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 36


def test_ddp_without_a_best_checkpoint_reads_the_epochs_values_on_every_rank_and_ends(tmp_path):
    # Only rank zero's progress bar shows the epoch's values; reading them reduces them across ranks. Nothing else
    # read them first once callbacks.model_checkpoint=null: rank zero waited in a collective the others never joined.
    result = train(
        *FAST,
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.max_epochs=2",
        "callbacks.model_checkpoint=null",
        "strategy.timeout_s=60",
        "test=false",
        f"hydra.run.dir={tmp_path}",
        timeout=240,
    )
    assert result.returncode == 0, output(result)[-3000:]
    assert "fit: 2 epochs" in output(result)
