"""The on-disk format of one stored key: a valid safetensors file, and where it lives.

A file is ``8-byte little-endian header length | JSON header | data``. The JSON header holds one
U8 tensor named ``kv`` covering all the data, and ``__metadata__`` with the format version, the
layout fingerprint, the key (hex) and the xxh3-64 checksum of the data. The header is padded
with trailing spaces (allowed by the safetensors spec) so that the data starts at a multiple of
``ALIGN`` bytes, which lets O_DIRECT read the data straight into an aligned host buffer.

Files live under ``<root>/<layout dir>/<fan-out>/<key hex>.safetensors``: the layout directory
is named after the fingerprint (files of another layout are invisible, and still rejected on
read), the fan-out is two hex digits of a hash of the key (256 sub-directories keep directories
small). Temporary files are ``.tmp.<pid>.<random>.<host>`` in the same sub-directory, so a
rename into place is atomic and never crosses a filesystem.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import xxhash

FORMAT_VERSION = "1"
ALIGN = 4096
TENSOR_NAME = "kv"
SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp."
_CHECKSUM_HEX_DIGITS = 16
_MAX_HEADER_BYTES = 1 << 20


class FileFormatError(Exception):
    """A stored file that is not what this tier wrote for that key (internal, never escapes)."""


@dataclass(frozen=True)
class HeaderInfo:
    """What a file header claims about its contents."""

    key_hex: str
    fingerprint: str
    data_len: int
    checksum: str
    data_offset: int


def checksum(data: memoryview | bytes) -> str:
    """The checksum stored in the header: xxh3-64 of the data, 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


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


def data_offset(key: bytes, fingerprint: str, data_len: int) -> int:
    """Where the data starts in the file for this key: a multiple of ``ALIGN``."""
    body = _header_json(key.hex(), fingerprint, data_len, "0" * _CHECKSUM_HEX_DIGITS)
    return -(-(8 + len(body)) // ALIGN) * ALIGN


def build_header(key: bytes, fingerprint: str, data_len: int, digest: str) -> bytes:
    """The bytes before the data: length prefix and space-padded JSON, ``data_offset`` long."""
    body = _header_json(key.hex(), fingerprint, data_len, digest)
    offset = data_offset(key, fingerprint, data_len)
    body += b" " * (offset - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


def parse_header(head: bytes | memoryview) -> HeaderInfo:
    """Parse the header at the start of ``head``; raise ``FileFormatError`` if it is not ours.

    Valid only if re-building the header from what it claims gives back the exact same bytes,
    so any changed byte (padding included) is caught.
    """
    head = bytes(head)
    if len(head) < 8:
        raise FileFormatError(f"file is {len(head)} bytes, shorter than a header")
    (length,) = struct.unpack_from("<Q", head)
    if length > _MAX_HEADER_BYTES or 8 + length > len(head):
        raise FileFormatError(f"header length {length} does not fit the {len(head)} bytes read")
    try:
        doc = json.loads(head[8 : 8 + length].decode("ascii"))
        meta = doc["__metadata__"]
        tensor = doc[TENSOR_NAME]
        key_hex = meta["key"]
        fingerprint = meta["layout_fingerprint"]
        data_len = tensor["shape"][0]
        algo, digest = meta["checksum"].split(":")
        key = bytes.fromhex(key_hex)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise FileFormatError(f"unreadable header: {e}") from e
    if (
        algo != "xxh3_64"
        or len(digest) != _CHECKSUM_HEX_DIGITS
        or not isinstance(data_len, int)
        or data_len < 0
        or not isinstance(fingerprint, str)
    ):
        raise FileFormatError("header fields have unexpected types or values")
    expected = build_header(key, fingerprint, data_len, digest)
    if head[: len(expected)] != expected:
        raise FileFormatError("header is not byte-identical to the one this format writes")
    return HeaderInfo(key_hex, fingerprint, data_len, digest, len(expected))


def check_header(head: bytes | memoryview, key: bytes, fingerprint: str, data_len: int) -> str:
    """The checksum a header promises for the data, if it is this key's header for this layout.

    Raises ``FileFormatError`` naming what differs (foreign layout, other key, other size).
    """
    info = parse_header(head)
    if info.fingerprint != fingerprint:
        raise FileFormatError(f"foreign layout fingerprint {info.fingerprint!r}")
    if info.key_hex != key.hex():
        raise FileFormatError(f"header names key {info.key_hex}")
    if info.data_len != data_len:
        raise FileFormatError(f"header says {info.data_len} data bytes, expected {data_len}")
    return info.checksum


def layout_dir_name(fingerprint: str) -> str:
    """The directory that holds the files of one layout (and one format version)."""
    return f"kv-v{FORMAT_VERSION}-{xxhash.xxh3_64_hexdigest(fingerprint.encode())}"


def fanout_dir_name(key: bytes) -> str:
    """The sub-directory of a key: two hex digits of a hash, so keys spread evenly."""
    return xxhash.xxh3_64_hexdigest(key)[:2]


def relative_path(key: bytes) -> str:
    """A key's file, relative to the layout directory."""
    return os.path.join(fanout_dir_name(key), key.hex() + SUFFIX)


def key_from_file_name(name: str) -> bytes | None:
    """The key a final file name encodes, or None if the name is not one of ours."""
    if not name.endswith(SUFFIX):
        return None
    try:
        key = bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None
    return key or None


def temp_file_name(pid: int, token: str, host: str) -> str:
    """A temporary name: who wrote it, so a sweep can tell a live writer from a dead one."""
    return f"{TEMP_PREFIX}{pid}.{token}.{host}"


def parse_temp_file_name(name: str) -> tuple[int, str] | None:
    """(pid, host) of a temporary file name, or None if the name is not a temporary file."""
    if not name.startswith(TEMP_PREFIX):
        return None
    parts = name[len(TEMP_PREFIX) :].split(".", 2)
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[2]
