"""What several storage tiers share: no tier imports another, they all import from here.

A module lives here once a second tier needs it (the filesystem, Valkey and S3 tiers, and
``SealedTier`` around a plug-in). The tier contract itself (``backends.base``, with the
namespacing of plug-ins, ``backends.namespaced``) and the record format (``backends.record``)
stay at the top of ``kv_offload.backends``: a plug-in author imports those, not these.

Contents (one module each):
- bounding work: ``deadline`` (a whole request's deadline), ``sized_read`` (never more bytes
  than the buffer), ``pacing`` (long jobs in short steps), ``outage`` (fail fast while a server
  is down), ``rejections`` (refused records, logged once per episode);
- threads and jobs: ``io_threads`` (a tier's I/O threads), ``jobs`` (job bookkeeping),
  ``refresher`` (a shared tier's background refresh);
- keys held: ``index`` (the LRU key index under a byte budget), ``lru``, ``listing`` (what a
  scan found), ``changes`` (the change feed), ``server_keys`` (a shared store's keys);
- records and buffers: ``sealing`` (keyed record codecs), ``sealed_tier`` (a plug-in behind
  them), ``compression`` (lossless codecs of record data), ``host_buffers`` (a host buffer
  as bytes);
- settings and tests: ``options`` (``storage_options`` declared and checked),
  ``local_process`` (a throwaway server on loopback).
"""
