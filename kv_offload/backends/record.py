"""The header every stored value carries, whatever the tier: files, Valkey values, S3 objects.

A record is ``8-byte little-endian header length | JSON header | data``: a valid safetensors
blob. The JSON header holds one U8 tensor named ``kv`` covering all the data, and
``__metadata__`` with the format version, the layout fingerprint, the key (hex) and the
xxh3-64 checksum of the data. The header is padded with trailing spaces (allowed by the
safetensors spec) so that the data starts at a multiple of ``align`` bytes: the disk tier
uses 4096 (O_DIRECT reads land straight in aligned host buffers), network stores use 8
(safetensors' own alignment; a 4 KiB pad per value would be pure overhead there).

Why a header on every value: a record read back is served only if it names this key, this
layout fingerprint and this size, and its data hashes to the stored checksum. A value written
by another model, layout or library version, or damaged anywhere, is a miss, never wrong
bytes. ``parse_header`` re-builds the header from what it claims and compares byte for byte,
so any changed header byte (padding included) is caught too.

Records of one layout are kept together under ``layout_namespace(fingerprint)`` (a directory
name, a key prefix): a listing never even sees another layout's records.

Contents: ``pack`` and ``unpack_into`` (a whole record, for stores that hold values in one
piece), ``build_header``, ``parse_header``, ``check_header``, ``data_offset``, ``checksum``,
``layout_namespace``, ``RecordFormatError``, ``HeaderInfo``, ``Unpacked``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import xxhash

FORMAT_VERSION = "1"
TENSOR_NAME = "kv"
NETWORK_ALIGN = 8  # data offset alignment for values in network stores
_CHECKSUM_HEX_DIGITS = 16
_MAX_HEADER_BYTES = 1 << 20


class RecordFormatError(Exception):
    """A stored record that is not what kv-offload wrote for that key (internal: tiers turn
    it into a failed key, it never reaches the engine)."""


@dataclass(frozen=True)
class HeaderInfo:
    """What a record header claims about its contents."""

    key_hex: str
    fingerprint: str
    data_len: int
    checksum: str
    data_offset: int


def checksum(data: memoryview | bytes) -> str:
    """The checksum stored in the header: xxh3-64 of the data, 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def layout_namespace(fingerprint: str) -> str:
    """The name under which the records of one layout (and one format version) live."""
    return f"kv-v{FORMAT_VERSION}-{xxhash.xxh3_64_hexdigest(fingerprint.encode())}"


