"""The layout directory's generation record: one small file, replaced by rename.

A connector reset starts a new key generation (``kv_offload.store.key_view``); the tiering layer
seals it into a record and hands it to ``write_generation``, which lands it here, in the
layout directory every engine of this layout opens, so an engine that restarts reads it back
and never serves keys stored before the reset. Written to a temporary name (the tier's
temporary-file pattern: a crashed writer's leftovers are swept like any other) and renamed
into place: a reader sees the old record or the new one, never half of one. fsync'd: resets
are rare and must outlast a crash. The root budget evicts it only with its directory.
"""

from __future__ import annotations

import logging
import os

from kv_offload.backends.filesystem.fileformat import GENERATION_NAME
from kv_offload.backends.filesystem.io_engine import unlink_quietly

logger = logging.getLogger(__name__)
MAX_GENERATION_BYTES = 1 << 16


def read_generation_file(layout_dir: str) -> bytes | None:
    """The record, or None when there is none; raises OSError when it cannot be read."""
    try:
        with open(os.path.join(layout_dir, GENERATION_NAME), "rb") as f:
            return f.read(MAX_GENERATION_BYTES)
    except FileNotFoundError:
        return None


def write_generation_file(layout_dir: str, temp_name: str, record: bytes) -> bool:
    """Replace the record; False (logged) if it could not be written."""
    path, temp = os.path.join(layout_dir, GENERATION_NAME), os.path.join(layout_dir, temp_name)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, record)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, path)
    except OSError as e:
        unlink_quietly(temp)
        logger.warning("kv-offload: could not write the generation record %s: %s", path, e)
        return False
    return True
