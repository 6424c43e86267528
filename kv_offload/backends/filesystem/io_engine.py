"""Moving bytes between host buffers and files: O_DIRECT when possible, buffered otherwise.

O_DIRECT needs the memory address, the file offset and the length of every transfer aligned
(``ALIGN`` covers every common logical block size). The data of a file starts at an aligned
offset (see fileformat), so when the host buffer is aligned the whole body goes straight between
the device and the buffer; only the header and the tail (< ``ALIGN`` bytes) pass through a small
per-thread aligned scratch page. A buffered write pads nothing; an O_DIRECT write pads the tail
page and truncates the file back to its exact size (safetensors rejects trailing bytes).

Filesystems without O_DIRECT (tmpfs on old kernels, ramfs, some overlay and FUSE mounts) fail
``open`` or the transfer with EINVAL; the engine then falls back to buffered I/O for good.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading

import torch

from kv_offload.backends.common.host_buffers import host_view
from kv_offload.backends.filesystem.fileformat import ALIGN

O_DIRECT = getattr(os, "O_DIRECT", 0)  # (0 where the OS has none: probe_direct_io says False)


class NotRegularFile(Exception):
    """A FIFO, socket or device where a data file should be: never read (a FIFO's open or
    read would block an I/O thread, and then the process's exit, until someone writes)."""


def open_regular(path: str, flags: int = os.O_RDONLY) -> int:
    """Open ``path`` for reading without blocking on a FIFO (O_NONBLOCK changes nothing for
    regular files); raise ``NotRegularFile`` if it is not a regular file."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(f"{path} is not a regular file")
    return fd


class FileSizeMismatch(Exception):
    """The file on disk does not have the size the caller's buffer implies."""

    def __init__(self, actual: int, expected: int) -> None:
        super().__init__(f"file is {actual} bytes, expected {expected}")
        self.actual = actual


EMPTY_VALUE = torch.empty(0, dtype=torch.uint8)
"""The value of a write whose whole record is its ``header`` (a compressed record): written
buffered, since its length is no multiple of the O_DIRECT alignment."""


def aligned_host_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor whose first byte is ``ALIGN``-aligned, as O_DIRECT needs.

    Host pools meant for the filesystem tier should be allocated this way, with slot sizes that
    are multiples of ``ALIGN``; unaligned buffers still work, through buffered I/O.
    """
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift : shift + nbytes]


class _Scratch(threading.local):
    """A per-thread page-aligned buffer (anonymous mmap) for headers and tails."""

    def get(self, nbytes: int) -> memoryview:
        current = getattr(self, "map", None)
        if current is None or len(current) < nbytes:
            self.map = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
        return memoryview(self.map)


class ValueScratch(threading.local):
    """A per-thread aligned buffer for repacked values (`base.Repack`): grown to the largest
    value the thread has moved and kept, so at most one per I/O thread is ever allocated
    (a fresh buffer per key would be fresh pages, which the kernel zeroes on first touch:
    that cost more than the copy into them)."""

    def get(self, nbytes: int) -> torch.Tensor:
        current = getattr(self, "buffer", None)
        if current is None or current.numel() < nbytes:
            self.buffer = current = aligned_host_buffer(nbytes)
        return current[:nbytes]


def _advance(iov: list[memoryview], done: int) -> list[memoryview]:
    """The part of ``iov`` left after ``done`` bytes were transferred."""
    rest = []
    for view in iov:
        if done >= len(view):
            done -= len(view)
        else:
            rest.append(view[done:])
            done = 0
    return rest


def pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
    """Write every byte of ``iov`` at ``offset`` (one ``pwritev`` may write less)."""
    while iov:
        done = os.pwritev(fd, iov, offset)
        if done <= 0:
            raise OSError(errno.EIO, "write made no progress")
        offset += done
        iov = _advance(iov, done)


def preadv_upto(fd: int, iov: list[memoryview], offset: int, want: int) -> int:
    """Read until ``want`` bytes arrived or end of file; return how many arrived."""
    total = 0
    while iov and total < want:
        done = os.preadv(fd, iov, offset + total)
        if done <= 0:
            break
        total += done
        iov = _advance(iov, done)
    return total


def probe_direct_io(path: str) -> bool:
    """Whether a new file at ``path`` accepts O_DIRECT writes and reads (it is removed after).

    Raises OSError when the file cannot be created and written at all (read-only, no
    permission...).
    """
    page = mmap.mmap(-1, ALIGN)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.pwritev(fd, [page], 0)
    finally:
        os.close(fd)
    try:
        if not O_DIRECT:
            return False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        try:
            os.pwritev(fd, [page], 0)
            os.preadv(fd, [page], 0)
            return True
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        finally:
            os.close(fd)
    finally:
        unlink_quietly(path)
        page.close()


class IOEngine:
    """Writes and reads whole files for the tier; raises OSError on I/O faults."""

    def __init__(self, *, direct: bool, fsync: bool) -> None:
        self.direct = direct and bool(O_DIRECT)
        self.fsync = fsync
        self.direct_fallbacks = 0
        self._scratch = _Scratch()

    def _use_direct(self, buf: torch.Tensor) -> bool:
        return self.direct and buf.numel() > 0 and buf.data_ptr() % ALIGN == 0

    def _fall_back(self, e: OSError) -> bool:
        """After an EINVAL from O_DIRECT: switch to buffered I/O, tell the caller to retry."""
        if e.errno != errno.EINVAL:
            return False
        self.direct = False
        self.direct_fallbacks += 1
        return True

    def write_new(self, temp_path: str, final_path: str, header: bytes, buf: torch.Tensor) -> None:
        """Write header + buffer to a new ``temp_path``, then rename it to ``final_path``."""
        direct = self._use_direct(buf)
        try:
            try:
                self._write(temp_path, header, buf, direct)
            except OSError as e:
                if not (direct and self._fall_back(e)):
                    raise
                unlink_quietly(temp_path)
                self._write(temp_path, header, buf, False)
            os.rename(temp_path, final_path)
        except BaseException:
            unlink_quietly(temp_path)
            raise
        if self.fsync:
            dir_fd = os.open(os.path.dirname(final_path), os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def _write(self, path: str, header: bytes, buf: torch.Tensor, direct: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o600)  # private: the KV reveals prompts
        try:
            data = host_view(buf)
            size = len(header) + len(data)
            if not direct:
                pwritev_all(fd, [memoryview(header), data], 0)
            else:
                body = len(data) // ALIGN * ALIGN
                scratch = self._scratch.get(len(header) + ALIGN)
                scratch[: len(header)] = header
                iov = [scratch[: len(header)], data[:body]]
                tail = len(data) - body
                if tail:
                    page = scratch[len(header) : len(header) + ALIGN]
                    page[:tail] = data[body:]
                    page[tail:] = bytes(ALIGN - tail)
                    iov.append(page)
                pwritev_all(fd, [v for v in iov if len(v)], 0)
                if tail:
                    os.ftruncate(fd, size)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, path: str, header_len: int, buf: torch.Tensor) -> bytes:
        """Fill ``buf`` with the data of ``path``; return the header bytes.

        Raises FileNotFoundError (gone), FileSizeMismatch (size is not ``header_len + len(buf)``)
        or another OSError. The caller still has to check header and checksum.
        """
        if self._use_direct(buf):
            try:
                return self._read(path, header_len, buf, True)
            except OSError as e:
                if not self._fall_back(e):
                    raise
        return self._read(path, header_len, buf, False)

    def _read(self, path: str, header_len: int, buf: torch.Tensor, direct: bool) -> bytes:
        fd = open_regular(path, os.O_RDONLY | (O_DIRECT if direct else 0))
        try:
            data = host_view(buf)
            want = header_len + len(data)
            actual = os.fstat(fd).st_size
            if actual != want:
                raise FileSizeMismatch(actual, want)
            scratch = self._scratch.get(header_len + ALIGN)
            body = len(data) // ALIGN * ALIGN if direct else len(data)
            iov = [scratch[:header_len], data[:body]]
            tail = len(data) - body
            if tail:
                iov.append(scratch[header_len : header_len + ALIGN])
            got = preadv_upto(fd, [v for v in iov if len(v)], 0, want)
            if got < want:
                raise FileSizeMismatch(got, want)
            if tail:
                data[body:] = scratch[header_len : header_len + tail]
            return bytes(scratch[:header_len])
        finally:
            os.close(fd)


def read_head(path: str, limit: int = 1 << 20) -> bytes:
    """The first bytes of a file (at most ``limit``), buffered: to diagnose an odd file."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read(limit)


def unlink_quietly(path: str) -> bool:
    """Remove a file if it can be removed (gone already, or read-only: nothing to do)."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True
