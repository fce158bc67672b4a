"""Checkpoints in an object store (``paths.checkpoints=s3://...``), against a real S3 server: SeaweedFS on 127.0.0.1
(tests/s3server.py), one a session. A DDP run writes there; one SIGKILLed mid-epoch resumes to the uninterrupted run's
weights; a truncated ``last.ckpt`` is passed over; the checkpoint a run resumed from is never deleted (Lightning
#21813); src.eval, src.export and src.predict read a URL; bad credentials, a missing bucket and an unreachable endpoint
are one line before training; a server stopped mid-run is one line, and the checkpoint before stays whole. The Slurm
requeue through the store: tests/slurm/test_one_node.py."""

from __future__ import annotations

import io
import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, output, run_module, train
from tests.s3server import READER_KEY, READER_SECRET, SECRET, start
from tests.test_checkpoints import EXACT, assert_same_training, small_disk  # noqa: F401 - the fixture: a tmpfs
from tests.test_supervision import LONG

# EXACT, shorter: 2 epochs of 6 steps, last.ckpt every 2 (a save to the store is the slow part here)
SHORT = [*EXACT, "trainer.limit_train_batches=6", "trainer.max_epochs=2"]

DDP = ["strategy=ddp", "trainer.devices=2"]
NEWEST = "callbacks.model_checkpoint.monitor=null"  # the newest epoch is the best kept: one replaced every epoch


def prefix(server, name: str) -> str:
    return server.url(f"{name}-{uuid.uuid4().hex[:8]}")


class Store:
    """The test's own client of the server, with the credentials a run gets from its environment."""

    def __init__(self, server) -> None:
        import s3fs

        self.fs = s3fs.S3FileSystem(
            key=server.env["AWS_ACCESS_KEY_ID"],
            secret=server.env["AWS_SECRET_ACCESS_KEY"],
            client_kwargs={"endpoint_url": server.endpoint, "region_name": "us-east-1"},
            skip_instance_cache=True,
        )

    def names(self, url: str) -> list[str]:
        return sorted(p.rsplit("/", 1)[1] for p in self.fs.ls(url.split("://")[1], refresh=True) if p.endswith(".ckpt"))

    def load(self, url: str) -> dict:
        return torch.load(io.BytesIO(self.fs.cat_file(url.split("://")[1])), map_location="cpu", weights_only=True)

    def version(self, url: str) -> str | None:
        """The object's ETag, or None while there is none."""
        self.fs.invalidate_cache()
        try:
            return self.fs.info(url.split("://")[1])["ETag"]
        except FileNotFoundError:
            return None

    def exists(self, url: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(url.split("://")[1])


@pytest.fixture(scope="module")
def store(s3_store):
    return Store(s3_store)


@pytest.fixture(scope="module")
def uninterrupted(s3_store, store, tmp_path_factory):
    """A DDP run (2 ranks) of SHORT's 12 steps whose checkpoints go to the store, and what it left there."""
    url = prefix(s3_store, "whole")
    run_dir = tmp_path_factory.mktemp("whole")
    result = train(*SHORT, *DDP, NEWEST, f"paths.checkpoints={url}", f"hydra.run.dir={run_dir}", env=s3_store.env)
    assert result.returncode == 0, output(result)[-3000:]
    return url, run_dir, result


def test_a_ddp_run_writes_its_checkpoints_to_the_store_and_no_secret_anywhere(uninterrupted, store, s3_store, tmp_path):
    url, run_dir, result = uninterrupted
    names = store.names(url)
    assert names[1:] == ["last.ckpt", "last.prev.ckpt"] and names[0].startswith("best-epoch001-"), names
    everything = [p.rsplit("/", 1)[1] for p in store.fs.ls(url.split("://")[1], refresh=True)]
    assert sorted(everything) == names  # nothing else: the start's write check took its object back
    assert store.load(f"{url}/last.ckpt")["global_step"] == 12
    assert store.load(f"{url}/last.prev.ckpt")["global_step"] == 10  # the generation before, kept
    assert not (run_dir / "checkpoints").exists()  # the run dir keeps the logs, the lock and the config
    assert f"checkpoints: {url}" in (run_dir / "config.yaml").read_text()
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]
    assert SECRET not in output(result)

    # a new training pointed at the same prefix (a command run again with another run dir) would overwrite them
    def versions():
        store.fs.invalidate_cache()
        return {name: store.fs.info(f"{url}/{name}".split("://")[1]).get("LastModified") for name in names}

    written = versions()
    again = train(*SHORT, *DDP, NEWEST, f"paths.checkpoints={url}", f"hydra.run.dir={tmp_path}/run", env=s3_store.env)
    assert again.returncode == 2 and again.stderr.splitlines()[-1] == (
        f"error: paths.checkpoints={url} holds an earlier run's checkpoints (last.ckpt, last.prev.ckpt, {names[0]}), "
        f"which a new run would overwrite: to go on with that run, pass ckpt_path=last; to train anew, pass another "
        f"paths.checkpoints (or remove {url} first)"
    ), output(again)[-3000:]
    assert versions() == written and None not in written.values()
    assert not (tmp_path / "run").exists()  # the refused run took back the dir it made


