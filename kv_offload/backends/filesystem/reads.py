"""How `FilesystemTier` reads a key: the file into the caller's buffer (or, for a repacked
value, into this I/O thread's own buffer, unpacked into the caller's once verified), served
only if header and checksum (or tag, or AES-GCM decryption) match; a bad file is removed
and counted, never served.

`FileReads` is a part the tier owns (``FilesystemTier._reads``), built with what a read
needs, passed explicitly: the tier's config, I/O engine, key index, scratch buffers, where a
key's file lives, its counters, and the read failure episodes (its own). The tier keeps the
jobs: it hands one key at a time to ``FileReads.read`` on an I/O thread and ends the key
(unpins it in the index, records the outcome in its job) whatever the read did.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

import torch

from kv_offload.backends.base import Repack
from kv_offload.backends.common.host_buffers import host_view
from kv_offload.backends.common.index import KeyIndex
from kv_offload.backends.common.rejections import Rejections
from kv_offload.backends.filesystem.config import FilesystemTierConfig
from kv_offload.backends.filesystem.episodes import FailureEpisodes
from kv_offload.backends.filesystem.fileformat import (
    ALIGN,
    FileFormatError,
    check_header,
    data_offset,
    names_match,
    parse_header,
)
from kv_offload.backends.filesystem.io_engine import (
    FileSizeMismatch,
    IOEngine,
    NotRegularFile,
    ValueScratch,
    read_head,
    unlink_quietly,
)
from kv_offload.backends.record import unpack_into

logger = logging.getLogger("kv_offload.backends.filesystem.tier")  # (the tier's log lines)


class FileReads:
    """Reads keys' files for one `FilesystemTier` (the read half of the tier)."""

    def __init__(self, config: FilesystemTierConfig, io: IOEngine, index: KeyIndex,
                 scratch: ValueScratch, file_path: Callable[[bytes], str],
                 count: Callable[..., None], episodes: FailureEpisodes,
                 rejections: Rejections) -> None:
        self._config = config
        self._io = io
        self._index = index
        self._scratch = scratch  # repacked values (shared with the tier's writes: one buffer
        # per I/O thread)
        self._file_path = file_path
        self._count = count
        self._episodes = episodes  # read failures, logged once per episode
        self._rejections = rejections

    def read(self, key: bytes, value: torch.Tensor | Repack) -> bool:
        """Fill ``value`` from the file of ``key``; True when it was served (verified, and
        unpacked for a `Repack`). Never raises: a failure is counted and is a miss. The
        caller pinned ``key`` for the read and unpins it after."""
        try:
            repack = value if isinstance(value, Repack) else None
            buf = value if repack is None else self._scratch.get(repack.nbytes)
            served = self._read_checked(key, self._file_path(key), buf)
            if served and repack is not None:  # (a failing unpack fails the key)
                repack.unpack(buf)
            return served
        except FileNotFoundError:
            self._index.remove(key)  # deleted by another process
            self._count("read_failed", "read_failed_vanished")
        except OSError as e:
            self._episodes.failed("io", f"key {key.hex()}: {e}")
        except Exception as e:
            self._episodes.failed("bug", f"key {key.hex()}: {e!r}", exc_info=True)
        return False

    def _read_checked(self, key: bytes, path: str, buf: torch.Tensor) -> bool:
        fingerprint, codec = self._config.layout_fingerprint, self._config.codec
        try:
            head = self._io.read(path, data_offset(key, fingerprint, buf.numel(), codec), buf)
        except FileSizeMismatch as e:
            expected = data_offset(key, fingerprint, buf.numel(), codec) + buf.numel()
            if e.actual < expected:  # a compressed record (or a plain one of another size)
                return self._read_whole(key, path, buf, e.actual)
            return self._size_mismatch(key, path, buf.numel(), e.actual)
        except NotRegularFile as e:  # e.g. a FIFO planted under a key's name
            return self._discard(key, path, str(e))
        try:
            expected_digest = check_header(head, key, fingerprint, buf.numel(), codec)
        except FileFormatError as e:
            return self._discard(key, path, f"bad header: {e}")
        # (verified, and decrypted when encrypting, in place in the host buffer)
        if not codec.open(key, fingerprint, expected_digest, host_view(buf)):
            return self._discard(key, path, f"{codec.algo} digest mismatch")
        return self._served(key, path, len(head) + buf.numel())

    def _read_whole(self, key: bytes, path: str, buf: torch.Tensor, size: int) -> bool:
        """A file smaller than this key's plain record: read whole (at most ``size`` bytes,
        fewer than the plain record's) and opened by the record layer, which decodes a
        compressed record's verified payload into ``buf``, or says what else it is."""
        record = read_head(path, size)
        if len(record) != size:  # (changed under us: judged as what it is now)
            return self._size_mismatch(key, path, buf.numel(), len(record))
        got = unpack_into(record, key, self._config.layout_fingerprint, host_view(buf),
                          align=ALIGN, codec=self._config.codec)
        if got.bad is not None:
            return self._discard(key, path, got.bad)
        if not got.ok:
            return self._size_mismatch(key, path, buf.numel(), size)
        return self._served(key, path, size)

    def _served(self, key: bytes, path: str, nbytes: int) -> bool:
        self._rejections.verified()
        self._index.touch(key)
        with contextlib.suppress(OSError):  # persist recency: a restart orders LRU by mtime
            os.utime(path)
        self._episodes.succeeded()
        self._count("read_ok")
        self._count("bytes_read", n=nbytes)
        return True

    def _size_mismatch(self, key: bytes, path: str, wanted: int, actual: int) -> bool:
        """A file whose size does not fit the buffer: a caller mistake, or a damaged file."""
        codec = self._config.codec
        try:
            info = parse_header(read_head(path), codec)
        except FileFormatError as e:
            return self._discard(key, path, f"bad header: {e}")
        intact = (
            not codec.keyed  # (a keyed record's size claim is not trusted unverified)
            and names_match(info, key, self._config.layout_fingerprint, codec)
            and actual == info.data_offset + info.data_len
        )
        if not intact:
            return self._discard(key, path, f"size {actual} bytes disagrees with its header")
        self._count("read_failed", "read_failed_buffer_size")
        logger.warning(
            "kv-offload: key %s holds %d bytes but the read buffer has %d; not served",
            key.hex(), info.data_len, wanted,
        )
        return False

    def _discard(self, key: bytes, path: str, reason: str) -> bool:
        """Report a bad file: forget the key and remove the file so it is never read again."""
        self._index.remove(key)
        unlink_quietly(path)
        self._count("read_failed", "bad_files_removed", "rejected_records")
        self._rejections.rejected(key, f"{path}: {reason}")
        return False