def _header_json(key_hex: str, fingerprint: str, data_len: int, digest: str) -> bytes:
    doc = {
        "__metadata__": {
            "format": "kv-offload",
            "format_version": FORMAT_VERSION,
            "layout_fingerprint": fingerprint,
            "key": key_hex,
            "checksum": "xxh3_64:" + digest,
        },
        TENSOR_NAME: {"dtype": "U8", "shape": [data_len], "data_offsets": [0, data_len]},
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def data_offset(key: bytes, fingerprint: str, data_len: int, *, align: int) -> int:
    """Where the data starts in the record for this key: a multiple of ``align``."""
    body = _header_json(key.hex(), fingerprint, data_len, "0" * _CHECKSUM_HEX_DIGITS)
    return -(-(8 + len(body)) // align) * align


def build_header(key: bytes, fingerprint: str, data_len: int, digest: str, *,
                 align: int) -> bytes:
    """The bytes before the data: length prefix and space-padded JSON, ``data_offset`` long."""
    body = _header_json(key.hex(), fingerprint, data_len, digest)
    offset = data_offset(key, fingerprint, data_len, align=align)
    body += b" " * (offset - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


def parse_header(head: bytes | memoryview, *, align: int) -> HeaderInfo:
    """Parse the header at the start of ``head``; raise ``RecordFormatError`` if it is not ours.

    Valid only if re-building the header from what it claims gives back the exact same bytes,
    so any changed byte (padding included) is caught.
    """
    if len(head) < 8:
        raise RecordFormatError(f"record is {len(head)} bytes, shorter than a header")
    (length,) = struct.unpack_from("<Q", head)
    if length > _MAX_HEADER_BYTES or 8 + length > len(head):
        raise RecordFormatError(
            f"header length {length} does not fit the {len(head)} bytes read")
    head = bytes(head[: 8 + length])  # only the header is copied, never the data
    try:
        doc = json.loads(head[8:].decode("ascii"))
        meta = doc["__metadata__"]
        tensor = doc[TENSOR_NAME]
        key_hex = meta["key"]
        fingerprint = meta["layout_fingerprint"]
        data_len = tensor["shape"][0]
        algo, digest = meta["checksum"].split(":")
        key = bytes.fromhex(key_hex)
    except RecursionError:  # JSON nested deeper than the parser's stack: not ours
        raise RecordFormatError("unreadable header: JSON nested too deeply") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise RecordFormatError(f"unreadable header: {e}") from e
    if (
        algo != "xxh3_64"
        or len(digest) != _CHECKSUM_HEX_DIGITS
        or not isinstance(data_len, int)
        or data_len < 0
        or not isinstance(fingerprint, str)
    ):
        raise RecordFormatError("header fields have unexpected types or values")
    expected = build_header(key, fingerprint, data_len, digest, align=align)
    if head != expected:
        raise RecordFormatError("header is not byte-identical to the one this format writes")
    return HeaderInfo(key_hex, fingerprint, data_len, digest, len(expected))


def check_header(head: bytes | memoryview, key: bytes, fingerprint: str, data_len: int, *,
                 align: int) -> str:
    """The checksum a header promises for the data, if it is this key's header for this layout.

    Raises ``RecordFormatError`` naming what differs (foreign layout, other key, other size).
    """
    info = parse_header(head, align=align)
    if info.fingerprint != fingerprint:
        raise RecordFormatError(f"foreign layout fingerprint {info.fingerprint!r}")
    if info.key_hex != key.hex():
        raise RecordFormatError(f"header names key {info.key_hex}")
    if info.data_len != data_len:
        raise RecordFormatError(f"header says {info.data_len} data bytes, expected {data_len}")
    return info.checksum


@dataclass(frozen=True)
class Unpacked:
    """What ``unpack_into`` made of a stored record.

    ``ok``: the data is in the buffer. Otherwise nothing may be served, and either ``bad``
    says why the record is not ours to serve (corrupt, foreign layout, other key: delete it),
    or ``held_bytes`` says the record is intact but holds another size than the buffer (the
    caller's mistake: keep it).
    """

    ok: bool = False
    bad: str | None = None
    held_bytes: int | None = None


def pack(key: bytes, fingerprint: str, data: memoryview, *, align: int) -> bytes:
    """A whole record: header then data (one copy of the data, into the returned bytes)."""
    header = build_header(key, fingerprint, len(data), checksum(data), align=align)
    return b"".join((header, data))


def unpack_into(record: bytes | memoryview, key: bytes, fingerprint: str, out: memoryview, *,
                align: int) -> Unpacked:
    """Check a whole record against this key, layout and ``len(out)``, and copy its data
    into ``out`` only if the header and the checksum hold (``out`` is untouched otherwise)."""
    n = len(out)
    try:
        digest = check_header(record, key, fingerprint, n, align=align)
    except RecordFormatError as e:
        try:
            info = parse_header(record, align=align)
        except RecordFormatError:
            return Unpacked(bad=str(e))
        intact = (info.key_hex == key.hex() and info.fingerprint == fingerprint
                  and len(record) == info.data_offset + info.data_len)
        return Unpacked(held_bytes=info.data_len) if intact else Unpacked(bad=str(e))
    data = memoryview(record)[data_offset(key, fingerprint, n, align=align):]
    if len(data) != n:
        return Unpacked(bad=f"{len(data)} data bytes after the header, expected {n}")
    if checksum(data) != digest:
        return Unpacked(bad="checksum mismatch")
    out[:] = data
    return Unpacked(ok=True)
