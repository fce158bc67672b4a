"""The datamodules: CIFAR-10 batches read, verified and split; synthetic images learnable; clear errors."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from src.core.errors import UserError
from src.data.cifar10 import CIFAR10DataModule, read_batch
from src.data.in_memory import CIFAR10_MEAN, CIFAR10_STD
from src.data.synthetic import SyntheticDataModule
from tests.conftest import FAST_RUN, ROOT, output, train, write_cifar_folder


def test_generated_cifar_folder_loads_with_a_seeded_disjoint_split(cifar_root, caplog):
    dm = CIFAR10DataModule(root=str(cifar_root), download=False, val_size=0.2, batch_size=8, seed=3)
    with caplog.at_level(logging.WARNING):
        dm.prepare_data()
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (80, 20, 20)
    again = CIFAR10DataModule(root=str(cifar_root), download=False, val_size=0.2, seed=3)
    again.setup("fit")
    assert torch.equal(again.val_set.images, dm.val_set.images)  # same seed, same split
    other = CIFAR10DataModule(root=str(cifar_root), download=False, val_size=0.2, seed=4)
    other.setup("fit")
    assert not torch.equal(other.val_set.images, dm.val_set.images)
    # disjoint: no image is both in train and val (the generated images are distinct random arrays)
    train_rows = {bytes(x.numpy()) for x in dm.train_set.images}
    assert not any(bytes(x.numpy()) in train_rows for x in dm.val_set.images)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32 and labels.dtype == torch.int64


def test_a_folder_that_is_not_the_release_loads_with_a_one_line_warning(cifar_root, caplog):
    with caplog.at_level(logging.WARNING):
        CIFAR10DataModule(root=str(cifar_root), download=False).prepare_data()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "not the canonical release" in warnings[0] and "data_batch_1" in warnings[0]


def test_a_truncated_batch_file_is_an_error_naming_the_file(cifar_root):
    path = cifar_root / "cifar-10-batches-py" / "data_batch_3"
    path.write_bytes(path.read_bytes()[:1000])
    dm = CIFAR10DataModule(root=str(cifar_root), download=False)
    with pytest.raises(UserError, match=r"data_batch_3 is truncated or corrupt"):
        dm.setup("fit")


def test_a_batch_file_that_would_run_code_is_refused(cifar_root):
    path = cifar_root / "cifar-10-batches-py" / "test_batch"
    path.write_bytes(pickle.dumps({"data": __import__("os").system}))  # a pickle that imports os.system
    with pytest.raises(UserError, match="test_batch is truncated or corrupt.*unexpected object"):
        read_batch(path)


def test_a_missing_batch_file_is_named(cifar_root):
    (cifar_root / "cifar-10-batches-py" / "data_batch_5").unlink()
    with pytest.raises(UserError, match="lacks data_batch_5"):
        CIFAR10DataModule(root=str(cifar_root), download=False).prepare_data()


def test_missing_data_without_download_names_data_root(tmp_path):
    with pytest.raises(UserError, match=rf"data.root={tmp_path}.*data.download=false.*data=synthetic"):
        CIFAR10DataModule(root=str(tmp_path), download=False).prepare_data()


def test_missing_data_with_an_unreachable_server_fails_fast_and_names_data_root(tmp_path):
    dm = CIFAR10DataModule(root=str(tmp_path), download=True, download_url="http://127.0.0.1:9/cifar-10-python.tar.gz")
    with pytest.raises(UserError, match=rf"not under data.root={tmp_path}.*127.0.0.1:9.*data=synthetic"):
        dm.prepare_data()
    assert not (tmp_path / "cifar-10-batches-py").exists() and not (tmp_path / "cifar-10-python.tar.gz").exists()


def test_a_data_root_that_is_a_file_or_lies_under_one_is_one_line_before_any_download(tmp_path):
    """Before: a warning that the download lock could not be made, a download begun, then its failure."""
    (tmp_path / "file").write_text("x")
    for root in (tmp_path / "file", tmp_path / "file" / "sub"):
        dm = CIFAR10DataModule(root=str(root), download=True, download_url="http://127.0.0.1:9/cifar-10-python.tar.gz")
        with pytest.raises(UserError, match=rf"^data.root={root} is a file, or lies under one, not a folder: point"):
            dm.prepare_data()


def test_val_size_that_leaves_nothing_to_train_on_is_a_user_error(cifar_root):
    with pytest.raises(UserError, match="data.val_size=100"):
        CIFAR10DataModule(root=str(cifar_root), download=False, val_size=100).setup("fit")


@pytest.mark.parametrize(
    "values",
    [
        {"batch_size": 0},
        {"batch_size": -4},
        {"batch_size": 1.5},
        {"max_batch_size": 0},
        {"num_workers": -1},
        {"num_workers": True},  # before: taken as 1 worker
        {"augment": "maybe"},  # before: taken as true
        {"pin_memory": "maybe"},
    ],
)
def test_a_count_of_the_datamodule_out_of_its_range_is_a_user_error_naming_it(values):
    ((key, value),) = values.items()
    with pytest.raises(UserError, match=f"data.{key}={value} must be"):
        SyntheticDataModule(**values)


def test_real_sample_reads_in_release_order_with_its_statistics(sample_root, caplog):
    dm = CIFAR10DataModule(root=str(sample_root), download=False, batch_size=100)
    with caplog.at_level(logging.WARNING):
        dm.prepare_data()
    assert "not the canonical release" in caplog.text
    images, labels = read_batch(sample_root / "cifar-10-batches-py" / "data_batch_1")
    assert images.shape == (1000, 3, 32, 32) and labels[:10].tolist() == [6, 9, 9, 4, 1, 1, 2, 7, 8, 3]
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4500, 500, 1000)
    # channel order and scale are right: the sample's per-channel means are CIFAR-10's to within a few %
    means = dm.train_set.images.float().mean(dim=(0, 2, 3)) / 255
    assert torch.allclose(means, torch.tensor(CIFAR10_MEAN), atol=0.03)
    normalised = torch.stack([dm.test_set[i][0] for i in range(1000)])
    assert normalised.mean(dim=(0, 2, 3)).abs().max() < 0.15
    assert (normalised.std(dim=(0, 2, 3)) - 1).abs().max() < 0.15
    assert torch.tensor(CIFAR10_STD).min() > 0


def test_training_augmentation_crops_and_flips_but_evaluation_does_not(sample_root):
    dm = CIFAR10DataModule(root=str(sample_root), download=False)
    dm.setup("fit")
    raw = dm.train_set.images[0]
    views = torch.stack([dm.train_set[0][0] for _ in range(200)])
    assert len({bytes(v.numpy()) for v in views}) > 50  # crop offsets x flips: many distinct views
    plain = dm.val_set[0][0]
    assert torch.equal(plain, dm.val_set[0][0])
    expected = (raw.float() / 255 - torch.tensor(CIFAR10_MEAN)[:, None, None]) / torch.tensor(CIFAR10_STD)[
        :, None, None
    ]
    assert torch.allclose(dm.val_set.transform(raw), expected, atol=1e-5)
    assert views.shape == (200, 3, 32, 32)


def test_synthetic_data_is_deterministic_sized_and_class_dependent():
    a = SyntheticDataModule(num_train=200, num_test=50, image_size=24, seed=1)
    b = SyntheticDataModule(num_train=200, num_test=50, image_size=24, seed=1)
    a.setup("fit"), b.setup("fit")
    assert torch.equal(a.train_set.images, b.train_set.images)
    assert a.train_set.images.shape == (180, 3, 24, 24) and len(a.val_set) == 20 and len(a.test_set) == 50
    # the per-class mean images differ far more than the noise between two halves of one class
    x, y = a.train_set.images.float(), a.train_set.labels
    class_means = torch.stack([x[y == c].mean(0) for c in range(10)])
    spread = torch.cdist(class_means.flatten(1), class_means.flatten(1))
    assert spread[~torch.eye(10, dtype=torch.bool)].min() > 20
    assert set(np.unique(y.numpy())) == set(range(10))


# -- the first download: once per data.root, before any rank waits in the rendezvous --------------------------------


def cifar_tarball(tmp_path: Path) -> bytes:
    """A tar.gz laid out as the release's cifar-10-python.tar.gz (its MD5 is not the release's)."""
    folder = write_cifar_folder(tmp_path / "source") / "cifar-10-batches-py"
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    return archive.read_bytes()


@contextlib.contextmanager
def slow_server(body: bytes, seconds: float) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on 127.0.0.1 that sends ``body`` in pieces over ``seconds``; yields its URL and the paths it
    sent whole (torchvision's first GET only reads where the URL leads, and hangs up)."""
    sent: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            pieces = 16
            try:
                for i in range(pieces):  # the wait first: the last piece's write is the last thing before the record
                    time.sleep(seconds / pieces)
                    self.wfile.write(body[i * len(body) // pieces : (i + 1) * len(body) // pieces])
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return
            sent.append(self.path)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cifar-10-python.tar.gz", sent
    finally:
        server.shutdown()
        server.server_close()


def test_a_first_download_slower_than_the_rendezvous_timeout_ends_before_the_ranks_meet(tmp_path):
    # Before, rank 0 downloaded after starting rank 1, which then timed out in the rendezvous (2 s here) and failed
    # the run. Now every rank waits for the download first; it fails on its MD5 (not the release), once, in one line.
    root, seconds, body = tmp_path / "data", 6.0, cifar_tarball(tmp_path)  # 3x the rendezvous timeout
    with slow_server(body, seconds) as (url, sent):
        start = time.monotonic()
        result = train(
            *FAST_RUN,
            "data=cifar10",
            f"data.root={root}",
            f"data.download_url={url}",
            "strategy=ddp",
            "trainer.devices=2",
            "strategy.timeout_s=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        )
        took = time.monotonic() - start
    text = output(result)
    assert result.returncode == 2, text[-3000:]
    assert [line for line in text.splitlines() if line.startswith("error:")] == [
        f"error: the file downloaded from {url} is not CIFAR-10's release (MD5 {hashlib.md5(body).hexdigest()}, the "
        "release's is c58f30108f718f92721af3b95e74349a): point data.download_url at the release or a mirror of it, or "
        f"put the release's cifar-10-batches-py folder under data.root={root}"
    ], text[-3000:]
    assert "could not form a process group" not in text and "Traceback" not in text
    assert sent == ["/cifar-10-python.tar.gz"], "the other rank downloaded again instead of failing with its line"
    assert seconds < took < seconds + 60
    assert sorted(p.name for p in root.iterdir()) == [".cifar-10-download-failed.json", ".cifar-10-download.lock"]


def lock_waiters(path: Path) -> int:
    """Processes waiting for a POSIX lock on ``path`` (/proc/locks marks a blocked request '->')."""
    inode = f":{path.stat().st_ino} "
    return sum("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def test_a_download_that_failed_while_this_process_waited_fails_it_at_once_with_that_line(tmp_path):
    # another process (on another node) holds the lock, then records its failure: this one, waiting, repeats its line
    # without trying the URL, which would hang here until the 30 s read timeout
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import json, sys; from pathlib import Path; from src.launch.run_dir import locked\n"
                f"root = Path({str(tmp_path)!r})\n"
                "with locked(root / '.cifar-10-download.lock'):\n"
                "    print('locked', flush=True); sys.stdin.readline()\n"
                "    (root / '.cifar-10-download-failed.json').write_text(json.dumps("
                "{'line': 'downloading failed on node2', 'host': 'node2', 'pid': 1, 'run': 'elsewhere', 'at': 1.0}))\n"
            ),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "locked\n"
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        dm = CIFAR10DataModule(root=str(tmp_path), download_url=f"http://127.0.0.1:{silent.getsockname()[1]}/c.tar.gz")
        raised: list[BaseException] = []
        waiter = threading.Thread(target=lambda: raised.append(pytest.raises(UserError, dm.prepare_data).value))
        waiter.start()
        deadline = time.monotonic() + 30
        while lock_waiters(tmp_path / ".cifar-10-download.lock") == 0:
            assert waiter.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        start = time.monotonic()
        holder.communicate("go\n", timeout=30)
        waiter.join(timeout=20)
        assert not waiter.is_alive() and time.monotonic() - start < 10
        assert str(raised[0]) == "downloading failed on node2"
        silent.setblocking(False)
        with pytest.raises(BlockingIOError):
            silent.accept()  # nobody tried the URL


def test_a_failure_an_earlier_download_left_is_tried_again_not_repeated(tmp_path):
    (tmp_path / ".cifar-10-download-failed.json").write_text('{"line": "an earlier failure", "pid": 1, "at": 1.0}')
    dm = CIFAR10DataModule(root=str(tmp_path), download_url="http://127.0.0.1:9/cifar-10-python.tar.gz")
    with pytest.raises(UserError, match=r"downloading it from http://127.0.0.1:9/.* failed \(URLError"):
        dm.prepare_data()
    assert "127.0.0.1:9" in json.loads((tmp_path / ".cifar-10-download-failed.json").read_text())["line"]


def test_a_complete_download_puts_the_folder_in_place_whole_and_leaves_nothing_else(tmp_path, monkeypatch):
    # the release cannot be fetched here: the served archive's own MD5 stands in for the release's
    body = cifar_tarball(tmp_path)
    monkeypatch.setattr("src.data.cifar10.ARCHIVE_MD5", hashlib.md5(body).hexdigest())
    root = tmp_path / "data"
    (root / ".cifar-10-download-4242").mkdir(parents=True)  # a download killed half way
    (root / ".cifar-10-download-failed.json").write_text('{"line": "an earlier failure"}')
    with slow_server(body, 0.1) as (url, sent):
        dm = CIFAR10DataModule(root=str(root), download_url=url, batch_size=8)
        dm.prepare_data()
    assert sent == ["/cifar-10-python.tar.gz"]
    assert sorted(p.name for p in root.iterdir()) == [".cifar-10-download.lock", "cifar-10-batches-py"]
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 100 and len(dm.test_set) == 20


def test_a_rank_counts_the_cores_srun_bound_it_to_once(monkeypatch):
    """data.num_workers=auto's cores: srun's per-task binding gives a rank its own cores, not a share to divide
    again."""
    from src.launch.ranks import rank_cores

    def machine(cpus: int, affinity: int, **slurm: str) -> None:
        monkeypatch.setattr(os, "cpu_count", lambda: cpus)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
        for key in ("SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_CPUS_PER_TASK", "SLURM_JOB_NAME", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(key, raising=False)
        for key, value in slurm.items():
            monkeypatch.setenv(key, value)

    srun = {"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "train", "SLURM_CPUS_PER_TASK": "8"}
    machine(64, 8, **srun)
    assert rank_cores(4) == 8  # --cpu-bind=cores: the task's own 8 (it was 8 // 4 = 2)
    machine(64, 64, **srun)
    assert rank_cores(4) == 16  # not bound: the node's cores shared by its 4 tasks
    machine(64, 32, **srun)
    assert rank_cores(4) == 8  # the job's cores on this node (a cgroup), not bound per task: shared
    machine(64, 8)
    assert rank_cores(4) == 2  # no srun: our own 4 local ranks share what this process may use


def test_the_run_lines_word_on_loader_workers_says_an_unused_count_and_more_workers_than_cores(monkeypatch):
    """Before: data.num_workers=4 under the device pipeline went without a word, and under the DataLoader pipeline
    torch warned once per loader (a raw UserWarning, twice a run). rank_cores is fixed at 2 here."""
    monkeypatch.setattr(SyntheticDataModule, "rank_cores", lambda self: 2)
    assert SyntheticDataModule(pipeline="device").describe_workers() is None
    assert SyntheticDataModule(num_workers=4, pipeline="device").describe_workers() == (
        "data.num_workers=4 unused (data.pipeline=device batches on the device, without loader workers; "
        "data.pipeline=dataloader uses them)"
    )
    assert SyntheticDataModule(num_workers=2, pipeline="dataloader").describe_workers() == (
        "2 loader workers a process (data.num_workers; 2 core(s) for this rank), started by fork"
    )
    assert SyntheticDataModule(num_workers=0, pipeline="dataloader").describe_workers() == (
        "0 loader workers a process (data.num_workers; 2 core(s) for this rank)"  # none to start
    )
    assert (
        SyntheticDataModule(num_workers=4, pipeline="dataloader")
        .describe_workers()
        .endswith(
            "(data.num_workers; 2 core(s) for this rank): more workers than cores, which they take from training, "
            "started by fork"
        )
    )


@pytest.mark.parametrize(
    "version, name, hangs",
    [
        ((3, 10, 12), "cpython", True),  # Ubuntu 22.04's
        ((3, 10, 15), "cpython", False),
        ((3, 11, 2), "cpython", True),  # Debian 12's
        ((3, 11, 9), "cpython", True),
        ((3, 11, 10), "cpython", False),
        ((3, 12, 0), "cpython", False),
        ((3, 13, 1), "cpython", False),
        ((3, 10, 12), "pypy", False),
    ],
)
def test_a_fork_that_can_hang_is_known_by_the_python_release(version, name, hangs):
    """cpython#112275: before 3.10.15 and 3.11.10, a forked child waits for good on the interpreter's thread-state lock
    where another thread held it at the fork; 3.12 mended it first."""
    from src.data.in_memory import fork_can_hang

    assert fork_can_hang(version, name) is hangs


def test_workers_start_by_forkserver_where_this_pythons_fork_can_hang_beside_a_process_group(monkeypatch):
    """auto: fork for one process (no process group's threads); forkserver beside a process group where the Python's
    fork can hang, said on the run line with the release that mends it; a start method named is taken as named."""
    from src.data import in_memory

    monkeypatch.setattr(SyntheticDataModule, "rank_cores", lambda self: 2)
    monkeypatch.setattr(in_memory, "FORK_SAFE_FROM", {sys.version_info[:2]: (3, 99, 0)})
    data = SyntheticDataModule(num_workers=2, pipeline="dataloader")
    for world, hangs, method in ((1, True, "fork"), (2, False, "fork"), (2, True, "forkserver")):
        data.trainer = type("Trainer", (), {"world_size": world, "num_devices": world})()
        monkeypatch.setattr(in_memory, "fork_can_hang", lambda hangs=hangs: hangs)
        assert data.worker_start()[0] == method
    version = ".".join(map(str, sys.version_info[:3]))
    why = f"auto: Python {version}'s fork can hang a worker beside the process group's threads, mended in 3.99.0"
    assert data.worker_start() == ("forkserver", why)
    assert data.describe_workers() == (
        f"2 loader workers a process (data.num_workers; 2 core(s) for this rank), started by forkserver ({why})"
    )
    assert SyntheticDataModule(pipeline="dataloader", multiprocessing_context="spawn").worker_start() == ("spawn", None)
    with pytest.raises(
        UserError, match="^data.multiprocessing_context=threads is not known: choose one of auto, fork, "
    ):
        SyntheticDataModule(multiprocessing_context="threads")
