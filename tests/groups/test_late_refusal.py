"""A group that refuses its store (or a DeepSeek-V4 load) after earlier groups queued theirs.

The room checks of ``GroupedManager.store`` and ``DeepSeekV4Offload.store`` were not exact: a
READY key counted as evictable may be the parent of a key that cannot go, which leaf-first
policies never evict (leftovers14; exact since session 15, ``test_exact_room.py``). A later
group's ``swap_out`` then refused while the earlier groups' stores stayed queued, and the call
raised: the caller, told the store failed, reused its blocks, and the queued copies read them
at the next step. Now the call returns a future that
fails with the refusal only once those copies ended. The refusal is injected (the group's
``swap_out`` raises): the safety net stays for a refusal the check cannot foresee.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from test_groups_manager import caches, hashes, make, tables

from kvmgr.errors import PoolExhaustedError
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, allocate_caches


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise PoolExhaustedError("injected: no room", needed=1, available=0, reason="cpu_full")


async def _check_late_refusal(managers: list[Any], store: Any) -> asyncio.Future[Any]:
    """``store()`` gives a future (no raise), busy blocks until the step, then the refusal."""
    future = store()
    assert isinstance(future, asyncio.Future)
    assert any(m.snapshot().gpu_busy for m in managers[:-1])  # the earlier groups' copies
    await asyncio.sleep(0)
    assert not future.done()  # the queued copies have not run
    return future


@pytest.mark.asyncio
async def test_grouped_store_fails_after_the_queued_copies() -> None:
    kv = caches(torch.Generator().manual_seed(21))
    hs = hashes(8)
    async with make(kv) as mgr:
        mgr.managers[-1].swap_out = _refuse  # type: ignore[method-assign]
        future = await _check_late_refusal(mgr.managers, lambda: mgr.store(hs, tables(8)))
        await mgr.step()
        with pytest.raises(PoolExhaustedError, match="injected"):
            await future
        assert all(m.snapshot().gpu_busy == {} for m in mgr.managers)  # blocks free to reuse
        assert mgr.lookup(hs).num_tokens == 0  # the landed groups restore nothing


@pytest.mark.asyncio
async def test_grouped_store_refused_by_the_first_group_raises() -> None:
    kv = caches(torch.Generator().manual_seed(22))
    async with make(kv) as mgr:
        mgr.managers[0].swap_out = _refuse  # type: ignore[method-assign]
        with pytest.raises(PoolExhaustedError, match="injected"):
            mgr.store(hashes(8), tables(8))  # nothing queued: raised, nothing changed
        assert all(m.statistics().queued_swaps == 0 for m in mgr.managers)


LAYOUT = DeepSeekV4Layout(compress_ratios=(0, 4, 128), head_dim=128)
N = 301


@pytest.mark.asyncio
async def test_dsv4_store_fails_after_the_queued_copies() -> None:
    need = {g.name: len(LAYOUT.blocks_at(g.name, N)) for g in LAYOUT.groups}
    kv = allocate_caches(LAYOUT, {g: 2 * k for g, k in need.items()})
    offload = DeepSeekV4Offload.create(LAYOUT, kv, {g: 8 for g in need}, engine="host")
    tables_ = {g: [-1] * LAYOUT.blocks_at(g, N).start + list(range(k)) for g, k in need.items()}
    async with offload:
        names = [n for n in need if LAYOUT.blocks_at(n, N)]
        managers = [offload.managers[n] for n in names]
        managers[-1].swap_out = _refuse  # type: ignore[method-assign]
        keys = ([b"block-0"], b"request@301")
        future = await _check_late_refusal(managers, lambda: offload.store(N, tables_, *keys))
        await offload.step()
        with pytest.raises(PoolExhaustedError, match="injected"):
            await future
        assert all(m.snapshot().gpu_busy == {} for m in managers)
        assert not offload.is_restorable(N, *keys)


@pytest.mark.asyncio
async def test_dsv4_load_fails_after_the_queued_copies() -> None:
    """The same for a load: a group refusing after others queued theirs raised while those
    H2D copies still had to write the caller's fresh blocks (handed to another request once
    the caller was told the load failed)."""
    need = {g.name: len(LAYOUT.blocks_at(g.name, N)) for g in LAYOUT.groups}
    kv = allocate_caches(LAYOUT, {g: 2 * k for g, k in need.items()})
    offload = DeepSeekV4Offload.create(LAYOUT, kv, {g: 8 for g in need}, engine="host")
    tables_ = {g: [-1] * LAYOUT.blocks_at(g, N).start + list(range(k)) for g, k in need.items()}
    fresh = {g: list(range(k, 2 * k)) for g, k in need.items()}
    keys = ([b"block-0"], b"request@301")
    async with offload:
        stored = offload.store(N, tables_, *keys)
        await offload.step()
        await stored
        names = [n for n in need if LAYOUT.blocks_at(n, N)]
        managers = [offload.managers[n] for n in names]
        managers[-1].swap_in = _refuse  # type: ignore[method-assign]
        future = await _check_late_refusal(managers, lambda: offload.load(N, fresh, *keys))
        await offload.step()
        with pytest.raises(PoolExhaustedError, match="injected"):
            await future
        assert all(m.snapshot().gpu_busy == {} for m in managers)
