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

How the data is protected is a ``RecordCodec``: the default, ``CHECKSUM``, is the unkeyed
xxh3-64 above (it catches damage, not forgery: anyone who can write to the store can make a
record that verifies). With ``secret_file`` the tiers get a keyed codec instead
(``kv_offload.backends.common.sealing``: an HMAC tag, or AES-GCM encryption) whose name goes in
the header's ``checksum`` field and whose records live under another namespace, so the two
kinds never pass for each other. Every function below takes the codec (default: CHECKSUM).

Compressed records (``compression``, ``kv_offload.backends.common.compression``): the header's
``__metadata__`` also holds ``compression`` (the decoder) and ``uncompressed_bytes`` (the page
size), the ``kv`` tensor covers the payload, and the codec seals the payload, bound to both
fields (the digest of a compressed record does not verify as a plain one, nor with another page
size). Such a header is padded to ``NETWORK_ALIGN`` whatever the tier: the payload is never
read in place, so aligning it would only store padding; and a compressed record is always
smaller than the plain record of its page, so a sized read (at most the plain record's bytes)
receives it whole. Records without the two fields are read as before: a store may hold both
kinds.

Contents: ``pack`` and ``unpack_into`` (a whole record, for stores that hold values in one
piece; ``pack_into``), ``build_header``, ``parse_header``, ``check_header``, ``names_match``,
``data_offset``, ``checksum``, ``layout_namespace``, ``RecordCodec``, ``CHECKSUM``,
``RecordFormatError``, ``HeaderInfo``, ``Unpacked``.
"""

from __future__ import annotations

import copy
import functools
import json
import struct
from dataclasses import dataclass

import xxhash

from kv_offload.backends.common.compression import DECODERS, Compression

FORMAT_VERSION = "1"
TENSOR_NAME = "kv"
NETWORK_ALIGN = 8  # data offset alignment for values in network stores
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
    compression: str | None = None  # the decoder of a compressed record's payload
    uncompressed_bytes: int | None = None  # the page a compressed payload decodes to


def checksum(data: memoryview | bytes) -> str:
    """The checksum stored in the header: xxh3-64 of the data, 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def layout_namespace(fingerprint: str) -> str:
    """The name under which the records of one layout (and one format version) live."""
    return f"kv-v{FORMAT_VERSION}-{xxhash.xxh3_64_hexdigest(fingerprint.encode())}"


class RecordCodec:
    """How a record's data is checked (and maybe transformed) on its way to and from a store.

    This base class is the unkeyed xxh3-64 checksum (``CHECKSUM``); keyed codecs override it
    (``kv_offload.backends.common.sealing``). ``digest`` is what the header's ``checksum`` field
    holds after ``algo:``: ``digest_chars`` hex digits.
    """

    algo = "xxh3_64"
    digest_chars = 16
    encrypts = False
    """True: the stored bytes differ from the data (``seal`` writes them into ``out``)."""
    keyed = False
    """True: only holders of the secret make records that verify. A keyed codec's headers
    are not trusted on their own either: a record of the right key whose header claims
    another size is deleted as bad (an unkeyed record of another size is kept: the
    caller's buffer is what is wrong)."""

    compression: Compression | None = None
    """Records written through this codec are compressed with it (None: never). Reads open
    both kinds whatever it is. Set by ``with_compression``."""

    def with_compression(self, compression: Compression | None) -> RecordCodec:
        """This codec, writing records compressed with ``compression`` (a copy: the keys
        are shared, never re-derived)."""
        if compression is self.compression:
            return self
        twin = copy.copy(self)
        twin.compression = compression
        return twin

    def namespace(self, fingerprint: str) -> str:
        """Where this codec's records of one layout live (a directory name, a key prefix)."""
        return layout_namespace(fingerprint)

    def tier_fingerprint(self, fingerprint: str) -> str:
        """The fingerprint a plug-in tier is given (keyed codecs: one of their own, so a
        plug-in keeps sealed and plain records apart as it keeps layouts apart)."""
        return fingerprint

    def header_names(self, key: bytes, fingerprint: str) -> tuple[str, str]:
        """(key hex, fingerprint) as the header shows them."""
        return key.hex(), fingerprint

    def seal(self, key: bytes, fingerprint: str, data: memoryview,
             out: memoryview | None = None) -> str:
        """The digest of ``data`` for this key and layout; an encrypting codec writes the
        stored bytes (as many as ``data``) into ``out``."""
        return checksum(data)

    def open(self, key: bytes, fingerprint: str, digest: str, data: memoryview,
             out: memoryview | None = None) -> bool:
        """Whether the stored bytes ``data`` verify against ``digest`` for this key and
        layout; if so their plaintext is put into ``out`` (None: ``data`` is already where
        it belongs, decrypted there in place). On False, ``out`` (or ``data``) may hold
        anything: nothing may be served from it."""
        if checksum(data) != digest:
            return False
        if out is not None:
            out[:] = data
        return True


CHECKSUM = RecordCodec()


def _header_json(key_hex: str, fingerprint: str, data_len: int, digest: str,
                 algo: str, compressed: tuple[str, int] | None = None) -> bytes:
    meta = {
        "format": "kv-offload",
        "format_version": FORMAT_VERSION,
        "layout_fingerprint": fingerprint,
        "key": key_hex,
        "checksum": f"{algo}:{digest}",
    }
    if compressed is not None:  # (safetensors metadata values are strings)
        meta["compression"], meta["uncompressed_bytes"] = compressed[0], str(compressed[1])
    doc = {
        "__metadata__": meta,
        TENSOR_NAME: {"dtype": "U8", "shape": [data_len], "data_offsets": [0, data_len]},
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def data_offset(key: bytes, fingerprint: str, data_len: int, *, align: int,
                codec: RecordCodec = CHECKSUM) -> int:
    """Where the data starts in the record for this key: a multiple of ``align``."""
    key_hex, names_fingerprint = codec.header_names(key, fingerprint)
    return _frame(len(key_hex), names_fingerprint, data_len, codec.algo, codec.digest_chars,
                  align).length


def build_header(key: bytes, fingerprint: str, data_len: int, digest: str, *,
                 align: int, codec: RecordCodec = CHECKSUM) -> bytes:
    """The bytes before the data: length prefix and space-padded JSON, ``data_offset`` long."""
    body = _header_json(*codec.header_names(key, fingerprint), data_len, digest, codec.algo)
    offset = data_offset(key, fingerprint, data_len, align=align, codec=codec)
    body += b" " * (offset - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


def names_match(info: HeaderInfo, key: bytes, fingerprint: str,
                codec: RecordCodec = CHECKSUM) -> bool:
    """Whether a parsed header names this key and layout (as ``codec`` writes them)."""
    return (info.key_hex, info.fingerprint) == codec.header_names(key, fingerprint)


def parse_header(head: bytes | memoryview, *, align: int,
                 codec: RecordCodec = CHECKSUM) -> HeaderInfo:
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
        bytes.fromhex(key_hex)  # (the check: a key is hex)
        compressed = None
        if "compression" in meta or "uncompressed_bytes" in meta:
            compressed = (meta["compression"], int(meta["uncompressed_bytes"]))
    except RecursionError:  # JSON nested deeper than the parser's stack: not ours
        raise RecordFormatError("unreadable header: JSON nested too deeply") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise RecordFormatError(f"unreadable header: {e}") from e
    if algo != codec.algo:  # a record of the other mode (with or without a secret)
        raise RecordFormatError(f"record protected by {algo!r}, expected {codec.algo!r}")
    if (
        len(digest) != codec.digest_chars
        or not isinstance(data_len, int)
        or data_len < 0
        or not isinstance(fingerprint, str)
    ):
        raise RecordFormatError("header fields have unexpected types or values")
    if compressed is not None and (not isinstance(compressed[0], str)
                                   or compressed[0] not in DECODERS or compressed[1] <= 0):
        raise RecordFormatError(f"compressed with {compressed[0]!r} to "
                                f"{compressed[1]} bytes: not a codec this version reads")
    expected = _rebuilt_header(key_hex, fingerprint, data_len, digest, align, codec,
                               compressed)
    if head != expected:
        raise RecordFormatError("header is not byte-identical to the one this format writes")
    if compressed is None:
        return HeaderInfo(key_hex, fingerprint, data_len, digest, len(expected))
    return HeaderInfo(key_hex, fingerprint, data_len, digest, len(expected), *compressed)


def _rebuilt_header(key_hex: str, fingerprint: str, data_len: int, digest: str, align: int,
                    codec: RecordCodec, compressed: tuple[str, int] | None = None) -> bytes:
    """The header the writer of these claimed fields would have written (names as given)."""
    body = _header_json(key_hex, fingerprint, data_len, digest, codec.algo, compressed)
    if compressed is not None:  # (never read in place: padded to the network alignment)
        align = NETWORK_ALIGN
    body += b" " * (-(-(8 + len(body)) // align) * align - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


_HEX_DIGITS = frozenset(b"0123456789abcdef")


@dataclass(frozen=True)
class _Frame:
    """The header written for any key of one name length, layout, size and codec, cut
    around the two fields that vary: the key (at `key_at`) and the digest (at `digest_at`)."""

    header: bytes  # with zeros for key and digest
    key_at: int
    digest_at: int
    digest_chars: int

    @property
    def length(self) -> int:
        return len(self.header)

    def digest_if_written_by_us(self, head: bytes | memoryview, key_hex: str) -> str | None:
        """The digest, if `head` starts with this header for `key_hex` and a hex digest."""
        h, k, d, n = self.header, self.key_at, self.digest_at, self.digest_chars
        key = key_hex.encode("ascii")
        if len(head) < len(h) or head[:k] != h[:k] or head[k:k + len(key)] != key or \
                head[k + len(key):d] != h[k + len(key):d] or head[d + n:len(h)] != h[d + n:]:
            return None
        digest = bytes(head[d:d + n])
        return digest.decode("ascii") if _HEX_DIGITS.issuperset(digest) else None


@functools.lru_cache(maxsize=256)
def _frame(key_chars: int, fingerprint: str, data_len: int, algo: str, digest_chars: int,
           align: int) -> _Frame:
    body = _header_json("0" * key_chars, fingerprint, data_len, "0" * digest_chars, algo)
    body += b" " * (-(-(8 + len(body)) // align) * align - 8 - len(body))
    header = struct.pack("<Q", len(body)) + body
    # (JSON escapes every quote inside a string, so these markers occur only as the fields)
    key_at = header.index(b'"key":"') + len(b'"key":"')
    marker = f'"checksum":"{algo}:'.encode()
    return _Frame(header, key_at, header.index(marker) + len(marker), digest_chars)


def check_header(head: bytes | memoryview, key: bytes, fingerprint: str, data_len: int, *,
                 align: int, codec: RecordCodec = CHECKSUM) -> str:
    """The digest a header promises for the data, if it is this key's header for this layout.

    Raises ``RecordFormatError`` naming what differs (foreign layout, other key, other size).
    A header byte-identical to the one written for this key, layout and size with a hex
    digest is accepted without parsing it (a read's header check was two JSON encodings and
    a decoding, ~100 us: most of the Python a disk read costs); any other is parsed, which
    accepts what a rebuild reproduces and names what differs.
    """
    key_hex, names_fingerprint = codec.header_names(key, fingerprint)
    frame = _frame(len(key_hex), names_fingerprint, data_len, codec.algo, codec.digest_chars,
                   align)
    digest = frame.digest_if_written_by_us(head, key_hex)
    if digest is not None:
        return digest
    info = parse_header(head, align=align, codec=codec)
    want_key, want_fingerprint = codec.header_names(key, fingerprint)
    if info.fingerprint != want_fingerprint:
        raise RecordFormatError(f"foreign layout fingerprint {info.fingerprint!r}")
    if info.key_hex != want_key:
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


def pack(key: bytes, fingerprint: str, data: memoryview, *, align: int,
         codec: RecordCodec = CHECKSUM) -> bytes | bytearray:
    """A whole record: header then data (one copy of the data, into the returned bytes;
    an encrypting codec writes its ciphertext there instead). A codec with ``compression``
    writes the compressed record instead where that saves bytes (``pack_compressed``)."""
    if codec.compression is not None:
        record = pack_compressed(key, fingerprint, data, align=align, codec=codec)
        if record is not None:
            return record
    if not codec.encrypts:
        header = build_header(key, fingerprint, len(data), codec.seal(key, fingerprint, data),
                              align=align, codec=codec)
        return b"".join((header, data))
    record = bytearray(data_offset(key, fingerprint, len(data), align=align, codec=codec)
                       + len(data))
    pack_into(key, fingerprint, data, memoryview(record), align=align, codec=codec)
    return record


def _sealed_fingerprint(fingerprint: str, compressed: tuple[str, int]) -> str:
    """What a compressed record's digest binds in place of the fingerprint: the layout and
    both compression fields (so no header edit makes its payload verify as something else)."""
    return f"{fingerprint}\0compression={compressed[0]}:{compressed[1]}"


def pack_compressed(key: bytes, fingerprint: str, data: memoryview, *, align: int,
                    codec: RecordCodec) -> bytearray | None:
    """The compressed record of ``data`` (``codec.compression``), or None where it would not
    be smaller than the plain record (``align``: the plain record's alignment)."""
    assert codec.compression is not None
    payload = codec.compression.compress(data)
    if payload is None:
        return None
    compressed = (codec.compression.decoder, len(data))
    key_hex, names_fingerprint = codec.header_names(key, fingerprint)
    probe = _rebuilt_header(key_hex, names_fingerprint, len(payload), "0" * codec.digest_chars,
                            NETWORK_ALIGN, codec, compressed)
    if len(probe) + len(payload) >= data_offset(key, fingerprint, len(data), align=align,
                                                codec=codec) + len(data):
        return None  # (a sized read of the plain record's bytes must receive it whole)
    record = bytearray(len(probe) + len(payload))
    body = memoryview(record)[len(probe):]
    sealed = _sealed_fingerprint(fingerprint, compressed)
    if codec.encrypts:
        digest = codec.seal(key, sealed, memoryview(payload), body)
    else:
        digest = codec.seal(key, sealed, memoryview(payload))
        body[:] = payload
    header = _rebuilt_header(key_hex, names_fingerprint, len(payload), digest, NETWORK_ALIGN,
                             codec, compressed)
    record[:len(header)] = header
    return record


def pack_into(key: bytes, fingerprint: str, data: memoryview, record: memoryview, *,
              align: int, codec: RecordCodec = CHECKSUM) -> None:
    """Write the whole record of ``data`` into ``record`` (exactly ``data_offset`` +
    ``len(data)`` bytes long)."""
    offset = data_offset(key, fingerprint, len(data), align=align, codec=codec)
    if len(record) != offset + len(data):
        raise ValueError(f"record buffer of {len(record)} bytes, expected {offset + len(data)}")
    body = record[offset:]
    if codec.encrypts:
        digest = codec.seal(key, fingerprint, data, body)
    else:
        digest = codec.seal(key, fingerprint, data)
        body[:] = data
    record[:offset] = build_header(key, fingerprint, len(data), digest, align=align,
                                   codec=codec)


def unpack_into(record: bytes | memoryview, key: bytes, fingerprint: str, out: memoryview, *,
                align: int, codec: RecordCodec = CHECKSUM) -> Unpacked:
    """Check a whole record against this key, layout and ``len(out)``, and put its data into
    ``out`` only if the header and the digest hold (otherwise ``out`` is untouched by an
    unkeyed or authenticating codec, and undefined after a failed decryption)."""
    n = len(out)
    digest = _judge_header(record, len(record), key, fingerprint, n, align, codec)
    if isinstance(digest, HeaderInfo):
        return _open_compressed(record, digest, key, fingerprint, out, codec)
    if isinstance(digest, Unpacked):
        return digest
    data = memoryview(record)[data_offset(key, fingerprint, n, align=align, codec=codec):]
    if len(data) != n:
        return Unpacked(bad=f"{len(data)} data bytes after the header, expected {n}")
    if not codec.open(key, fingerprint, digest, data, out):
        return Unpacked(bad=f"{codec.algo} digest mismatch")
    return Unpacked(ok=True)


def unpack_in_place(head: bytes | memoryview, key: bytes, fingerprint: str, data: memoryview,
                    *, align: int, codec: RecordCodec = CHECKSUM) -> Unpacked:
    """``unpack_into`` for a record received in two parts: its header ``head``, and its data
    already in the buffer it is for (a network read straight into the host buffer). Checked,
    and decrypted when encrypting, in place; ``ok`` only if the header and digest hold,
    otherwise ``data`` may hold anything and nothing may be served from it."""
    n = len(data)
    digest = _judge_header(head, len(head) + n, key, fingerprint, n, align, codec)
    if isinstance(digest, HeaderInfo):  # (the size of a plain record, yet compressed)
        return Unpacked(bad="a compressed record padded to a plain record's size")
    if isinstance(digest, Unpacked):
        return digest
    if len(head) != data_offset(key, fingerprint, n, align=align, codec=codec):
        return Unpacked(bad=f"a {len(head)}-byte header where the data should start")
    if not codec.open(key, fingerprint, digest, data):
        return Unpacked(bad=f"{codec.algo} digest mismatch")
    return Unpacked(ok=True)


def _judge_header(head: bytes | memoryview, record_len: int, key: bytes, fingerprint: str,
                  n: int, align: int, codec: RecordCodec) -> str | HeaderInfo | Unpacked:
    """The digest the header promises for ``n`` data bytes of this key and layout; or the
    header of this key's compressed record of that page (``HeaderInfo``: its payload is
    still to verify); or why the record (``record_len`` bytes in all) cannot be served
    (``Unpacked``)."""
    try:
        return check_header(head, key, fingerprint, n, align=align, codec=codec)
    except RecordFormatError as e:
        try:
            info = parse_header(head, align=align, codec=codec)
        except RecordFormatError:
            return Unpacked(bad=str(e))
        whole = names_match(info, key, fingerprint, codec) and \
            record_len == info.data_offset + info.data_len
        if info.compression is not None and whole and info.uncompressed_bytes == n:
            return info
        held = info.data_len if info.compression is None else info.uncompressed_bytes
        intact = not codec.keyed and whole
        return Unpacked(held_bytes=held) if intact else Unpacked(bad=str(e))


def _open_compressed(record: bytes | memoryview, info: HeaderInfo, key: bytes,
                     fingerprint: str, out: memoryview, codec: RecordCodec) -> Unpacked:
    """Verify (decrypt) a compressed record's payload, then decode it into ``out``: served
    only if it decodes to exactly ``len(out)`` bytes."""
    assert info.compression is not None and info.uncompressed_bytes is not None
    payload = memoryview(record)[info.data_offset:info.data_offset + info.data_len]
    sealed = _sealed_fingerprint(fingerprint, (info.compression, info.uncompressed_bytes))
    if codec.encrypts:  # (the record may be read-only bytes: decrypted into a copy)
        plain = memoryview(bytearray(len(payload)))
        opened = codec.open(key, sealed, info.checksum, payload, plain)
        payload = plain
    else:
        opened = codec.open(key, sealed, info.checksum, payload)
    if not opened:
        return Unpacked(bad=f"{codec.algo} digest mismatch")
    if not DECODERS[info.compression](payload, out):
        return Unpacked(bad=f"{info.compression} payload does not decode to exactly "
                            f"{len(out)} bytes")
    return Unpacked(ok=True)
