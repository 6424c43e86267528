"""A worker rank's report as it crosses vLLM's process boundary: two columns (keys, and the
media bits each is held in now), equivalent to the `KeyChange` records it was made from."""

from __future__ import annotations

import os
import pickle

import pytest

pytest.importorskip("vllm")

from kv_offload.types import HOST_BIT, STORAGE_BIT, KeyChange, Location  # noqa: E402
from kv_offload.vllm.metadata import KVOffloadWorkerMetadata, RankReport  # noqa: E402


def every_kind_of_change() -> list[KeyChange]:
    keys = [(os.urandom(32), group) for group in (0, 1, 2, 0)]
    return [KeyChange(keys[0], Location.HOST), KeyChange(keys[1], Location.HOST, True),
            KeyChange(keys[2], Location.STORAGE), KeyChange(keys[3], Location.ABSENT)]


def test_the_columns_say_what_each_change_says_and_give_the_records_back():
    changes = every_kind_of_change()
    report = RankReport.of(changes, False, 7)
    assert report.keys == tuple(c.key for c in changes)
    assert report.held == bytes([HOST_BIT, HOST_BIT | STORAGE_BIT, STORAGE_BIT, 0])
    assert report.changes == tuple(changes)


def test_a_report_survives_pickling_and_reports_of_one_rank_concatenate_in_order():
    first, later = every_kind_of_change(), every_kind_of_change()
    meta = KVOffloadWorkerMetadata({0: RankReport.of(first, True, 3)})
    meta = meta.aggregate(KVOffloadWorkerMetadata({0: RankReport.of(later, False, 5)}))
    meta = pickle.loads(pickle.dumps(meta))
    (merged,) = meta.reports.values()
    assert merged.changes == tuple(first + later)
    assert merged.reset and merged.reflected_step == 5


def test_a_report_with_a_byte_short_names_both_lengths():
    with pytest.raises(ValueError, match="one held byte per key: 2 keys, 1 bytes"):
        RankReport(((b"a", 0), (b"b", 0)), bytes([HOST_BIT]), False, 0)
