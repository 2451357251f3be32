"""A random multi-turn workload through a GroupedManager with small CPU pools: every load
returns the stored bytes, the index agrees with the managers, and no group holds a block that
no restorable boundary needs (no orphans)."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from kvmgr.errors import PoolExhaustedError
from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec

BS = 16
LAYOUT = GroupedLayout(
    [
        GroupSpec(name="full", kind="full", block_size=BS, page_bytes=(32, 16)),
        GroupSpec(name="swa", kind="sliding_window", block_size=BS, page_bytes=(24,), window=40),
        GroupSpec(name="mamba", kind="recurrent", block_size=BS, page_bytes=(40,)),
    ],
    hash_block_size=BS,
)
NUM_GPU = 64


def content(key: bytes, page: int) -> torch.Tensor:
    """The bytes a block named ``key`` holds in a page of ``page`` bytes (never zeros)."""
    raw = hashlib.shake_128(key + b"%d" % page).digest(page)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) | 1


def needed(held: set[bytes], chains: list[list[bytes]]) -> set[bytes]:
    """Held keys some restorable boundary needs, by the definition."""
    out: set[bytes] = set()
    for hs in chains:
        for n in range(BS, len(hs) * BS + 1, BS):
            need = {
                k
                for g, spec in enumerate(LAYOUT.groups)
                for k in LAYOUT.keys(g, hs, spec.live_blocks(n))
            }
            if need <= held:
                out |= need
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_random_workload_keeps_bytes_index_and_no_orphans(seed: int) -> None:
    rng = random.Random(seed)
    gpu = {
        g.name: [torch.zeros(NUM_GPU, p, dtype=torch.uint8) for p in g.page_bytes]
        for g in LAYOUT.groups
    }
    chains: list[list[bytes]] = []
    rejected = 0
    cpu = {"full": 24, "swa": 20, "mamba": 14}
    async with GroupedManager.create(LAYOUT, gpu, cpu) as mgr:
        for step in range(60):
            # a new conversation, or the next turn of one (its prefix plus more blocks)
            short = [c for c in chains if len(c) <= 8]
            base: list[bytes] = [] if not short or rng.random() < 0.3 else list(rng.choice(short))
            hs, parent = list(base), base[-1] if base else b"seed%d-%d" % (seed, step)
            for _ in range(rng.randint(1, 5)):
                parent = hashlib.blake2b(parent + b"%d" % len(hs), digest_size=16).digest()
                hs.append(parent)
            chains.append(hs)
            plan = mgr.lookup(hs)
            if plan.is_hit:
                dst = {
                    g.name: [NUM_GPU // 2 + j for j in range(b.stop)]
                    for g, b in zip(LAYOUT.groups, plan.blocks)
                }
                done = mgr.load(plan, dst)
                await mgr.step()
                await done
                for g, spec in enumerate(LAYOUT.groups):
                    for j, key in zip(plan.blocks[g], plan.keys[g]):
                        for t, page in zip(gpu[spec.name], spec.page_bytes):
                            assert torch.equal(t[dst[spec.name][j]], content(key, page)), (
                                "wrong bytes"
                            )
            # the request "computes" its blocks: each GPU page gets the content of its key
            n = len(hs)
            for g, spec in enumerate(LAYOUT.groups):
                for j, key in enumerate(LAYOUT.keys(g, hs, range(n))):
                    for t, page in zip(gpu[spec.name], spec.page_bytes):
                        t[j] = content(key, page)
            try:
                stored = mgr.store(hs, {g.name: list(range(n)) for g in LAYOUT.groups})
            except PoolExhaustedError:  # every block of a pool in use by this request's keys
                rejected += 1
                await mgr.step()
            else:
                await mgr.step()
                await stored
            mgr.sync()
            in_tier = {k for m in mgr.managers for k in m.snapshot().keys}
            held = set(mgr.index.held_keys())
            assert held == in_tier, "the index disagrees with the managers"
            orphans = held - needed(held, chains)
            assert not orphans, f"{len(orphans)} orphans hold CPU memory"
        assert mgr.num_orphans_dropped > 0  # evictions happened and left orphans to drop
        assert rejected < 10
