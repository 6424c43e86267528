"""Edit one tensor of a safetensors file in place, as a fine-tune or a merge tool would,
leaving every size, the header and (optionally) the file's mtime as they were."""

from __future__ import annotations

import json
import os
from pathlib import Path


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """The byte range [start, end) of tensor ``name``'s data in the file."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    start, end = header[name]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + end


def edit_tensor_in_place(path: Path, name: str, *, restore_mtime: bool = True) -> None:
    """Flip every byte of tensor ``name`` (same length: nothing else in the file moves);
    with ``restore_mtime``, put the file's atime and mtime back as they were."""
    before = os.stat(path)
    start, end = tensor_span(path, name)
    with open(path, "r+b") as f:
        f.seek(start)
        data = f.read(end - start)
        f.seek(start)
        f.write(bytes(b ^ 0x01 for b in data))
    if restore_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert after.st_size == before.st_size
    assert not restore_mtime or after.st_mtime_ns == before.st_mtime_ns