def test_a_ddp_run_sigkilled_mid_epoch_resumes_from_the_store_to_the_uninterrupted_weights(
    uninterrupted, s3_store, store, tmp_path
):
    url = prefix(s3_store, "killed")
    args = [*SHORT, *DDP, NEWEST, f"paths.checkpoints={url}", f"hydra.run.dir={tmp_path}"]
    proc = train(*args, background=True, env=s3_store.env)
    deadline, seen = time.monotonic() + 180, set()
    while len(seen - {None}) < 2:  # last.ckpt put twice: step 4 at least
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no second checkpoint in the store"
        seen.add(store.version(f"{url}/last.ckpt"))
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # the launcher: its local rank follows it (it watches its launcher)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    stopped_at = store.load(f"{url}/last.ckpt")["global_step"]
    assert 4 <= stopped_at < 12, stopped_at

    resumed = train(*args, "ckpt_path=last", env=s3_store.env)
    assert resumed.returncode == 0, output(resumed)[-3000:]
    assert f"Restoring states from the checkpoint path at {url}/last.ckpt" in output(resumed)
    assert_same_training(store.load(f"{url}/last.ckpt"), store.load(f"{uninterrupted[0]}/last.ckpt"), steps=12)


def test_ctrl_c_with_the_checkpoints_in_the_store_stops_at_one_step_and_names_the_run_dir_to_resume_in(
    s3_store, store, tmp_path
):
    """Before, Ctrl-C ended such a run on `error: AttributeError: 'str' object has no attribute 'parent'`, exit 1:
    the line took the run dir for the checkpoint's folder's parent, and an s3:// checkpoint has no local path."""
    url = prefix(s3_store, "interrupted")
    args = [*LONG, f"paths.checkpoints={url}"]  # steps enough that the stop lands mid-run
    # a terminal's foreground job has SIGINT at its default; a suite started in the background ignores it, and a run
    # started from there would too (as a script's background job keeps ignoring Ctrl-C)
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = train(*args, f"hydra.run.dir={tmp_path}", background=True, env=s3_store.env, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, ignored)
    deadline = time.monotonic() + 180
    while store.version(f"{url}/last.ckpt") is None:  # step 2's
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint in the store"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at the terminal does
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, out[-3000:]
    (line,) = [line for line in out.splitlines() if line.startswith("interrupted")] or [out[-3000:]]
    said = re.fullmatch(
        rf"interrupted \(Ctrl-C\) at step (\d+) of epoch 0; {url}/last.ckpt written; "
        rf"resume with hydra.run.dir={tmp_path} ckpt_path=last",
        line,
    )
    assert said, line
    assert store.load(f"{url}/last.ckpt")["global_step"] == int(said.group(1)) >= 2
    assert "Found credentials" not in out and "Found endpoint" not in out, out[:2000]  # boto's, in the log file only
    assert "exists and is not empty" not in out, out[:2000]  # a new prefix (before: its probe's folder marker)
    assert "Found credentials in environment variables" in (tmp_path / "train.log").read_text()


