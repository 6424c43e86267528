"""The plain host pool asks Linux for transparent huge pages: random small-page copies then
miss the TLB far less (see `kv_offload.backends.cpu.pool`). Checked on the real kernel's
accounting (`/proc/self/smaps`); skipped where THP is off or absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kv_offload.backends.cpu.pool import allocate_pool
from kv_offload.kernels.geometry import HostSlotLayout

HUGE_PAGE_BYTES = 2 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib_around(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding `address` in this process."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            mapping = lo <= address < hi
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("the pool's mapping is not in /proc/self/smaps")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off or absent here")
def test_a_plain_host_pool_is_backed_by_huge_pages_once_touched():
    slot = 64 * 1024
    layout = HostSlotLayout(slot_bytes=slot, ref_offsets=((0,),), group_bytes=(slot,))
    pool = allocate_pool(layout, 64 * HUGE_PAGE_BYTES, pin=False)
    pool.fill_(7)  # first touch: the kernel commits the pages now
    assert torch.all(pool[::97] == 7)
    assert _huge_kib_around(pool.data_ptr() + pool.numel() // 2) >= 32 * 1024

