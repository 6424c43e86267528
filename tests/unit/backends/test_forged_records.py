"""The attacker test: someone who can write to the store (but holds no secret) plants records.

For every built-in tier (real files, a real redis-server, moto's S3 server) and a plug-in tier
(DictTier, wrapped by `make_storage_tier`): a record forged with a recomputed xxh3 is served
without a secret (today's trust model: every writer is trusted) and refused with one; records
tampered with, from another secret, or replayed under another key are refused, removed and
counted; and a planted record cannot keep the real value out (present-key skips).
"""

from __future__ import annotations

import logging

import pytest
import torch

from kv_offload.backends import make_storage_tier
from kv_offload.backends.base import StorageTier
from kv_offload.backends.common.sealed_tier import SealedTier
from kv_offload.backends.common.sealing import Authenticated, Encrypted
from kv_offload.backends.filesystem import FilesystemTier
from kv_offload.backends.filesystem.fileformat import ALIGN
from kv_offload.backends.record import CHECKSUM, NETWORK_ALIGN, RecordCodec, data_offset, pack
from kv_offload.config import parse_config

from helpers.servers import make_bucket, unique_name
from helpers.tier_helpers import random_bytes, read, write

FP = "llama|LBHNC|page=70000|tp1|rank0"
SIZE = 70_000  # not a multiple of 4096: O_DIRECT tails, AES-GCM tails
SECRET = b"the fleet's shared secret, 32 by"
CODECS = {"none": CHECKSUM, "auth": Authenticated(SECRET), "encrypt": Encrypted(SECRET)}
GUESS = b"an attacker's guess at a secret"
ATTACKERS = {"auth": Authenticated(GUESS), "encrypt": Encrypted(GUESS)}  # same mode, other key
KINDS = ["filesystem", "valkey", "s3", "plugin"]


def key(i: int) -> bytes:
    return bytes(8) + b"\x00\x00" + i.to_bytes(32, "little")


