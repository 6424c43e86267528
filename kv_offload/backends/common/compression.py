"""Lossless compression of record data: what ``compression`` changes in stored records.

Why: a storage tier's medium (a disk, a network link, a store's memory) holds and moves every
byte of a record; KV pages in bf16 carry few distinct exponent bytes, so fewer bytes can hold
the same page. Measured on real pages of the vLLM CPU engine
(``benchmarks/bench_compression.py``): blosc2's bit shuffle + LZ4 stores 0.72 of the bytes at
about 1.1 GB/s compression and 2.2 GB/s decompression per core, the fastest of the codecs
tried with a ratio under 0.85 (zstd and LZ4 over byte planes, blosc2 byte shuffle + zstd or
LZ4 also ran); ``"lossless"`` names it.

How: a ``Compression`` turns a page into a payload (``compress``; None when it would not save
enough to pay for itself: the record is then written as it always was) and a payload back
into exactly the page's bytes (``decompress_into``). The record layer
(``kv_offload.backends.record``) writes a compressed record's header with two more fields,
``compression`` and ``uncompressed_bytes``, and seals (checksums, authenticates, encrypts)
the payload: what is verified is what is stored. Reading, the payload is verified first and
only then decoded, straight into the caller's buffer.

Bounded: the output size is the caller's page (the buffer), never what the payload claims. A
payload whose own header claims another size, another compressed length, a special chunk
that would leave the buffer unwritten, or that fails to decode is a rejected record (a miss,
counted), never an allocation an attacker chooses. blosc2 runs with one thread, on the tier's
I/O thread that writes or reads the record: never on the engine's step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kv_offload.errors import ConfigError

OFF = "off"
LOSSLESS = "lossless"
INSTALL_HINT = "install it with pip install 'kv-offload[compress]'"
_MIN_SAVING = 1 / 32  # a payload must save this share of the page, or the page is stored


class Compression(ABC):
    """A lossless codec for record data. ``name`` is the setting that chose it; ``decoder``
    goes in the header of the records it writes: the name a reader decodes them by."""

    name: str
    decoder: str

    @abstractmethod
    def compress(self, data: memoryview) -> bytes | None:
        """The payload for ``data``, or None when it would save less than 1/32 of it."""

    @abstractmethod
    def decompress_into(self, payload: memoryview, out: memoryview) -> bool:
        """Decode ``payload`` into ``out``; True only if it decodes to exactly ``len(out)``
        bytes. On False, ``out`` may hold anything: nothing may be served from it."""


class Blosc2(Compression):
    """blosc2 chunks: a shuffle filter over ``typesize``-byte values, then a fast coder."""

    decoder = "blosc2"

    def __init__(self, name: str, coder: str, shuffle: str, clevel: int,
                 typesize: int = 2) -> None:
        blosc2 = import_blosc2()
        self.name = name
        self._coder = getattr(blosc2.Codec, coder)
        self._filter = getattr(blosc2.Filter, shuffle)
        self._clevel = clevel
        self._typesize = typesize

    def __repr__(self) -> str:
        return f"Blosc2({self.name!r})"

    def compress(self, data: memoryview) -> bytes | None:
        import blosc2

        payload = blosc2.compress2(data, typesize=self._typesize, clevel=self._clevel,
                                   codec=self._coder, filters=[self._filter], nthreads=1)
        return payload if len(payload) <= len(data) * (1 - _MIN_SAVING) else None

    def decompress_into(self, payload: memoryview, out: memoryview) -> bool:
        return decode_blosc2(payload, out)


_CHUNK_HEADER = 32  # a blosc2 chunk's extended header
_SPECIAL_WRITTEN = (0, 1, 3)  # none, zeros, a repeated value: all write every output byte


def decode_blosc2(payload: memoryview, out: memoryview) -> bool:
    """A blosc2 chunk decoded into ``out`` after its header claims exactly ``len(out)``
    bytes from exactly ``len(payload)``; special chunks that write nothing (uninitialised)
    or NaNs are refused."""
    import blosc2
    import numpy as np

    if len(payload) < _CHUNK_HEADER or len(out) == 0:
        return False
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(payload)
    except Exception:  # (a header blosc2 cannot read)
        return False
    if nbytes != len(out) or cbytes != len(payload):
        return False
    if (payload[31] >> 4) & 7 not in _SPECIAL_WRITTEN:
        return False
    try:
        blosc2.decompress2(payload, dst=np.frombuffer(out, dtype=np.uint8), nthreads=1)
    except Exception:  # (a damaged stream: blosc2 raises, having written at most len(out))
        return False
    return True


def import_blosc2():
    """blosc2, or a ``ConfigError`` naming the extra to install."""
    try:
        import blosc2
    except ImportError as e:
        raise ConfigError(f"compression needs the blosc2 package ({e}); {INSTALL_HINT}") from e
    return blosc2


# name -> (coder, shuffle filter, level): what the configuration accepts besides "off"
CODECS = {
    "blosc2-lz4": ("LZ4", "BITSHUFFLE", 5),
    "blosc2-zstd": ("ZSTD", "SHUFFLE", 1),
}
ALIASES = {LOSSLESS: "blosc2-lz4"}
CHOICES = (OFF, LOSSLESS, *CODECS)
DECODERS = {"blosc2": decode_blosc2}
"""Header ``compression`` value -> decode(payload, out): every codec a reader opens, whatever
this process writes (records written with another setting are served too)."""


def make_compression(name: str) -> Compression | None:
    """The codec of a ``compression`` setting (None: off); ``ConfigError`` if unknown or
    its library is missing."""
    if name == OFF:
        return None
    resolved = ALIASES.get(name, name)
    if resolved not in CODECS:
        raise ConfigError(f"compression: {name!r} is not a codec; accepted: "
                          f"{', '.join(CHOICES)}")
    coder, shuffle, clevel = CODECS[resolved]
    return Blosc2(resolved, coder, shuffle, clevel)
