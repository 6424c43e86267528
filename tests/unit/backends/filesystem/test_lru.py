"""The sharded LRU of the filesystem index agrees with a plain ordered dict, operation by
operation, and walks the oldest keys across shards in exact order."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload.backends.common.lru import NUM_SHARDS, SegmentedLRU, ShardedLRU

KEYS = st.integers(0, 40).map(lambda n: b"key-%d" % n)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), KEYS, st.integers(0, 1 << 20)),
        st.tuples(st.just("touch"), KEYS, st.just(0)),
        st.tuples(st.just("pop"), KEYS, st.just(0)),
        st.tuples(st.just("walk"), st.just(b""), st.integers(0, 50)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.sets(KEYS, max_size=8))
def test_the_lru_agrees_with_an_ordered_dict(ops, skipped):
    lru, model = ShardedLRU(), OrderedDict()
    for op, key, n in ops:
        if op == "put":
            assert lru.put(key, n) == model.pop(key, None)
            model[key] = n
        elif op == "touch":
            assert lru.touch(key) == (key in model)
            if key in model:
                model.move_to_end(key)
        elif op == "pop":
            assert lru.pop(key) == model.pop(key, None)
        else:  # walk the n oldest keys that are not skipped, stop early
            walk = lru.oldest(skipped.__contains__)
            got = [kv for _, kv in zip(range(n), walk)]
            walk.close()
            want = [(k, v) for k, v in model.items() if k not in skipped][:n]
            assert got == want
        assert len(lru) == len(model)
        assert all((k in lru) == (k in model) for k in (b"key-0", key))
    assert list(lru.oldest()) == list(model.items())
    assert sorted(lru.keys()) == sorted(model)


def test_the_oldest_keys_come_in_order_across_every_shard():
    lru = ShardedLRU()
    keys = [b"%d" % i for i in range(5 * NUM_SHARDS)]
    for key in keys:
        lru.put(key, 1)
    for key in keys[::3]:
        lru.touch(key)
    expected = [k for i, k in enumerate(keys) if i % 3] + keys[::3]
    assert [k for k, _ in lru.oldest()] == expected
    for key in expected[:1000]:
        lru.pop(key)
    assert [k for k, _ in lru.oldest()] == expected[1000:]


def test_sizes_change_in_place_without_changing_the_order():
    lru = ShardedLRU()
    for key in (b"a", b"b", b"c"):
        lru.put(key, 1)
    lru.set_size(b"a", 7)
    assert list(lru.oldest()) == [(b"a", 7), (b"b", 1), (b"c", 1)]
    with pytest.raises(ValueError, match="out of range"):
        lru.put(b"d", -1)


SEGMENT_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), KEYS, st.integers(0, 30)),
        st.tuples(st.just("add"), KEYS, st.integers(0, 30)),
        st.tuples(st.just("touch"), KEYS, st.just(0)),
        st.tuples(st.just("pop"), KEYS, st.just(0)),
        st.tuples(st.just("walk"), st.just(b""), st.integers(0, 50)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(SEGMENT_OPS, st.sets(KEYS, max_size=8), st.integers(1, 100))
def test_the_segmented_lru_agrees_with_two_ordered_dicts(ops, skipped, limit):
    """Probation and protected (at most `limit` bytes, its oldest demoted to probation's
    most recent end); eviction order is probation then protected, least recent first."""
    lru = SegmentedLRU(limit)
    probation: OrderedDict[bytes, int] = OrderedDict()
    protected: OrderedDict[bytes, int] = OrderedDict()

    def demote():
        while sum(protected.values()) > limit and len(protected) > 1:
            key, size = protected.popitem(last=False)
            probation[key] = size

    for op, key, n in ops:
        if op == "put":
            if key in protected:
                assert lru.put(key, n) == protected.pop(key)
                protected[key] = n
                demote()
            else:
                assert lru.put(key, n) == probation.pop(key, None)
                probation[key] = n
        elif op == "add":
            assert lru.add(key, n) == (key not in protected and key not in probation)
            if key not in protected:
                probation.setdefault(key, n)
        elif op == "touch":
            assert lru.touch(key) == (key in probation or key in protected)
            if key in probation or key in protected:
                size = probation.pop(key) if key in probation else protected.pop(key)
                protected[key] = size
                demote()
        elif op == "pop":
            assert lru.pop(key) == (probation.pop(key, None) if key in probation
                                    else protected.pop(key, None))
        else:
            walk = lru.oldest(skipped.__contains__)
            got = [kv for _, kv in zip(range(n), walk)]
            walk.close()
            order = [*probation.items(), *protected.items()]
            assert got == [(k, v) for k, v in order if k not in skipped][:n]
        assert len(lru) == len(probation) + len(protected)
        assert lru.protected_bytes == sum(protected.values())
        assert lru.contains_each([key, b"key-0"]) == [
            k in probation or k in protected for k in (key, b"key-0")]
    assert list(lru.oldest()) == [*probation.items(), *protected.items()]
    for index in {ShardedLRU.shard_of(k) for k in [*probation, *protected]}:
        held = lru.shard_keys(index)
        assert held == {k for k in [*probation, *protected] if ShardedLRU.shard_of(k) == index}
        assert lru.sizes_in_shard(index, held) == [
            probation[k] if k in probation else protected[k] for k in held]


def test_protected_keys_past_the_limit_go_back_to_probation_least_recent_first():
    lru = SegmentedLRU(protected_limit=20)
    lru.put(b"a", 10)
    lru.put(b"b", 11)
    lru.put(b"c", 1)
    assert lru.touch(b"a") and lru.protected_bytes == 10
    assert lru.touch(b"b")  # 21 bytes > 20: a (the least recent protected) is demoted
    assert lru.protected_bytes == 11
    assert [k for k, _ in lru.oldest()] == [b"c", b"a", b"b"]
    assert not lru.touch(b"z") and lru.pop(b"b") == 11 and lru.protected_bytes == 0
