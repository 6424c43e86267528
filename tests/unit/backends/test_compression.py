"""Compressed records (``compression``; kv_offload.backends.common.compression): bit-exact
round trips for every page layout, under every record codec; hostile payloads (wrong sizes,
truncated, bombs, chunks that would leave the buffer unwritten) refused; records with and
without compression served from one store by engines of either setting, on the real disk,
Valkey and S3 tiers."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from kv_offload.backends.common.compression import make_compression
from kv_offload.backends.common.sealing import Authenticated, Encrypted, make_codec
from kv_offload.backends.record import (
    CHECKSUM,
    NETWORK_ALIGN,
    RecordCodec,
    pack,
    pack_compressed,
    parse_header,
    unpack_into,
)
from kv_offload.config import COMPRESSION_CHOICES, parse_config
from kv_offload.errors import ConfigError

blosc2 = pytest.importorskip("blosc2", reason="pip install -e '.[compress]'")

SECRET = b"fleet secret 0123456789abcdef"
KEY = b"\x00" * 8 + b"\x01\x00" + b"\xab" * 32
FP = "llama|LBHNC|page=65536|tp1|rank0"
LOSSLESS = make_compression("lossless")
CODECS = {"checksum": CHECKSUM, "hmac": Authenticated(SECRET), "aes-gcm": Encrypted(SECRET)}


def values(dtype: torch.dtype, n: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(dtype).view(torch.uint8).numpy().tobytes()


def page_layouts() -> dict[str, bytes]:
    """One page of each kind a host slot holds, as the engine would fill it: attention K|V
    of 32 tokens x 4 heads x 128 in each KV dtype, an MLA latent (576 wide), and a Mamba
    state page (conv state bf16, SSM state fp32, then zero padding to the unified page)."""
    tokens_heads = 32 * 4 * 2 * 128
    pages = {f"attention-{name}": values(dtype, tokens_heads, i) for i, (name, dtype) in
             enumerate([("bf16", torch.bfloat16), ("fp16", torch.float16),
                        ("fp32", torch.float32), ("fp8", torch.float8_e4m3fn)])}
    pages["mla-bf16"] = values(torch.bfloat16, 32 * 576, 7)
    conv, ssm = values(torch.bfloat16, 3 * 2048, 8), values(torch.float32, 16 * 128 * 8, 9)
    pages["mamba-state"] = conv + ssm + bytes(8192)
    return pages


PAGES = page_layouts()
COMPRESSIBLE = {"attention-bf16", "mla-bf16", "mamba-state"}  # (bit shuffle over 2 bytes)


def open_record(record, codec: RecordCodec, n: int, key=KEY, align=NETWORK_ALIGN):
    out = bytearray(b"\x5a" * n)
    got = unpack_into(record, key, FP, memoryview(out), align=align, codec=codec)
    return got, bytes(out)


@pytest.mark.parametrize("layout", sorted(PAGES))
@pytest.mark.parametrize("codec_name", sorted(CODECS))
@pytest.mark.parametrize("align", [NETWORK_ALIGN, 4096])
def test_every_page_layout_round_trips_bit_exact(layout, codec_name, align):
    page = PAGES[layout]
    codec = CODECS[codec_name].with_compression(LOSSLESS)
    record = pack(KEY, FP, memoryview(page), align=align, codec=codec)
    plain = pack(KEY, FP, memoryview(page), align=align, codec=CODECS[codec_name])
    assert len(record) <= len(plain)
    if layout in COMPRESSIBLE:  # (a page that would not save 1/32 is stored plain)
        assert len(record) < 0.9 * len(plain)
        assert parse_header(record, align=align, codec=codec).compression == "blosc2"
    got, out = open_record(record, codec, len(page), align=align)
    assert got.ok and out == page
    # (a reader with compression off serves it too: reads open both kinds)
    got, out = open_record(record, CODECS[codec_name], len(page), align=align)
    assert got.ok and out == page


@pytest.mark.parametrize("name", [c for c in COMPRESSION_CHOICES if c != "off"])
def test_every_codec_choice_round_trips(name):
    codec = CHECKSUM.with_compression(make_compression(name))
    page = PAGES["attention-bf16"]
    record = pack(KEY, FP, memoryview(page), align=NETWORK_ALIGN, codec=codec)
    assert len(record) < 0.9 * len(page)
    got, out = open_record(record, CHECKSUM, len(page))
    assert got.ok and out == page


def test_an_incompressible_page_is_stored_plain():
    page = os.urandom(65536)
    codec = CHECKSUM.with_compression(LOSSLESS)
    assert pack_compressed(KEY, FP, memoryview(page), align=NETWORK_ALIGN, codec=codec) is None
    record = pack(KEY, FP, memoryview(page), align=NETWORK_ALIGN, codec=codec)
    assert parse_header(record, align=NETWORK_ALIGN).compression is None
    got, out = open_record(record, codec, len(page))
    assert got.ok and out == page


# -- hostile payloads: made by a writer who knows the format, the key and the fingerprint --

def forged(payload: bytes, uncompressed: int, codec: RecordCodec = CHECKSUM,
           decoder: str = "blosc2") -> bytes:
    """A compressed record around ``payload`` whose digest verifies (xxh3: anyone can)."""
    from kv_offload.backends import record as rec

    compressed = (decoder, uncompressed)
    digest = codec.seal(KEY, rec._sealed_fingerprint(FP, compressed), memoryview(payload))
    header = rec._rebuilt_header(KEY.hex(), FP, len(payload), digest, NETWORK_ALIGN, codec,
                                 compressed)
    return header + payload


def chunk(data: bytes, **kwargs) -> bytes:
    return blosc2.compress2(data, typesize=2, clevel=5, codec=blosc2.Codec.LZ4,
                            filters=[blosc2.Filter.BITSHUFFLE], **kwargs)


PAGE = PAGES["attention-bf16"]


def test_a_well_formed_forged_record_decodes_only_to_the_page_size():
    assert open_record(forged(chunk(PAGE), len(PAGE)), CHECKSUM, len(PAGE))[0].ok


@pytest.mark.parametrize("case", [
    "claims-smaller-page", "claims-larger-page", "truncated", "bomb", "garbage",
    "uninitialised-chunk", "unknown-decoder", "trailing-bytes",
])
def test_hostile_payloads_are_refused_never_served(case):
    n = len(PAGE)
    good = chunk(PAGE)
    if case == "claims-smaller-page":  # header says n, the chunk decodes to less
        record = forged(chunk(PAGE[: n // 2]), n)
    elif case == "claims-larger-page":  # the chunk decodes to more than the buffer
        record = forged(chunk(PAGE + PAGE), n)
    elif case == "truncated":
        record = forged(good[: len(good) // 2], n)
    elif case == "bomb":  # 64 MiB of zeros in a few bytes, claimed to be the page
        record = forged(chunk(bytes(64 << 20)), n)
    elif case == "garbage":
        record = forged(os.urandom(len(good)), n)
    elif case == "uninitialised-chunk":  # a special chunk that writes nothing
        uninit = bytearray(chunk(bytes(n)))
        uninit[31] = (uninit[31] & 0x8F) | (4 << 4)
        record = forged(bytes(uninit), n)
    elif case == "unknown-decoder":
        record = forged(good, n, decoder="zip")
    else:  # bytes after the chunk
        record = forged(good + b"\x00" * 64, n)
    got, out = open_record(record, CHECKSUM, n)
    assert not got.ok and got.bad, got
    assert out != PAGE


@pytest.mark.parametrize("codec_name", ["hmac", "aes-gcm"])
def test_a_compressed_record_whose_fields_were_edited_fails_its_tag(codec_name):
    codec = CODECS[codec_name].with_compression(LOSSLESS)
    record = bytes(pack(KEY, FP, memoryview(PAGE), align=NETWORK_ALIGN, codec=codec))
    (length,) = struct.unpack_from("<Q", record)
    doc = json.loads(record[8:8 + length])
    doc["__metadata__"]["uncompressed_bytes"] = str(len(PAGE) - 2)
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % NETWORK_ALIGN)
    edited = struct.pack("<Q", len(body)) + body + record[8 + length:]
    got, _ = open_record(edited, codec, len(PAGE) - 2)
    assert not got.ok and got.bad
    # and a flipped payload byte fails under every codec
    for name, plain in CODECS.items():
        codec = plain.with_compression(LOSSLESS)
        damaged = bytearray(pack(KEY, FP, memoryview(PAGE), align=NETWORK_ALIGN, codec=codec))
        damaged[-100] ^= 0x40
        got, out = open_record(bytes(damaged), codec, len(PAGE))
        assert not got.ok and got.bad, name


def test_a_record_of_the_wrong_page_size_is_not_served():
    codec = CHECKSUM.with_compression(LOSSLESS)
    record = pack(KEY, FP, memoryview(PAGE), align=NETWORK_ALIGN, codec=codec)
    got, _ = open_record(record, codec, len(PAGE) // 2)
    assert not got.ok and got.held_bytes == len(PAGE)  # intact, the caller's buffer is wrong
    got, _ = open_record(record, Authenticated(SECRET).with_compression(LOSSLESS), len(PAGE))
    assert not got.ok and got.bad  # (another mode's record)


# -- configuration --

def test_the_config_key_takes_the_documented_choices():
    base = {"cpu_bytes_to_use": "1GiB"}
    assert parse_config(base).compression == "off"
    for name in COMPRESSION_CHOICES:
        assert parse_config({**base, "compression": name}).compression == name
    with pytest.raises(ConfigError, match="compression must be one of"):
        parse_config({**base, "compression": "gzip"})
    with pytest.raises(ConfigError, match="plug-in.*set compression to 'off'"):
        parse_config({**base, "compression": "lossless",
                      "storage_tier": "kv_offload.backends.example:DictTier"})
    from kv_offload.backends.common.compression import CHOICES

    assert tuple(CHOICES) == COMPRESSION_CHOICES
    assert make_codec(None, compression="lossless").compression is not None
    assert make_codec(None).compression is None and make_codec(None) is CHECKSUM


# -- real tiers: records of both kinds in one store --

def _filesystem(root, codec, direct=True):
    from kv_offload.backends.filesystem import FilesystemTier, FilesystemTierConfig

    return FilesystemTier(FilesystemTierConfig(str(root), FP, 1 << 30, rescan_interval_s=0,
                                               direct_io=direct, codec=codec))


def _valkey(server, prefix, codec):
    from kv_offload.backends.valkey import ValkeyTier

    return ValkeyTier.from_options({"url": server.url, "key_prefix": prefix,
                                    "refresh_interval_s": 0}, FP, codec=codec)


def _s3(server, bucket, codec):
    from kv_offload.backends.s3 import S3Tier

    return S3Tier.from_options({"bucket": bucket, "endpoint_url": server.endpoint_url,
                                "bytes_to_use": 1 << 30, "refresh_interval_s": 0,
                                "helper_process": False}, FP, codec=codec)


@pytest.fixture(params=["filesystem", "filesystem-buffered", "valkey", "s3"])
def open_tier(request, tmp_path):
    """A factory of tiers (given a codec) over one store shared by all it opens."""
    from helpers.servers import make_bucket, unique_name

    opened = []
    kind = request.param
    if kind == "valkey":
        server, prefix = request.getfixturevalue("valkey_server"), unique_name("cmp") + ":"
    elif kind == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = make_bucket(server.endpoint_url)

    def make(codec):
        if kind.startswith("filesystem"):
            tier = _filesystem(tmp_path / "tier", codec, direct=kind == "filesystem")
        elif kind == "valkey":
            tier = _valkey(server, prefix, codec)
        else:
            tier = _s3(server, bucket, codec)
        opened.append(tier)
        return tier

    make.kind = kind
    yield make
    for tier in opened:
        tier.close()


def host_buffers(pages):
    from kv_offload.backends.filesystem import aligned_host_buffer

    bufs = []
    for page in pages:
        buf = aligned_host_buffer(len(page))
        buf.copy_(torch.frombuffer(bytearray(page), dtype=torch.uint8))
        bufs.append(buf)
    return bufs


@pytest.mark.parametrize("codec_name", ["checksum", "aes-gcm"])
def test_a_store_holding_both_kinds_serves_each_engine_bit_exact(open_tier, codec_name):
    from helpers.tier_helpers import read, write

    plain_codec = CODECS[codec_name]
    packed_codec = plain_codec.with_compression(LOSSLESS)
    pages = [PAGES["attention-bf16"], PAGES["mla-bf16"] + bytes(65536 - len(PAGES["mla-bf16"])),
             os.urandom(65536)]  # (the last one does not compress: stored plain)
    pages = [p[:65536].ljust(65536, b"\0") for p in pages]
    compressing, plain = open_tier(packed_codec), open_tier(plain_codec)
    keys_c = [KEY[:-1] + bytes([i]) for i in range(3)]
    keys_p = [KEY[:-1] + bytes([10 + i]) for i in range(3)]
    assert write(compressing, keys_c, host_buffers(pages)).ok
    assert write(plain, keys_p, host_buffers(pages)).ok
    counts = compressing.stats().counts
    assert counts["page_bytes_written"] == 3 * 65536
    assert counts["record_bytes_written"] < 0.95 * counts["page_bytes_written"]
    for reader in (compressing, plain):
        for keys in (keys_c, keys_p):
            reader.find(keys)
            bufs = host_buffers([b"\0" * 65536] * 3)
            assert read(reader, keys, bufs).ok, (reader, keys)
            assert [bytes(b.numpy()) for b in bufs] == pages


def test_a_corrupted_compressed_file_is_never_served_and_is_removed(tmp_path):
    from helpers.tier_helpers import read, write

    codec = CHECKSUM.with_compression(LOSSLESS)
    tier = _filesystem(tmp_path, codec)
    try:
        assert write(tier, [KEY], host_buffers([PAGE])).ok
        (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                   if f.endswith(".safetensors")]
        assert os.path.getsize(path) < len(PAGE)  # stored compressed
        with open(path, "r+b") as f:
            f.seek(-500, os.SEEK_END)
            byte = f.read(1)
            f.seek(-500, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x10]))
        bufs = host_buffers([b"\0" * len(PAGE)])
        assert not read(tier, [KEY], bufs).ok
        assert tier.stats()["rejected_records"] == 1 and not os.path.exists(path)
    finally:
        tier.close()


@pytest.mark.parametrize("example", ["llama-8b", "gemma3", "deepseek-mla", "qwen3-next"])
def test_canonical_pages_of_vllm_allocated_models_round_trip_compressed(example):
    """The pages a host slot holds for models allocated as vLLM 0.32 allocates them
    (attention, sliding window, MLA latents, GatedDeltaNet states with their padded slots),
    filled with bf16 Gaussians: compressed, and back bit for bit."""
    import kv_offload as ko
    from kv_offload.testing.example_models import build_example

    model = build_example(example, num_blocks=2)
    flat = model.buffer.view(-1)
    flat[: flat.numel() // 2 * 2].view(torch.bfloat16).copy_(
        torch.randn(flat.numel() // 2, generator=torch.Generator().manual_seed(3)))
    canonical = ko.canonicalize(model.kv_caches, model.groups, model.num_blocks)
    codec = Authenticated(SECRET).with_compression(LOSSLESS)
    for refs in canonical.group_refs:
        for ref in refs[:3]:
            row = canonical.tensors[ref.tensor_idx].tensor[1]
            page = row[ref.offset_bytes:ref.offset_bytes + ref.page_size_bytes].numpy().tobytes()
            record = pack(KEY, FP, memoryview(page), align=4096, codec=codec)
            assert len(record) < 0.9 * len(page), (example, ref.layer_name)
            got, out = open_record(record, codec, len(page), align=4096)
            assert got.ok and out == page, (example, ref.layer_name)
