"""CIFAR-10 from the release's python-version batches: download once, verify, read safely."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pickle
import shutil
import socket
import time
from pathlib import Path
from typing import NoReturn

import torch
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import download_url, extract_archive

from src.core.console import warning_line
from src.core.errors import ToldElsewhere, UserError
from src.data.in_memory import InMemoryImageDataModule
from src.launch.ranks import alive, is_launch_rank_zero
from src.launch.run_dir import locked, read_json, write_json

log = logging.getLogger(__name__)

FOLDER = "cifar-10-batches-py"
# The release's own checksums, as torchvision records them.
RELEASE_MD5 = {name: md5 for name, md5 in CIFAR10.train_list + CIFAR10.test_list}
RELEASE_MD5[CIFAR10.meta["filename"]] = CIFAR10.meta["md5"]
TRAIN_FILES = [name for name, _ in CIFAR10.train_list]
TEST_FILE = CIFAR10.test_list[0][0]
ARCHIVE_MD5 = CIFAR10.tgz_md5  # cifar-10-python.tar.gz's
# batches.meta's label_names, in label order
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
DOWNLOAD_TIMEOUT_S = 30  # per read: a dead network fails in this long, a slow download takes the time it needs
# in data.root: the download's lock, and the record a failed download leaves for the processes that waited for it
DOWNLOAD_LOCK = ".cifar-10-download.lock"
FAILED_DOWNLOAD = ".cifar-10-download-failed.json"
_STAGING = ".cifar-10-download-"  # + pid: the archive and its extraction, renamed into place when whole
WRITER_EXIT_WAIT_S = 60


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """The batches are pickles; load only what a numpy array needs, never arbitrary code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle's signature
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        return super().find_class(module, name)


