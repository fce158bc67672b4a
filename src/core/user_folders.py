"""This user's own folders on a node: the node folder in the node's temp dir, and the caches kept in the home folder,
which fall back to the node folder where the home folder cannot be written (a container run as a user without a home
of its own, as ``docker run --user UID`` does, or with a read-only root filesystem).

Before, such a node's every rank timed bf16 against fp32 for itself, all at once, and without the shared answer its
ranks could choose differently (src/models/fast_path.py), and every process printed matplotlib's two warnings about
its config folder and built matplotlib's font cache again (torchmetrics imports matplotlib in every process).
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

from src.core.errors import StorageError


def node_folder_path() -> Path:
    """Where ``node_folder()`` is, made or not: ``$TMPDIR/cifar10-ddp-UID``."""
    return Path(tempfile.gettempdir()) / f"cifar10-ddp-{os.getuid()}"


def node_folder() -> Path:
    """This user's folder in the node's temp dir (``TMPDIR``), made on first use, its mode 0700: every job of a node
    shares /tmp, and a folder of one user's would refuse another's ranks (and show them its files). A StorageError
    where it cannot be made, or where its name is another user's folder or a link."""
    folder = node_folder_path()
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        found = folder.lstat()
    except OSError as err:
        raise StorageError(
            f"cannot make {folder} for the checkpoints this node stages ({err.strerror}): point TMPDIR at a writable "
            "local folder"
        ) from None
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
        raise StorageError(
            f"{folder} is not a folder of this user's (uid {os.getuid()}): another user or a link holds its name; "
            "point TMPDIR at a folder of your own"
        )
    return folder


def writable(folder: Path) -> bool:
    """Whether ``folder`` is a folder this process can write in, made (and its parents) where it is missing. One that
    is there is only looked at (every rank of a run asks at its start, and a home is often a shared filesystem)."""
    try:
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return folder.is_dir() and os.access(folder, os.W_OK)


def _home_folder(variable: str, default: str) -> Path | None:
    """``$variable``, or ``~/default``; None where there is no home folder to name (no ``HOME``, no user entry)."""
    try:
        return Path(os.environ.get(variable) or Path.home() / default)
    except RuntimeError:
        return None


def cache_folder(name: str) -> Path:
    """This user's cache folder ``name``: ``$XDG_CACHE_HOME/NAME`` (``~/.cache/NAME``) where it can be written, else
    ``NAME`` in the node folder; the home's where neither can (what is kept there then cannot be kept)."""
    home = _home_folder("XDG_CACHE_HOME", ".cache")
    if home is not None and writable(home / name):
        return home / name
    try:
        return node_folder() / name
    except StorageError:
        return home / name if home is not None else node_folder_path() / name


def matplotlib_folder() -> None:
    """``MPLCONFIGDIR``: ``matplotlib`` in the node folder, where matplotlib's config or cache folder cannot be written
    and nothing set the variable. Otherwise matplotlib makes a temporary folder in each process, says so in two
    warnings and builds its font cache there again. Where both can be written, they stay matplotlib's (and a
    ``matplotlibrc`` in the config folder is read, as before)."""
    if os.environ.get("MPLCONFIGDIR") or not sys.platform.startswith(("linux", "freebsd")):
        return
    own = [_home_folder("XDG_CONFIG_HOME", ".config"), _home_folder("XDG_CACHE_HOME", ".cache")]
    if all(folder is not None and writable((folder / "matplotlib").resolve()) for folder in own):
        return
    try:
        folder = node_folder() / "matplotlib"
        folder.mkdir(exist_ok=True)
    except (StorageError, OSError):  # matplotlib's own temporary folder then, with its warnings
        return
    os.environ["MPLCONFIGDIR"] = str(folder)
