"""``DeepSeekV4Offload`` checks every group's GPU ids before any group queues a swap.

A bad id in a later group used to raise only after the earlier groups' stores (or loads) were
queued: the caller saw an error, and the copies ran anyway. A float id was truncated by ``int``
(2.5 stored block 2's KV under the key); ``None`` raised a bare ``TypeError``.
"""

from __future__ import annotations

import pytest
import torch

from kvmgr.errors import InvalidBlockError
from kvmgr.models.deepseek_v4 import DeepSeekV4Layout, DeepSeekV4Offload, allocate_caches

LAYOUT = DeepSeekV4Layout(compress_ratios=(0, 4, 128), head_dim=128)
N = 301
NEED = {g.name: len(LAYOUT.blocks_at(g.name, N)) for g in LAYOUT.groups}
LAST = LAYOUT.groups[-1].name
KEYS = ([b"block-0"], b"request@301")


def _offload() -> tuple[DeepSeekV4Offload, dict[str, list[int]], dict[str, list[int]]]:
    caches = allocate_caches(LAYOUT, {g: 2 * k for g, k in NEED.items()})
    for tensors in caches.values():
        for t in tensors:
            t.view(torch.uint8).random_(0, 256)
    tables = {g: [-1] * LAYOUT.blocks_at(g, N).start + list(range(k)) for g, k in NEED.items()}
    fresh = {g: list(range(k, 2 * k)) for g, k in NEED.items()}
    offload = DeepSeekV4Offload.create(LAYOUT, caches, {g: 8 for g in NEED}, engine="host")
    return offload, tables, fresh


def _bad(ids: list[int], what: str, live: range) -> list[object]:
    ids = list(ids)
    ids[live[-1]] = {"range": 10**6, "repeat": ids[live[0]], "float": ids[live[-1]] + 0.5,
                     "bool": True, "none": None}[what]  # fmt: skip
    return ids


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["range", "repeat", "float", "bool", "none"])
async def test_a_bad_id_in_the_last_group_queues_no_store(what: str) -> None:
    offload, tables, _ = _offload()
    async with offload:
        bad = {**tables, LAST: _bad(tables[LAST], what, LAYOUT.blocks_at(LAST, N))}
        with pytest.raises(InvalidBlockError):
            offload.store(N, bad, *KEYS)
        await offload.step()
        for m in offload.managers.values():
            stats = m.statistics()
            assert stats.queued_swaps == 0 and stats.cpu_blocks_used == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["range", "repeat", "float", "bool"])
async def test_a_bad_id_in_the_last_group_queues_no_load(what: str) -> None:
    offload, tables, fresh = _offload()
    async with offload:
        stored = offload.store(N, tables, *KEYS)
        await offload.step()
        await stored
        bad = {**fresh, LAST: _bad(fresh[LAST], what, range(len(fresh[LAST])))}
        with pytest.raises(InvalidBlockError):
            offload.load(N, bad, *KEYS)
        reports = await offload.step()
        assert [r.h2d.blocks for r in reports] == [0] * len(reports)
        assert all(m.statistics().queued_swaps == 0 for m in offload.managers.values())
        loaded = offload.load(N, fresh, *KEYS)  # the good call still works
        await offload.step()
        await loaded
