"""The S3 tier's targeted question: does the bucket hold these keys' objects now?

Why: the tier learns of other writers' objects from a listing crawl of a few pages per
``refresh_interval_s``, one pass over the whole prefix at a time (about 25 minutes at a
million objects with the defaults, listing.py). A decode server waiting for the blocks its
prefill server just stored, or any server that must see another's blocks within a second,
knows which keys it needs: one ``HEAD`` per key answers at a cost proportional to the
request, not to the prefix.

How: one ``HeadObject`` per key, queued on the tier's I/O threads (``connections`` of them:
the heads of one call run side by side, each through the helper process like every request
of the tier), and the caller waits for them at most ``request_timeout_s`` in all: each head
runs under what is left of that deadline, and one still queued when it has passed (behind
the tier's jobs) is not sent. Objects found are adopted as the listing adopts them
(``BucketKeys.adopt_found``: other writers' objects, never evicted by this engine, with their
size and time from the head), so ``lookup`` and ``take_changes`` see them. A key not answered
(the endpoint down, stalled or refusing, the deadline passed) is answered from the view; the
first failure opens the endpoint's outage episode as a failed job would, and the call's other
heads are then not sent. Nothing raises for the store's fault.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from botocore.exceptions import BotoCoreError, ClientError

from kv_offload.backends.common.deadline import request_deadline
from kv_offload.backends.common.io_threads import IoThreads
from kv_offload.backends.common.jobs import JobBook
from kv_offload.backends.common.listing import ScanListing
from kv_offload.backends.common.outage import Outage
from kv_offload.backends.s3.keys import BucketKeys

logger = logging.getLogger("kv_offload.backends.s3.tier")  # (the tier's log lines)

ABSENT = frozenset({"NoSuchKey", "NotFound", "404"})  # (a HEAD has no body: just "404")


@dataclass(frozen=True)
class _Head:
    """What one head found: the object is there (with its size and time) or not."""

    here: bool
    size: int = 0
    mtime: float = 0.0


@dataclass
class _Call:
    """One `find` call: its deadline, and each key's head (None: not answered)."""

    deadline: float  # monotonic
    heads: list[_Head | None]
    pending: int
    done: threading.Condition = field(default_factory=threading.Condition)
    failed: bool = False  # a head failed for the endpoint's reason: send no more


class S3Finds:
    """Answers ``S3Tier.find`` (the tier's client, index, I/O threads, outage and book)."""

    def __init__(self, s3, bucket: str, index: BucketKeys, io: IoThreads, *,
                 request_timeout_s: float, outage: Outage, book: JobBook,
                 name_of: Callable[[bytes], str],
                 trouble: Callable[[str, Exception], None]) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._index = index
        self._io = io
        self._request_timeout_s = request_timeout_s
        self._outage = outage
        self._book = book
        self._name_of = name_of
        self._trouble = trouble  # counts a failed request; the endpoint's own opens an outage

    def find(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key's object is in the bucket now (the view's answer where the
        endpoint did not answer in time); objects found are adopted."""
        answers = self._index.contains(list(keys))
        self._book.count("finds")
        self._book.count("find_keys", n=len(keys))
        if not keys or self._book.closed or not self._outage.should_try():
            return answers
        call = _Call(time.monotonic() + self._request_timeout_s, [None] * len(keys),
                     len(keys))
        try:
            for i, key in enumerate(keys):
                self._io.submit(self._head, call, i, key)
        except RuntimeError:  # (the tier closed meanwhile: its threads take no more)
            return answers
        with call.done:  # (a head that was sent ends by the deadline: a little grace)
            call.done.wait_for(lambda: call.pending == 0,
                               max(0.0, call.deadline - time.monotonic()) + 0.05)
            heads = list(call.heads)
        found = ScanListing()
        for i, (key, head) in enumerate(zip(keys, heads)):
            if head is not None:
                answers[i] = head.here
                if head.here:
                    found.add(key, head.size, head.mtime)
        self._book.count("find_adopted", n=self._index.adopt_found(found))
        return answers

    def _head(self, call: _Call, i: int, key: bytes) -> None:
        """One HEAD of the call, on an I/O thread (never sent once the call is over)."""
        head: _Head | None = None
        try:
            left = call.deadline - time.monotonic()
            if left <= 0 or call.failed:
                return
            with request_deadline(left):
                reply = self._s3.head_object(Bucket=self._bucket, Key=self._name_of(key))
            head = _Head(True, int(reply.get("ContentLength", 0)),
                         _timestamp(reply.get("LastModified")))
            self._outage.succeeded()
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) in ABSENT:
                head = _Head(False)
                self._outage.succeeded()
            else:
                self._failed(call, e)
        except (BotoCoreError, OSError) as e:
            self._failed(call, e)
        except Exception:  # (a bug must not reach the worker: the view answers)
            self._book.count("find_failed", "find_failed_bug")
            logger.exception("kv-offload: unexpected error in a HEAD of %s", self._bucket)
        finally:
            with call.done:
                call.heads[i] = head
                call.pending -= 1
                if call.pending <= 0:
                    call.done.notify_all()

    def _failed(self, call: _Call, error: Exception) -> None:
        call.failed = True
        self._trouble("find", error)


def _timestamp(value) -> float:
    """A head's ``LastModified`` (a datetime) in seconds; 0 when absent (the oldest: a key
    of unknown age is evicted first among those adopted with it)."""
    return value.timestamp() if hasattr(value, "timestamp") else 0.0
