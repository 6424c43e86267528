"""A throwaway S3 endpoint on loopback, for tests and `kv-offload bench --tier s3`.

Runs moto's S3 server (``python -m moto.server``, from ``pip install 'moto[server]'``) in a
child process on a free 127.0.0.1 port, so a test can kill it mid-request as a crash would.
moto keeps objects in the server's memory and implements S3's semantics (conditional puts,
listings, batch deletes): a correctness reference, not a performance one.
"""

from __future__ import annotations

import sys
import urllib.request

from kv_offload.backends.common.local_process import LocalProcess

# moto accepts any credentials; boto3 needs some to sign requests.
TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kv-offload-test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_DEFAULT_REGION": "us-east-1"}


class LocalS3Server(LocalProcess):
    """moto's S3 server in a child process on 127.0.0.1 (a context manager)."""

    name = "moto server"
    start_timeout_s = 30.0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=0.5):
                return True
        except OSError:
            return False
