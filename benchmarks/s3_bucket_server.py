"""A moto S3 server on loopback that already holds a million objects, for `--tier s3`.

`bench_step_cost.py --tier s3` needs an S3 endpoint whose bucket holds ``--keys`` objects
under the tier's prefix. Two things make plain moto unfit, and this process fixes both:

- Loading: a million PUTs over HTTP take most of an hour here. This process puts the
  objects straight into moto's in-memory backend (``S3Backend.put_object``, ~40 us and
  ~3.7 KB of server memory each), then starts moto's HTTP server (``ThreadedMotoServer``)
  on the same backend. The objects are filler: a 1-byte body under a name the tier lists as
  a key (``<root><key hex>``), as another engine's objects would look; nobody reads them.
- Listing: moto's ``ListObjectsV2`` sorts every object of the bucket for each page
  (O(objects log objects): ~1.4 s of CPU per page at 100k objects, ~14 s at a million), a
  cost of moto, not of S3 (whose pages take tens of ms at any bucket size). Here the
  backend keeps the bucket's names in a sorted list (built once when the first listing
  comes, then kept by each PUT with ``bisect.insort``; deleted names are skipped and dropped
  when a listing passes them), and a page without a delimiter or continuation token (the
  tier's: ``Prefix`` + ``StartAfter``) is a bisection and a slice. Other listings are moto's.
  The reply is built and serialized by moto as before, but for one thing: moto's
  serializer parses each object's ``LastModified`` string back into a datetime with
  botocore's dateutil-based parser (about half of the server's time per page); here an
  ISO 8601 string goes to ``datetime.fromisoformat``, the tier's own parser (client.py).

Run by `step_cost_s3.py` (``S3BucketServer``), not by hand::

    python benchmarks/s3_bucket_server.py --port 9000 --bucket b --root kv-offload/ns/ \
        --names names.txt --records docs.txt --block-bytes 1024 --report fill.json

``--names``: one key in hex per line (filler); ``--records``: the keys whose objects are
real records of ``--block-bytes`` (`step_cost_s3.record_of`); ``--report``: a JSON file
written once the server answers (objects, load seconds, the server's memory).
"""

from __future__ import annotations

import argparse
import bisect
import json
import resource
import threading
import time

import moto.core.serialize
from moto.core import DEFAULT_ACCOUNT_ID
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.s3.models import S3Backend, s3_backends

from kv_offload.backends.s3.client import parse_timestamp

_sorted: dict[str, list[str]] = {}  # bucket -> its names in order, once listed
_lock = threading.Lock()  # (moto's server answers each request on its own thread)
_moto_list = S3Backend.list_objects_v2
_moto_put = S3Backend.put_object
_moto_datetime = moto.core.serialize.parse_to_aware_datetime


def _aware_datetime(value):
    if isinstance(value, str):
        parsed = parse_timestamp(value)
        if parsed.tzinfo is not None:
            return parsed
    return _moto_datetime(value)


def _names_of(bucket) -> list[str]:
    names = _sorted.get(bucket.name)
    if names is None:
        names = _sorted[bucket.name] = sorted(bucket.keys.keys())
    return names


def _put_object(self, bucket_name, key_name, *args, **kwargs):
    key = _moto_put(self, bucket_name, key_name, *args, **kwargs)
    with _lock:
        names = _sorted.get(bucket_name)
        if names is not None:
            at = bisect.bisect_left(names, key_name)
            if at == len(names) or names[at] != key_name:
                names.insert(at, key_name)
    return key


def _list_objects_v2(self, bucket, prefix, delimiter, continuation_token, start_after,
                     max_keys):
    if delimiter or continuation_token:
        return _moto_list(self, bucket, prefix, delimiter, continuation_token, start_after,
                          max_keys)
    prefix = prefix or ""
    page, truncated = [], False
    with _lock:
        names = _names_of(bucket)
        at = bisect.bisect_right(names, max(prefix, start_after or ""))
        while at < len(names) and names[at].startswith(prefix):
            name = names[at]
            key = bucket.keys.get(name)
            if key is None:  # deleted since: not listed, and out of the order
                del names[at]
                continue
            if len(page) == max_keys:
                truncated = True
                break
            page.append(key)
            at += 1
    # (no NextContinuationToken: the tier pages with StartAfter)
    return page, truncated, None


def serve(args) -> None:
    S3Backend.put_object = _put_object
    S3Backend.list_objects_v2 = _list_objects_v2
    moto.core.serialize.parse_to_aware_datetime = _aware_datetime
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    backend.create_bucket(args.bucket, "us-east-1")
    started = time.monotonic()
    objects = 0
    with open(args.names) as f:
        for line in f:
            _moto_put(backend, args.bucket, args.root + line.strip(), b"x")
            objects += 1
    if args.records:  # (imported here: torch and the tier's record format)
        from step_cost_s3 import record_of
        from step_cost_shared import block_of

        with open(args.records) as f:
            for line in f:
                key = bytes.fromhex(line.strip())
                _moto_put(backend, args.bucket, args.root + key.hex(),
                          record_of(key, block_of(key, args.block_bytes)))
                objects += 1
    load_s = time.monotonic() - started
    started = time.monotonic()
    _names_of(backend.get_bucket(args.bucket))
    index_s = time.monotonic() - started
    server = ThreadedMotoServer("127.0.0.1", args.port, verbose=False)
    server.start()
    with open(args.report, "w") as f:
        json.dump({"objects": objects, "load_s": load_s, "index_s": index_s,
                   "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
                  f)
    threading.Event().wait()  # until killed (LocalProcess.stop: SIGKILL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--root", required=True, help="the tier's prefix + namespace + '/'")
    parser.add_argument("--names", required=True, help="a file of keys in hex, one a line")
    parser.add_argument("--records", help="keys in hex whose objects are real records")
    parser.add_argument("--block-bytes", type=int, default=0, help="their blocks' size")
    parser.add_argument("--report", required=True, help="where to write the load report")
    serve(parser.parse_args())
