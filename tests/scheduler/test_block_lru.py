"""The CPU tier's LRU kept by block decides exactly as the key-based ``LRUPolicy`` (issue 27).

Two ``CpuTier`` objects get the same random calls: one with ``by_block=False`` (the key-based
``LRUPolicy``, held to the plain rules by ``test_cpu_tier_decisions.py``), one with the default
``BlockLru``. Stores (chains, chains below old keys, roots, children stored before their
parents, long ones that compact the log), landings, failed stores, loads in flight, touches
(repeated keys too), invalidations, evictions of one key, of the leading run and of more keys
than qualify, with and without protected keys: after every call both must have raised alike,
handed out the same blocks, evicted the same keys in the same order, and hold the same recency
order, index and block states.
"""

# ruff: noqa: B023  (every lambda here is called at once, in the loop turn that made it)

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.errors import KVMgrError, UnknownKeyError
from kvmgr.policy import LRUPolicy
from kvmgr.pool.allocator import BlockAllocator
from kvmgr.scheduler.block_lru import BlockLru
from kvmgr.scheduler.chains import KeyChains
from kvmgr.scheduler.cpu_tier import CpuTier


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        got = call()
    except KVMgrError as exc:
        return type(exc)
    return got.tolist() if isinstance(got, np.ndarray) else got


class _GeneralChains(KeyChains):
    """Removals always through the general child-count pass (the old behaviour)."""

    __slots__ = ()

    def _remove_chain(self, at: np.ndarray, last: int) -> None:
        self._remove_links(at, self._up_np[at])


class _CountedChains(KeyChains):
    """Counts the removals that took the one-chain pass (``passes``, by the class)."""

    __slots__ = ()
    passes = 0

    def _remove_chain(self, at: np.ndarray, last: int) -> None:
        _CountedChains.passes += 1
        super()._remove_chain(at, last)


class _CheckedPool(BlockAllocator):
    """Every free checked, vouched or not (the old behaviour)."""

    __slots__ = ()

    def give(self, ids: np.ndarray, *, vouched: bool = False) -> None:
        super().give(ids)


class _Pair:
    """The key-based tier (``old``) and the by-block tier (``new``), called alike."""

    def __init__(self, num_blocks: int) -> None:
        self.removed: dict[str, list[list[bytes]]] = {"old": [], "new": []}
        self.old = CpuTier(num_blocks, "lru", self.removed["old"].append, by_block=False)
        self.new = CpuTier(num_blocks, "lru", self.removed["new"].append)
        assert isinstance(self.new.policy, BlockLru)
        assert isinstance(self.old.policy, LRUPolicy)
        # the old tier also takes the general paths the batched round skips (helper batched3):
        # the child counts of any removal (not the one-chain pass) and the checked free
        self.old.chains.__class__, self.old.pool.__class__ = _GeneralChains, _CheckedPool
        self.new.chains.__class__ = _CountedChains

    def both(self, call: Callable[[CpuTier], Any]) -> Any:
        want, got = _outcome(lambda: call(self.old)), _outcome(lambda: call(self.new))
        assert got == want
        return want

    def same(self) -> None:
        old, new = self.old, self.new
        assert self.removed["new"] == self.removed["old"]
        assert new.policy.ordered_keys() == old.policy.ordered_keys()
        assert len(new.policy) == len(old.policy)
        assert new.index == old.index and new.state == old.state
        assert all(k in new.policy for k in new.index)
        a, b = new.chains, old.chains
        assert a.num_parents == b.num_parents and a.orphans == b.orphans and a.loose == b.loose
        assert (a._up_np == b._up_np).all() and (a._kids_np == b._kids_np).all()
        top = old.pool._top
        assert new.pool._top == top and (new.pool._stack_np[:top] == old.pool._stack_np[:top]).all()


def _store(pair: _Pair, rng: random.Random, new: list[bytes], how: str) -> Any:
    old = pair.old
    ready = [k for k, b in old.index.items() if old.state[b] == 2]
    order = old.policy.ordered_keys()
    if how == "roots":
        parents: list[bytes | None] = [None] * len(new)
    elif how == "late":  # the parent is stored later (if ever)
        parents = [new[0] + b"p", *new[:-1]]
    else:  # a chain, often below one of the next victims
        base = rng.choice(order[:8]) if order and rng.random() < 0.5 else None
        parents = [base, *new[:-1]]
    protected = frozenset(rng.sample(ready, min(len(ready), rng.randint(0, 3))))
    as_list = rng.random() < 0.3

    def store(tier: CpuTier) -> Any:
        tier.chains.check(new, parents)
        ids = tier.make_room_small(len(new), protected) if as_list else tier.make_room(
            len(new), protected)  # fmt: skip
        tier.add_pending(new, ids, parents)
        return ids

    return pair.both(store)


