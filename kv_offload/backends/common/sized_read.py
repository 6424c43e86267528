"""Reads from a shared store that never take more bytes than the caller's buffer.

A network store answers a read with whatever its value holds: a 1 GiB object planted under a
key whose block is 4 KiB would otherwise be received whole (and, by redis-py/hiredis, held
twice) before any check sees that its size is wrong. So a tier first learns the stored size
with the read itself (Valkey: ``STRLEN`` pipelined with ``GETRANGE 0 expected-1``, one round
trip; S3: a ranged GET, whose ``Content-Range`` gives the object's size) and asks for at most
``expected_bytes``: the record this key would have for the caller's buffer. A value of any
other size is a miss that cost at most that many bytes. ``judge_wrong_size`` then says, from
the header at the start of what was read, whether the value is intact but of another size
(the caller's buffer is wrong: keep the value) or not ours (delete it).
"""

from __future__ import annotations

from kv_offload.backends.record import (
    CHECKSUM,
    NETWORK_ALIGN,
    RecordCodec,
    RecordFormatError,
    Unpacked,
    data_offset,
    names_match,
    parse_header,
)


def expected_bytes(key: bytes, fingerprint: str, data_len: int,
                   codec: RecordCodec = CHECKSUM) -> int:
    """The size of this key's record in a network store for ``data_len`` data bytes."""
    return data_offset(key, fingerprint, data_len, align=NETWORK_ALIGN, codec=codec) + data_len


def judge_wrong_size(head: bytes | memoryview, held: int, key: bytes, fingerprint: str,
                     data_len: int, codec: RecordCodec = CHECKSUM) -> Unpacked:
    """A value of ``held`` bytes where ``expected_bytes`` were expected; ``head`` is what
    was read of its start. Intact (its header names this key and layout, and its size
    matches the header; with a secret a header alone proves nothing, so never):
    ``held_bytes``; anything else: ``bad``."""
    want = expected_bytes(key, fingerprint, data_len, codec)
    try:
        info = parse_header(head, align=NETWORK_ALIGN, codec=codec)
    except RecordFormatError as e:
        return Unpacked(bad=f"{held} bytes stored where {want} were expected ({e})")
    if (not codec.keyed and names_match(info, key, fingerprint, codec)
            and held == info.data_offset + info.data_len):
        return Unpacked(held_bytes=info.data_len)
    return Unpacked(bad=f"{held} bytes stored where {want} were expected, and its header "
                        f"does not account for them")
