"""Keyed record codecs (kv_offload.backends.common.sealing): a record verifies only for holders
of the secret, for its own key, layout and size; plain and keyed records never pass for each
other."""

from __future__ import annotations

import pytest

from kv_offload.backends.common.sealing import Authenticated, Encrypted
from kv_offload.backends.record import (
    CHECKSUM,
    NETWORK_ALIGN,
    checksum,
    data_offset,
    pack,
    unpack_into,
)

SECRET = b"fleet secret 0123456789abcdef"
KEY, OTHER_KEY = b"\x00" * 8 + b"\x01\x00" + b"\xab" * 32, b"\x00" * 8 + b"\x01\x00" + b"\xcd" * 32
FP = "llama|LBHNC|page=4096|tp1|rank0"
DATA = bytes(range(256)) * 16 + b"tail"  # 4100 bytes: not a multiple of the AES block
KEYED = [Authenticated(SECRET), Encrypted(SECRET)]


def unpack(record, codec, key=KEY, fp=FP):
    out = bytearray(len(DATA))
    got = unpack_into(record, key, fp, memoryview(out), align=NETWORK_ALIGN, codec=codec)
    return got, bytes(out)


def forged_with_recomputed_xxh3(data: bytes) -> bytes:
    """Today's format, made by someone who knows the key and the fingerprint only."""
    return bytes(pack(KEY, FP, memoryview(data), align=NETWORK_ALIGN))


@pytest.mark.parametrize("codec", KEYED, ids=repr)
def test_a_sealed_record_round_trips_bit_exact(codec):
    record = pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN, codec=codec)
    got, out = unpack(record, codec)
    assert got.ok and out == DATA


def test_a_forged_xxh3_record_is_served_without_a_secret_and_refused_with_one():
    evil = b"\xee" * len(DATA)
    got, out = unpack(forged_with_recomputed_xxh3(evil), CHECKSUM)
    assert got.ok and out == evil  # today's trust model: any writer decides
    for codec in KEYED:
        got, out = unpack(forged_with_recomputed_xxh3(evil), codec)
        assert not got.ok and got.bad and out != evil


@pytest.mark.parametrize("codec", KEYED, ids=repr)
def test_a_sealed_record_is_refused_by_an_engine_without_the_secret(codec):
    record = pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN, codec=codec)
    got, _ = unpack(record, CHECKSUM)
    assert not got.ok and got.bad


@pytest.mark.parametrize("codec", KEYED, ids=repr)
def test_every_flipped_bit_of_data_header_or_tag_is_refused(codec):
    record = bytes(pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN, codec=codec))
    offset = data_offset(KEY, FP, len(DATA), align=NETWORK_ALIGN, codec=codec)
    digest_at = record.index(codec.algo.encode()) + len(codec.algo) + 1
    for i in (8, 20, digest_at, digest_at + 5, offset - 1, offset, offset + 2000,
              len(record) - 1):
        bad = bytearray(record)
        bad[i] ^= 0x01
        got, _ = unpack(bytes(bad), codec)
        assert not got.ok and got.bad, f"byte {i} flipped and the record still verified"


@pytest.mark.parametrize("codec", KEYED, ids=repr)
def test_a_record_from_another_secret_is_refused(codec):
    other = type(codec)(b"another fleet's secret 98765")
    got, _ = unpack(pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN, codec=other), codec)
    assert not got.ok and got.bad


@pytest.mark.parametrize("codec", KEYED, ids=repr)
def test_a_record_replayed_under_another_key_or_layout_is_refused(codec):
    record = pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN, codec=codec)
    got, _ = unpack(record, codec, key=OTHER_KEY)
    assert not got.ok and got.bad
    got, _ = unpack(record, codec, fp="gemma|LBHNC|page=4096|tp1|rank0")
    assert not got.ok and got.bad


def test_a_header_rebuilt_around_other_data_with_its_checksum_is_refused():
    """An attacker who copies a genuine tag and recomputes everything unkeyed still fails."""
    codec = KEYED[0]
    genuine = bytes(pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN, codec=codec))
    offset = data_offset(KEY, FP, len(DATA), align=NETWORK_ALIGN, codec=codec)
    evil = genuine[:offset] + bytes(len(DATA))
    got, _ = unpack(evil, codec)
    assert not got.ok and got.bad == "hmac_sha256 digest mismatch"


def test_a_keyed_header_claiming_another_size_is_deleted_not_kept():
    """Unkeyed, an intact record of another size is the caller's mistake (kept); keyed, its
    claims are unverified: it is bad, so a planted one cannot hold the key."""
    for codec, kept in ((CHECKSUM, True), (KEYED[0], False)):
        record = pack(KEY, FP, memoryview(DATA[:100]), align=NETWORK_ALIGN, codec=codec)
        got, _ = unpack(record, codec)
        assert not got.ok and (got.held_bytes == 100) is kept and (got.bad is None) is kept


def test_encrypted_records_show_neither_data_nor_key_nor_fingerprint_and_never_repeat():
    codec = Encrypted(SECRET)
    first = bytes(pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN, codec=codec))
    second = bytes(pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN, codec=codec))
    assert first != second  # a fresh nonce each time
    for record in (first, second):
        assert DATA[:64] not in record and KEY.hex().encode() not in record
        assert FP.encode() not in record and checksum(DATA).encode() not in record
    assert KEY.hex().encode() in bytes(pack(KEY, FP, memoryview(DATA), align=NETWORK_ALIGN,
                                            codec=Authenticated(SECRET)))


def test_namespaces_differ_by_mode_and_secret_and_show_no_fingerprint_hash():
    names = {CHECKSUM.namespace(FP), Authenticated(SECRET).namespace(FP),
             Encrypted(SECRET).namespace(FP), Authenticated(b"x" * 16).namespace(FP)}
    assert len(names) == 4
    assert Authenticated(SECRET).namespace(FP).startswith("kv-v1a-")
    assert Encrypted(SECRET).namespace(FP).startswith("kv-v1e-")
    assert SECRET.decode() not in repr(Encrypted(SECRET))
