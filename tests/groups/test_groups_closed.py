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
