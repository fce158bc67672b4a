"""What the project serves listens on 127.0.0.1 only: `make tensorboard`. The helpers here read what a process tree
listens on (tests/test_security.py, tests/test_sweep.py, tests/test_torchrun.py watch their runs with them)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from tests.conftest import ROOT, descendants, free_port


def listening_sockets() -> list[tuple[str, int, int]]:
    """(local address, port, socket inode) of every socket in LISTEN state, read from /proc/net/tcp and tcp6."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A":  # LISTEN
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    text = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:  # /proc writes IPv6 as four little-endian 32-bit words
                    text = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                found.append((text, int(hex_port, 16), int(fields[9])))
    return found


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket in LISTEN state on ``port``."""
    return {address for address, listened, _ in listening_sockets() if listened == port}


def listeners_of(pids: list[int]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every socket the processes ``pids`` listen on; a socket a child inherited (between
    fork and exec it holds its parent's) is its first holder's in ``pids``, so list parents before children."""
    owner: dict[int, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner.setdefault(int(target[8:-1]), pid)
        except OSError:  # the process ended meanwhile
            continue
    return {(address, port, owner[inode]) for address, port, inode in listening_sockets() if inode in owner}


def watch_listeners(proc: subprocess.Popen, timeout: float = 300) -> tuple[subprocess.CompletedProcess, set]:
    """Until ``proc`` (started with its output on a pipe) ends: its output, and every (address, port, pid) that it or
    a process below it listened on."""
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
    reader.start()
    seen: set[tuple[str, int, int]] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= listeners_of([proc.pid, *descendants(proc.pid)])
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(chunks), ""), seen


WILDCARD = {"0.0.0.0", "::"}  # every interface


def test_make_tensorboard_listens_on_localhost_only():
    port = free_port()
    proc = subprocess.Popen(
        ["make", "-s", "tensorboard", f"TB_PORT={port}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not listening_addresses(port):
            assert proc.poll() is None and time.monotonic() < deadline, "TensorBoard never listened"
            time.sleep(0.2)
        assert listening_addresses(port) == {"127.0.0.1"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
