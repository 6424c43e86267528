"""Digests of whole files, remembered across processes by what changes when a file does.

Why whole files: a digest of samples misses an edit that no sample covers (a merged LoRA or
one re-quantised tensor rewritten in place keeps every size and header). Every byte goes
through xxh3-128 (about 18 GB/s per core here, releasing the GIL), so reading the file is
the cost, not hashing it.

Why remembered: a restart over unchanged weights must not read them all again. A digest is
kept under the file's identity on its file system (device, inode) with what the kernel
changes whenever content may have changed: size, mtime and ctime in nanoseconds. An edit
in place moves mtime and ctime; restoring mtime with ``utime`` moves ctime again, and ctime
cannot be set by a user (only by changing the system clock). An entry is used only when all
five still match; anything else is read again. A copy or a replacement (``rename`` over
the file) has another inode: read again.

The cache is one JSON file per user (`cache_dir`: ``$KV_OFFLOAD_CACHE_DIR``, else
``$XDG_CACHE_HOME/kv-offload``, else ``~/.cache/kv-offload``), private (0700 directory,
0600 file), replaced by rename so a reader sees a whole version. Processes that digest the
same file at once (the ranks of one engine) take a per-file lock, so one reads it and the
others find its digest. A cache that cannot be written (read-only home) costs a full read
at every start, said once in the log; a damaged one is ignored and rewritten.

Trust: the cache is as trusted as the user's home (whoever can write it can also edit the
weights the engine loads). xxh3 is not a cryptographic hash: it finds accidental and
operational changes, not a collision an attacker built on purpose (an attacker who can
write the weights needs none).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import xxhash

logger = logging.getLogger("kv_offload")

CACHE_NAME = "file-digests.json"
MAX_ENTRIES = 20_000  # (a few hundred models' shards; the least recently used go first)
# 1 MiB reads: measured fastest here from the page cache (the chunk stays in the CPU's cache
# between the copy and the hash; 4 and 16 MiB were 30-40% slower). Not mmap, although faster
# from the page cache: a file truncated while mapped kills the process with SIGBUS.
READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileState:
    """What the kernel changes when a file's content may have changed."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileState:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @property
    def key(self) -> str:
        return f"{self.device}:{self.inode}"


@dataclass(frozen=True)
class FileDigest:
    """One file's digest and whether it came from the cache (`remembered`) or a read."""

    path: Path
    size: int
    digest: str
    remembered: bool


def cache_dir() -> Path:
    """Where digests are remembered (see the module docstring)."""
    explicit = os.environ.get("KV_OFFLOAD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kv-offload"


def digest_file(path: Path) -> str:
    """xxh3-128 of every byte of ``path`` (a regular file), hex."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        with suppress(AttributeError, OSError):  # (a hint only)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


class FileDigests:
    """Whole-file digests, remembered in ``directory`` (default: `cache_dir()`)."""

    def __init__(self, directory: Path | None = None, *, threads: int = 2) -> None:
        self.directory = directory or cache_dir()
        self.threads = threads
        self._lock = threading.Lock()  # (this process's threads: the entries and the file)
        self._unwritable_said = False

    def digests(self, paths: Sequence[Path]) -> list[FileDigest]:
        """The digest of every file in ``paths`` (regular files; symbolic links followed),
        in order: remembered where the file is unchanged, read otherwise. Raises OSError
        when a file cannot be read."""
        if not paths:
            return []
        known = self._entries()  # (once: a file's own lock re-reads it before a read)
        with ThreadPoolExecutor(min(self.threads, len(paths)),
                                thread_name_prefix="kv-offload-digest") as pool:
            return list(pool.map(lambda path: self._digest(path, known), paths))

    def _digest(self, path: Path, known: dict[str, dict]) -> FileDigest:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        state = FileState.of(st)
        remembered = _matching(known, state)
        if remembered is not None:
            return FileDigest(path, state.size, remembered, True)
        with self._file_lock(state):  # (another process may be reading it right now)
            with self._lock:
                remembered = _matching(self._entries(), state)
            if remembered is not None:
                return FileDigest(path, state.size, remembered, True)
            digest = digest_file(path)
            if FileState.of(os.stat(path)) != state:  # changed while read: no one version
                raise OSError(f"{path} changed while it was read; try again once it is "
                              "written")
            self._remember(state, digest)
        return FileDigest(path, state.size, digest, False)

    # --- the cache file ---

    def _entries(self) -> dict[str, dict]:
        try:
            with open(self.directory / CACHE_NAME, encoding="utf-8") as f:
                entries = json.load(f)
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):  # none yet, or damaged: digests are read again
            return {}

    def _remember(self, state: FileState, digest: str) -> None:
        with self._lock, self._cache_lock():
            entries = self._entries()
            entries.pop(state.key, None)
            entries[state.key] = {"size": state.size, "mtime_ns": state.mtime_ns,
                                  "ctime_ns": state.ctime_ns, "digest": digest}
            for stale in list(entries)[:max(0, len(entries) - MAX_ENTRIES)]:
                del entries[stale]  # (insertion order: the least recently written first)
            try:
                fd, temp = tempfile.mkstemp(prefix=".digests-", dir=self.directory)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        json.dump(entries, f)
                    os.replace(temp, self.directory / CACHE_NAME)
                except BaseException:
                    os.unlink(temp)
                    raise
            except OSError as exc:
                self._say_unwritable(exc)

    @contextmanager
    def _cache_lock(self) -> Iterator[None]:
        with self._locked(self.directory / (CACHE_NAME + ".lock")):
            yield

    @contextmanager
    def _file_lock(self, state: FileState) -> Iterator[None]:
        with self._locked(self.directory / f"digest-{state.device}-{state.inode}.lock"):
            yield

    @contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        """An exclusive lock on ``path`` across processes (none if the cache directory
        cannot be made: then every process reads for itself)."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self._say_unwritable(exc)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (releases the lock)

    def _say_unwritable(self, exc: OSError) -> None:
        if not self._unwritable_said:
            self._unwritable_said = True
            logger.warning("kv-offload: cannot remember weight digests in %s (%s): every "
                           "start reads the weights in full; set KV_OFFLOAD_CACHE_DIR to a "
                           "writable directory", self.directory, exc)


def _matching(entries: dict[str, dict], state: FileState) -> str | None:
    """The remembered digest of the file in ``state``, if every part of it matches."""
    entry = entries.get(state.key)
    if not isinstance(entry, dict):
        return None
    same = (entry.get("size"), entry.get("mtime_ns"), entry.get("ctime_ns")) == (
        state.size, state.mtime_ns, state.ctime_ns)
    digest = entry.get("digest")
    return digest if same and isinstance(digest, str) else None
