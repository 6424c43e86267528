"""A throwaway S3 endpoint on loopback, for tests and `kv-offload bench --backend s3`.

Runs moto's S3 server (``python -m moto.server``, from ``pip install 'moto[server]'``) in a
child process on a free 127.0.0.1 port, so a test can kill it mid-request as a crash would.
moto keeps objects in the server's memory and implements S3's semantics (conditional puts,
listings, batch deletes): a correctness reference, not a performance one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from kv_offload.backends.valkey.local_server import free_port

# moto accepts any credentials; boto3 needs some to sign requests.
TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kv-offload-test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_DEFAULT_REGION": "us-east-1"}


class LocalS3Server:
    """moto's S3 server in a child process on 127.0.0.1 (a context manager)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir = tempfile.mkdtemp(prefix="kv-offload-s3-")
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Start (or restart, empty) the server on this port; wait until it answers."""
        log_path = os.path.join(self.workdir, "server.log")
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                with open(log_path, errors="replace") as f:
                    raise RuntimeError(f"moto server did not start on port {self.port}: "
                                       f"{f.read()[-2000:]}")
            time.sleep(0.05)

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=0.5):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        self.kill()

    def __enter__(self) -> LocalS3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
