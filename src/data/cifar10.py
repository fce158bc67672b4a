"""CIFAR-10 from the release's python-version batches: download once, verify, read safely."""

from __future__ import annotations

import hashlib
import logging
import pickle
import shutil
import socket
from pathlib import Path

import torch
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import download_and_extract_archive

from src.data.in_memory import InMemoryImageDataModule
from src.errors import UserError

log = logging.getLogger(__name__)

FOLDER = "cifar-10-batches-py"
# The release's own checksums, as torchvision records them.
RELEASE_MD5 = {name: md5 for name, md5 in CIFAR10.train_list + CIFAR10.test_list}
RELEASE_MD5[CIFAR10.meta["filename"]] = CIFAR10.meta["md5"]
TRAIN_FILES = [name for name, _ in CIFAR10.train_list]
TEST_FILE = CIFAR10.test_list[0][0]
DOWNLOAD_TIMEOUT_S = 30


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """The batches are pickles; load only what a numpy array needs, never arbitrary code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
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
        raise UserError(f"cannot read {path}: {err.strerror}; fix its permissions or point data.root elsewhere") from err
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
    def folder(self) -> Path:
        return self.root / FOLDER

    def prepare_data(self) -> None:
        """Download once when missing (``data.download=true``), then check the files against the release."""
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
                self._download()
            self._verify()
        except PermissionError as err:
            raise UserError(f"data.root={self.root} cannot be read ({err.strerror}: {err.filename}): fix its "
                            "permissions (chmod -R a+rX), or point data.root at a copy you can read") from err
        self._checked = True

    def _download(self) -> None:
        log.info("Downloading CIFAR-10 from %s into %s", self.download_url, self.root)
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # urllib has none by default: a dead network would hang
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            download_and_extract_archive(self.download_url, download_root=str(self.root),
                                         filename=CIFAR10.filename, md5=CIFAR10.tgz_md5, remove_finished=True)
        except PermissionError as err:
            raise UserError(f"data.root={self.root} is not writable ({err.strerror}): choose another data.root") from err
        except Exception as err:  # noqa: BLE001 - any failure to fetch means the same thing to the user
            (self.root / CIFAR10.filename).unlink(missing_ok=True)
            shutil.rmtree(self.folder, ignore_errors=True)
            raise UserError(
                f"CIFAR-10 is not under data.root={self.root} and downloading it from {self.download_url} failed "
                f"({type(err).__name__}: {err}); put the release's {FOLDER} folder there, point data.root at one, "
                "or run offline with data=synthetic"
            ) from err
        finally:
            socket.setdefaulttimeout(previous)

    def _verify(self) -> None:
        missing = [name for name in RELEASE_MD5 if not (self.folder / name).is_file()]
        if missing:
            raise UserError(f"{self.folder} lacks {', '.join(missing)}: restore them, or delete the folder and "
                            "let data.download=true fetch the release again")
        differing = [name for name, md5 in RELEASE_MD5.items() if md5sum(self.folder / name) != md5]
        for name in differing:  # not the release's bytes: read them now, so a truncated file fails before DDP starts
            if name != CIFAR10.meta["filename"]:
                read_batch(self.folder / name)
        if differing:
            log.warning("data.root=%s is in the CIFAR-10 format but is not the canonical release (%s differ from "
                        "its checksums): loading it anyway; figures from it are not CIFAR-10 results",
                        self.root, ", ".join(differing))
        else:
            log.info("CIFAR-10 release verified under %s", self.folder)

    def load(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.folder.is_dir():  # a rank that skipped prepare_data still explains itself
            self.download = False
            self.prepare_data()
        train = [read_batch(self.folder / name) for name in TRAIN_FILES]
        test_x, test_y = read_batch(self.folder / TEST_FILE)
        return torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), test_x, test_y
