"""The tier's directory: checking the root at start, and which temporary files are stale.

Scans (``fanout_scan``) list file names (the name encodes the key; each header is validated
when the file is read). Temporary files left by a writer that died are removed: at once when
the writer was a process on this host that no longer exists (its name holds the host and
pid), else once this process has seen the file stay unchanged (inode, mtime, size) for
``stale_temp_s`` seconds of its own monotonic clock (shared filesystems: a live writer
elsewhere may still be about to rename it; `is_stale_temp`). Its mtime is never compared
with a clock: a wall clock that jumps, or another host whose clock is skewed, would make a
file being written look older than it is and sweep it from under its writer. The cost: a
process that just started sweeps another host's leftovers only ``stale_temp_s`` after its
first listing of them.
"""

from __future__ import annotations

import errno
import os
import secrets

from kv_offload.backends.filesystem.fileformat import (
    CHECKSUM,
    RecordCodec,
    layout_dir_name,
    parse_temp_file_name,
    temp_file_name,
)
from kv_offload.backends.filesystem.io_engine import probe_direct_io
from kv_offload.errors import TierRootError

_HEX = "0123456789abcdef"
FANOUT_DIRS = [a + b for a in _HEX for b in _HEX]


def make_private_dirs(path: str) -> None:
    """Create ``path`` and its missing parents as 0700 whatever the umask allows (the KV
    reveals prompts: nobody else on the host may list or read it). ``os.makedirs`` gives
    its mode to the last directory only; existing directories are left as they are."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)  # (a umask can only take bits away)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise


def prepare_layout_dir(root_dir: str, fingerprint: str, host: str,
                       codec: RecordCodec = CHECKSUM) -> tuple[str, bool]:
    """Create ``<root>/<layout dir>/<fan-out dirs>`` and check that files can be written there.

    Returns (layout dir, whether O_DIRECT works there). Raises ``TierRootError`` naming the root
    and the reason when it is not a usable, writable directory.
    """
    root = os.path.abspath(root_dir)
    if os.path.exists(root) and not os.path.isdir(root):
        raise TierRootError(
            errno.ENOTDIR, f"root_dir {root!r} is not a directory; expected a directory"
        )
    layout_dir = os.path.join(root, layout_dir_name(fingerprint, codec))
    try:
        for fanout in FANOUT_DIRS:
            make_private_dirs(os.path.join(layout_dir, fanout))
        # (a token per call: tiers opened at once in one process must not share the file)
        probe = os.path.join(layout_dir, temp_file_name(
            os.getpid(), f"probe-{secrets.token_hex(4)}", host))
        direct = probe_direct_io(probe)
    except OSError as e:
        raise TierRootError(
            e.errno,
            f"root_dir {root!r} is not usable: {e.strerror or e} ({e.filename or layout_dir}); "
            f"expected a directory where this process can create and write files",
        ) from e
    return layout_dir, direct


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale_temp(name: str, host: str, unchanged_s: float, stale_temp_s: float) -> bool:
    """Whether the temporary file ``name`` may be removed: its writer was a process of this
    host (``host``) that is gone, or it has stayed unchanged for more than ``stale_temp_s``
    (``unchanged_s``: as timed by the caller's ``FileWatch``, on its monotonic clock)."""
    owner = parse_temp_file_name(name)
    if owner is None:
        return False
    pid, owner_host = owner
    if owner_host == host and pid != os.getpid() and not _pid_alive(pid):
        return True  # (the fast path: no wait for a writer known to be dead)
    return unchanged_s > stale_temp_s
