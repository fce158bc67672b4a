"""How a checkpoint is written and read: a write a kill cannot leave half done, the generation before it, one line
for a write the filesystem refuses, and one UserError for a file that cannot be read.

Lightning writes checkpoints and restores the loops, optimizer, scheduler and callbacks from them. The invariant
this module keeps: a checkpoint's final name (``last.ckpt``, ``best-*.ckpt``) holds a whole file or none, and
``last.prev.ckpt`` is the ``last.ckpt`` before the current one, kept until the next one is whole. The same holds for
checkpoints in an object store (an ``s3://`` URL), which src/checkpoints/object_store.py reads and writes.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from src.checkpoints import object_store
from src.core import user_folders
from src.core.errors import StorageError, UserError, closed_folder, storage_error_in
from src.launch.run_dir import resume_with

LAST = "last.ckpt"
PREVIOUS = "last.prev.ckpt"  # the last.ckpt before the current one


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``name.ckpt`` as a hidden temp file beside it, fsyncs, then renames it over the final name.

    Lightning's own save goes through a temp file in the system temp dir, then a move: across filesystems (node-local
    /tmp, tmpfs) that move is a copy into the final name, which a kill leaves half written. A rename within one
    directory is atomic: the final name holds the old file or the new, never a part. ``last.ckpt``'s previous generation
    becomes ``last.prev.ckpt``, deleted just before the next ``last.ckpt`` is written: between writes it takes one
    checkpoint's worth of disk more. A write the filesystem refuses (full, read-only, a folder removed under the run)
    leaves no temp file and raises one StorageError saying what is intact. ``saved`` and ``save_s`` count this process's
    writes (rank zero's: only it writes) and the seconds they took. An ``s3://`` path is written, read and removed
    through src/checkpoints/object_store.py, with the same promises.
    """

    def __init__(self) -> None:
        super().__init__()
        self._made: set[Path] = set()
        self.saved, self.save_s = 0, 0.0

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        started = time.perf_counter()
        self._write(checkpoint, path, storage_options)
        self.save_s += time.perf_counter() - started
        self.saved += 1

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's read of the checkpoint a run resumes from or tests: an ``s3://`` one from its local copy."""
        if object_store.is_url(path):
            path = _local_copy(str(path), "ckpt_path")
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        """ModelCheckpoint's removal of an older best: never the checkpoint this run resumed from."""
        if object_store.is_url(path):
            return object_store.remove(str(path))
        if str(Path(path).absolute()) in object_store.RESUMED:
            return None
        return super().remove_checkpoint(path)

    def _write(self, checkpoint: dict[str, Any], path: Any, storage_options: Any) -> None:
        if object_store.is_url(path):
            return self._put(checkpoint, str(path))
        final = Path(path)
        tmp = final.with_name(f".{final.name}{object_store.TMP_MARK}{os.getpid()}")
        previous = final.with_name(PREVIOUS) if final.name == LAST else None
        try:
            self._make_dir(final.parent)
            if previous is not None:
                previous.unlink(missing_ok=True)
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            if previous is not None and final.exists():
                _keep_as(final, previous)
            os.replace(tmp, final)
            _fsync_dir(final.parent)  # the rename itself survives a power cut only once the directory is synced
        except Exception as err:
            _discard(tmp)  # first: a full disk's line counts the space it held as free
            refused = storage_error_in(err)
            if refused is None:
                raise
            raise StorageError(refused_write(refused, final, final.parent, _tensor_bytes(checkpoint))) from err
        finally:
            _discard(tmp)

    def _put(self, checkpoint: dict[str, Any], url: str) -> None:
        """Stage the checkpoint in this user's node-local folder (src/checkpoints/object_store.py's ``node_folder``),
        then put it as one object; ``last.ckpt``'s previous generation is copied to ``last.prev.ckpt`` on the server
        first."""
        folder, name = url.rsplit("/", 1)
        previous = f"{folder}/{PREVIOUS}" if name == LAST else None
        try:
            with object_store.staged(name) as stage:
                with open(stage, "wb") as f:
                    torch.save(checkpoint, f)
                intact = f"the previous {LAST} in {folder} is kept" if name == LAST else f"{folder} is as it was"
                object_store.put(stage, url, previous, intact)
        except UserError:  # the store's own line (put), or the node folder's: said as they are
            raise
        except Exception as err:  # torch.save's zip writer buries a full disk's OSError under a RuntimeError
            refused = storage_error_in(err)
            if refused is None:
                raise
            raise StorageError(
                f"cannot stage {url} in {user_folders.node_folder_path()} ({refused.strerror}): the store is as it "
                f"was; free space there (or point TMPDIR elsewhere) and {resume_with()}"
            ) from err

    def _make_dir(self, directory: Path) -> None:
        """Create the checkpoint folder once; if it is gone later, something removed it under the run."""
        if directory not in self._made:
            directory.mkdir(parents=True, exist_ok=True)
            self._made.add(directory)
        elif not directory.is_dir():
            raise FileNotFoundError(errno.ENOENT, "vanished during the run", str(directory))


