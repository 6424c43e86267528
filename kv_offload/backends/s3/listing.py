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
  list_pages_per_refresh * page_s)``, ``page_s`` being one page's round trips (the
  `Refresher` waits ``refresh_interval_s`` after each poll ends). Defaults, pages of 0.5 s
  (20 requests of 25 ms): ~25 minutes at a million objects, ~1.5 s up to 1000
  (`bench_step_cost.py --tier s3` measures it). Reads never depend on it: a key this
  engine does not know of is a miss, recomputed, never wrong bytes.
- Cost per poll: at most ``list_pages_per_refresh`` pages (20 requests each, see Garbage),
  each request bounded in time by ``request_timeout_s``; per second,
  ``list_pages_per_refresh / refresh_interval_s`` pages, whatever the size of the prefix.
- A failed page (an outage) keeps the pass where it was: the next poll tries it again.

Garbage (why a page is listed in requests of 50 objects, issue 25): a full collection of
CPython's garbage collector stops every thread of the engine's process for as long as it
takes to walk every tracked object not frozen, and runs once the objects promoted into the
old generation since the last one exceed a quarter of those it holds. Objects are promoted
when they are alive during a generation-1 collection, and young collections run when the
tracked objects allocated (net of those freed) pass ``gc.get_threshold()[0]`` (700).
botocore parses a reply into an element tree twice (once to see whether a 200 hides an
error) and then into a dict per object: ~7 tracked objects per listed object alive at once.
A reply of 1000 objects (7000 elements) always set off young collections mid-parse, and 4.5
to 14 objects per object listed reached the old generation (the parsed reply was also held
while the next one was parsed): at ten pages a second, a full collection every ~20 s in
`benchmarks/bench_step_cost.py --tier s3`. A request of ``700 // 14 = 50`` objects never
allocates past the threshold on its own, and each reply is reduced to bytes and numbers
(untracked) before the next request: ~0.03 objects promoted per object listed
(`tests/unit/backends/s3/test_listing_garbage.py`, `benchmarks/bench_s3_gc.py`). The price: 20
requests per page instead of one (more round trips and ~1.5x the client's CPU per page).
The whole listing (``full``: the tier's start-up, before the engine serves and before vLLM
freezes its start-up heap) keeps requests of 1000: its round trips are start-up time.

One listing at a time (a lock); a ``full()`` abandons the pass in progress.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError

from kv_offload.backends.common.deadline import request_deadline
from kv_offload.backends.common.jobs import JobBook
from kv_offload.backends.common.listing import ScanListing
from kv_offload.backends.common.outage import Outage
from kv_offload.backends.common.pacing import Pause, let_others_run
from kv_offload.backends.s3.keys import BucketKeys, ScanStart

PAGE_OBJECTS = 1000  # objects per page: the unit of ``list_pages_per_refresh``
TRACKED_PER_OBJECT = 14  # objects botocore allocates per listed object, at most: see below
MIN_REQUEST_OBJECTS = 10


def request_objects(chosen: int | None = None) -> int:
    """Objects per ListObjectsV2 request (``MaxKeys``): ``chosen`` (the
    ``list_request_objects`` option), else few enough that parsing one reply never
    allocates the young generation's threshold (see "Garbage" above), read at each request:
    an engine may set its own thresholds."""
    if chosen is not None:
        return min(PAGE_OBJECTS, chosen)
    young = gc.get_threshold()[0]
    if young <= 0:  # (automatic collection off: nothing to stay under)
        return PAGE_OBJECTS
    return max(MIN_REQUEST_OBJECTS, min(PAGE_OBJECTS, young // TRACKED_PER_OBJECT))


@dataclass(frozen=True)
class _Batch:
    """What one ListObjectsV2 reply listed, in the tier's terms."""

    keys: list[bytes]  # this layout's keys, in name order
    truncated: bool  # more names follow


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
                 request_objects: int | None = None,
                 book: JobBook, stopping: threading.Event,
                 trouble: Callable[[str, Exception], None],
                 delete: Callable[[list[bytes]], None]) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._root = root
        self._index = index
        self._pages_per_poll = pages_per_poll
        self._request_objects = request_objects  # (None: from the GC threshold)
        self._request_timeout_s = request_timeout_s
        self._outage = outage
        self._book = book
        self._stopping = stopping  # set when the tier closes: an unfinished pass drops nothing
        self._trouble = trouble
        self._delete = delete  # deletes evicted objects (already out of the index)
        self._lock = threading.Lock()
        self._pass: _Pass | None = None

    def full(self) -> None:
        """List the whole prefix now: adopt others' objects, drop vanished ones, evict. In
        requests of 1000 unless ``list_request_objects`` says otherwise: the whole listing
        is the tier's start-up (before the engine serves, and before vLLM freezes its
        start-up heap, which takes what the parse promoted along), and its round trips are
        the start-up's time: 1000 requests for a million objects, not 20,000."""
        with self._lock:
            self._pass = None  # (abandoned: this one covers it)
            self._step(None, pause=None, chosen=self._request_objects or PAGE_OBJECTS)

    def poll(self) -> None:
        """List the next pages of the pass in progress (at most ``pages_per_poll``)."""
        with self._lock:
            self._step(self._pages_per_poll, pause=let_others_run, chosen=self._request_objects)

    def _step(self, max_pages: int | None, pause: Pause, chosen: int | None) -> None:
        if not self._outage.should_try():
            return
        if self._pass is None:
            self._pass = _Pass(self._index.start_scan(), ScanListing())
        current = self._pass
        pages = 0
        try:
            while max_pages is None or pages < max_pages:
                more = self._list_page(current, chosen)
                if more is None:
                    return  # closing: an unfinished listing must not drop anything
                pages += 1
                self._book.count("listing_pages")
                if not more:
                    self._finish(current, pause)
                    break
            self._outage.succeeded()
        except (BotoCoreError, ClientError, OSError) as e:
            self._trouble("refresh", e)  # (the pass stays where it was: the next poll resumes)

    def _list_page(self, current: _Pass, chosen: int | None) -> bool | None:
        """The next page (``PAGE_OBJECTS`` names) of the pass, in requests of
        `request_objects(chosen)`: whether more follow (None: the tier is closing)."""
        size = request_objects(chosen)
        for _ in range(-(-PAGE_OBJECTS // size)):  # (requests, not names: a store that
            # sends fewer names than asked still ends a page in as many requests)
            if self._stopping.is_set():
                return None
            batch = self._list_request(current, size)
            self._book.count("keys_adopted", n=self._index.adopt_listed(batch.keys))
            if not batch.truncated:
                return False
        return True

    def _list_request(self, current: _Pass, max_keys: int) -> _Batch:
        """One ListObjectsV2 request, reduced at once to keys (bytes) and the listing's
        columns: botocore's parse of the reply (a dict per object) is garbage when this
        returns, before the next request is parsed (see "Garbage" above)."""
        with request_deadline(self._request_timeout_s):
            reply = self._s3.list_objects_v2(
                Bucket=self._bucket, Prefix=self._root, MaxKeys=max_keys,
                **({"StartAfter": current.after} if current.after else {}))
        found = []
        for obj in reply.get("Contents", ()):
            current.after = obj["Key"]
            key = self._key_of(obj["Key"])
            if key is not None:
                current.listing.add(key, obj["Size"], obj["LastModified"].timestamp())
                found.append(key)
        self._book.count("listing_requests")
        return _Batch(found, bool(reply.get("IsTruncated")))

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
