"""What the project serves listens on 127.0.0.1 only: `make tensorboard`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import ROOT, free_port


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket in LISTEN state on ``port``, read from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # /proc writes IPv6 as four little-endian 32-bit words
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_make_tensorboard_listens_on_localhost_only():
    port = free_port()
    proc = subprocess.Popen(["make", "-s", "tensorboard", f"TB_PORT={port}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not listening_addresses(port):
            assert proc.poll() is None and time.monotonic() < deadline, "TensorBoard never listened"
            time.sleep(0.2)
        assert listening_addresses(port) == {"127.0.0.1"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