def _keep_as(current: Path, previous: Path) -> None:
    """Make ``previous`` a second name of ``current`` (a hard link, staged and renamed: never half there)."""
    staged = previous.with_name(f".{previous.name}{object_store.TMP_MARK}{os.getpid()}")
    try:
        os.link(current, staged)
        os.replace(staged, previous)
    except OSError as err:
        _discard(staged)
        if storage_error_in(err) is not None and err.errno != errno.EPERM:
            raise
        os.replace(current, previous)  # no hard links here: moved instead (resume falls back to it meanwhile)


def _discard(path: Path) -> None:
    """Remove a file on its way, if it is there and can be: on a filesystem that turned read-only after it was
    opened, its removal fails too, and that must not replace the error being reported (which names the target)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def refused_write(
    err: OSError, target: Path | None, checkpoints: Path | None, needed: int | None = None, trains: bool = True
) -> str:
    """One line for a write the filesystem refused (full, read-only, removed under the run): what happened, which
    ``last.ckpt`` in ``checkpoints`` is intact, and what to do. Of a command that does not train (``trains``: src.eval),
    no word of checkpoints."""
    target = target or Path(os.fsdecode(err.filename or "the run dir"))
    folder = target.parent
    if err.errno == errno.ENOENT and not folder.is_dir():
        gone = folder
        while not gone.parent.is_dir() and gone.parent != gone:
            gone = gone.parent
        then = f"its checkpoints and logs went with it; restore it and {resume_with()}, or start again"
        return (
            f"{gone} vanished during the run (it was removed while the run was writing {target.name}): "
            f"{then if trains else 'restore it, or run again elsewhere'}"
        )
    step = _step_of(checkpoints / LAST) if checkpoints is not None and trains else None
    previous = "the previous " if target.name == LAST else ""
    if not trains:
        intact, again = "", "run again"  # joined below as "...: free space and run again"
    elif step is not None:
        intact, again = f"{previous}{LAST} (step {step}) is intact; ", resume_with()
    else:  # nothing to resume from (ckpt_path=last would be refused): the run starts again
        intact, again = f"there is no intact {LAST} yet; ", "run again"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _megabytes(shutil.disk_usage(folder).free) if folder.is_dir() else "?"
        sizes = f"{_megabytes(needed)} MB needed, {free} MB free" if needed else f"{free} MB free"
        return f"no space left on device writing {target} ({sizes}): {intact}free space and {again}"
    return f"cannot write {target} ({err.strerror}): {intact}make {folder} writable and {again}"


def _step_of(path: Path) -> int | None:
    """The global step of an intact checkpoint at ``path``, else None."""
    try:
        return int(read_checkpoint(path)["global_step"])
    except (UserError, KeyError, TypeError, ValueError):
        return None


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _megabytes(size: int) -> str:
    return f"{size / 2**20:.0f}" if size >= 2**20 else f"{size / 2**20:.1f}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Temp files of writes that were killed half way (their final names were never touched)."""
    stale = sorted(directory.glob(f".*.ckpt{object_store.TMP_MARK}*")) if directory.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


class UnreadableCheckpoint(UserError):
    """A checkpoint file that is missing, cut off, corrupt or unreadable (not one that is merely untrusted)."""


