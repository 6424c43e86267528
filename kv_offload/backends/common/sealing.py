"""Keyed record codecs: what ``secret_file`` (and ``encrypt: true``) change in stored records.

Without a secret a record carries an unkeyed xxh3-64 checksum (``record.CHECKSUM``): it catches
damage, but anyone who can write to the store can forge a record that verifies, and keys are
vLLM's block hashes, which anyone who can tokenize a prompt can compute. So without a secret,
everyone with write access to the store decides what engines serve. With a secret:

- ``Authenticated``: each record carries an HMAC-SHA256 tag over the key, the layout
  fingerprint, the data length and the data. A record whose tag does not verify is a miss.
  (HMAC-SHA256 over keyed BLAKE2b, measured on this machine with 16 KiB..4 MiB values:
  1.5-1.8 GB/s against 0.9 GB/s: OpenSSL's SHA-256 uses the CPU's SHA extensions.)
- ``Encrypted`` (``encrypt: true``): AES-256-GCM. The record's data is the ciphertext (as
  long as the plaintext: sizes and offsets do not change), the header's ``checksum`` field
  holds the nonce and the GCM tag, and key, fingerprint and length are the associated data,
  so a record replayed under another key or layout fails like a forged one. Nonces are 96
  random bits per record (``os.urandom``): the chance that two of N records share one is
  about N^2 / 2^97, and NIST SP 800-38D asks to stay under 2^32 records per key with random
  nonces (64 TiB of 16 KiB blocks); rotate the secret well before a fleet writes that much.
  The header shows neither key nor fingerprint. What stays visible to a reader of the store:
  each record's name (the storage key in hex: key generation, cache group and vLLM's block
  hash, so a reader who can guess a prompt can tell whether it was cached), its size and its
  times.

Subkeys: HKDF-SHA256 (``cryptography``) derives one key per purpose from the secret (the tag
or cipher key, and a namespace key), so no key serves two algorithms. The namespace of keyed
records is ``kv-v1a-...`` (authenticated) or ``kv-v1e-...`` (encrypted) followed by a keyed
hash of the fingerprint: records of another mode or another secret are never even listed, and
the header's algorithm name tells them apart again should one be copied in (a miss, never
wrong bytes, in both directions).
"""

from __future__ import annotations

import hmac
import os
import struct
from hashlib import sha256

from kv_offload.backends.common.compression import OFF, make_compression
from kv_offload.backends.record import CHECKSUM, FORMAT_VERSION, RecordCodec
from kv_offload.errors import ConfigError
from kv_offload.runtime.secret_file import read_secret

_DOMAIN = b"kv-offload record v1\0"
_NONCE_BYTES = 12
_TAG_BYTES = 16
INSTALL_HINT = "install it with pip install 'kv-offload[secure]'"


def _bound(key: bytes, fingerprint: str, data_len: int) -> bytes:
    """Key, fingerprint and length, length-prefixed: what a tag binds besides the data."""
    fp = fingerprint.encode()
    return b"".join((_DOMAIN, struct.pack("<I", len(key)), key, struct.pack("<I", len(fp)),
                     fp, struct.pack("<Q", data_len)))


def _subkey(secret: bytes, purpose: str) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=f"kv-offload {purpose} v1".encode()).derive(secret)


class _Keyed(RecordCodec):
    keyed = True
    mode = ""  # "a" or "e": in the namespace

    def __init__(self, secret: bytes) -> None:
        self._namespace_key = _subkey(secret, "namespace")

    def __repr__(self) -> str:  # (never the keys)
        return f"{type(self).__name__}()"

    def _keyed_name(self, fingerprint: str) -> str:
        return hmac.new(self._namespace_key, fingerprint.encode(), sha256).hexdigest()[:16]

    def namespace(self, fingerprint: str) -> str:
        return f"kv-v{FORMAT_VERSION}{self.mode}-{self._keyed_name(fingerprint)}"

    def tier_fingerprint(self, fingerprint: str) -> str:
        return f"{fingerprint}|{self.algo}:{self._keyed_name(fingerprint)}"


