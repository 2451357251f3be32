"""The event stream at close: nothing is recorded after ``cleared`` (newuser16, round 4 session
14)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.tiers import PutResult, TierStatistics


class _HeldTier:
    """A lower tier whose writes wait until the test lets them go (a frozen server)."""

    name = "held"
    single_tenant = True

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def put_many(self, keys, blobs):  # type: ignore[no-untyped-def]
        await self.release.wait()
        n = len(keys)
        return PutResult(np.ones(n, dtype=bool), n, 0, 0.0)

    async def get_many(self, keys):  # type: ignore[no-untyped-def]
        return [None] * len(keys)

    async def contains_many(self, keys):  # type: ignore[no-untyped-def]
        return np.zeros(len(keys), dtype=bool)

    async def delete_many(self, keys):  # type: ignore[no-untyped-def]
        return 0

    async def aclose(self) -> None:
        self.release.set()

    def statistics(self) -> TierStatistics:
        return TierStatistics(name="held")


@pytest.mark.asyncio
async def test_a_write_through_that_ends_after_close_records_no_event() -> None:
    """``cleared`` is the stream's last event: a lower-tier write still running when ``aclose``
    gave up waiting (a frozen server) appended ``stored`` (tier ``held``) after it, so a router
    draining ``take_events()`` indexed blocks of an instance that had closed."""
    tier = _HeldTier()
    gpu = [torch.randn(8, 4, 16)]
    config = ManagerConfig(num_cpu_blocks=8, tier_write_through=True)
    mgr = OffloadManager(gpu, config, tiers=[tier])
    ids = mgr.allocate("a", 2)
    stored = mgr.swap_out(ids, [b"k0" * 8, b"k1" * 8])
    await mgr.step()
    await stored
    await mgr.aclose(timeout_s=0.01)  # the write-through is still held
    events = mgr.take_events()
    assert events[-1].kind == "cleared"
    tier.release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert mgr.take_events() == []  # nothing after the close's cleared
