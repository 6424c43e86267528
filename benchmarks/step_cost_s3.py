"""`bench_step_cost.py --tier s3`: a real `S3Tier` over a moto server holding the inventory.

- The server (`S3BucketServer`): `s3_bucket_server.py` in its own process (its CPU is not
  the engine's interpreter's), its bucket filled before it serves: the inventory's filler
  as 1-byte objects and the documents' blocks as real records, all under the tier's
  ``<prefix><namespace>/`` (the names a listing of the tier's prefix returns).
- The tier under test: `S3Tier` with the default options but ``list_pages_per_refresh``
  (``--s3-pages-per-refresh``): its constructor lists the whole prefix (the start-up
  listing, timed as the tier's start-up), then its crawl lists that many pages of 1000 every
  ``refresh_interval_s`` (1 s) on the tier's own thread while the engine steps.
- Another engine (`S3Writer`, in the writer process): PUTs records as an `S3Tier` would
  (the same name, the same packed record) with a plain boto3 client; a second `S3Tier`
  would list the whole prefix first (minutes at a million objects) before its first write.
- The delay probe waits at most two passes of the crawl (from the start-up listing's time
  per page) plus 30 s: a write is found when the crawl passes its name, so within one pass.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from step_cost_shared import FINGERPRINT, BlockWriter, SharedTierRun

from kv_offload.backends.common.host_buffers import host_view
from kv_offload.backends.record import CHECKSUM, NETWORK_ALIGN, pack
from kv_offload.backends.s3 import S3Tier
from kv_offload.backends.s3.client import make_client
from kv_offload.backends.s3.config import S3TierConfig
from kv_offload.backends.s3.listing import PAGE_OBJECTS
from kv_offload.backends.s3.local_server import TEST_CREDENTIALS, LocalS3Server

BUCKET = "step-cost-bench"
PREFIX = "kv-offload/"
ROOT = f"{PREFIX}{CHECKSUM.namespace(FINGERPRINT)}/"  # where the tier's objects live
SERVER = Path(__file__).with_name("s3_bucket_server.py")


def record_of(key: bytes, block: torch.Tensor) -> bytes:
    """The object an `S3Tier` of this layout writes for ``key``."""
    return pack(key, FINGERPRINT, host_view(block), align=NETWORK_ALIGN, codec=CHECKSUM)


class S3BucketServer(LocalS3Server):
    """`s3_bucket_server.py` on a free port, its bucket holding ``names`` (filler) and
    ``records`` (real records of ``block_bytes``); ``report``: what its load measured."""

    name = "moto-filled"  # (in its work directory's name and in errors)
    start_timeout_s = 3600.0  # (a million objects load in about a minute here)

    def __init__(self, names: Path, records: Path, block_bytes: int) -> None:
        self._args = ["--bucket", BUCKET, "--root", ROOT, "--names", str(names),
                      "--records", str(records), "--block-bytes", str(block_bytes)]
        super().__init__()

    @property
    def _report_path(self) -> str:
        return os.path.join(self.workdir, "report.json")

    def command(self) -> list[str]:
        return [sys.executable, str(SERVER), "--port", str(self.port), *self._args,
                "--report", self._report_path]

    def answers(self) -> bool:
        return os.path.exists(self._report_path) and super().answers()

    @property
    def report(self) -> dict:
        with open(self._report_path) as f:
            return json.load(f)


class S3Writer(BlockWriter):
    """Another engine's PUTs (see the module docstring)."""

    def __init__(self, endpoint_url: str) -> None:
        os.environ.update(TEST_CREDENTIALS)
        self._s3 = make_client(S3TierConfig(bucket=BUCKET, bytes_to_use=1,
                                            layout_fingerprint=FINGERPRINT,
                                            endpoint_url=endpoint_url))

    def write(self, key: bytes, block: torch.Tensor) -> bool:
        try:
            self._s3.put_object(Bucket=BUCKET, Key=ROOT + key.hex(), Body=record_of(key, block))
        except Exception as e:  # (a failed write is no key to find; say why)
            print(f"writer: PUT failed: {e}", file=sys.stderr)
            return False
        return True


def start_s3(inventory: list[bytes], documents: set[bytes], block_bytes: int, *,
             pages_per_refresh: int = 1) -> SharedTierRun:
    """A moto server holding ``inventory`` (``documents`` as real records, the rest
    filler) and the tier under test on it, its start-up listing done."""
    os.environ.update(TEST_CREDENTIALS)  # (moto takes any; the writer process inherits them)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        names, records = Path(tmp) / "names.txt", Path(tmp) / "records.txt"
        names.write_text("".join(f"{k.hex()}\n" for k in inventory if k not in documents))
        records.write_text("".join(f"{k.hex()}\n" for k in sorted(documents)))
        server = S3BucketServer(names, records, block_bytes)
    fill_s = time.monotonic() - started
    started = time.monotonic()
    tier = S3Tier.from_options({"bucket": BUCKET, "bytes_to_use": "1GiB", "prefix": PREFIX,
                                "endpoint_url": server.endpoint_url,
                                "list_pages_per_refresh": pages_per_refresh}, FINGERPRINT)
    start_up_s = time.monotonic() - started
    pages = max(1, math.ceil(len(inventory) / PAGE_OBJECTS))
    page_s = start_up_s / pages
    interval_s = tier.config.refresh_interval_s
    pass_s = math.ceil(pages / pages_per_refresh) * (interval_s + pages_per_refresh * page_s)
    notes = {**server.report, "start_up_page_ms": page_s * 1e3,
             "pages_per_refresh": pages_per_refresh, "expected_pass_s": pass_s}
    return SharedTierRun("s3", server, server.endpoint_url, tier, block_bytes, start_up_s,
                         fill_s, delay_bound_s=2 * pass_s + 30, server_notes=notes)

