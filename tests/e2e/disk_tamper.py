"""A planted bug for the disk tier: files that hold another block's bytes under a valid header.

Each target file keeps its own key and layout in the header, but gets the data of a source
file and a checksum recomputed for that data — what a tier that wrote a block under the wrong
key would leave behind. The tier's own checks (header, key, size, checksum) all pass, so only
a comparison of outputs (`kv-offload serve-check`) can catch it.

The sources must be blocks of another prompt: shuffling a prompt's blocks among themselves
changes nothing a model computes (attention sums over the set of key/value pairs, and each
key carries its position, RoPE being applied before the cache), so it is no bug to catch.
"""

from __future__ import annotations

from pathlib import Path

from kv_offload.backends.filesystem.fileformat import build_header, checksum, parse_header


def _data(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[parse_header(raw).data_offset:]


def give_other_blocks_bytes(targets: list[Path], sources: list[Path]) -> None:
    """Rewrite `targets[i]` with the data of `sources[i % len(sources)]`, header rebuilt."""
    if not targets or not sources or set(targets) & set(sources):
        raise ValueError(f"need targets and distinct sources, got {len(targets)} targets, "
                         f"{len(sources)} sources, {len(set(targets) & set(sources))} shared")
    for i, path in enumerate(targets):
        raw = path.read_bytes()
        info = parse_header(raw)
        data = _data(sources[i % len(sources)])
        if len(data) != info.data_len:
            raise ValueError(f"{path} holds {info.data_len} bytes, its source {len(data)}")
        header = build_header(bytes.fromhex(info.key_hex), info.fingerprint, len(data),
                              checksum(data))
        path.write_bytes(header + data)
