"""Checkpoints in an object store: ``paths.checkpoints=s3://bucket/prefix/RUN`` (AWS S3, GCS's S3 interoperability,
MinIO, SeaweedFS), read and written through s3fs, the fsspec filesystem Lightning's ModelCheckpoint already uses for
a remote dirpath. The run dir stays local: logs, the lock, ``config.yaml``.

A POSIX folder gives the local checkpoints an atomic rename, fsync and hard links (src/checkpoints/files.py); an
object store has none of them, and keeps the same invariants otherwise:

- a checkpoint is written to node-local temp first, then put as one object (a multipart upload for a large file),
  which the store shows whole or not at all: a reader never sees part of one, and a put that fails leaves the object
  that was there;
- ``last.ckpt``'s generation before is a server-side copy to ``last.prev.ckpt``, made before the new ``last.ckpt`` is
  put: there is a whole ``last.ckpt`` at every moment;
- a run never deletes the checkpoint it resumed from, which Lightning's ModelCheckpoint does on every remote
  filesystem when its newer best replaces it (Lightning #21813);
- a checkpoint is read from a node-local copy, downloaded once a node by the first of its ranks that asks while the
  others wait (a lock file), and again only when the object changed (its ETag).

Credentials and the endpoint come from AWS's own variables and files (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, ``~/.aws/config``), as every AWS tool reads them:
none is in the config, and no line of the project names a secret.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from src.core import user_folders
from src.core.errors import StorageError, UserError, require, storage_error_in
from src.launch.run_dir import resume_with

log = logging.getLogger(__name__)

KEY = "paths.checkpoints"
SCHEMES = ("s3",)
# botocore's own retries (standard mode) bound a request; a store that stops answering fails a write in about a minute
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 10, 60, 3
RESUMED: set[str] = set()  # the checkpoints this process resumed from: never deleted by this run
# a file on its way: .NAME.tmp-PID beside a local checkpoint (src/checkpoints/files.py), .NAME.tmp-RANDOM when staged
# in node_folder()
TMP_MARK = ".tmp-"
STALE_STAGE_S = 60.0
# a downloaded copy no process has used for this long is removed (each is a checkpoint's size, 90 to 190 MB): the
# node's next use of the folder sweeps them, and a later read downloads the object again
UNUSED_COPY_S = 7 * 24 * 3600.0
_swept = False  # this process removed the stale staged files once


def is_url(path: Any) -> bool:
    return "://" in str(path)


def join(folder: str | Path, name: str) -> str | Path:
    """``folder/name`` for a local folder (a Path) or an object-store prefix (a URL, its ``//`` kept)."""
    return f"{str(folder).rstrip('/')}/{name}" if is_url(folder) else Path(folder) / name


def check_url(url: str, key: str = KEY) -> None:
    """An ``s3://bucket/prefix`` URL, with no credentials in it (they would land in config.yaml and the logs)."""
    scheme, _, rest = str(url).partition("://")
    if scheme not in SCHEMES:
        raise UserError(
            f"{key}={url}: only s3:// URLs are supported (AWS S3, and S3-compatible stores through "
            "AWS_ENDPOINT_URL: GCS's S3 interoperability, MinIO); or give a local or shared folder"
        )
    bucket = rest.split("/", 1)[0]
    if "@" in bucket or ":" in bucket:
        raise UserError(
            f"{key}: the URL holds credentials or a host ({scheme}://...@...): give s3://BUCKET/PREFIX, and the "
            "credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, the host in AWS_ENDPOINT_URL"
        )
    if not bucket:
        raise UserError(f"{key}={url} names no bucket: give s3://BUCKET/PREFIX")


_FS: tuple[int, Any] | None = None  # this process's filesystem (a forked child makes its own)


def filesystem() -> Any:
    """s3fs's filesystem, with bounded timeouts and retries; credentials and endpoint from AWS's variables and files."""
    global _FS
    if _FS is None or _FS[0] != os.getpid():
        require("s3fs", "s3", f"{KEY}=s3://...")
        import s3fs

        config = {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"max_attempts": ATTEMPTS, "mode": "standard"},
        }
        fs = s3fs.S3FileSystem(config_kwargs=config, skip_instance_cache=True)
        fs.retries = ATTEMPTS  # s3fs's own retries of a request, around botocore's
        _FS = (os.getpid(), fs)
    return _FS[1]


def _key(url: str | Path) -> str:
    return str(url).split("://", 1)[1]