def not_a_file(key: str, path: Path, wanted: str) -> str | None:
    """None where ``path`` is a file; else the line for a ``key`` that names no file: a missing path, a folder (a run
    dir given for its checkpoint: the newest ``.ckpt`` in it or in its ``checkpoints/`` is named; the folder itself is
    not searched further), or a path behind a folder this process may not enter or list (another user's run dir)."""
    try:
        if path.is_file():
            return None
        if not path.is_dir():
            return f"{key}={path} does not exist: pass {wanted}"
        for folder in (path, path / "checkpoints"):
            if folder.is_dir():
                os.listdir(folder)  # glob passes over a folder it may not list, without a word
        found = [p for p in (*path.glob("*.ckpt"), *path.glob("checkpoints/*.ckpt")) if p.is_file()]
    except PermissionError as err:
        return (
            f"{key}={path} cannot be read ({err.strerror} on {closed_folder(path, err)}): fix that folder's "
            "permissions, or pass another checkpoint"
        )
    if not found:
        return f"{key}={path} is a folder and holds no .ckpt file: pass {wanted}"
    newest = max(found, key=lambda p: (p.name == "last.ckpt", p.stat().st_mtime))
    return f"{key}={path} is a folder: pass a file in it, such as {key}={newest}"


def cannot_read(key: str, shown: str | Path, err: OSError) -> str:
    """The line for a checkpoint or exported model that is there but cannot be opened (its permissions)."""
    return f"{key}={shown} cannot be read ({err.strerror}): fix its permissions, or pass another checkpoint"


def _local_copy(url: str, key: str) -> Path:
    """The node-local copy of an object-store checkpoint; a missing or unreadable object is one UnreadableCheckpoint."""
    object_store.check_url(url, key)
    try:
        return object_store.local_copy(url)
    except FileNotFoundError:
        raise UnreadableCheckpoint(f"{key}={url} does not exist: pass a .ckpt written by src.train") from None
    except OSError as err:
        raise UnreadableCheckpoint(f"{key}={url} cannot be read ({err})") from None


def read_checkpoint(path: str | Path, key: str = "ckpt_path", trusted: bool = False) -> dict[str, Any]:
    """Load a checkpoint on the CPU, weights-only unless ``trusted``; any failure is a UserError naming ``key``.

    ``weights_only`` unpickles tensors, numbers and strings only; a file that needs more can run code
    when loaded, so it loads only when the user says they trust it. An ``s3://`` URL is read from its node-local
    copy, and the lines name the URL.
    """
    shown = path
    path = _local_copy(str(path), key) if object_store.is_url(path) else Path(path)
    refused = not_a_file(key, path, "the path of a .ckpt file written by src.train")
    if refused is not None:
        raise UnreadableCheckpoint(refused)
    try:
        with open(path, "rb") as f:
            intact = zipfile.is_zipfile(f)  # torch.save writes a zip archive: a cut-off one lacks its directory
    except OSError as err:
        raise UnreadableCheckpoint(cannot_read(key, shown, err)) from err
    if not intact:
        raise UnreadableCheckpoint(
            f"{key}={shown} is not a checkpoint: truncated, corrupt or in another format (not "
            "the zip archive torch.save writes); pass an intact .ckpt written by src.train"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=not trusted, mmap=True)  # mmap: no tensor read
    except pickle.UnpicklingError as err:
        if not trusted and "weights_only" in str(err):
            raise UserError(
                f"{key}={shown} holds Python objects beyond tensors and numbers, and unpickling them can run code: "
                "if you trust the file, pass ckpt_trusted=true to load it in full"
            ) from err
        raise UnreadableCheckpoint(f"{key}={shown} is not a readable checkpoint (corrupt or truncated: {err})") from err
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        raise UnreadableCheckpoint(
            f"{key}={shown} is not a readable checkpoint (corrupt or truncated: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from err
    if not isinstance(checkpoint, dict):  # torch.save(a_tensor), a list of state dicts: intact, yet no checkpoint
        raise UserError(
            f"{key}={shown} is not a checkpoint of this project's model (it holds a {type(checkpoint).__name__}, not "
            "the dict Lightning writes): pass a .ckpt written by src.train"
        )
    return checkpoint
