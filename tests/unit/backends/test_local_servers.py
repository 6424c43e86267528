"""Loopback servers started by tests or `kv-offload bench` die with the process that started
them, even when it is SIGKILLed and runs no cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kv_offload.backends.valkey.local_server import server_binary

STARTER = """
import sys, time
from kv_offload.backends.valkey.local_server import LocalServer
server = LocalServer()
print(server.process.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie is dead, waiting for reaping
    except FileNotFoundError:
        return False


@pytest.mark.skipif(server_binary() is None, reason="no redis-server/valkey-server on PATH")
def test_a_valkey_server_dies_when_the_process_that_started_it_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE,
                              text=True, env={**os.environ})
    try:
        server_pid = int(parent.stdout.readline())
        assert alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        survived = alive(server_pid)
    finally:
        parent.kill()
    if survived:
        os.kill(server_pid, signal.SIGKILL)
    assert not survived, "the server outlived the process that started it"
