"""The batched round's shortcuts (issue 27, helper batched5) give what the long way gives.

1. ``SwapQueue.add`` looks up no conflict marks while the newest generation has no part that
   could conflict: random programs of stores and loads (list and array ids) fall into the same
   generations as a reference model of the conflict rules (docs/transfer.md, rule 5).
2. ``GpuBlocks.release`` skips the DRAINING scan while ``num_draining`` is 0: random programs of
   allocations, copies and frees leave the same states, busy counts and pool as a twin that
   always scans, and ``num_draining`` counts the DRAINING blocks.
3. ``Lane.keys`` / ``Lane.parents`` (built when asked, one store's own list) equal the
   concatenation of every keyed store's keys and parents.
4. ``GpuBlocks.checked_ids``' int64 shortcut and ``check_array``'s one bound pass (and its
   strictly increasing shortcut): the same ids (a copy) and the same typed errors as the
   general path.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np
import pytest

from kvmgr.errors import InvalidBlockError, PoolExhaustedError
from kvmgr.scheduler.gpu_blocks import GpuBlocks, GpuState
from kvmgr.scheduler.queue import Kind, Lane, Part, SwapQueue
from kvmgr.transfer.plan import Direction

GPU = 24


def _part(kind: Kind, gpu: Any, keys: list[bytes] | None = None, **kw: Any) -> Part:
    cpu = list(range(len(gpu))) if type(gpu) is list else np.arange(len(gpu), dtype=np.int64)
    return Part(kind, asyncio.get_running_loop().create_future(), None, gpu, cpu, keys, **kw)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(20))
async def test_parts_fall_into_the_generations_the_conflict_rules_give(seed: int) -> None:
    rng = np.random.default_rng(seed)
    queue = SwapQueue(GPU)
    read: set[int] = set()  # the model: blocks the newest generation reads and writes
    written: set[int] = set()
    generation = 0
    for _ in range(80):
        if rng.random() < 0.1:
            queue.take()
            read, written, generation = set(), set(), generation + 1
            continue
        store = rng.random() < 0.6
        ids = [int(b) for b in rng.choice(GPU, int(rng.integers(1, 12)), replace=False)]
        block = set(ids)
        if (written if store else written | read) & block:  # conflict: a new generation
            read, written, generation = set(), set(), generation + 1
        (read if store else written).update(block)
        gpu: Any = ids if rng.random() < 0.5 else np.array(ids, dtype=np.int64)
        queue.add(_part(Kind.STORE if store else Kind.LOAD, gpu, [b"k"] * len(ids)))
        assert queue.generations[-1].number == generation, (store, ids)


def _gpu_books(gpu: GpuBlocks) -> tuple[Any, ...]:
    pool = gpu.pool
    assert pool is not None
    return bytes(gpu.state), gpu.busy.tolist(), pool.num_free, bytes(pool._bytes)


@pytest.mark.parametrize("seed", range(20))
def test_release_without_the_draining_scan_frees_what_the_scan_frees(seed: int) -> None:
    rng = np.random.default_rng(seed)
    fast, scanning = GpuBlocks(GPU, owned=True), GpuBlocks(GPU, owned=True)
    scanning.num_draining = 10**9  # never 0: always scans
    held: list[np.ndarray] = []
    copies: list[np.ndarray] = []
    for _ in range(120):
        roll = rng.random()
        if roll < 0.25:
            n = int(rng.integers(1, 5))
            got = [g.allocate(n) for g in (fast, scanning)]
            if got[0] is not None:
                assert got[1] is not None and got[0].tolist() == got[1].tolist()
                held.append(got[0])
        elif roll < 0.55 and held:  # a copy of some held blocks
            blocks = held[int(rng.integers(len(held)))]
            ids = rng.choice(blocks, int(rng.integers(1, len(blocks) + 1)), replace=False)
            for g in (fast, scanning):
                g.acquire(ids)
            copies.append(ids)
        elif roll < 0.8 and copies:  # one or two copies end together (a lane: ids may repeat)
            k = min(int(rng.integers(1, 3)), len(copies))
            ids = np.concatenate([copies.pop(int(rng.integers(len(copies)))) for _ in range(k)])
            for g in (fast, scanning):
                g.release(ids)
        elif held:  # the request frees its blocks: DRAINING while a copy uses them
            ids = held.pop(int(rng.integers(len(held))))
            for g in (fast, scanning):
                g.give_back(ids)
        assert _gpu_books(fast) == _gpu_books(scanning)
        assert fast.num_draining == bytes(fast.state).count(GpuState.DRAINING)
    for ids in copies:  # every copy ends: no block stays DRAINING
        fast.release(ids)
    assert fast.num_draining == 0 and GpuState.DRAINING not in bytes(fast.state)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(10))
async def test_lane_keys_and_parents_are_every_store_s_in_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lane, keys, parents, next_key = Lane(Direction.D2H), [], [], 0
    for _ in range(int(rng.integers(1, 6))):
        roll = rng.random()
        if roll < 0.2:  # a preempt: no keys
            lane.add(_part(Kind.PREEMPT, [1, 2], None, req_id="r"))
            continue
        n = int(rng.integers(1, 5))
        new = [b"k%d" % i for i in range(next_key, next_key + n)]
        next_key += n
        chain = [None, *new[:-1]]
        given = None if roll < 0.6 else [b"p%d" % i for i in range(n)]
        lane.add(_part(Kind.STORE, list(range(n)), new, parents=given))
        keys += new
        parents += chain if given is None else given
        assert lane.keys == keys and list(lane.parents) == parents
    assert Lane(Direction.H2D).keys == [] and Lane(Direction.D2H).parents == ()


def _checked(gpu: GpuBlocks, ids: Any) -> object:
    try:
        return gpu.checked_ids(ids, "store").tolist()
    except InvalidBlockError as exc:
        return str(exc)


@pytest.mark.parametrize("owned", [True, False])
def test_int64_ids_are_checked_like_any_other_ids(owned: bool) -> None:
    gpu = GpuBlocks(GPU, owned=owned)
    if owned:
        gpu.allocate(12)  # 0..11 held
    cases = [[3, 1, 2], [0, 11], [5, -1], [-7, 4], [GPU, 1], [1, GPU - 1], [2, 2], [4, 13, 4]]
    for case in cases:
        big_endian = np.array(case, dtype=">i8")  # not native int64: the general path
        assert _checked(gpu, np.array(case, dtype=np.int64)) == _checked(gpu, big_endian), case
    strided = np.arange(12, dtype=np.int64)[::3]
    assert _checked(gpu, strided) == [0, 3, 6, 9]
    mine = np.array([1, 2, 3], dtype=np.int64)
    got = gpu.checked_ids(mine, "store")
    mine[0] = 9  # the caller reuses its array: the checked ids are a copy
    assert got.tolist() == [1, 2, 3]
    with pytest.raises(InvalidBlockError, match=f"gpu block id {GPU} out of range"):
        gpu.checked_ids(np.array([0, GPU], dtype=np.int64), "store")
    with pytest.raises(InvalidBlockError, match="gpu block id -3 out of range"):
        gpu.checked_ids(np.array([-3, GPU + 5], dtype=np.int64), "store")


def _reference_check(gpu: GpuBlocks, ids: np.ndarray, what: str) -> None:
    """``check_array`` before its one-pass tests: range, then held, then repeats."""
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= gpu.num_blocks:
        raise InvalidBlockError(f"gpu block id {lo if lo < 0 else hi} out of range [0, {GPU})")
    if gpu.pool is not None:
        held = gpu.state_np[ids] == GpuState.HELD
        if not held.all():
            raise gpu._not_held(int(ids[np.flatnonzero(~held)[0]]), what)
    if len(ids) > 1 and len(set(ids.tolist())) != len(ids):
        raise InvalidBlockError(f"duplicate gpu block ids in {ids.tolist()[:16]}")


@pytest.mark.parametrize("owned", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_check_array_raises_what_the_checks_one_by_one_raise(owned: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    gpu = GpuBlocks(GPU, owned=owned)
    if owned:
        gpu.allocate(GPU // 2)
    for _ in range(300):
        n = int(rng.integers(1, 2 * GPU))
        ids = rng.integers(-2 if rng.random() < 0.1 else 0, GPU + (rng.random() < 0.1), n)
        if rng.random() < 0.5:  # mostly distinct
            ids = rng.permutation(GPU)[: min(n, GPU)]
        ids = ids.astype(np.int64)
        if rng.random() < 0.4:  # sorted: strictly increasing (the shortcut) or with repeats
            ids = np.unique(ids) if rng.random() < 0.7 else np.sort(ids)
        got = []
        for check in (gpu.check_array, lambda i, w: _reference_check(gpu, i, w)):
            try:
                check(ids, "store")
                got.append(None)
            except InvalidBlockError as exc:
                got.append(str(exc))
        assert got[0] == got[1], ids.tolist()


def _tier_books(tier: Any) -> tuple[Any, ...]:
    chains, lru, pool = tier.chains, tier._lru, tier.pool
    return (
        list(tier.index.items()),
        bytes(tier.state),
        (chains._up_block.tolist(), chains._kids.tolist(), chains.num_parents),
        (dict(chains.loose), {k: sorted(v) for k, v in chains.orphans.items()}),
        (lru.ordered_keys(), len(lru)),
        (pool.num_free, pool._top, pool._stack[: pool._top].tolist(), bytes(pool._bytes)),
    )


@pytest.mark.parametrize("seed", range(16))
def test_evicting_a_chain_run_leaves_the_chains_as_the_general_removal(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvmgr.scheduler.block_lru import BlockLru
    from kvmgr.scheduler.cpu_tier import CpuTier

    rng = np.random.default_rng(seed)
    fast, general = (CpuTier(64, "lru", lambda keys: None) for _ in range(2))
    leading_run, hinted = BlockLru._leading_run, []

    def only_fast(lru: Any, n: int, guarded: set[int]) -> tuple[Any, bool]:
        run, chain = leading_run(lru, n, guarded)
        if lru is general._lru:
            return run, False  # the general removal
        hinted.append(chain)
        return run, chain

    monkeypatch.setattr(BlockLru, "_leading_run", only_fast)
    for tier in (fast, general):  # first a whole chain evicted: the short way at least once
        ids = tier.make_room(16, ())
        tier.add_pending([b"r%d" % i for i in range(16)], ids, None)
        tier.stores_landed(ids, all_pending=True)
        tier.evict_for(tier.pool.num_free + 16, ())
    assert _tier_books(fast) == _tier_books(general) and hinted == [True]
    next_key = 0
    for _ in range(60):
        roll = rng.random()
        if roll < 0.5:  # one chain of new keys, hanging below a stored key or a root
            n = int(rng.integers(9, 20))
            keys = [b"c%d" % i for i in range(next_key, next_key + n)]
            next_key += n
            stored = list(fast.index)
            base = stored[int(rng.integers(len(stored)))] if stored and rng.random() < 0.5 else None
            parents = [base, *keys[:-1]]
            for tier in (fast, general):
                try:
                    ids = tier.make_room(n, ())
                except PoolExhaustedError:  # no room: the same on both (compared below)
                    continue
                tier.add_pending(keys, ids, None if base is None else parents)
                tier.stores_landed(ids, all_pending=True)
        elif roll < 0.85:  # room for a later store: evicts leaves first
            n = int(rng.integers(2, 24))
            for tier in (fast, general):
                with contextlib.suppress(PoolExhaustedError):
                    tier.evict_for(tier.pool.num_free + n, ())
        else:  # invalidate a few keys (their children stay: orphans)
            stored = [k for k in fast.index if fast.can_evict(k)]
            picked = list(dict.fromkeys(stored[int(i)] for i in rng.integers(0, 1 + len(stored), 3)
                                        if int(i) < len(stored)))  # fmt: skip
            if picked:
                for tier in (fast, general):
                    tier.drop(picked)
        assert _tier_books(fast) == _tier_books(general)
    assert any(hinted)  # the chain run was removed the short way


@pytest.mark.parametrize("seed", range(8))
def test_a_vouched_give_stacks_the_ids_as_a_checked_one(seed: int) -> None:
    from kvmgr.pool.allocator import BlockAllocator

    rng = np.random.default_rng(seed)
    vouched, checked = BlockAllocator(64), BlockAllocator(64)
    for _ in range(40):
        n = int(rng.integers(1, 12))
        got = [p.take(n) for p in (vouched, checked)]
        if got[0] is None:
            continue
        assert got[1] is not None and got[0].tolist() == got[1].tolist()
        order = rng.random()  # strictly descending (evicted leaf first), ascending, any
        ids = np.sort(got[0])[::-1] if order < 0.4 else np.sort(got[0]) if order < 0.6 else got[0]
        ids = rng.permutation(ids) if order >= 0.8 else ids
        vouched.give(np.ascontiguousarray(ids), vouched=True)
        checked.give(np.ascontiguousarray(ids))
        assert vouched._stack[: vouched._top].tolist() == checked._stack[: checked._top].tolist()
        assert (
            bytes(vouched._bytes) == bytes(checked._bytes) and vouched.num_free == checked.num_free
        )