class Store:
    """One tier kind, and raw access to where its records live (the attacker's view)."""

    def __init__(self, request, tmp_path, kind: str, codec: RecordCodec) -> None:
        self.kind, self.codec = kind, codec
        if kind == "filesystem":
            self.tier = FilesystemTier.from_options(
                {"root_dir": str(tmp_path), "bytes_to_use": 1 << 26, "rescan_interval_s": 0},
                FP, codec=codec)
        elif kind == "valkey":
            pytest.importorskip("redis")
            import redis

            server = request.getfixturevalue("valkey_server")
            self.prefix = unique_name("forge") + ":"
            self.redis = redis.Redis.from_url(server.url)
            from kv_offload.backends.valkey import ValkeyTier

            self.tier = ValkeyTier.from_options(
                {"url": server.url, "key_prefix": self.prefix, "refresh_interval_s": 0}, FP,
                codec=codec)
        elif kind == "s3":
            pytest.importorskip("boto3")
            import boto3

            server = request.getfixturevalue("s3_server")
            self.bucket = make_bucket(server.endpoint_url)
            self.s3 = boto3.client("s3", endpoint_url=server.endpoint_url)
            from kv_offload.backends.s3 import S3Tier

            self.tier = S3Tier.from_options(
                {"bucket": self.bucket, "endpoint_url": server.endpoint_url,
                 "bytes_to_use": 1 << 26, "refresh_interval_s": 0}, FP, codec=codec)
        else:
            config = parse_config({"cpu_bytes_to_use": 1,
                                   "storage_tier": "kv_offload.backends.example:DictTier"})
            self.tier = make_storage_tier(config, FP, codec)
            assert isinstance(self.tier, SealedTier) == codec.keyed

    # -- the attacker's side: raw bytes where the tier keeps its records --

    def forged(self, k: bytes, data: torch.Tensor, codec: RecordCodec = CHECKSUM) -> bytes:
        """A record as the attacker makes it: today's format with a recomputed checksum,
        or sealed with a secret of the attacker's own."""
        if self.kind == "plugin" and not self.codec.keyed:
            return data.numpy().tobytes()  # (a plain plug-in stores the data as it is)
        align = ALIGN if self.kind == "filesystem" else NETWORK_ALIGN
        return bytes(pack(k, FP, memoryview(data.numpy()), align=align, codec=codec))

    def plant(self, k: bytes, raw: bytes) -> None:
        if self.kind == "filesystem":
            with open(self.tier.file_path(k), "wb") as f:
                f.write(raw)
            self.tier.rescan()  # the tier learns of it as of any other writer's file
        elif self.kind == "valkey":
            self.redis.set(self._valkey_name(k), raw)
            self.tier.refresh()
        elif self.kind == "s3":
            self.s3.put_object(Bucket=self.bucket, Key=self._s3_name(k), Body=raw)
            self.tier.refresh()
        else:
            inner = self.tier.inner if self.codec.keyed else self.tier
            assert write(inner, [k], [torch.frombuffer(bytearray(raw), dtype=torch.uint8)]).ok

    def raw(self, k: bytes) -> bytes | None:
        """The stored bytes of a key (None: none stored)."""
        if self.kind == "filesystem":
            try:
                with open(self.tier.file_path(k), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        if self.kind == "valkey":
            return self.redis.get(self._valkey_name(k))
        if self.kind == "s3":
            try:
                return self.s3.get_object(Bucket=self.bucket, Key=self._s3_name(k))["Body"].read()
            except self.s3.exceptions.NoSuchKey:
                return None
        namespaced = self.tier.inner if self.codec.keyed else self.tier  # (NamespacedTier)
        plugin = namespaced.inner  # DictTier: its dict is the plug-in's storage itself
        stored = plugin._data.get(namespaced._wrap([k])[0])
        return None if stored is None else stored.numpy().tobytes()

    def _valkey_name(self, k: bytes) -> bytes:
        return f"{self.prefix}{self.codec.namespace(FP)}:{k.hex()}".encode()

    def _s3_name(self, k: bytes) -> str:
        return f"kv-offload/{self.codec.namespace(FP)}/{k.hex()}"


@pytest.fixture
def make_store(request, tmp_path):
    opened: list[StorageTier] = []

    def open_store(kind: str, mode: str) -> Store:
        store = Store(request, tmp_path, kind, CODECS[mode])
        opened.append(store.tier)
        return store

    yield open_store
    for tier in opened:
        tier.close()


def fetch(store: Store, k: bytes) -> tuple[bool, torch.Tensor]:
    out = torch.zeros(SIZE, dtype=torch.uint8)
    return read(store.tier, [k], [out]).ok, out


@pytest.mark.parametrize("kind", KINDS)
def test_a_forged_record_with_a_recomputed_xxh3_is_served_without_a_secret(make_store, kind):
    store = make_store(kind, "none")
    evil = random_bytes(SIZE, 666)
    store.plant(key(1), store.forged(key(1), evil))
    ok, out = fetch(store, key(1))
    assert ok and torch.equal(out, evil)  # today's trust model: every writer decides


@pytest.mark.parametrize("mode", ["auth", "encrypt"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_forged_record_is_refused_removed_and_counted_with_a_secret(make_store, kind, mode):
    store = make_store(kind, mode)
    evil = random_bytes(SIZE, 666)
    plants = {key(1): store.forged(key(1), evil),  # today's format, xxh3 recomputed
              key(2): store.forged(key(2), evil, ATTACKERS[mode])}  # sealed with another secret
    for k, raw in plants.items():
        store.plant(k, raw)
    sealed_size = data_offset(key(1), FP, SIZE, align=NETWORK_ALIGN, codec=store.codec) \
        + SIZE
    rejected = 0
    for k, raw in plants.items():
        ok, _ = fetch(store, k)  # (a failed read leaves its buffer undefined: never served)
        assert not ok
        if kind == "plugin" and len(raw) != sealed_size:
            continue  # DictTier itself refuses a value of the wrong size (and overwrites it
            # on the next write: it cannot block the key), so the seal never sees it
        rejected += 1
        assert store.raw(k) is None  # deleted: the tier may delete
    assert rejected >= 1 and store.tier.stats()["rejected_records"] == rejected


@pytest.mark.parametrize("mode", ["auth", "encrypt"])
@pytest.mark.parametrize("kind", KINDS)
def test_tampered_and_replayed_records_are_refused(make_store, kind, mode):
    store = make_store(kind, mode)
    data = random_bytes(SIZE, 1)
    assert write(store.tier, [key(1)], [data]).ok
    genuine = store.raw(key(1))
    assert genuine is not None
    tampered_data = bytearray(genuine)
    tampered_data[-100] ^= 0x01
    tampered_tag = bytearray(genuine)
    tag_at = genuine.index(store.codec.algo.encode()) + len(store.codec.algo) + 1
    tampered_tag[tag_at + 3] ^= 0x01 if genuine[tag_at + 3] != ord("0") else 0x02
    tampered_header = genuine.replace(b'"shape":[70000]', b'"shape":[70001]', 1)
    assert tampered_header != genuine
    plants = {key(2): genuine, key(3): bytes(tampered_data), key(4): bytes(tampered_tag),
              key(5): tampered_header}  # key 2: a genuine record replayed under another key
    for k, raw in plants.items():
        store.plant(k, raw)
    for k in plants:
        assert not fetch(store, k)[0], f"key {k.hex()} was served"
    assert store.tier.stats()["rejected_records"] == len(plants)
    ok, out = fetch(store, key(1))
    assert ok and torch.equal(out, data)  # the genuine one still serves


@pytest.mark.parametrize("mode", ["auth", "encrypt"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_record_cannot_keep_the_real_value_out(make_store, kind, mode):
    """The attacker writes first; present-key skips (skip-if-present, SET NX, If-None-Match)
    may skip the engine's write, but the one failed read removes the plant and the next
    write stores the real value."""
    store = make_store(kind, mode)
    data, evil = random_bytes(SIZE, 7), random_bytes(SIZE, 666)
    store.plant(key(1), store.forged(key(1), evil))
    failed_reads = 0
    for _ in range(2):
        assert write(store.tier, [key(1)], [data]).ok
        ok, out = fetch(store, key(1))
        if ok:
            break
        failed_reads += 1
    assert ok and torch.equal(out, data) and failed_reads <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_encrypted_records_hold_no_plaintext_and_no_key(make_store, kind):
    store = make_store(kind, "encrypt")
    data = random_bytes(SIZE, 3)
    assert write(store.tier, [key(1)], [data]).ok
    raw = store.raw(key(1))
    assert data.numpy().tobytes()[:256] not in raw and key(1).hex().encode() not in raw
    ok, out = fetch(store, key(1))
    assert ok and torch.equal(out, data)


def test_rejections_are_logged_once_per_episode(make_store, caplog):
    store = make_store("filesystem", "auth")
    evil = random_bytes(SIZE, 666)
    for i in range(5):
        store.plant(key(i), store.forged(key(i), evil))
    with caplog.at_level(logging.WARNING, logger="kv_offload"):
        for i in range(5):
            assert not fetch(store, key(i))[0]
    lines = [r for r in caplog.records if "record verification" in r.getMessage()]
    assert len(lines) == 1 and "written without the shared secret" in lines[0].getMessage()
    assert store.tier.stats()["rejected_records"] == 5
