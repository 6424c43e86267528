"""FileWatch: how long a file has stayed unchanged, timed on this process's own clock.

Why: liveness (a layout directory's heartbeat, root_budget.py) and the sweep of temporary
files (fanout_scan.py) used to compare a file's mtime with this host's wall clock. Both
clocks can be wrong: a wall clock that jumps (NTP stepping it, a VM resumed, an operator
setting the date) or a host whose clock is skewed from the one that stamped the file (a
shared filesystem where clients set times, or a server whose clock differs) made a file
written a second ago look minutes old, so a live engine's directory could be evicted, or a
live writer's temporary file swept from under it.

How: the observer remembers, per name, a *signature* of what it saw (e.g. inode, mtime in
ns, size, content) and the ``time.monotonic()`` at which it first saw that signature. A file
is judged by how long its signature has stayed the same on the observer's monotonic clock,
never by what its time stamps say: a writer that keeps changing the file is alive whatever
the stamps read, and a file nobody changes is quiet once the observer has watched it long
enough. A time stamp only counts as part of the signature (a different value is a change).

Cost: a file first seen is treated as just changed, so nothing is judged quiet before the
observer has watched it for the whole interval: a process that just started reclaims
nothing for one interval (e.g. ``heartbeat_timeout_s``) after its first look. That is the
price of never trusting a stamp; a dead writer's leftovers only wait a little longer.

Not thread-safe: each owner uses its watch under its own lock (the rescan's).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass
class _Sighting:
    signature: Hashable
    since: float  # monotonic time at which this signature was first seen


class FileWatch:
    """Per name: the last signature seen and since when (this process's monotonic clock)."""

    def __init__(self) -> None:
        self._seen: dict[str, _Sighting] = {}
        self._excused: set[str] = set()

    def unchanged_for(self, name: str, signature: Hashable, now: float | None = None) -> float:
        """Seconds ``name`` has shown ``signature`` (0.0 when first seen, or changed)."""
        now = time.monotonic() if now is None else now
        seen = self._seen.get(name)
        if seen is None:
            self._seen[name] = _Sighting(signature, now)
            return 0.0
        excused = name in self._excused
        self._excused.discard(name)  # (one observation only: never a real change masked later)
        if seen.signature != signature:
            seen.signature = signature
            if not excused:  # (an excused one is our own change: the quiet time goes on)
                seen.since = now
        return now - seen.since

    def excuse(self, name: str) -> None:
        """A change of ``name`` seen at its next observation is this process's own doing (it
        deleted files of a quiet directory just before): it does not restart the quiet time.
        Only the next observation: if it does not show the change yet, the change counts
        when it shows (a longer wait, never an early verdict)."""
        if name in self._seen:
            self._excused.add(name)

    def keep_only(self, names: Iterable[str]) -> None:
        """Forget every name but ``names`` (files gone since: bounded memory)."""
        keep = set(names)
        for name in [n for n in self._seen if n not in keep]:
            del self._seen[name]
        self._excused &= keep

    def __len__(self) -> int:
        return len(self._seen)
