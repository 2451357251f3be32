"""``DeepSeekV4Offload.store`` / ``load``: the future resolves only once every group's copy ended.

Round 4, session 13 (newuser14): the future was ``asyncio.gather`` of the groups' swap
futures, which fails as soon as one group fails while the other groups' copies still run, and
which cancels those groups' futures when it is cancelled (a cancelled swap future is done while
its copy runs). The caller owns the GPU blocks (``manage_gpu_blocks=False``) and is told it may
reuse them once the future resolved: a block rewritten then is read by a group's store still in
flight, so that group's keys became READY with the new bytes (wrong KV for every later restore
once the failed group is stored again). Now the future waits for every group's copy (as
``GroupedManager``'s does), then raises the first group's error; cancelling it leaves the
copies and their futures alone.
"""

from __future__ import annotations

import asyncio

import pytest

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import TransferError
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, allocate_caches
from kvmgr.testing import FaultyEngine
from kvmgr.transfer import HostEngine

LAYOUT = DeepSeekV4Layout(compress_ratios=(0, 4, 128), head_dim=128)
N = 301
NEED = {g.name: len(LAYOUT.blocks_at(g.name, N)) for g in LAYOUT.groups}
FIRST, LAST = LAYOUT.groups[0].name, LAYOUT.groups[-1].name
KEYS = ([b"block-0"], b"request@301")


def _offload(engines: dict[str, FaultyEngine]) -> tuple[DeepSeekV4Offload, dict[str, list[int]]]:
    caches = allocate_caches(LAYOUT, {g: 2 * k for g, k in NEED.items()})
    managers = {
        g: OffloadManager(
            caches[g],
            ManagerConfig(num_cpu_blocks=8, engine="host", manage_gpu_blocks=False),
            engine=engines[g],
        )
        for g in NEED
    }
    tables = {g: [-1] * LAYOUT.blocks_at(g, N).start + list(range(k)) for g, k in NEED.items()}
    return DeepSeekV4Offload(LAYOUT, managers), tables


def _busy(offload: DeepSeekV4Offload) -> dict[str, object]:
    return {g: m.snapshot().gpu_busy for g, m in offload.managers.items() if m.snapshot().gpu_busy}


@pytest.mark.asyncio
async def test_a_failed_group_does_not_resolve_the_store_while_another_group_copies() -> None:
    # the first group fails its store at once; the last group's copy is held in flight
    engines = {g: FaultyEngine(HostEngine()) for g in NEED}
    engines[FIRST] = FaultyEngine(HostEngine(), fail_batches={0})
    engines[LAST] = FaultyEngine(HostEngine(), hold=True)
    offload, tables = _offload(engines)
    async with offload:
        stored = offload.store(N, tables, *KEYS)
        await offload.step()
        await asyncio.sleep(0.05)
        assert not stored.done(), "resolved while the last group's copy still runs"
        assert _busy(offload)  # the held copy still reads its blocks
        engines[LAST].release()
        with pytest.raises(TransferError):
            await asyncio.wait_for(stored, 5)
        assert _busy(offload) == {}  # resolved: no copy touches a block any more


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["store", "load"])
async def test_cancelling_the_future_leaves_every_group_copy_running(what: str) -> None:
    engines = {g: FaultyEngine(HostEngine()) for g in NEED}
    offload, tables = _offload(engines)
    async with offload:
        if what == "load":
            first = offload.store(N, tables, *KEYS)
            await offload.step()
            await first
            fresh = {g: list(range(k, 2 * k)) for g, k in NEED.items()}
        engines[LAST].hold()
        if what == "store":
            future = offload.store(N, tables, *KEYS)
        else:
            future = offload.load(N, fresh, *KEYS)
        await offload.step()
        future.cancel()
        await asyncio.sleep(0.01)
        assert future.cancelled()
        engines[LAST].release()
        for m in offload.managers.values():  # each group's swap still ends with its copy
            await m.step()
        await asyncio.sleep(0.05)
        assert _busy(offload) == {}
        if what == "store":  # the copies landed: the restore point is there in every group
            assert offload.is_restorable(N, *KEYS)
