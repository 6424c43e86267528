"""The on-disk format: valid safetensors, aligned data, headers that catch any changed byte."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open

from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig
from kv_offload.backends.filesystem.fileformat import (
    ALIGN,
    FileFormatError,
    build_header,
    check_header,
    checksum,
    data_offset,
    key_from_file_name,
    parse_header,
    parse_temp_file_name,
    temp_file_name,
)

from helpers.tier_helpers import random_bytes, write

KEY = bytes.fromhex("00ff10aa") + b"rank0"
FINGERPRINT = "llama-8b|LBHNC|page=65536|tp=1"


@pytest.mark.parametrize("size", [1, 4096, 12345])
def test_tier_files_are_safetensors_with_our_metadata(tmp_path, size):
    tier = FilesystemTier(FilesystemTierConfig(str(tmp_path), FINGERPRINT, 1 << 30))
    data = random_bytes(size, 7)
    assert write(tier, [KEY], [data]).ok
    path = tier.file_path(KEY)
    tier.close()
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        assert list(f.keys()) == ["kv"]
        assert torch.equal(f.get_tensor("kv"), data)
    assert meta == {
        "format": "kv-offload",
        "format_version": "1",
        "layout_fingerprint": FINGERPRINT,
        "key": KEY.hex(),
        "checksum": "xxh3_64:" + checksum(data.numpy().tobytes()),
    }
    with open(path, "rb") as f:
        raw = f.read()
    (header_len,) = struct.unpack_from("<Q", raw)
    assert (8 + header_len) % ALIGN == 0 and len(raw) == 8 + header_len + size
    assert raw[8 + header_len :] == data.numpy().tobytes()


def test_long_fingerprints_get_a_longer_aligned_header():
    fingerprint = "x" * 5000
    header = build_header(KEY, fingerprint, 10, "0123456789abcdef")
    assert len(header) == data_offset(KEY, fingerprint, 10) == 2 * ALIGN
    info = parse_header(header)
    assert (info.fingerprint, info.data_len, info.data_offset) == (fingerprint, 10, 2 * ALIGN)


def test_header_round_trip():
    header = build_header(KEY, FINGERPRINT, 777, "0123456789abcdef")
    info = parse_header(header + b"data follows")
    assert info.key_hex == KEY.hex()
    assert info.fingerprint == FINGERPRINT
    assert (info.data_len, info.checksum, info.data_offset) == (777, "0123456789abcdef", ALIGN)


def test_every_single_bit_flip_in_a_header_is_caught():
    """A flipped header either fails the check or promises another checksum (then the data
    check fails): a changed header is never served."""
    digest = "0123456789abcdef"
    header = build_header(KEY, FINGERPRINT, 777, digest)
    used = 8 + struct.unpack_from("<Q", header)[0] - header.count(b" ")
    # Every bit of the length prefix and the JSON, then a sample of the padding.
    positions = list(range(used)) + list(range(used, len(header), 97))
    for pos in positions:
        for bit in range(8):
            flipped = bytearray(header)
            flipped[pos] ^= 1 << bit
            try:
                promised = check_header(bytes(flipped), KEY, FINGERPRINT, 777)
            except FileFormatError:
                continue
            assert promised != digest, (pos, bit)


def _full_check(head: bytes, key: bytes, fingerprint: str, data_len: int) -> str:
    """check_header's acceptance by the full parse alone (no quick frame comparison)."""
    info = parse_header(head)
    if (info.key_hex, info.fingerprint, info.data_len) != (key.hex(), fingerprint, data_len):
        raise FileFormatError("not this key's header")
    return info.checksum


def _outcome(check, *args):
    try:
        return "accepted", check(*args)
    except FileFormatError:
        return ("refused",)


@pytest.mark.parametrize("digest", ["0123456789abcdef", "0123456789ABCDEF"])
def test_the_quick_header_check_accepts_exactly_what_the_full_parse_accepts(digest):
    """check_header first compares the header with the one written for this key, layout and
    size (no JSON work); every single-bit change must get the full parse's verdict."""
    header = build_header(KEY, FINGERPRINT, 777, digest)
    assert check_header(header, KEY, FINGERPRINT, 777) == digest
    used = 8 + struct.unpack_from("<Q", header)[0] - header.count(b" ")
    for pos in list(range(used)) + list(range(used, len(header), 97)):
        for bit in range(8):
            flipped = bytearray(header)
            flipped[pos] ^= 1 << bit
            args = (bytes(flipped), KEY, FINGERPRINT, 777)
            assert _outcome(check_header, *args) == _outcome(_full_check, *args), (pos, bit)


def test_check_header_names_what_differs():
    header = build_header(KEY, FINGERPRINT, 777, "0123456789abcdef")
    assert check_header(header, KEY, FINGERPRINT, 777) == "0123456789abcdef"
    with pytest.raises(FileFormatError, match="foreign layout"):
        check_header(header, KEY, "other-layout", 777)
    with pytest.raises(FileFormatError, match="names key"):
        check_header(header, b"other", FINGERPRINT, 777)
    with pytest.raises(FileFormatError, match="778"):
        check_header(header, KEY, FINGERPRINT, 778)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda h: h[:7],
        lambda h: h[:100],
        lambda h: struct.pack("<Q", 1 << 40) + h[8:],
        lambda h: h.replace(b'"U8"', b'"I8"'),
        lambda h: h.replace(b"xxh3_64:", b"xxh3_32:"),
        lambda h: h[:8] + json.dumps({"a": 1}).encode().ljust(len(h) - 8),
    ],
    ids=["short", "cut-json", "huge-length", "dtype", "algorithm", "foreign-json"],
)
def test_malformed_headers_are_rejected(mangle):
    header = build_header(KEY, FINGERPRINT, 777, "0123456789abcdef")
    with pytest.raises(FileFormatError):
        parse_header(mangle(header))


def test_file_names_encode_keys_and_temp_names_their_writer():
    assert key_from_file_name(KEY.hex() + ".safetensors") == KEY
    assert key_from_file_name("zz.safetensors") is None
    assert key_from_file_name(KEY.hex() + ".tmp") is None
    name = temp_file_name(1234, "ab-7", "node.cluster.local")
    assert parse_temp_file_name(name) == (1234, "node.cluster.local")
    assert parse_temp_file_name(KEY.hex() + ".safetensors") is None
