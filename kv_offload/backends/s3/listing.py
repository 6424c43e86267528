"""Listings of the S3 tier's prefix: the inventory at start, then a crawl bounded per poll.

Contents:
- `PrefixListing`: ``full()`` lists the whole prefix now (start-up, ``S3Tier.refresh``);
  ``poll()`` lists at most ``list_pages_per_refresh`` pages (1000 objects each) of a crawl
  that resumes where the last poll stopped (``StartAfter`` = the last name listed), and is
  called every ``refresh_interval_s`` by the tier's `Refresher` thread.

Why: the tier used to list the whole prefix every 30 s. botocore parses each listed object
(XML, a timestamp) at ~84 us of CPU: a million objects cost ~84 CPU-seconds per listing, in
the engine's process, competing with the engine for its cores and its interpreter lock.

How the crawl keeps what other engines write visible, at a bounded cost:
- Object names are ``<prefix><namespace>/<key hex>`` and keys are hashes, so new objects land
  anywhere in the name order: ``StartAfter`` cannot list only the new ones. Each poll lists
  the next pages of one pass over the prefix instead; the keys of each page are adopted at
  once (``BucketKeys.adopt_listed``: another writer's object is readable from the moment the
  crawl passes its name). When a pass reaches the end, the keys that predate it and that it
  did not see are dropped (``BucketKeys.finish_listing``, in paced steps) and the next pass
  starts from the beginning.
- Delay: an object another engine wrote is visible within one pass, i.e. within
  ``ceil(objects / (1000 * list_pages_per_refresh)) * (refresh_interval_s +
  list_pages_per_refresh * page_s)``, ``page_s`` being one page's round trip (the
  `Refresher` waits ``refresh_interval_s`` after each poll ends). Defaults, pages of 50 ms:
  ~18 minutes at a million objects, ~1 s up to 1000 (`bench_step_cost.py --tier s3`
  measures it). Reads never depend on it: a key this engine does not know of is a miss,
  recomputed, never wrong bytes.
- Cost per poll: at most ``list_pages_per_refresh`` requests, each bounded in time by
  ``request_timeout_s``, and ~84 ms of CPU per page; per second, ``list_pages_per_refresh /
  refresh_interval_s`` pages, whatever the size of the prefix.
- A failed page (an outage) keeps the pass where it was: the next poll tries it again.

One listing at a time (a lock); a ``full()`` abandons the pass in progress.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError

from kv_offload.backends.deadline import request_deadline
from kv_offload.backends.filesystem.listing import ScanListing
from kv_offload.backends.filesystem.pacing import Pause, let_others_run
from kv_offload.backends.jobs import JobBook
from kv_offload.backends.outage import Outage
from kv_offload.backends.s3.keys import BucketKeys, ScanStart

PAGE_OBJECTS = 1000  # objects per ListObjectsV2 page (the S3 maximum)


@dataclass
class _Pass:
    """One pass over the prefix, in progress."""

    start: ScanStart
    listing: ScanListing
    after: str = ""  # the last name listed: the next page starts after it


class PrefixListing:
    """Lists one tier's prefix: whole (``full``) or a few pages at a time (``poll``)."""

    def __init__(self, s3, bucket: str, root: str, index: BucketKeys, *,
                 pages_per_poll: int, request_timeout_s: float, outage: Outage,
                 book: JobBook, stopping: threading.Event,
                 trouble: Callable[[str, Exception], None],
                 delete: Callable[[list[bytes]], None]) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._root = root
        self._index = index
        self._pages_per_poll = pages_per_poll
        self._request_timeout_s = request_timeout_s
        self._outage = outage
        self._book = book
        self._stopping = stopping  # set when the tier closes: an unfinished pass drops nothing
        self._trouble = trouble
        self._delete = delete  # deletes evicted objects (already out of the index)
        self._lock = threading.Lock()
        self._pass: _Pass | None = None

    def full(self) -> None:
        """List the whole prefix now: adopt others' objects, drop vanished ones, evict."""
        with self._lock:
            self._pass = None  # (abandoned: this one covers it)
            self._step(None, pause=None)

    def poll(self) -> None:
        """List the next pages of the pass in progress (at most ``pages_per_poll``)."""
        with self._lock:
            self._step(self._pages_per_poll, pause=let_others_run)

    def _step(self, max_pages: int | None, pause: Pause) -> None:
        if not self._outage.should_try():
            return
        if self._pass is None:
            self._pass = _Pass(self._index.start_scan(), ScanListing())
        current = self._pass
        pages = 0
        try:
            while max_pages is None or pages < max_pages:
                if self._stopping.is_set():
                    return  # closing: an unfinished listing must not drop anything
                with request_deadline(self._request_timeout_s):
                    reply = self._s3.list_objects_v2(
                        Bucket=self._bucket, Prefix=self._root, MaxKeys=PAGE_OBJECTS,
                        **({"StartAfter": current.after} if current.after else {}))
                pages += 1
                found = []
                for obj in reply.get("Contents", []):
                    current.after = obj["Key"]
                    key = self._key_of(obj["Key"])
                    if key is not None:
                        current.listing.add(key, obj["Size"], obj["LastModified"].timestamp())
                        found.append(key)
                self._book.count("keys_adopted", n=self._index.adopt_listed(found))
                self._book.count("listing_pages")
                if not reply.get("IsTruncated"):
                    self._finish(current, pause)
                    break
            self._outage.succeeded()
        except (BotoCoreError, ClientError, OSError) as e:
            self._trouble("refresh", e)  # (the pass stays where it was: the next poll resumes)

    def _finish(self, current: _Pass, pause: Pause) -> None:
        self._pass = None
        merged = self._index.finish_listing(current.listing, current.start, pause)
        self._delete(self._index.evict_to_budget())
        self._book.count("refreshes")
        self._book.count("keys_adopted", n=merged.added)
        self._book.count("keys_vanished", n=merged.dropped)

    def _key_of(self, name: str) -> bytes | None:
        try:
            return bytes.fromhex(name[len(self._root):]) or None
        except ValueError:
            return None  # not one of ours (e.g. the generation record)
