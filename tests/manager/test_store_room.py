"""``OffloadManager.check_store_room``: the room step of ``swap_out``, asked without changing
anything (issue 27, session 15).

The grouped stores (``GroupedManager``, ``DeepSeekV4Offload``) counted every READY key without
readers as evictable; the policies evict leaves only, so a READY key above a PENDING, read or
protected key is no victim and a group's ``swap_out`` could still refuse after the check
passed. Here a random program of stores, loads and steps asks the check before every store and
compares it with what ``swap_out`` does right after: the same answer, both ways, for every
policy without admission control (with ``admit`` a pass still means ``swap_out`` finds room).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.errors import InvalidKeyError, PoolExhaustedError

NUM_GPU = 64


def _key(chain: int, j: int) -> bytes:
    return f"c{chain}-{j}".encode()


def _manager(policy: str, num_cpu: int, **config: Any) -> OffloadManager:
    kv = [torch.zeros((NUM_GPU, 16), dtype=torch.uint8)]
    cfg = ManagerConfig(num_cpu_blocks=num_cpu, engine="host", manage_gpu_blocks=False,
                        policy=policy, **config)  # fmt: skip
    return OffloadManager(kv, cfg)


async def _program(mgr: OffloadManager, seed: int, exact: bool) -> tuple[int, int]:
    """Random stores (chain segments, explicit parents), loads and steps; (passed, refused)."""
    rng = random.Random(seed)
    futures: list[asyncio.Future[Any]] = []
    gpu, counts = 0, [0, 0]
    for _ in range(120):
        op = rng.random()
        if op < 0.6:
            chain, start = rng.randrange(4), rng.randrange(6)
            keys = [_key(chain, j) for j in range(start, start + rng.randint(1, 4))]
            parents = [_key(chain, j - 1) if j else None for j in range(start, start + len(keys))]
            ids = [(gpu + i) % NUM_GPU for i in range(len(keys))]
            gpu += len(keys)
            try:
                mgr.check_store_room(keys, parents)
                passed = True
            except PoolExhaustedError:
                passed = False
            try:
                futures.append(mgr.swap_out(ids, keys, parents))
                refused = False
            except PoolExhaustedError:
                refused = True
            assert not (passed and refused), (keys, mgr.snapshot().keys)
            if exact:
                assert passed or refused, (keys, mgr.snapshot().keys)
            counts[passed] += 1
        elif op < 0.8:
            ready = [k for k, s in mgr.snapshot().keys.items() if s.state.name == "READY"]
            if ready:
                key = rng.choice(ready)
                futures.append(mgr.swap_in([key], [gpu % NUM_GPU]))
                gpu += 1
        else:
            await mgr.step()
            await asyncio.gather(*futures)
            futures.clear()
    await mgr.step()
    await asyncio.gather(*futures)
    return counts[1], counts[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "reuse", "online"])
@pytest.mark.parametrize("seed", range(4))
async def test_the_check_agrees_with_swap_out(policy: str, seed: int) -> None:
    async with _manager(policy, 6) as mgr:
        exact = not hasattr(mgr.policy, "admit")
        passed, refused = await _program(mgr, seed, exact)
    assert passed and (refused or not exact)  # both answers were asked about


@pytest.mark.asyncio
@pytest.mark.parametrize("below", ["pending", "read", "protected"])
async def test_a_ready_key_above_one_that_cannot_go_is_no_victim(below: str) -> None:
    """The tier full with the chain a -> b (b PENDING, being read, or a key of the store):
    ``a`` is READY without readers, yet no policy evicts it, so one new key finds no room."""
    async with _manager("lru", 2) as mgr:
        a, b = b"a", b"b"
        await asyncio.gather(mgr.swap_out([0, 1], [a, b]), mgr.step())
        if below == "pending":
            mgr.invalidate([b])
            pending = mgr.swap_out([1], [b], [a])
        elif below == "read":
            pending = mgr.swap_in([b], [5])
        keys, parents = ([b, b"c"], [a, b]) if below == "protected" else ([b"x"], [None])
        with pytest.raises(PoolExhaustedError, match="0 free and 0 evictable") as info:
            mgr.check_store_room(keys, parents)
        assert (info.value.needed, info.value.available) == (1, 0)
        with pytest.raises(PoolExhaustedError):
            mgr.swap_out([2, 3][: len(keys)], keys, parents)  # what the check foretold
        if below != "protected":
            await asyncio.gather(pending, mgr.step())
        mgr.check_store_room([b"x"], [None])  # now a READY leaf chain: b, then a go
        assert mgr.statistics().cpu_keys_ready == 2  # the check evicted nothing


@pytest.mark.asyncio
async def test_keys_the_threshold_turns_away_need_no_block() -> None:
    async with _manager("lru", 2, store_threshold=2) as mgr:
        await asyncio.gather(mgr.swap_out([0], [b"a"]), mgr.step())  # seen once: not stored
        assert mgr.check_store_room([b"b", b"c", b"d"]) == 0  # none seen before: none stored
        assert mgr.check_store_room([b"a"]) == 1  # seen once: this store admits it
        with pytest.raises(InvalidKeyError):
            mgr.check_store_room([b"a", b"a"])  # repeated, as swap_out refuses it


@pytest.mark.asyncio
async def test_wait_refuses_only_a_store_larger_than_the_tier() -> None:
    async with _manager("lru", 2, backpressure="wait") as mgr:
        await asyncio.gather(mgr.swap_out([0, 1], [b"a", b"b"]), mgr.step())
        mgr.invalidate([b"b"])
        pending = mgr.swap_out([1], [b"b"], [b"a"])
        assert mgr.check_store_room([b"x"]) == 1  # swap_out would wait for room
        with pytest.raises(PoolExhaustedError):
            mgr.check_store_room([b"x", b"y", b"z"])
        await asyncio.gather(pending, mgr.step())
