"""The per-call load's small-list paths (percall3): ``checked_ids`` copies a list of exact ints
and converts other integers, ``prepare_load``'s plain READY loop raises what the general check
raises, and its ``SwapResult`` built by ``tuple.__new__`` equals the NamedTuple's own."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import BlockStateError, InvalidBlockError, UnknownKeyError
from kvmgr.reports import SwapResult
from kvmgr.scheduler.gpu_blocks import GpuBlocks
from kvmgr.testing import NullEngine

K = [hashlib.blake2b(b"small%d" % i, digest_size=16).digest() for i in range(8)]


@pytest.mark.parametrize("owned", [False, True])
def test_checked_ids_of_a_short_list(owned: bool) -> None:
    gpu = GpuBlocks(8, owned=owned)
    held = gpu.allocate(4).tolist() if owned else [0, 1, 2, 3]
    ids = held[:3]
    got = gpu.checked_ids(ids, "load")
    assert got == ids and got is not ids and all(type(b) is int for b in got)
    mixed = [np.int64(held[0]), held[1]]
    got = gpu.checked_ids(mixed, "load")
    assert got == held[:2] and all(type(b) is int for b in got)
    assert gpu.check_small(ids, "load") is True and gpu.check_small(mixed, "load") is False
    for bad in ([held[0], held[0]], [8], [-1], [1.5], [True]):
        with pytest.raises(InvalidBlockError):
            gpu.checked_ids(bad, "load")
    if owned:
        with pytest.raises(InvalidBlockError, match="not held"):
            gpu.checked_ids([7], "load")


@pytest.mark.asyncio
async def test_a_per_call_load_result_and_errors() -> None:
    config = ManagerConfig(num_cpu_blocks=8)
    async with OffloadManager([torch.zeros(16, 2, 4)], config, engine=NullEngine()) as mgr:
        gpu = mgr.allocate("r", 8)
        stored = mgr.swap_out(gpu[:2], K[:2], [None, None])
        with pytest.raises(BlockStateError, match="pending"):
            mgr.swap_in(K[:1], gpu[4:5])  # PENDING
        with pytest.raises(UnknownKeyError):
            mgr.swap_in([K[0], K[5]], gpu[4:6])  # a key missing: that error first
        await mgr.step()
        first = await stored
        loaded = mgr.swap_in(K[1:2], gpu[6:7])
        await mgr.step()
        got = await asyncio.wait_for(loaded, 5)
        want = SwapResult(1, got.num_bytes, 0, first.cpu_block_ids[1:], (gpu[6],))
        assert type(got) is SwapResult and got == want and got._fields == want._fields