def read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch file -> uint8 images (N, 3, 32, 32) and int64 labels; a damaged file raises UserError naming it."""
    try:
        with open(path, "rb") as f:
            entry = _NumpyOnlyUnpickler(f, encoding="latin1").load()
        data, labels = entry["data"], entry.get("labels", entry.get("fine_labels"))
        images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
        labels = torch.as_tensor(labels, dtype=torch.int64)
        if images.dtype != torch.uint8 or len(images) != len(labels) or len(labels) == 0:
            raise ValueError(f"{len(images)} images of {images.dtype} for {len(labels)} labels")
        if labels.min() < 0 or labels.max() > 9:
            raise ValueError("labels outside 0-9")
    except PermissionError as err:
        raise UserError(
            f"cannot read {path}: {err.strerror}; fix its permissions or point data.root elsewhere"
        ) from err
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(
            f"{path} is truncated or corrupt ({type(err).__name__}: {err}); delete {path.parent} and let "
            "data.download=true fetch the release again, or restore the file"
        ) from err
    return images, labels


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CIFAR10DataModule(InMemoryImageDataModule):
    """CIFAR-10 under ``root/cifar-10-batches-py``: 50,000 training images (split into train/val) and 10,000 test."""

    def __init__(self, root: str = "data", download: bool = True, download_url: str = CIFAR10.url, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.num_classes != 10:
            raise UserError(f"CIFAR-10 has 10 classes, not data.num_classes={self.num_classes}")
        self.root, self.download, self.download_url = Path(root).expanduser(), download, download_url
        self._checked = False

    @property
    def class_names(self) -> list[str]:
        return list(CLASSES)

    @property
    def folder(self) -> Path:
        return self.root / FOLDER

    def prepare_data(self) -> None:
        """Download once when missing (``data.download=true``); in the process that owns the run, also check the files
        against the release.

        Every rank calls it before the ranks meet (src/train.py), whatever started them: a download can outlast any
        rendezvous timeout. The first process to need it downloads, under a lock in data.root; the others (this run's
        ranks on the node, or on every node where data.root is shared, and other runs) wait for it and find the data.
        """
        if self._checked:
            return
        try:
            if not self.folder.is_dir():
                if not self.download:
                    raise UserError(
                        f"CIFAR-10 is not under data.root={self.root} (no {FOLDER} folder) and data.download=false: "
                        "set data.download=true, point data.root at the folder that holds it, or use data=synthetic "
                        "offline"
                    )
                self._download_once()
            if is_launch_rank_zero():  # one process checks the files: the others could only repeat what it says
                self._verify()
        except PermissionError as err:
            raise UserError(
                f"data.root={self.root} cannot be read ({err.strerror}: {err.filename}): fix its "
                "permissions (chmod -R a+rX), or point data.root at a copy you can read"
            ) from err
        self._checked = True

    def _download_once(self) -> None:
        """Download under the lock, unless another process has meanwhile; a download that failed while this process
        waited for it fails this one too, at once, with its line (rather than a retry, and 30 s more offline)."""
        record = self.root / FAILED_DOWNLOAD
        with contextlib.ExitStack() as held:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                before = read_json(record)  # a failure from before this process waited: not one to repeat
                held.enter_context(locked(self.root / DOWNLOAD_LOCK))
                alone = True
            except OSError as err:
                if err.errno in (errno.EEXIST, errno.ENOTDIR):  # before: a download into a file, then its failure
                    raise UserError(
                        f"data.root={self.root} is a file, or lies under one, not a folder: point data.root at the "
                        f"folder that holds {FOLDER}, or at a new one to download it into"
                    ) from err
                if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise UserError(
                        f"CIFAR-10 is not under data.root={self.root}, which is not writable "
                        f"({err.strerror}): choose another data.root, or put the release's {FOLDER} "
                        "folder there"
                    ) from err
                log.warning(
                    "cannot lock %s (%s): downloading without it (other processes may download too)",
                    self.root / DOWNLOAD_LOCK,
                    err.strerror,
                )  # a filesystem without locks
                alone = False
            if self.folder.is_dir():
                return  # another process downloaded it
            failed = read_json(record)
            if failed is not None and failed != before:
                _failed_meanwhile(failed)
            for stale in self.root.glob(_STAGING + "*") if alone else ():  # downloads killed half way
                shutil.rmtree(stale, ignore_errors=True)
            try:
                self._download()
            except UserError as err:
                write_json(
                    record,
                    {
                        "line": str(err),
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "run": _this_run(),
                        "at": time.time(),
                    },
                )
                raise
            record.unlink(missing_ok=True)

    def _download(self) -> None:
        """Fetch and unpack the release into a staging folder, then rename it into place: the folder is there whole,
        or not at all, for any process that looks."""
        log.info("Downloading CIFAR-10 from %s into %s", self.download_url, self.root)
        staging = self.root / f"{_STAGING}{os.getpid()}"
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # urllib has none by default: a dead network would hang
        try:
            download_url(self.download_url, str(staging), CIFAR10.filename)
            md5 = md5sum(staging / CIFAR10.filename)
            if md5 != ARCHIVE_MD5:
                raise UserError(
                    f"the file downloaded from {self.download_url} is not CIFAR-10's release (MD5 {md5}, "
                    f"the release's is {ARCHIVE_MD5}): point data.download_url at the release or a "
                    f"mirror of it, or put the release's {FOLDER} folder under data.root={self.root}"
                )
            extract_archive(str(staging / CIFAR10.filename), str(staging))
            try:
                os.replace(staging / FOLDER, self.folder)
            except OSError:
                if not self.folder.is_dir():  # else another process's download, without a lock, was first: the same
                    raise
        except PermissionError as err:
            raise UserError(
                f"data.root={self.root} is not writable ({err.strerror}): choose another data.root"
            ) from err
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure to fetch means the same thing to the user
            raise UserError(
                f"CIFAR-10 is not under data.root={self.root} and downloading it from {self.download_url} failed "
                f"({type(err).__name__}: {err}); put the release's {FOLDER} folder there, point data.root at one, "
                "or run offline with data=synthetic"
            ) from err
        finally:
            socket.setdefaulttimeout(previous)
            shutil.rmtree(staging, ignore_errors=True)

    def _verify(self) -> None:
        missing = [name for name in RELEASE_MD5 if not (self.folder / name).is_file()]
        if missing:
            raise UserError(
                f"{self.folder} lacks {', '.join(missing)}: restore them, or delete the folder and "
                "let data.download=true fetch the release again"
            )
        differing = [name for name, md5 in RELEASE_MD5.items() if md5sum(self.folder / name) != md5]
        for name in differing:  # not the release's bytes: read them now, so a truncated file fails before DDP starts
            if name != CIFAR10.meta["filename"]:
                read_batch(self.folder / name)
        if differing:
            warning_line(
                log,
                f"data.root={self.root} is in the CIFAR-10 format but is not the canonical release "
                f"({', '.join(differing)} differ from its checksums): loading it anyway; figures from it are not "
                "CIFAR-10 results",
                say=is_launch_rank_zero(),  # every rank checks the data it loads
            )
        else:
            log.info("CIFAR-10 release verified under %s", self.folder)

    def load(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.folder.is_dir():  # a rank that skipped prepare_data still explains itself
            self.download = False
            self.prepare_data()
        train = [read_batch(self.folder / name) for name in TRAIN_FILES]
        test_x, test_y = read_batch(self.folder / TEST_FILE)
        return torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), test_x, test_y


def _this_run() -> str | None:
    """The run dir of this process's run (every rank of a run has the same), if Hydra started it."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None


def _failed_meanwhile(record: dict) -> NoReturn:
    """Fail with the line of the download this process waited for; where a process of this run on this node failed it
    (and prints the line), wait for that one to end, or to stop this one, and add no second line."""
    line = str(record.get("line") or "downloading CIFAR-10 failed in another process")
    if record.get("run") is None or record.get("run") != _this_run() or record.get("host") != socket.gethostname():
        raise UserError(line)
    deadline = time.monotonic() + WRITER_EXIT_WAIT_S
    while alive(int(record.get("pid", 0))) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(int(record.get("pid", 0))):
        raise UserError(line)  # it has not said it yet: this one does
    raise ToldElsewhere(line)
