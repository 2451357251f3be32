"""``GroupedManager.peek`` and ``lookup`` after close raise ``ClosedError``, as their docstrings
say and as ``OffloadManager.peek``/``lookup`` do (newuser12: ``peek``, and ``lookup`` of a miss,
returned a plan from the index of closed managers)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvmgr.errors import ClosedError
from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec

BS = 16
LAYOUT = GroupedLayout(
    [
        GroupSpec(name="full", kind="full", block_size=BS, page_bytes=(BS * 8,)),
        GroupSpec(
            name="swa", kind="sliding_window", block_size=BS, page_bytes=(BS * 8,), window=40
        ),
    ],
    hash_block_size=BS,
)


@pytest.mark.asyncio
async def test_peek_and_lookup_after_close_raise_closed_error() -> None:
    gpu = {g.name: [torch.zeros(8, BS * 8, dtype=torch.uint8)] for g in LAYOUT.groups}
    hit, miss = hashlib.blake2b(b"stored").digest(), hashlib.blake2b(b"never").digest()
    mgr = GroupedManager.create(LAYOUT, gpu, {"full": 8, "swa": 8})
    async with mgr:
        stored = mgr.store([hit], {"full": [0], "swa": [0]})
        await mgr.step()
        await stored
        assert mgr.peek([hit]).num_tokens == BS
    for call in (mgr.peek, mgr.lookup):
        for hashes in ([hit], [miss]):
            with pytest.raises(ClosedError):
                call(hashes)


@pytest.mark.asyncio
async def test_take_events_after_close_with_orphans_pending_returns_the_events() -> None:
    """A store that failed in one group leaves the other group's landed blocks orphans, dropped
    at the next sync; after close that sync raised ``ClosedError`` from ``take_events`` (whose
    docstring names no error), and a router draining the last events lost them."""
    from kvmgr import ManagerConfig, OffloadManager
    from kvmgr.errors import TransferError
    from kvmgr.testing import FaultyEngine
    from kvmgr.transfer.host import HostEngine

    config = ManagerConfig(num_cpu_blocks=8, engine="host", manage_gpu_blocks=False)
    managers = [
        OffloadManager(
            [torch.zeros(8, BS * 8, dtype=torch.uint8)],
            config,
            engine=FaultyEngine(HostEngine(), fail_rate=float(g), seed=0),  # "swa" fails
        )
        for g in range(2)
    ]
    mgr = GroupedManager(LAYOUT, managers)
    hashes = [hashlib.blake2b(bytes([i])).digest() for i in range(3)]
    async with mgr:
        stored = mgr.store(hashes, {"full": [0, 1, 2], "swa": [0, 1, 2]})
        await mgr.step()
        with pytest.raises(TransferError):
            await stored
    events = mgr.take_events()
    # the full group's blocks landed; each group's close cleared its tier
    assert [e.kind for e in events] == ["stored", "cleared", "cleared"]
    assert mgr.take_events() == []
