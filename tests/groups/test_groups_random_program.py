"""GroupedManager under a random program (issue 27, helper newuser11): stores of shared prefixes
with dropped (``None``) blocks, several per step, into small CPU pools (evictions, orphan drops),
and lookups + loads in between; every loaded block must hold the bytes stored under its key."""

from __future__ import annotations

import contextlib
import hashlib
import random

import pytest
import torch

from kvmgr.errors import KVMgrError
from kvmgr.groups import GroupedLayout, GroupedManager, GroupSpec

BS = 16
LAYOUT = GroupedLayout(
    [
        GroupSpec(name="full", kind="full", block_size=BS, page_bytes=(BS * 8,)),
        GroupSpec(
            name="swa", kind="sliding_window", block_size=BS, page_bytes=(BS * 8,), window=40
        ),
        GroupSpec(name="mamba", kind="recurrent", block_size=2 * BS, page_bytes=(256,)),
    ],
    hash_block_size=BS,
)


def _prefixes(rng: random.Random) -> list[list[bytes]]:
    """Six chains of 8 block hashes; about half branch off an earlier one."""
    seqs: list[list[bytes]] = []
    for s in range(6):
        share = seqs and rng.random() < 0.5
        hashes = list(seqs[rng.randrange(len(seqs))][: rng.randrange(1, 6)]) if share else []
        parent = hashes[-1] if hashes else bytes([s])
        for i in range(len(hashes), 8):
            parent = hashlib.blake2b(parent + bytes([i, s])).digest()
            hashes.append(parent)
        seqs.append(hashes)
    return seqs


async def _settle(mgr: GroupedManager, pending: list, busy: set) -> None:  # type: ignore[type-arg]
    await mgr.step()
    for future in pending:
        with contextlib.suppress(KVMgrError):  # a refused store (no room): its keys missing
            await future
    pending.clear()
    busy.clear()


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(8))
async def test_loads_return_what_was_stored(seed: int) -> None:
    rng = random.Random(seed)
    gpu = {g.name: [torch.zeros((64, p), dtype=torch.uint8) for p in g.page_bytes]
           for g in LAYOUT.groups}  # fmt: skip
    seqs = _prefixes(rng)
    truth: dict[tuple[str, bytes], list[torch.Tensor]] = {}  # one content per grouped key
    busy: set[tuple[str, int]] = set()  # GPU blocks of stores not yet flushed: not rewritten
    pending: list = []  # type: ignore[type-arg]
    cpu = {"full": rng.randint(4, 20), "swa": rng.randint(3, 12), "mamba": rng.randint(2, 6)}
    num_loads = 0
    async with GroupedManager.create(LAYOUT, gpu, cpu) as mgr:
        for _ in range(40):
            hashes = seqs[rng.randrange(len(seqs))][: rng.randint(1, 8)]
            if rng.random() < 0.5:
                if len(busy) > 40:
                    await _settle(mgr, pending, busy)
                tables = {}
                for g, spec in enumerate(LAYOUT.groups):
                    free = [i for i in range(32) if (spec.name, i) not in busy]
                    ids = rng.sample(free, LAYOUT.num_blocks(g, len(hashes)))
                    table = [i if rng.random() < 0.9 else None for i in ids]
                    for j, i in enumerate(table):
                        if i is None:
                            continue
                        key = LAYOUT.keys(g, hashes, [j])[0]
                        fresh = [torch.randint(0, 256, t.shape[1:], dtype=torch.uint8)
                                 for t in gpu[spec.name]]  # fmt: skip
                        for t, c in zip(gpu[spec.name], truth.setdefault((spec.name, key), fresh)):
                            t[i] = c
                        busy.add((spec.name, i))
                    tables[spec.name] = table
                try:
                    pending.append(mgr.store(hashes, tables))
                except KVMgrError:
                    continue
                if rng.random() < 0.5:
                    await _settle(mgr, pending, busy)
                continue
            plan = mgr.lookup(hashes)
            if not plan.is_hit:
                continue
            loaded = mgr.load(plan, {g.name: list(range(32, 48)) for g in LAYOUT.groups})
            await mgr.step()
            await loaded
            num_loads += 1
            for spec, blocks, keys in zip(LAYOUT.groups, plan.blocks, plan.keys, strict=True):
                for j, key in zip(blocks, keys, strict=True):
                    for t, want in zip(gpu[spec.name], truth[(spec.name, key)], strict=True):
                        assert torch.equal(t[32 + j], want), (spec.name, j)
    assert num_loads > 0
