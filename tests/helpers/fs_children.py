"""Child processes for the filesystem tier's safety tests (run as ``python fs_children.py``).

``evict-then-refused ROOT SIZE``: under a kernel file-size limit (RLIMIT_FSIZE) just above
SIZE, fill a budget of six SIZE chunks, then write a chunk twice as large. The budget makes it
evict the two oldest chunks; the kernel refuses the file (EFBIG). Prints a JSON report: the
write results, what the tier still holds, and whether every small chunk still reads back
bit-exact. The limit applies to the whole process, so it runs in a child of its own.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import torch
from tier_helpers import chunk, read, write

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.fileformat import data_offset

FINGERPRINT = "fs-children"


def evict_then_refused(root: str, size: int) -> dict:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 8192, size + 8192))
    file_bytes = data_offset(chunk(0, size)[0], FINGERPRINT, size) + size
    tier = FilesystemTier(
        FilesystemTierConfig(root, FINGERPRINT, 6 * file_bytes + 4096, rescan_interval_s=0)
    )
    small = [chunk(i, size) for i in range(6)]
    stored = [write(tier, [key], [data]).ok for key, data in small]
    big_key, big_data = chunk(99, 2 * size)
    refused = write(tier, [big_key], [big_data]).ok
    intact = []
    for key, data in small:
        out = torch.empty(size, dtype=torch.uint8)
        intact.append(read(tier, [key], [out]).ok and torch.equal(out, data))
    report = {
        "stored": stored,
        "big_write_ok": refused,
        "present": tier.lookup([k for k, _ in small]),
        "files": [os.path.exists(tier.file_path(k)) for k, _ in small],
        "intact": intact,
        "counts": tier.stats().counts,
    }
    tier.close()
    return report


if __name__ == "__main__":
    command, root, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert command == "evict-then-refused", command
    print(json.dumps(evict_then_refused(root, size)), flush=True)
