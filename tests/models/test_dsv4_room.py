"""``DeepSeekV4Offload.store`` checks every group's room before any group queues its store.

Round 4, session 13 (newuser14): a group whose CPU tier had no room raised
``PoolExhaustedError`` ("nothing changed") from its ``swap_out`` after the earlier groups'
stores were queued. Those ran at the next step and read the caller's blocks, which the caller,
told the store failed, had rewritten: the earlier groups' keys became READY with another
request's bytes, and once the last group had room a restore served them. Now the room of every
group is checked first (free blocks plus READY blocks without loads in flight, less the store's
own READY keys), as ``GroupedManager.store`` does.
"""

from __future__ import annotations

import asyncio

import pytest

from kvmgr.errors import PoolExhaustedError
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, allocate_caches

LAYOUT = DeepSeekV4Layout(compress_ratios=(0, 4, 128), head_dim=128)
N = 301
NEED = {g.name: len(LAYOUT.blocks_at(g.name, N)) for g in LAYOUT.groups}
KEYS = ([b"block-0"], b"request@301")


def _offload(cpu_blocks: dict[str, int], **config: object) -> tuple[DeepSeekV4Offload, dict]:
    caches = allocate_caches(LAYOUT, {g: 2 * k for g, k in NEED.items()})
    offload = DeepSeekV4Offload.create(LAYOUT, caches, cpu_blocks, engine="host", **config)
    tables = {g: [-1] * LAYOUT.blocks_at(g, N).start + list(range(k)) for g, k in NEED.items()}
    return offload, tables


@pytest.mark.asyncio
@pytest.mark.parametrize("short", [g.name for g in LAYOUT.groups])
async def test_a_group_without_room_queues_no_group_store(short: str) -> None:
    offload, tables = _offload({g: (k - 1 if g == short else 8) for g, k in NEED.items()})
    async with offload:
        with pytest.raises(PoolExhaustedError, match=short):
            offload.store(N, tables, *KEYS)
        for name, mgr in offload.managers.items():
            stats = mgr.statistics()
            assert stats.queued_swaps == 0 and stats.cpu_blocks_used == 0, name
            assert mgr.snapshot().gpu_busy == {}, name
        await offload.step()
        assert not any(m.statistics().cpu_keys_ready for m in offload.managers.values())


@pytest.mark.asyncio
async def test_a_store_that_fits_after_eviction_still_runs() -> None:
    offload, tables = _offload(dict(NEED))  # every tier exactly one restore point large
    async with offload:
        first = offload.store(N, tables, *KEYS)
        await offload.step()
        await first
        again = offload.store(N, tables, [b"block-1"], b"other@301")  # evicts the first
        await offload.step()
        await again
        assert offload.is_restorable(N, [b"block-1"], b"other@301")
        stored = offload.store(N, tables, [b"block-1"], b"other@301")  # all present: no room needed
        await offload.step()
        await stored


@pytest.mark.asyncio
async def test_backpressure_wait_still_waits_for_room() -> None:
    offload, tables = _offload(dict(NEED), backpressure="wait", store_wait_s=5.0)
    async with offload:
        first = offload.store(N, tables, *KEYS)  # PENDING until the step: nothing evictable
        second = offload.store(N, tables, [b"block-1"], b"other@301")  # waits, no raise
        await offload.step()
        await first
        await offload.step()
        await asyncio.wait_for(second, 5)
        assert offload.is_restorable(N, [b"block-1"], b"other@301")


@pytest.mark.asyncio
async def test_keys_already_in_flight_take_no_room() -> None:
    """A store of a restore point whose keys are still PENDING (its first store not landed
    yet) needs no new block: ``swap_out`` skips them. The room check counted them as new and
    refused the store on a tier exactly one restore point large (leftovers14)."""
    offload, tables = _offload(dict(NEED))
    async with offload:
        first = offload.store(N, tables, *KEYS)
        assert all(m.statistics().cpu_keys_pending for m in offload.managers.values())
        again = offload.store(N, tables, *KEYS)  # refused before the fix: "need k, 0 free"
        await offload.step()
        await first
        await again
        assert offload.is_restorable(N, *KEYS)
        pending = offload.store(N, tables, [b"block-1"], b"other@301")  # evicts the first
        with pytest.raises(PoolExhaustedError, match="no group's store was queued"):
            offload.store(N, tables, [b"block-2"], b"third@301")  # PENDING keys: no victims
        await offload.step()
        await pending
        assert offload.is_restorable(N, [b"block-1"], b"other@301")
        assert not offload.is_restorable(N, [b"block-2"], b"third@301")
