"""The sharded LRU of the filesystem index agrees with a plain ordered dict, operation by
operation, and walks the oldest keys across shards in exact order."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_offload.backends.filesystem.lru import NUM_SHARDS, ShardedLRU

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
