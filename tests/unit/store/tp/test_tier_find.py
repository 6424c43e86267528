"""`TPRecordTier.find`: a rank asks the store about the records that would serve its keys.

A rank key is served by TP-free records of any TP size that cover its heads. Another server
(here a second filesystem tier over the same real directory, as another engine's would be)
stores records after this rank's tier started, with rescans off: only `find` can tell the
rank of them. It must ask the tier below for every candidate record of the rank keys (as
`lookup`'s presence bits are kept per candidate), count a key found only when the records
found cover every head the rank needs, make `lookup` say so at once, and report the newly
covered keys through `take_changes`, once.
"""

from __future__ import annotations

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.canonical import canonicalize
from kv_offload.store.key_view import storage_key
from kv_offload.store.tiered import layout_fingerprint
from kv_offload.store.tp.records import HeadRange, Record, RecordOrder, TPShare, rank_records
from kv_offload.store.tp.tier import TPRecordTier
from kv_offload.testing.example_models import build_example

from helpers.tier_helpers import drain_changes, random_bytes, write


def rank0_of_tp4(root: str) -> tuple[TPRecordTier, FilesystemTier]:
    """Rank 0 of 4 of the Llama-3-8B example (heads 0-1 of 8) over a filesystem tier of
    its own, and another server's tier over the same directory; both with rescans off."""
    model = build_example("llama-8b", 4, layout="LBHNC", tp_size=4)
    canonical = canonicalize(model.kv_caches, model.groups, 4)
    records = rank_records(canonical, model.kv_caches, model.groups,
                           TPShare("weights", 4, 0, 8),
                           layout_fingerprint(canonical, "weights|tp4|rank0"))

    def disk() -> FilesystemTier:
        return FilesystemTier(FilesystemTierConfig(root, records.fingerprint, 1 << 30,
                                                   rescan_interval_s=0))

    return TPRecordTier(disk(), records), disk()


def store_record(other: FilesystemTier, rank: TPRecordTier, key: bytes, first: int,
                 stop: int) -> None:
    """Another server stores the record of heads [first, stop) of `key`'s block."""
    recs = rank.records.groups[0]
    record = Record.named(HeadRange(first, stop), RecordOrder.HEAD_MAJOR)
    assert record in recs.candidates
    assert write(other, [rank.records.record_key(key, record)],
                 [random_bytes(recs.record_bytes(record), first * 10 + stop)]).ok


def test_find_covers_a_rank_key_from_records_another_server_stored(tmp_path):
    rank, other = rank0_of_tp4(str(tmp_path))
    whole, half, nothing = (storage_key((bytes([n]) * 32, 0)) for n in (1, 2, 3))
    store_record(other, rank, whole, 0, 8)  # a TP=1 record: every head, ours among them
    store_record(other, rank, half, 1, 2)  # head 1 only: head 0 is still missing
    keys = [whole, half, nothing]
    assert rank.lookup(keys) == [False, False, False]
    assert rank.find(keys) == [True, False, False]
    assert rank.lookup(keys) == [True, False, False]
    assert drain_changes(rank) == ({whole}, set())  # once, though the record's "added" came too
    store_record(other, rank, half, 0, 1)  # now heads 0 and 1: covered by two records
    assert rank.find([half]) == [True]
    assert rank.lookup(keys) == [True, True, False]
    assert drain_changes(rank) == ({half}, set())
    assert rank.find([nothing]) == [False] and drain_changes(rank) == (set(), set())
    rank.close()
    other.close()


def test_take_changes_hands_out_found_keys_within_max_keys(tmp_path):
    rank, other = rank0_of_tp4(str(tmp_path))
    keys = [storage_key((bytes([n]) * 32, 0)) for n in range(1, 4)]
    for key in keys:
        store_record(other, rank, key, 0, 2)  # the rank's own record (TP=4 rank 0's)
    assert rank.find(keys) == [True, True, True]
    first = rank.take_changes(2)
    assert len(first.added) == 2 and not first.removed
    assert drain_changes(rank) == (set(keys) - set(first.added), set())
    rank.close()
    other.close()