def test_a_truncated_last_ckpt_is_passed_over_and_the_checkpoint_resumed_from_is_never_deleted(
    uninterrupted, s3_store, store, tmp_path
):
    url = prefix(s3_store, "cut")
    for name in store.names(uninterrupted[0]):
        store.fs.copy(f"{uninterrupted[0]}/{name}".split("://")[1], f"{url}/{name}".split("://")[1])
    best = next(n for n in store.names(url) if n.startswith("best-epoch001-"))  # step 12, the newest intact
    whole = store.fs.cat_file(f"{url}/last.ckpt".split("://")[1])
    store.fs.pipe_file(
        f"{url}/last.ckpt".split("://")[1], whole[: len(whole) // 2]
    )  # a node lost mid-upload, elsewhere

    one_more = [*SHORT, "trainer.max_epochs=3", NEWEST, f"paths.checkpoints={url}", f"hydra.run.dir={tmp_path}"]
    result = train(*one_more, "ckpt_path=last", env=s3_store.env)
    assert result.returncode == 0, output(result)[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: {url}/last.ckpt cannot be read (not the zip archive torch.save writes): resuming from {url}/{best} "
        "(step 12), the newest intact checkpoint of the run dir",
        # copied from another run's prefix: this run's best is of its own epochs
        f"warning: ckpt_path={url}/{best} was saved by a run that kept its checkpoints in {uninterrupted[0]}: this run "
        f"keeps its own in {url}, and its best checkpoint (the one a test uses) is the best of the epochs it trains "
        f"from here; the earlier run's best stays in {uninterrupted[0]}",
        # the two DDP ranks' checkpoint, resumed by one process
        "warning: resuming a checkpoint of world size 2 at world size 1: the global batch is 4 (4 per process) where "
        "it trained with 8; the learning rate and the steps per epoch follow it: to keep them, pass data.batch_size=8",
    ], result.stderr[-2000:]
    names = store.names(url)
    # epoch 2's best replaced epoch 1's as the newest, but the run began from that file: it stays (Lightning #21813)
    assert best in names and any(n.startswith("best-epoch002-") for n in names), names
    assert store.load(f"{url}/last.ckpt")["global_step"] == 18

    # the commands that read a checkpoint take its URL
    newest = next(n for n in names if n.startswith("best-epoch002-"))
    evaluated = run_module(
        "src.eval",
        f"ckpt_path={url}/{newest}",
        *FAST[:3],
        f"hydra.run.dir={tmp_path}/eval",
        "trainer.accelerator=cpu",
        "trainer.limit_test_batches=1",
        env=s3_store.env,
    )
    assert evaluated.returncode == 0 and f"{url}/{newest} (epoch 2, step 18)" in output(evaluated), output(evaluated)
    exported = run_module(
        "src.export",
        f"ckpt_path={url}/{newest}",
        "format=safetensors",
        "export.validate=false",
        f"export.dir={tmp_path}/export",
        f"hydra.run.dir={tmp_path}/export-run",
        env=s3_store.env,
    )
    assert exported.returncode == 0, output(exported)[-3000:]
    assert (tmp_path / "export" / f"{Path(newest).stem}.safetensors").is_file()
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "red.png")
    predicted = run_module(
        "src.predict",
        f"ckpt_path={url}/{newest}",
        f"images={tmp_path}/red.png",
        "top_k=1",
        f"hydra.run.dir={tmp_path}/predict",
        env=s3_store.env,
    )
    assert predicted.returncode == 0 and "red.png" in predicted.stdout, output(predicted)[-3000:]


@pytest.mark.parametrize(
    "env, url, said",
    [
        ({"AWS_SECRET_ACCESS_KEY": "not-the-key"}, "runs/x", "the store refused the credentials"),
        (
            {"AWS_ACCESS_KEY_ID": READER_KEY, "AWS_SECRET_ACCESS_KEY": READER_SECRET},
            "runs/x",
            "cannot write there: the store refused the credentials",
        ),
        ({}, "no-such-bucket/x", "the bucket no-such-bucket does not exist"),
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "runs/x", "the store at http://127.0.0.1:9 cannot be reached"),
        ({}, "key:secret@runs/x", "the URL holds credentials"),
        ({}, "", "only s3:// URLs are supported"),
    ],
    ids=[
        "wrong credentials",
        "a key that may only read",
        "no bucket",
        "unreachable",
        "credentials in the URL",
        "another scheme",
    ],
)
def test_a_store_that_cannot_work_is_one_line_before_any_rank_trains(env, url, said, s3_store, tmp_path):
    where = f"s3://{url}" if url else "gs://runs/x"
    result = train(*FAST, *DDP, f"paths.checkpoints={where}", f"hydra.run.dir={tmp_path}", env={**s3_store.env, **env})
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and said in errors[0], output(result)[-3000:]
    assert errors[0].startswith("error: paths.checkpoints") and "Run:" not in output(result)  # nothing started
    assert "not-the-key" not in output(result) and "secret@" not in output(result).replace(where, "")