@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([8, 16, 48]))
def test_by_block_evicts_the_same_keys_in_the_same_order(rng, num_blocks):
    _program(rng, num_blocks)


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([8, 48]), st.sampled_from([1, 3]))
def test_the_victim_search_by_chunks_of_any_width_evicts_the_same(rng, num_blocks, width):
    """``_leaf_entries`` reads the log by chunks of 1024 entries and more; here by chunks of
    one or three, so that the chunks' edges fall everywhere in these small logs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockLru, "_first_chunk", staticmethod(lambda n: width))
        _program(rng, num_blocks)


def _program(rng: random.Random, num_blocks: int) -> None:
    pair = _Pair(num_blocks)
    pending: list[tuple[list[bytes], list[int]]] = []
    loading: list[list[int]] = []
    next_key = 0
    for _ in range(60):
        old = pair.old
        ready = [k for k, b in old.index.items() if old.state[b] == 2]
        op = rng.choice(("store", "store", "store", "land", "land", "fail", "load", "unload",
                         "touch", "drop", "evict", "evict"))  # fmt: skip
        if op == "store":
            n = rng.randint(1, num_blocks if rng.random() < 0.2 else max(1, num_blocks // 3))
            new = [i.to_bytes(4, "little") for i in range(next_key, next_key + n)]
            next_key += n
            ids = _store(pair, rng, new, rng.choice(("chain", "chain", "roots", "late")))
            if isinstance(ids, list):
                pending.append((new, ids))
        elif op == "land" and pending:
            keys, ids = pending.pop(rng.randrange(len(pending)))
            pair.both(lambda t: t.stores_landed(np.array(ids, dtype=np.int64), all_pending=True))
        elif op == "fail" and pending:
            keys, ids = pending.pop(rng.randrange(len(pending)))
            pair.both(lambda t: t.stores_failed(keys, np.array(ids, dtype=np.int64)))
        elif op == "load" and ready:
            picked = rng.sample(ready, min(len(ready), rng.randint(1, 4)))
            ids = [old.index[k] for k in picked]
            pair.both(lambda t: (t.add_readers(np.array(ids)), t.policy.touch(picked)))
            loading.append(ids)
        elif op == "unload" and loading:
            ids = loading.pop(rng.randrange(len(loading)))
            pair.both(lambda t: t.remove_readers(np.array(ids, dtype=np.int64)))
        elif op == "touch" and old.index:
            keys = [rng.choice(list(old.index)) for _ in range(rng.randint(1, 12))]
            pair.both(lambda t: t.policy.touch([*keys, b"never stored"]))
        elif op == "drop" and ready:
            busy = {b for ids in loading for b in ids}
            idle = [k for k in ready if old.index[k] not in busy]
            if idle:
                gone = rng.sample(idle, min(len(idle), 3))
                pair.both(lambda t: t.drop(gone))
        elif op == "evict" and old.index:
            n = rng.choice((1, 2, rng.randint(2, len(old.index) + 1)))
            protected = frozenset(rng.sample(ready, min(len(ready), rng.randint(0, 2))))
            pair.both(lambda t: t.evict_for(t.pool.num_free + n, protected))
        pair.same()


def test_a_long_run_of_stores_compacts_the_log_and_keeps_the_order():
    pair, passes_before = _Pair(16), _CountedChains.passes
    for r in range(40):  # each round: 8 new keys, touches of old ones, a full tier
        new = [bytes([r, i]) for i in range(8)]
        ids = pair.both(lambda t: t.make_room(8, ()))
        pair.both(lambda t: (t.add_pending(new, np.array(ids), [None, *new[:-1]]),
                             t.stores_landed(np.array(ids), all_pending=True)))  # fmt: skip
        pair.both(lambda t: t.policy.touch(new[4:] + new[:2]))
        pair.same()
    assert pair.new.policy._tail <= 2 * 16 + 2 * 128  # compacted, never past the log
    assert (
        _CountedChains.passes - passes_before >= 30
    )  # each full round evicts one chain of 8 through the pass


def test_remove_of_an_untracked_key_changes_nothing():
    pair = _Pair(8)
    keys = [b"a", b"b"]
    ids = pair.both(lambda t: t.make_room(2, ()))
    pair.both(lambda t: t.add_pending(keys, np.array(ids), [None, b"a"]))
    before = pair.new.policy.ordered_keys()
    with pytest.raises(UnknownKeyError, match="not tracked"):
        pair.new.policy.remove([b"b", b"zz"])
    assert pair.new.policy.ordered_keys() == before and len(pair.new.policy) == 2