def why(err: BaseException) -> str:
    """What an error of the store means, in words a user can act on; never a credential."""
    names = {type(e).__name__ for e in _chain(err)}
    text = " ".join(str(e) for e in _chain(err))
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    at = f" at {endpoint}" if endpoint else ""
    if "NoCredentialsError" in names or "Unable to locate credentials" in text:
        return "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ClientConnectorError"} or (
        "Could not connect to the endpoint" in text
    ):
        return f"the store{at} cannot be reached (is AWS_ENDPOINT_URL right, and the server up?)"
    if "ReadTimeoutError" in names:
        return f"the store{at} stopped answering"
    if "bucket does not exist" in text or "NoSuchBucket" in text:
        return "the bucket does not exist: create it, or fix the URL"
    if (
        "PermissionError" in names
        or re.search(r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|Forbidden|403", text) is not None
    ):
        return (
            "the store refused the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE): wrong, "
            "expired, or without the right to read and write there"
        )
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"[:300]


def _chain(err: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def check_store(url: str, write: bool = True) -> None:
    """Before any rank trains: this node's folder for staged checkpoints is this user's, the bucket is there, the
    credentials are taken (a listing under the prefix), the endpoint answers, and (``write``: a training) the
    credentials may write and remove there: an empty object of this process's, put and removed again. A key that may
    only read would otherwise fail the first save, an epoch of every GPU later; one that may not remove, the first
    better checkpoint, which replaces the best before it. Each failure is one UserError naming what to change."""
    check_url(url)
    try:
        node_folder()
    except StorageError as err:
        raise UserError(f"{KEY}={url}: {err}") from None
    fs = filesystem()
    bucket = _key(url).split("/", 1)[0]
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        raise UserError(f"{KEY}={url}: the bucket {bucket} does not exist: create it, or fix the URL") from None
    except Exception as err:  # noqa: BLE001 - any failure of the store's first request: one line, before training
        raise UserError(f"{KEY}={url}: {why(err)}") from None
    try:
        fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=_key(url).partition("/")[2], MaxKeys=1)
    except Exception as err:  # noqa: BLE001
        raise UserError(f"{KEY}={url}: {why(err)}") from None
    if not write:
        return
    probe = f"{_key(url).rstrip('/')}/.write-check-{socket.gethostname()}-{os.getpid()}"
    try:
        fs.pipe_file(probe, b"")
    except Exception as err:  # noqa: BLE001
        raise UserError(f"{KEY}={url}: cannot write there: {why(err)}") from None
    try:
        fs.rm_file(probe)
    except Exception as err:  # noqa: BLE001
        raise UserError(
            f"{KEY}={url}: cannot remove what it writes there (a run replaces its best checkpoints; "
            f"s3://{probe}, empty, is left): {why(err)}"
        ) from None


def exists(url: str | Path) -> bool:
    try:
        return bool(filesystem().exists(_key(url)))
    except Exception as err:  # noqa: BLE001 - a store that does not answer: the line says why
        raise UserError(f"cannot look for {url}: {why(err)}") from None


def names(folder: str | Path, pattern: str) -> list[str]:
    """The URLs under ``folder`` whose names match ``pattern`` (a glob), sorted."""
    try:
        found = filesystem().glob(_key(join(folder, pattern)))
    except Exception as err:  # noqa: BLE001
        raise UserError(f"cannot list {folder}: {why(err)}") from None
    scheme = str(folder).split("://", 1)[0]
    return sorted(f"{scheme}://{key}" for key in found)


def put(stage: Path, url: str, previous: str | None, intact: str) -> None:
    """Put the staged file ``stage`` at ``url``; first copy what is there to ``previous`` (server-side), if given.
    A failure is one StorageError: what failed, why, and what holds: ``intact``; where ``previous`` is given, that
    only once the store said it holds one (none yet: nothing to resume from; no answer: the folder is as it was)."""
    fs = filesystem()
    folder, name = url.rsplit("/", 1)
    said, again = intact, None  # None: resume in this run dir (said only if it fails)
    try:
        if previous is not None:
            said = f"{folder} is as it was"  # until the store says whether it holds one
            if fs.exists(_key(url)):
                said = intact
                fs.copy(_key(url), _key(previous))
            else:  # the run's first: nothing kept, and ckpt_path=last would find nothing
                said, again = f"there is no {name} in {folder} yet", "run again"
        fs.put_file(str(stage), _key(url))
    except Exception as err:  # noqa: BLE001 - the store refused or went away: the previous checkpoint stands
        again = again or resume_with()
        raise StorageError(f"cannot write {url} ({why(err)}): {said}; fix the store and {again}") from err


def remove(url: str) -> None:
    """Delete a checkpoint (ModelCheckpoint's older best), unless this run resumed from it."""
    if url in RESUMED:
        log.info("kept %s: this run resumed from it", url)
        return
    try:
        filesystem().rm_file(_key(url))
    except FileNotFoundError:
        pass


def local_copy(url: str) -> Path:
    """A node-local copy of the object at ``url`` (in ``node_folder()``), downloaded once a node: the first rank
    that asks downloads it under a lock while the node's others wait, and it is fetched again only when the object
    changed. A missing object is FileNotFoundError; the store's other failures, OSError with ``why``'s words."""
    fs = filesystem()
    try:
        info = fs.info(_key(url))
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001
        raise OSError(why(err)) from None
    version = str(info.get("ETag") or info.get("LastModified") or info.get("size")).strip('"')
    folder = node_folder()
    name = hashlib.sha256(str(url).encode()).hexdigest()[:16]
    copy = folder / f"{name}-{hashlib.sha256(version.encode()).hexdigest()[:12]}.ckpt"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if copy.exists():
            return copy
        started = time.perf_counter()
        with staged(copy.name, folder) as download:
            try:
                fs.get_file(_key(url), str(download))
            except Exception as err:  # noqa: BLE001
                full = storage_error_in(err)
                if full is not None:  # this node's disk, not the store
                    raise StorageError(
                        f"cannot copy {url} to {folder} ({full.strerror}): free space there, or point TMPDIR at a "
                        "larger node-local folder"
                    ) from None
                raise OSError(why(err)) from None
            os.replace(download, copy)
        for older in folder.glob(f"{name}-*.ckpt"):  # one copy an object: the newest
            if older != copy:
                older.unlink(missing_ok=True)
        log.info("downloaded %s (%.0f MB) in %.1f s", url, copy.stat().st_size / 2**20, time.perf_counter() - started)
    return copy


def node_folder() -> Path:
    """This user's folder in the node's temp dir (src/core/user_folders.py's ``node_folder``): the copies downloaded,
    and the checkpoints staged before a put. The staged files of processes killed half way (SIGKILL, the OOM killer:
    no ``finally`` runs; a checkpoint's size each) are removed on first use in a process."""
    global _swept
    folder = user_folders.node_folder()
    if not _swept:
        _swept = True
        remove_stale_stages(folder)
        remove_unused_copies(folder)
    return folder


def remove_unused_copies(folder: Path, older_than_s: float = UNUSED_COPY_S) -> list[Path]:
    """Remove the downloaded copies in ``folder`` that no process has read for ``older_than_s``: each object's lock
    file is rewritten at every read (``local_copy``), so its time is the copy's last use. A copy whose lock a process
    holds (a download, a read) stays."""
    removed: list[Path] = []
    for lock_path in _idle(folder, "*.lock", older_than_s):
        copies = list(folder.glob(f"{lock_path.stem}-*.ckpt"))
        for copy in copies:
            copy.unlink(missing_ok=True)
        lock_path.unlink(missing_ok=True)
        removed += copies
    if removed:
        log.info(
            "removed %d downloaded checkpoint(s) unused for %d days from %s",
            len(removed),
            older_than_s // 86400,
            folder,
        )
    return removed


@contextlib.contextmanager
def staged(name: str, folder: Path | None = None) -> Iterator[Path]:
    """A new file in ``folder`` (``node_folder()`` by default) for ``name`` on its way to or from the store, locked
    (flock) while in use and removed after, unless it was renamed meanwhile."""
    fd, path = tempfile.mkstemp(prefix=f".{name}{TMP_MARK}", dir=folder or node_folder())
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed: remove_stale_stages passes over it, from any process
        yield Path(path)
    finally:
        Path(path).unlink(missing_ok=True)
        os.close(fd)


def remove_stale_stages(folder: Path, older_than_s: float = STALE_STAGE_S) -> list[Path]:
    """Remove the staged files in ``folder`` that no process holds (its lock went with it) and that were last written
    more than ``older_than_s`` ago (a file is locked an instant after it is made)."""
    removed = []
    for path in _idle(folder, f".*{TMP_MARK}*", older_than_s):
        path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        log.info("removed %d staged checkpoint file(s) that killed processes left in %s", len(removed), folder)
    return removed


def _idle(folder: Path, pattern: str, older_than_s: float) -> Iterator[Path]:
    """The files in ``folder`` matching ``pattern``, last written more than ``older_than_s`` ago, that no process
    holds a lock (flock) on: each yielded while this process holds it, so what the caller removes then is in no
    one's use."""
    now = time.time()
    for path in folder.glob(pattern):
        try:
            if now - path.stat().st_mtime < older_than_s:
                continue
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # its process, or another's sweep, removed it meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # in use
                continue
            yield path
        finally:
            os.close(fd)
