"""FilesystemTier: a persistent, checksummed, bounded disk tier behind the host-memory tier.

- ``lookup`` answers from the in-memory index (no disk access).
- Writes and reads run on a thread pool, one task per key, many files in flight. A write lands
  under a temporary name and is renamed into place; a read fills the host buffer in place and
  is served only if the header (format, layout fingerprint, key, size) and the xxh3 checksum
  of the data match (with ``secret_file``: the keyed tag, or the AES-GCM decryption, of
  ``config.codec``; see ``kv_offload.backends.common.sealing``). A bad file is removed, counted as
  ``rejected_records``, logged once per episode, and reported as a failed key, never raised.
  Removing it is also what keeps a planted file from blocking the key: writes skip keys
  the index holds, and the next write after the failed read stores the real value.
- Reads are `FileReads`' (reads.py), a part the tier builds with its config, I/O engine,
  index and counters; the tier keeps the jobs and ends each key whatever its read did.
- A byte budget with LRU eviction; a key being read is never evicted. A write deletes the
  files it evicts only after its own file has landed: a full disk fails the write and keeps
  them. Write failures are counted by reason and logged once per episode (``episodes``).
- The budget covers the whole root: other layout directories count against it, stale ones are
  evicted first, live ones share it (``root_budget``; done in the background rescan).
- Sharing: several processes (one host, or many over NFS/Lustre/...) may use one directory.
  Renames are atomic, deletes tolerate vanished files, and every ``rescan_interval_s`` seconds
  a background scan adds keys written by others and drops keys deleted by others; it re-lists
  only fan-out directories whose mtime moved (``fanout_scan``). A key written elsewhere is
  visible here within ``rescan_interval_s`` plus one scan (32 scans where directory mtimes
  cannot be trusted: clock skew, NFS attribute caches), merged in short lock holds.
- ``take_changes`` hands out what changed (own writes, evictions, bad files, what rescans
  found), the start-up inventory first, in chunks: callers never need to list the keys.
- ``find`` asks the directory about named keys now (one ``lstat`` each) and adopts those a
  rescan would: a key another process stored is seen at once by a server that needs it.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import os
import secrets
import socket
import threading
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kv_offload.backends.base import (
    Repack,
    StorageTier,
    TierChanges,
    TierJobResult,
    check_tier_keys,
    check_tier_request,
    value_bytes,
)
from kv_offload.backends.common.host_buffers import host_view
from kv_offload.backends.common.index import KeyIndex, Reservation
from kv_offload.backends.common.options import parse_options
from kv_offload.backends.common.rejections import Rejections
from kv_offload.backends.filesystem.config import FilesystemTierConfig, FilesystemTierStats
from kv_offload.backends.filesystem.directory import make_private_dirs, prepare_layout_dir
from kv_offload.backends.filesystem.episodes import FailureEpisodes
from kv_offload.backends.filesystem.fileformat import (
    ALIGN,
    build_header,
    data_offset,
    relative_path,
    temp_file_name,
)
from kv_offload.backends.filesystem.generation_file import (
    create_generation_file,
    read_generation_file,
    write_generation_file,
)
from kv_offload.backends.filesystem.io_engine import (
    EMPTY_VALUE,
    IOEngine,
    ValueScratch,
    aligned_host_buffer,
    unlink_quietly,
)
from kv_offload.backends.filesystem.reads import FileReads
from kv_offload.backends.filesystem.rescanner import Rescanner
from kv_offload.backends.filesystem.root_budget import warn_if_larger_than_the_filesystem
from kv_offload.backends.record import CHECKSUM, RecordCodec, pack_compressed
from kv_offload.config import format_size
from kv_offload.errors import TierClosedError
from kv_offload.runtime.affinity import join_our_cpus

logger = logging.getLogger(__name__)

MAX_KEY_BYTES = 100  # the key's hex is the file name; most filesystems allow 255 bytes


class _Job:
    """A submitted job: per-key outcome, finished when no key is left pending."""

    def __init__(self, job_id: int, keys: Sequence[bytes]) -> None:
        self.job_id = job_id
        self.keys = tuple(keys)
        self.succeeded = [False] * len(keys)
        self.pending = 0

    def result(self) -> TierJobResult:
        return TierJobResult(self.job_id, self.keys, tuple(self.succeeded))


class FilesystemTier(StorageTier):
    """A ``StorageTier`` that keeps one safetensors file per key in a directory."""

    def __init__(self, config: FilesystemTierConfig) -> None:
        self.config = config
        self._host = socket.gethostname()
        self._layout_dir, direct_ok = prepare_layout_dir(
            config.root_dir, config.layout_fingerprint, self._host, config.codec
        )
        self._rejections = Rejections(f"kv-offload filesystem tier {self._layout_dir}")
        self._io = IOEngine(direct=config.direct_io and direct_ok, fsync=config.fsync)
        self._scratch = ValueScratch()  # repacked values: one buffer per I/O thread
        self._index = KeyIndex(config.bytes_to_use)
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # guards jobs, results and counts
        self._writes = FailureEpisodes("write", self._counts, self._lock, logger)
        self._reads = FileReads(config, self._io, self._index, self._scratch, self.file_path,
                                self._count,
                                FailureEpisodes("read", self._counts, self._lock, logger),
                                self._rejections)
        warn_if_larger_than_the_filesystem(self._layout_dir, config.bytes_to_use)
        self._results: deque[TierJobResult] = deque()
        self._job_ids = itertools.count()
        self._temp_token = secrets.token_hex(4)
        self._temp_seq = itertools.count()
        self._closed = False
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kv-fs-io",
                                        initializer=join_our_cpus)
        self._rescanner = Rescanner(
            config, self._layout_dir, self._host, self._index, self._delete, self._count,
            lambda what: FailureEpisodes(what, self._counts, self._lock, logger),
        )
        self._rescanner.rescan(pause=None)  # nobody can call the tier yet: no pauses needed
        self._rescanner.start()  # rescans, and heartbeats even when rescans are off

    @classmethod
    def check_options(cls, options) -> None:
        parse_options(FilesystemTierConfig, options, tier="filesystem", layout_fingerprint="check")

    @classmethod
    def from_options(cls, options, layout_fingerprint: str, *,
                     codec: RecordCodec = CHECKSUM) -> FilesystemTier:
        config = parse_options(FilesystemTierConfig, options, tier="filesystem",
                               layout_fingerprint=layout_fingerprint, codec=codec)
        root = os.path.abspath(os.path.expanduser(config.root_dir))
        return cls(dataclasses.replace(config, root_dir=root))

    # -- the StorageTier interface -------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        check_tier_keys(keys)
        return self._index.contains(list(keys))

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key's file is there now, one ``lstat`` per key (no directory listing:
        the cost is the request's, not the directory's), adopting what a rescan would adopt
        (`FanoutScanner.probe`, `KeyIndex.adopt`): a key another process stored is then in
        ``lookup`` and ``take_changes`` without waiting for the next rescan. Room for them
        is made by the next rescan or write, as for keys a rescan adopted. Counted as
        ``finds``, ``find_keys`` (asked) and ``find_adopted`` (new to this tier)."""
        check_tier_keys(keys, max_key_bytes=MAX_KEY_BYTES)
        found = self._rescanner.find(keys)
        return [key in found for key in keys]

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keys of a hit: protected in the index's eviction order (memory only)."""
        self._index.touch_each(keys)

    def submit_write(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers, max_key_bytes=MAX_KEY_BYTES)
        return self._submit_write(keys, buffers)

    def submit_write_repacked(self, keys: Sequence[bytes],
                              values: Sequence[torch.Tensor | Repack]) -> int:
        check_tier_request(keys, values, max_key_bytes=MAX_KEY_BYTES, repacks=True)
        return self._submit_write(keys, values)  # (packed by the I/O thread: `_write_one`)

    def _submit_write(self, keys: Sequence[bytes],
                      values: Sequence[torch.Tensor | Repack]) -> int:
        job, tasks = self._new_job(keys), []
        for i, (key, buf) in enumerate(zip(keys, values)):
            if self._index.touch(key):  # same key, same bytes: already stored
                job.succeeded[i] = True
                self._count("write_skipped_present")
                continue
            nbytes = value_bytes(buf)
            size = data_offset(key, self.config.layout_fingerprint, nbytes,
                               self.config.codec) + nbytes
            reservation = self._index.reserve(size)
            if reservation is None:  # no room in this tier's share, even after evicting all
                # it may (keys being read, room held by writes in flight): no disk fault
                self._count("write_failed", "write_failed_budget")
                continue
            tasks.append((self._write_one, job, i, key, buf, size, reservation))
        return self._start(job, tasks)

    def submit_read(self, keys: Sequence[bytes], buffers: Sequence[torch.Tensor]) -> int:
        check_tier_request(keys, buffers, max_key_bytes=MAX_KEY_BYTES)
        return self._submit_read(keys, buffers)

    def submit_read_repacked(self, keys: Sequence[bytes],
                             values: Sequence[torch.Tensor | Repack]) -> int:
        check_tier_request(keys, values, max_key_bytes=MAX_KEY_BYTES, repacks=True)
        return self._submit_read(keys, values)  # (unpacked by the I/O thread: `_read_one`)

    def _submit_read(self, keys: Sequence[bytes],
                     values: Sequence[torch.Tensor | Repack]) -> int:
        job, tasks = self._new_job(keys), []
        for i, (key, buf) in enumerate(zip(keys, values)):
            if self._index.begin_read(key) is None:
                self._count("read_failed", "read_failed_absent")
                continue
            tasks.append((self._read_one, job, i, key, buf))
        return self._start(job, tasks)

    def poll(self) -> list[TierJobResult]:
        with self._lock:
            done = list(self._results)
            self._results.clear()
        return done

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._rescanner.stop()
        self._pool.shutdown(wait=True)

    # -- optional hooks of the interface, and more -----------------------------------------

    def take_changes(self, max_keys: int) -> TierChanges:
        """Keys added or removed since the last call (the start-up inventory first), at most
        ``max_keys``; O(keys handed out), no I/O, never waits on a rescan."""
        return self._index.feed.take(max_keys)

    def describe(self) -> str:
        budget = format_size(self.config.bytes_to_use)
        return f"filesystem {self.config.root_dir} (budget {budget} for the directory, " \
            "segmented LRU)"

    def stats(self) -> FilesystemTierStats:
        """Keys, bytes and counters (writes, failures by reason, evictions, bad files...)."""
        with self._lock:
            counts = dict(self._counts)
        root = self._rescanner.root
        return FilesystemTierStats(
            keys=len(self._index),
            bytes_used=self._index.used_bytes,
            bytes_budget=self.config.bytes_to_use,
            counts=counts,
            direct_io=self._io.direct,
            foreign_bytes=root.foreign_bytes,
            live_foreign_dirs=root.live_dirs,
            share_bytes=self._index.budget_bytes,
        )

    def keys(self) -> list[bytes]:
        return self._index.keys()

    def clear(self) -> None:
        """Remove every key and its file (a read in progress still completes: its open file
        outlives the unlink)."""
        held = self._index.keys()
        removed = [key for key in held if self._index.remove(key)]
        self._delete(removed)

    def read_generation(self) -> bytes | None:
        return read_generation_file(self._layout_dir)

    def write_generation(self, record: bytes) -> bool:
        return write_generation_file(self._layout_dir, self._generation_temp(), record)

    def create_generation(self, record: bytes) -> bytes | None:
        return create_generation_file(self._layout_dir, self._generation_temp(), record)

    def _generation_temp(self) -> str:
        return temp_file_name(os.getpid(), f"{self._temp_token}-{next(self._temp_seq)}",
                              self._host)

    def file_path(self, key: bytes) -> str:
        """Where the file of ``key`` lives (whether or not it exists)."""
        return os.path.join(self._layout_dir, relative_path(key))

    def rescan(self) -> None:
        """Scan the directory now: adopt others' keys, drop vanished ones, sweep temporary
        files, account for the whole root (heartbeat, other layout dirs) and evict."""
        self._rescanner.rescan()

    # -- internals -------------------------------------------------------------------------

    def _count(self, *names: str, n: int = 1) -> None:
        with self._lock:
            for name in names:
                self._counts[name] += n

    def _new_job(self, keys: Sequence[bytes]) -> _Job:
        with self._lock:
            if self._closed:
                raise TierClosedError("this FilesystemTier is closed; submit jobs before close()")
            return _Job(next(self._job_ids), keys)

    def _start(self, job: _Job, tasks: list[tuple]) -> int:
        job.pending = len(tasks)
        # A few drainers share the job's tasks instead of one pool task per key: a pool task
        # per key woke a thread per submit, each wanting the GIL and this lock (which its
        # finished keys take) while the submitter still held both: 5 ms to hand over the 62
        # reads of a 16 MiB hit, the first read starting only then.
        queue = deque(tasks)
        with self._lock:  # no close() between the check and the hand-over to the pool
            if self._closed:
                raise TierClosedError("this FilesystemTier was closed while a job was submitted")
            if not tasks:
                self._results.append(job.result())
            for _ in range(min(len(tasks), self.config.io_threads)):
                self._pool.submit(_drain, queue)
        return job.job_id

    def _key_done(self, job: _Job, i: int, ok: bool) -> None:
        with self._lock:
            job.succeeded[i] = ok
            job.pending -= 1
            if job.pending == 0:
                self._results.append(job.result())

    def _read_one(self, job: _Job, i: int, key: bytes, value: torch.Tensor | Repack) -> None:
        ok = False
        try:
            ok = self._reads.read(key, value)
        finally:  # (pinned by `_submit_read`)
            self._index.end_read(key)
            self._key_done(job, i, ok)

    def _delete(self, keys: list[bytes]) -> None:
        for key in keys:
            unlink_quietly(self.file_path(key))  # another process may have removed it already
        self._count("evictions", n=len(keys))

    def _write_one(
        self, job: _Job, i: int, key: bytes, value: torch.Tensor | Repack, size: int,
        reservation: Reservation,
    ) -> None:
        victims: list[bytes] | None = None
        codec = self.config.codec
        try:
            buf = value
            if isinstance(value, Repack):  # packed here, into this thread's own buffer
                buf = self._scratch.get(value.nbytes)
                value.pack(buf)
            record = None if codec.compression is None else pack_compressed(
                key, self.config.layout_fingerprint, host_view(buf), align=ALIGN, codec=codec)
            if record is not None:  # (written buffered: a payload of any length)
                header, stored, size = bytes(record), EMPTY_VALUE, len(record)
            else:
                stored = buf  # what goes to disk: the data, or its ciphertext
                if codec.encrypts:
                    stored = aligned_host_buffer(buf.numel())
                digest = codec.seal(key, self.config.layout_fingerprint, host_view(buf),
                                    host_view(stored) if codec.encrypts else None)
                header = build_header(key, self.config.layout_fingerprint, buf.numel(),
                                      digest, codec)
            final = self.file_path(key)
            for attempt in (0, 1):
                temp = os.path.join(
                    os.path.dirname(final),
                    temp_file_name(
                        os.getpid(), f"{self._temp_token}-{next(self._temp_seq)}", self._host
                    ),
                )
                try:
                    self._io.write_new(temp, final, header, stored)
                    break
                except FileNotFoundError:  # the fan-out directory was removed: recreate it
                    if attempt:
                        raise
                    make_private_dirs(os.path.dirname(final))
            victims = self._index.commit(reservation, key, size)
            self._rescanner.wrote(key)
        except OSError as e:
            name = errno.errorcode.get(e.errno or 0, "EUNKNOWN")
            self._writes.failed(name, f"key {key.hex()}: {e}")
        except Exception as e:
            self._writes.failed("bug", f"key {key.hex()}: {e!r}", exc_info=True)
        finally:
            if victims is None:  # the write failed: its victims stay, on disk and indexed
                self._index.release(reservation)
            self._key_done(job, i, victims is not None)
        if victims is not None:
            self._writes.succeeded()
            self._count("write_ok")
            self._count("bytes_written", n=size)
            self._count("page_bytes_written", n=value_bytes(value))
            self._count("record_bytes_written", n=size)
            self._delete(victims)  # only now that the new file has landed


def _drain(tasks: deque) -> None:
    """Run tasks of one job until none is left (its other drainers take from the same
    queue). A task ends its key itself, whatever happens (`_read_one`, `_write_one`); an
    error that still escapes one is logged and the next task runs."""
    while True:
        try:
            fn, *args = tasks.popleft()
        except IndexError:
            return
        try:
            fn(*args)
        except Exception:  # (a bug's last net: the other keys still end)
            logger.exception("kv-offload: unexpected error in a filesystem tier I/O task")
