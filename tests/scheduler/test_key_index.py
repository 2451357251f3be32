"""The one-pass store of keys all new (``kvmgr.scheduler.key_index``): ``add_absent`` takes back
exactly what it added, and ``Stores.prepare`` with the fast path leaves the tier exactly as the
general path does, on the calls that take it and on those it gives up on (a key indexed
already, a key repeated, no room without eviction, the policy refusing), and on random
programs of stores, landings and invalidations."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvmgr.scheduler.store as store_module
from kvmgr.config import ManagerConfig
from kvmgr.errors import BlockStateError, InvalidKeyError, PoolExhaustedError
from kvmgr.pool.allocator import BlockAllocator
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.cpu_tier import CpuTier
from kvmgr.scheduler.gpu_blocks import GpuBlocks
from kvmgr.scheduler.key_index import add_absent
from kvmgr.scheduler.store import Stores

BLOCKS = 48


def _key(i: int) -> bytes:
    return b"ki-%06d" % i


def test_add_absent_indexes_keys_all_new_in_order() -> None:
    index = {_key(0): 7, _key(1): 3}
    assert add_absent(index, [_key(5), _key(4)], [11, 12])
    assert list(index.items()) == [(_key(0), 7), (_key(1), 3), (_key(5), 11), (_key(4), 12)]


@pytest.mark.parametrize(
    "keys",
    [
        [_key(5), _key(1), _key(6)],  # one indexed already, in the middle
        [_key(5), _key(6), _key(5)],  # one repeated
        [_key(0)],  # the only one indexed
    ],
)
def test_add_absent_that_gives_up_leaves_the_index_as_it_was(keys: list[bytes]) -> None:
    index = {_key(0): 7, _key(1): 3, _key(2): 9}
    del index[_key(1)]  # a hole: popitem must not take an older entry
    index[_key(1)] = 4
    before = list(index.items())
    assert not add_absent(index, keys, [20, 21, 22][: len(keys)])
    assert list(index.items()) == before  # the same values, in the same order


def test_peek_is_what_take_returns_and_changes_nothing() -> None:
    pool, twin = BlockAllocator(16, num_ready=12), BlockAllocator(16, num_ready=12)

    def books(p: BlockAllocator) -> tuple[Any, ...]:
        return p.num_free, p._next_fresh, p._top, p._stack[: p._top].tolist(), bytes(p._bytes)

    # fresh only; reused after fresh; fresh then reused; reused only
    for n, give in ((5, None), (4, [1, 3, 0]), (6, [8, 2]), (3, [4, 5, 6, 7])):
        if give is not None:
            for p in (pool, twin):
                p.give(np.array(give, dtype=np.int64))
        before = books(pool)
        peeked = pool.peek(n)
        assert books(pool) == before
        taken = twin.take(n)  # the same history through take
        assert taken is not None and peeked.tolist() == taken.tolist()
        pool.commit(peeked)
        assert books(pool) == books(twin)


def _rig(policy: str) -> Stores:
    config = ManagerConfig(num_cpu_blocks=BLOCKS, policy=policy)
    cpu = CpuTier(BLOCKS, policy, lambda keys: None, counters=Counters())
    return Stores(cpu, GpuBlocks(64, owned=False), cpu.counters, config, block_bytes=64)


def _books(stores: Stores) -> tuple[Any, ...]:
    """Everything a store changes in the tier, in order where order matters."""
    cpu, pool, chains = stores.cpu, stores.cpu.pool, stores.cpu.chains
    lru = cpu._lru
    policy = (
        (lru._log[lru._head : lru._tail].tolist(), lru._stamp.tolist(), lru._len)
        if lru is not None
        else (len(cpu.policy), sorted(cpu.policy.keys()) if hasattr(cpu.policy, "keys") else 0)
    )
    return (
        list(cpu.index.items()),
        bytes(cpu.state),
        cpu.num_pending,
        (pool.num_free, pool._next_fresh, pool._top, pool._stack[: pool._top].tolist()),
        bytes(pool._bytes),
        (chains._up_block.tolist(), chains._kids.tolist(), chains.num_parents),
        (dict(chains.loose), {k: list(v) for k, v in chains.orphans.items()}),
        policy,
        [getattr(stores.counters, name) for name in Counters.TOTALS],
        stores.gpu.busy.tolist(),
    )


def _calls() -> list[list[bytes]]:
    """Batched stores of one chain each: all new; one indexed in the middle; one repeated;
    all new again; the first indexed (not tried); then with no room left (they evict): all
    new, one indexed in the middle, one repeated."""
    return [
        [_key(i) for i in range(16)],
        [_key(100), *[_key(i) for i in range(101, 106)], _key(3), _key(106), _key(107)],
        [_key(200), _key(201), *[_key(i) for i in range(202, 208)], _key(201), _key(208)],
        [_key(i) for i in range(300, 312)],
        [_key(0), *[_key(i) for i in range(400, 410)]],
        [_key(i) for i in range(500, 512)],
        [*[_key(i) for i in range(600, 610)], _key(505), _key(610)],
        [*[_key(i) for i in range(700, 710)], _key(703), _key(710)],
    ]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_prepare_with_the_fast_path_leaves_the_tier_as_the_general_path(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, general = _rig(policy), _rig(policy)
    tried: list[bool] = []
    add_new = store_module.add_new

    def counted(cpu: CpuTier, keys: list[bytes], parents: Any) -> Any:
        if cpu is general.cpu:
            return None  # the general path only
        ids = add_new(cpu, keys, parents)
        tried.append(ids is not None)
        return ids

    monkeypatch.setattr(store_module, "add_new", counted)
    for keys in _calls():
        got = []
        for stores in (fast, general):
            part = stores.prepare(np.arange(len(keys)), keys, None, None, batched=True)
            result = part.result
            got.append((result.stored.tolist(), result.present.tolist(),
                        result.cpu_block_ids.tolist(), np.asarray(part.cpu_ids).tolist()))  # fmt: skip
            stores.cpu.stores_landed(np.asarray(part.cpu_ids), all_pending=True)
        assert got[0] == got[1]
        assert _books(fast) == _books(general)
    # taken on the calls all new (the last one evicts); given up on the others but the prefix
    # one (not tried)
    assert tried == [True, False, False, True, True, False, False]
    assert fast.cpu.counters.evictions == general.cpu.counters.evictions > 0


@pytest.mark.parametrize("policy", ["arc", "s3fifo"])
def test_a_policy_that_refuses_the_fast_path_leaves_nothing_changed(policy: str) -> None:
    stores = _rig(policy)
    stores.prepare(np.arange(12), [_key(i) for i in range(12)], None, None, batched=True)
    keys = [_key(i) for i in range(20, 32)]
    stores.cpu.policy.insert([keys[5]], [None])  # tracked, not indexed (a desync)
    before = _books(stores)
    with pytest.raises(BlockStateError, match="already tracked"):
        stores.prepare(np.arange(12), keys, None, None, batched=True)
    assert _books(stores) == before


def test_bad_input_changes_nothing_before_the_fast_path() -> None:
    stores = _rig("lru")
    before = _books(stores)
    keys = [_key(i) for i in range(12)]
    with pytest.raises(InvalidKeyError):
        stores.prepare(np.arange(12), [*keys[:11], b""], None, None, batched=True)
    with pytest.raises(InvalidKeyError, match="distinct"):
        stores.prepare(np.arange(12), [*keys[:11], keys[0]], None, None, batched=False)
    with pytest.raises(InvalidKeyError, match="one key per gpu block"):
        stores.prepare(np.arange(11), keys, None, None, batched=True)
    assert _books(stores) == before


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_no_room_even_after_eviction_leaves_nothing_changed(policy: str) -> None:
    stores = _rig(policy)  # every block PENDING (no store landed): none is evictable
    for start in range(0, BLOCKS, 12):
        keys = [_key(i) for i in range(start, start + 12)]
        stores.prepare(np.arange(12), keys, None, None, batched=True)
    before = _books(stores)
    with pytest.raises(PoolExhaustedError):
        stores.prepare(np.arange(12), [_key(i) for i in range(900, 912)], None, None, batched=True)
    assert _books(stores) == before


def _step(stores: Stores, pending: list[Any], op: tuple[Any, ...]) -> object:
    """One operation of a random program; what it returned or raised (type and message)."""
    kind, arg = op
    cpu = stores.cpu
    try:
        if kind == "store":
            part = stores.prepare(np.arange(len(arg)), arg, None, None, batched=True)
            pending.append(np.asarray(part.cpu_ids))
            r = part.result
            return r.stored.tolist(), r.present.tolist(), r.cpu_block_ids.tolist()
        if kind == "land" and pending:
            cpu.stores_landed(pending.pop(arg % len(pending)), all_pending=True)
        elif kind == "drop":
            ready = [k for k in cpu.index if cpu.can_evict(k)][arg : arg + 3]
            cpu.drop(ready)
        return None
    except Exception as exc:  # the same refusal on both paths, nothing changed by it
        return type(exc).__name__, str(exc)


def _only_fast(monkeypatch: pytest.MonkeyPatch, general: Stores) -> list[bool]:
    """``add_new`` for every tier but ``general``'s (the general path only); whether each call
    took it, in order (``general``'s calls count as not taken)."""
    add_new, taken = store_module.add_new, []

    def only_fast(cpu: CpuTier, keys: list[bytes], parents: Any) -> Any:
        ids = None if cpu is general.cpu else add_new(cpu, keys, parents)
        taken.append(ids is not None)
        return ids

    monkeypatch.setattr(store_module, "add_new", only_fast)
    return taken


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(12))
def test_random_programs_leave_the_tier_as_the_general_path(
    policy: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(seed)
    fast, general = _rig(policy), _rig(policy)
    taken = _only_fast(monkeypatch, general)
    pendings: tuple[list[Any], list[Any]] = ([], [])
    for _ in range(60):
        roll = rng.random()
        if roll < 0.5:  # 9-16 keys from 200: some indexed already, some repeated
            op: tuple[Any, ...] = (
                "store",
                [_key(int(k)) for k in rng.integers(0, 200, rng.integers(9, 17))],
            )
        elif roll < 0.6:  # all new
            op = ("store", [_key(int(k)) for k in rng.permutation(10_000)[:12] + 1000])
        elif roll < 0.9:
            op = ("land", int(rng.integers(0, 100)))
        else:
            op = ("drop", int(rng.integers(0, 8)))
        got = [_step(s, p, op) for s, p in zip((fast, general), pendings)]
        assert got[0] == got[1], op
        assert _books(fast) == _books(general), op
    assert any(taken[::2]) and not all(taken[::2])  # the fast path ran, and gave up too


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_fresh_runs_and_reused_blocks_leave_the_tier_as_the_general_path(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room, the blocks a store takes are a run of fresh ids (written through slices),
    fresh ids then reused ones, or reused ones only (gathers and scatters): all three as the
    general path leaves them."""
    fast, general = _rig(policy), _rig(policy)
    taken = _only_fast(monkeypatch, general)
    pendings: tuple[list[Any], list[Any]] = ([], [])
    program: list[tuple[Any, ...]] = [
        ("store", [_key(i) for i in range(16)]),  # fresh 0-15
        ("land", 0),
        ("store", [_key(i) for i in range(16, 32)]),  # fresh 16-31
        ("land", 0),
        ("drop", 2), ("drop", 9), ("drop", 20),  # 9 blocks back on the stack
        ("store", [_key(i) for i in range(40, 52)]),  # fresh 32-43: a run
        ("store", [_key(i) for i in range(60, 72)]),  # 4 fresh, then 8 reused
        ("land", 0), ("land", 0),
        ("drop", 0), ("drop", 3), ("drop", 6), ("drop", 12),
        ("store", [_key(i) for i in range(80, 90)]),  # reused only
    ]  # fmt: skip
    for op in program:
        got = [_step(s, p, op) for s, p in zip((fast, general), pendings)]
        assert got[0] == got[1], op
        assert _books(fast) == _books(general), op
    assert taken[::2] == [True] * 5
    assert fast.cpu.pool._next_fresh == BLOCKS and fast.cpu.pool._top > 0


def test_int_list_stays_right_when_another_thread_grows_the_ints_meanwhile(monkeypatch) -> None:
    """``int_list`` grows the module's int objects; another thread may replace them between
    its length read and its concatenation. Here that other thread is played by ``np.arange``
    (which ``int_list`` calls in between): the values must still be ``ids`` themselves."""
    from kvmgr.scheduler import key_index

    monkeypatch.setattr(key_index, "_INTS", np.arange(4).astype(object))
    real_arange = np.arange

    def arange_while_another_thread_grows(*args: Any, **kwargs: Any) -> np.ndarray:
        key_index._INTS = real_arange(40).astype(object)  # the other thread's, already in
        return real_arange(*args, **kwargs)

    monkeypatch.setattr(key_index.np, "arange", arange_while_another_thread_grows)
    ids = real_arange(16, dtype=np.int64)[::-1].copy()
    got = key_index.int_list(ids, 64)
    monkeypatch.setattr(key_index.np, "arange", real_arange)
    assert got == ids.tolist()
    assert key_index.int_list(real_arange(64, dtype=np.int64), 64) == list(range(64))
