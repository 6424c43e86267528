"""The layout directory's generation record: one small file, replaced by rename.

A connector reset starts a new key generation (``kv_offload.store.key_view``); the tiering layer
seals it into a record and hands it to ``write_generation``, which lands it here, in the
layout directory every engine of this layout opens, so an engine that restarts reads it back
and never serves keys stored before the reset. Written to a temporary name (the tier's
temporary-file pattern: a crashed writer's leftovers are swept like any other) and renamed
into place: a reader sees the old record or the new one, never half of one. fsync'd: resets
are rare and must outlast a crash. The root budget evicts it only with its directory.

The first record of a directory is created with a hard link (`create_generation_file`): it
fails if a record is there, so engines starting together agree on the first one written.
Reads never follow a symbolic link, never block on a FIFO or a device planted under the
record's name, and read no more than `MAX_GENERATION_BYTES`: such a file is a record that
does not verify (a fresh generation), not a hung start-up.
"""

from __future__ import annotations

import logging
import os
import stat

from kv_offload.backends.filesystem.fileformat import GENERATION_NAME
from kv_offload.backends.filesystem.io_engine import unlink_quietly

logger = logging.getLogger(__name__)
MAX_GENERATION_BYTES = 1 << 16


def read_generation_file(layout_dir: str) -> bytes | None:
    """The record, or None when there is none; raises OSError when it cannot be read
    (b"" for something that is not a regular file: a record that does not verify)."""
    path = os.path.join(layout_dir, GENERATION_NAME)
    try:  # (O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        if os.path.islink(path):  # (ELOOP: a link planted under the name)
            logger.warning("kv-offload: %s is a symbolic link; not followed", path)
            return b""
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            logger.warning("kv-offload: %s is not a regular file; not read", path)
            return b""
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_GENERATION_BYTES)
    finally:
        os.close(fd)


def _write_temp(temp: str, record: bytes) -> None:
    """``record`` in a new private file ``temp``, fsync'd (resets must outlast a crash)."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, record)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_generation_file(layout_dir: str, temp_name: str, record: bytes) -> bool:
    """Replace the record; False (logged) if it could not be written."""
    path, temp = os.path.join(layout_dir, GENERATION_NAME), os.path.join(layout_dir, temp_name)
    try:
        _write_temp(temp, record)
        os.rename(temp, path)
    except OSError as e:
        unlink_quietly(temp)
        logger.warning("kv-offload: could not write the generation record %s: %s", path, e)
        return False
    return True


def create_generation_file(layout_dir: str, temp_name: str, record: bytes) -> bytes | None:
    """Store ``record`` unless a record is there; the record held afterwards. Raises
    OSError when it can be neither written nor read."""
    path, temp = os.path.join(layout_dir, GENERATION_NAME), os.path.join(layout_dir, temp_name)
    try:
        _write_temp(temp, record)
        try:
            os.link(temp, path)  # (fails if a record is there: the first one stays)
        except FileExistsError:
            return read_generation_file(layout_dir)
        return record
    finally:
        unlink_quietly(temp)
