"""The on-disk format of one stored key: a valid safetensors file, and where it lives.

A file is one record (``kv_offload.backends.record``: ``8-byte little-endian header length |
JSON header | data``, with the format version, layout fingerprint, key and xxh3-64 checksum)
whose header is padded so that the data starts at a multiple of ``ALIGN`` bytes, which lets
O_DIRECT read the data straight into an aligned host buffer.

Files live under ``<root>/<layout dir>/<fan-out>/<key hex>.safetensors``: the layout directory
is named after the fingerprint (files of another layout are invisible, and still rejected on
read), the fan-out is two hex digits of a hash of the key (256 sub-directories keep directories
small). Temporary files are ``.tmp.<pid>.<random>.<host>`` in the same sub-directory, so a
rename into place is atomic and never crosses a filesystem.
"""

from __future__ import annotations

import os

import xxhash

from kv_offload.backends import record
from kv_offload.backends.record import (  # noqa: F401 (re-exported for the filesystem tier)
    CHECKSUM,
    FORMAT_VERSION,
    TENSOR_NAME,
    HeaderInfo,
    RecordCodec,
    checksum,
    names_match,
)

ALIGN = 4096
SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp."
GENERATION_NAME = ".kv-generation"  # the layout's key generation (a record; see tiering)

# The header is the one every tier writes (kv_offload.backends.record); files align their data
# to ALIGN bytes. The filesystem tier calls a record that is not ours a FileFormatError.
FileFormatError = record.RecordFormatError


def data_offset(key: bytes, fingerprint: str, data_len: int,
                codec: RecordCodec = CHECKSUM) -> int:
    """Where the data starts in the file for this key: a multiple of ``ALIGN``."""
    return record.data_offset(key, fingerprint, data_len, align=ALIGN, codec=codec)


def build_header(key: bytes, fingerprint: str, data_len: int, digest: str,
                 codec: RecordCodec = CHECKSUM) -> bytes:
    """The bytes before the data: length prefix and space-padded JSON, ``data_offset`` long."""
    return record.build_header(key, fingerprint, data_len, digest, align=ALIGN, codec=codec)


def parse_header(head: bytes | memoryview, codec: RecordCodec = CHECKSUM) -> HeaderInfo:
    """Parse the header at the start of ``head``; raise ``FileFormatError`` if it is not ours."""
    return record.parse_header(head, align=ALIGN, codec=codec)


def check_header(head: bytes | memoryview, key: bytes, fingerprint: str, data_len: int,
                 codec: RecordCodec = CHECKSUM) -> str:
    """The digest a header promises for the data, if it is this key's header for this layout.

    Raises ``FileFormatError`` naming what differs (foreign layout, other key, other size).
    """
    return record.check_header(head, key, fingerprint, data_len, align=ALIGN, codec=codec)


def layout_dir_name(fingerprint: str, codec: RecordCodec = CHECKSUM) -> str:
    """The directory that holds the files of one layout (and one format version and codec)."""
    return codec.namespace(fingerprint)


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