def test_the_server_stopped_mid_run_is_one_line_and_the_checkpoint_before_stays_whole(tmp_path, s3_store):
    server = start(tmp_path / "s3", watch=os.getpid())  # this test's own: it stops it
    try:
        store, url = Store(server), server.url("stopped")
        long = [*FAST, "data.num_train=2000", "trainer.limit_train_batches=null", "test=false"]
        proc = train(
            *long,
            "callbacks.last_checkpoint.every_n_train_steps=2",
            "callbacks.progress_bar=null",
            f"paths.checkpoints={url}",
            f"hydra.run.dir={tmp_path}/run",
            background=True,
            env=server.env,
        )
        deadline = time.monotonic() + 180
        while not store.exists(f"{url}/last.ckpt"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        server.stop()
        out, _ = proc.communicate(timeout=180)
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1, out[-3000:]
        assert f"cannot write {url}/" in errors[0] and "cannot be reached" in errors[0], errors
        assert f"the previous last.ckpt in {url} is kept" in errors[0] or f"{url} is as it was" in errors[0], errors

        server = start(tmp_path / "s3", ports=server.ports, watch=os.getpid())  # the same data, served again
        assert store.load(f"{url}/last.ckpt")["global_step"] >= 2  # whole: it loads, with its step
    finally:
        server.stop()


def test_a_first_last_ckpt_the_store_refuses_says_there_is_none_to_resume_from(tmp_path, s3_store, monkeypatch):
    """Before, the line said "the previous last.ckpt ... is kept" and "resume with ckpt_path=last" also where the
    store had none yet (ckpt_path=last would find nothing)."""
    from src.checkpoints import object_store
    from src.core.errors import StorageError

    for name, value in s3_store.env.items():
        monkeypatch.setenv(name, value)
    stage = tmp_path / "last.ckpt"
    stage.write_bytes(b"x")
    folder = s3_store.url(f"first-{uuid.uuid4().hex[:8]}")
    said = {}
    # a key that may read but not write: the store says there is no last.ckpt yet, and refuses the put;
    # a wrong key: the store says nothing, so the line claims only what holds either way
    for key, secret in ((READER_KEY, READER_SECRET), (READER_KEY, "not-the-key")):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        monkeypatch.setattr(object_store, "_FS", None)
        with pytest.raises(StorageError) as refused:
            object_store.put(stage, f"{folder}/last.ckpt", f"{folder}/last.prev.ckpt", "the previous one is kept")
        said[secret] = str(refused.value)
        assert said[secret].startswith(f"cannot write {folder}/last.ckpt (") and "kept" not in said[secret], said
    assert said[READER_SECRET].endswith(f": there is no last.ckpt in {folder} yet; fix the store and run again"), said
    assert said["not-the-key"].endswith(f": {folder} is as it was; fix the store and resume with ckpt_path=last"), said


# -- this user's node-local folder: staged and downloaded checkpoints (in-process, and one process killed holding one)


def use_tmpdir(monkeypatch, folder: Path) -> Path:
    """TMPDIR as ``folder``, for this process (tempfile's cached answer too, and a first use of the node folder that
    sweeps it) and the processes it starts."""
    import tempfile

    from src.checkpoints import object_store

    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setattr(object_store, "_swept", False)
    return folder


def use_store(monkeypatch, server, url: str, checkpoint: dict) -> None:
    """This process a client of ``server`` as a run is (its variables, a filesystem made with them), and
    ``checkpoint`` saved at ``url`` there."""
    from src.checkpoints import object_store

    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(object_store, "_FS", None)
    blob = io.BytesIO()
    torch.save(checkpoint, blob)
    Store(server).fs.pipe_file(url.split("://")[1], blob.getvalue())


@pytest.fixture
def node_tmp(tmp_path, monkeypatch):
    return use_tmpdir(monkeypatch, tmp_path)


def test_a_staged_file_whose_process_was_killed_is_removed_and_one_in_use_is_kept(node_tmp):
    import subprocess
    import sys

    from src.checkpoints import object_store
    from tests.conftest import ROOT

    folder = object_store.node_folder()
    assert folder == node_tmp / f"cifar10-ddp-{os.getuid()}" and (folder.stat().st_mode & 0o777) == 0o700
    holder = subprocess.Popen(  # stages a checkpoint, says where, and holds it as a put under way would
        [
            sys.executable,
            "-c",
            "import time\nfrom src.checkpoints import object_store\nwith object_store.staged('last.ckpt') as path:\n"
            "    path.write_bytes(b'x' * 1000)\n    print(path, flush=True)\n    time.sleep(120)",
        ],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(node_tmp)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        killed = Path(holder.stdout.readline().strip())
        assert killed.parent == folder and killed.name.startswith(".last.ckpt.tmp-"), killed
        assert object_store.remove_stale_stages(folder, older_than_s=0) == []  # its process holds it
    finally:
        holder.kill()
        holder.wait()
    with object_store.staged("best.ckpt") as in_use:  # this process's, under way
        young = folder / ".last.ckpt.tmp-young"
        young.write_bytes(b"")  # as if just made, not locked yet
        kept = folder / "0123abcd-4567.ckpt"  # a downloaded copy
        kept.write_bytes(b"")
        old = time.time() - 3600
        for path in (killed, in_use, kept):
            os.utime(path, (old, old))
        assert object_store.remove_stale_stages(folder, older_than_s=60) == [killed]
        assert in_use.exists() and young.exists() and kept.exists()
    assert not in_use.exists()  # removed as its use ended


def test_a_node_folder_another_user_holds_is_one_line_naming_it_and_tmpdir_before_any_rank_starts(node_tmp):
    from src.checkpoints import object_store
    from src.core.errors import StorageError, UserError

    if os.geteuid() != 0:
        pytest.skip("only root can give a folder to another user here")
    taken = node_tmp / f"cifar10-ddp-{os.getuid()}"
    taken.mkdir()
    os.chown(taken, 65534, 65534)
    with pytest.raises(StorageError, match=r"is not a folder of this user's \(uid 0\).*point TMPDIR at a folder"):
        object_store.node_folder()  # a put or a download mid-run: the run stops with its one line
    with pytest.raises(UserError, match=rf"^paths.checkpoints=s3://b/x: {taken} is not a folder of this user's"):
        object_store.check_store("s3://b/x")  # before any rank starts, before the store is asked anything


def test_a_full_node_folder_while_staging_is_one_line_naming_it_and_leaves_nothing_staged(small_disk, monkeypatch):
    """A checkpoint of 16 MB staged on a 10 MB tmpfs: the store is never reached (no server here), and the line
    names the node folder that filled, not TMPDIR's parent."""
    from src.checkpoints.files import AtomicCheckpointIO
    from src.core.errors import StorageError

    use_tmpdir(monkeypatch, small_disk)
    folder = small_disk / f"cifar10-ddp-{os.getuid()}"
    with pytest.raises(StorageError) as raised:
        AtomicCheckpointIO().save_checkpoint({"weights": torch.zeros(4 * 2**20)}, "s3://b/x/last.ckpt")
    assert str(raised.value) == (
        f"cannot stage s3://b/x/last.ckpt in {folder} (No space left on device): the store is as it was; free space "
        "there (or point TMPDIR elsewhere) and resume with ckpt_path=last"
    )
    assert list(folder.iterdir()) == []


def test_a_full_node_folder_while_downloading_is_one_line_naming_it_not_the_object(small_disk, s3_store, monkeypatch):
    """``ckpt_path=s3://...`` of 16 MB copied to a 10 MB tmpfs: the object is fine, this node's disk is not."""
    from src.checkpoints.files import read_checkpoint
    from src.core.errors import StorageError

    url = s3_store.url(f"full-{uuid.uuid4().hex[:8]}/big.ckpt")
    use_store(monkeypatch, s3_store, url, {"weights": torch.zeros(4 * 2**20)})
    use_tmpdir(monkeypatch, small_disk)
    folder = small_disk / f"cifar10-ddp-{os.getuid()}"
    with pytest.raises(StorageError) as raised:
        read_checkpoint(url)
    assert str(raised.value) == (
        f"cannot copy {url} to {folder} (No space left on device): free space there, or point TMPDIR at a larger "
        "node-local folder"
    )
    assert [p.suffix for p in folder.iterdir()] == [".lock"]  # the object's download lock; nothing half copied


def test_downloaded_copies_unused_for_a_week_are_removed_and_read_or_held_ones_kept(node_tmp, s3_store, monkeypatch):
    import fcntl

    from src.checkpoints import object_store

    url = s3_store.url(f"copies-{uuid.uuid4().hex[:8]}/last.ckpt")
    use_store(monkeypatch, s3_store, url, {"global_step": 1})
    folder = object_store.node_folder()
    week, old = object_store.UNUSED_COPY_S, time.time() - object_store.UNUSED_COPY_S - 3600
    read = object_store.local_copy(url)  # downloaded, then read again a week later: the read renews its time
    os.utime(read.with_name(read.name.split("-")[0] + ".lock"), (old, old))
    assert object_store.local_copy(url) == read
    copies = {}
    for name, age in (("unused", week + 3600), ("recent", week - 3600), ("held", week + 3600)):
        copies[name] = folder / f"{name}-0123abcd.ckpt"
        copies[name].write_bytes(b"x")
        (folder / f"{name}.lock").write_bytes(b"")
        os.utime(folder / f"{name}.lock", (time.time() - age, time.time() - age))
    (folder / "notes.txt").write_text("not ours")
    with open(folder / "held.lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a process reading or downloading it now
        assert object_store.remove_unused_copies(folder) == [copies["unused"]]
    assert not (folder / "unused.lock").exists()
    assert copies["recent"].exists() and copies["held"].exists() and read.exists()
    assert (folder / "notes.txt").exists()