class Authenticated(_Keyed):
    """HMAC-SHA256 over key, fingerprint, length and data; the data is stored as it is."""

    algo = "hmac_sha256"
    digest_chars = 64
    mode = "a"

    def __init__(self, secret: bytes) -> None:
        super().__init__(secret)
        self._tag_key = _subkey(secret, "record tag")

    def _tag(self, key: bytes, fingerprint: str, data: memoryview) -> str:
        mac = hmac.new(self._tag_key, _bound(key, fingerprint, len(data)), sha256)
        mac.update(data)  # (hashlib releases the GIL on large buffers: I/O threads overlap)
        return mac.hexdigest()

    def seal(self, key, fingerprint, data, out=None) -> str:
        return self._tag(key, fingerprint, data)

    def open(self, key, fingerprint, digest, data, out=None) -> bool:
        if not hmac.compare_digest(self._tag(key, fingerprint, data), digest):
            return False
        if out is not None:
            out[:] = data
        return True


class Encrypted(_Keyed):
    """AES-256-GCM; digest = nonce + tag (hex), key/fingerprint/length as associated data."""

    algo = "aes256gcm"
    digest_chars = 2 * (_NONCE_BYTES + _TAG_BYTES)
    mode = "e"
    encrypts = True

    def __init__(self, secret: bytes) -> None:
        super().__init__(secret)
        from cryptography.hazmat.primitives.ciphers import algorithms

        self._aes = algorithms.AES(_subkey(secret, "record cipher"))

    def header_names(self, key: bytes, fingerprint: str) -> tuple[str, str]:
        return "", ""  # (bound as associated data instead of shown)

    def seal(self, key, fingerprint, data, out=None) -> str:
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        nonce = os.urandom(_NONCE_BYTES)
        ctx = Cipher(self._aes, modes.GCM(nonce)).encryptor()
        ctx.authenticate_additional_data(_bound(key, fingerprint, len(data)))
        _crypt_into(ctx, data, out)
        ctx.finalize()
        return nonce.hex() + ctx.tag.hex()

    def open(self, key, fingerprint, digest, data, out=None) -> bool:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        try:
            nonce = bytes.fromhex(digest[:2 * _NONCE_BYTES])
            tag = bytes.fromhex(digest[2 * _NONCE_BYTES:])
            ctx = Cipher(self._aes, modes.GCM(nonce, tag)).decryptor()
        except ValueError:
            return False
        ctx.authenticate_additional_data(_bound(key, fingerprint, len(data)))
        _crypt_into(ctx, data, data if out is None else out)
        try:
            ctx.finalize()
        except InvalidTag:
            return False
        return True


def _crypt_into(ctx, src: memoryview, dst: memoryview) -> None:
    """Run the cipher over ``src`` into ``dst`` (same length; may be the same memory: GCM
    is a stream mode, OpenSSL works in place). ``update_into`` wants room for a block more
    than it writes, so the last 16 bytes go through ``update``."""
    n = len(src)
    head = max(0, n - 16)
    if head:
        ctx.update_into(src[:head], dst[:head + 15])
    dst[head:n] = ctx.update(bytes(src[head:n]))


def make_codec(secret_file: str | None, encrypt: bool = False,
               compression: str = OFF) -> RecordCodec:
    """The codec of a config: CHECKSUM without a secret, else Authenticated or Encrypted;
    writing compressed records with ``compression`` (``backends.common.compression``)."""
    if secret_file is None:
        if encrypt:
            raise ConfigError("encrypt: true needs secret_file (the key is derived from the "
                              "shared secret)")
        return CHECKSUM.with_compression(make_compression(compression))
    check_crypto_available()
    secret = read_secret(secret_file)
    codec = Encrypted(secret) if encrypt else Authenticated(secret)
    return codec.with_compression(make_compression(compression))


def check_crypto_available() -> None:
    """Raise ``ConfigError`` naming the extra to install if ``cryptography`` is missing."""
    try:
        import cryptography.hazmat.primitives.ciphers  # noqa: F401
        import cryptography.hazmat.primitives.kdf.hkdf  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"secret_file needs the cryptography package ({e}); "
                          f"{INSTALL_HINT}") from e
