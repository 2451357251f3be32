"""The CPU tier's fast batch paths decide exactly what the plain policy rules decide (issue 27).

A ``CpuTier`` with the key-based LRU (``by_block=False``; the default ``BlockLru`` is held to
this one by ``test_block_lru.py``) runs its policy through the fast paths: ``insert_new`` (no re-check of keys
the tier vouches for, ``childless`` from the chains' orphans), the leading-run array eviction
(``can_evict.every``) and ``first_leaf``. A twin ``LRUPolicy`` beside it gets the same calls
through the checked ``insert`` (which raises if the tier vouched for a wrong batch) and evicts
with a per-key test only (no batch form: ``VictimSet`` offers, which
``tests/policy/test_policy_fast_evict.py`` holds to the one-offer-at-a-time rule). Random
stores (chains, chains below old keys, roots, children before their parents), landings, failed
stores, loads in flight, touches, invalidations and evictions drive both; the victims, the
recency order and the child counts must agree after every operation.
"""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.errors import InvalidKeyError, PoolExhaustedError
from kvmgr.policy import LRUPolicy
from kvmgr.scheduler.cpu_tier import CpuTier


class _Twin:
    """The tier's policy: the fast LRU, checked against the reference twin on every call."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.fast, self.ref = LRUPolicy(capacity), LRUPolicy(capacity)
        self.fast_inserts = 0

    def insert_new(self, keys, parents, *, childless=True):
        assert not childless or self.ref._tree.num_children.keys().isdisjoint(keys)
        self.ref.insert(keys, parents)  # checked: raises on a batch the tier vouched wrongly
        self.fast.insert_new(keys, parents, childless=childless)
        self.fast_inserts += 1

    def insert(self, keys, parents):
        self.ref.insert(keys, parents)
        self.fast.insert(keys, parents)

    def touch(self, keys):
        self.ref.touch(keys)
        self.fast.touch(keys)

    def remove(self, keys):
        self.ref.remove(keys)
        self.fast.remove(keys)

    def evict(self, n, can_evict, protected=()):
        def one_key(key):  # the per-key test only: the reference never takes a batch path
            return can_evict(key)

        want = self.ref.evict(n, one_key, protected)
        got = self.fast.evict(n, can_evict, protected)
        assert got == want
        return got

    def __len__(self):
        return len(self.fast)

    def __contains__(self, key):
        return key in self.fast


def _same(twin: _Twin) -> None:
    assert list(twin.fast._order.items()) == list(twin.ref._order.items())
    assert twin.fast._tree.num_children == twin.ref._tree.num_children


def _keys(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(4, "little") for i in range(start, start + n)]


@settings(max_examples=120, deadline=None)
@given(st.randoms(use_true_random=False), st.sampled_from([16, 48]))
def test_fast_paths_decide_like_the_plain_rules(rng, num_blocks):
    removed: list[list[bytes]] = []
    tier = CpuTier(num_blocks, "lru", removed.append, by_block=False)  # the key-based LRU
    twin = tier.policy = _Twin(num_blocks)  # type: ignore[assignment]
    pending: list[tuple[list[bytes], np.ndarray]] = []
    loading: list[np.ndarray] = []
    absent: list[bytes] = []  # parents named by stored children, not stored themselves
    next_key = 0
    for _ in range(50):
        ready = [k for k, b in tier.index.items() if tier.state[b] == 2]
        op = rng.choice(("chain", "chain", "roots", "late", "parent", "land", "fail", "load",
                         "unload", "touch", "drop", "evict", "evict1", "evictrun"))  # fmt: skip
        if op in ("chain", "roots", "late", "parent"):
            n = rng.randint(1, 2 * num_blocks // 3)
            new = _keys(next_key, n)
            next_key += n
            if op == "roots":
                parents: list[bytes | None] = [None] * n
            elif op == "late":
                parents = [new[0] + b"p", *new[:-1]]
                absent.append(parents[0])
            elif op == "parent":
                new = list(dict.fromkeys(k for k in rng.sample(absent, min(n, len(absent)))
                                         if k not in tier.index))  # fmt: skip
                parents = [None] * len(new)
            else:
                old = list(twin.fast._order)[:8]  # often below the next victims: a branch
                base = rng.choice(old) if old and rng.random() < 0.5 else None
                parents = [base, *new[:-1]]
            if not new:
                continue
            try:
                tier.chains.check(new, parents)
                protected = frozenset(rng.sample(ready, min(len(ready), rng.randint(0, 3))))
                ids = tier.make_room(len(new), protected)
            except (InvalidKeyError, PoolExhaustedError):
                continue
            tier.add_pending(new, ids.tolist() if rng.random() < 0.3 else ids, parents)
            pending.append((new, ids))
        elif op == "land" and pending:
            keys, ids = pending.pop(rng.randrange(len(pending)))
            tier.stores_landed(ids, all_pending=True)
        elif op == "fail" and pending:
            keys, ids = pending.pop(rng.randrange(len(pending)))
            tier.stores_failed(keys, ids)
        elif op == "load" and ready:
            picked = rng.sample(ready, min(len(ready), rng.randint(1, 4)))
            ids = np.array([tier.index[k] for k in picked], dtype=np.int64)
            tier.add_readers(ids)
            tier.policy.touch(picked)
            loading.append(ids)
        elif op == "unload" and loading:
            tier.remove_readers(loading.pop(rng.randrange(len(loading))))
        elif op == "touch" and tier.index:
            tier.policy.touch([rng.choice(list(tier.index)) for _ in range(rng.randint(1, 6))])
        elif op == "drop" and ready:
            busy = {int(b) for ids in loading for b in ids}
            idle = [k for k in ready if tier.index[k] not in busy]
            if idle:
                tier.drop(rng.sample(idle, min(len(idle), rng.randint(1, 4))))
        elif op.startswith("evict") and tier.index:
            n = 1 if op == "evict1" else rng.randint(2, len(tier.index) + 1)
            if op == "evictrun":  # exactly the leading chain of the order (the array path)
                items = list(twin.fast._order.items())
                n = next((i + 1 for i in range(len(items) - 1) if items[i][1] != items[i + 1][0]),
                         len(items))  # fmt: skip
            with contextlib.suppress(PoolExhaustedError):
                tier.evict_for(tier.pool.num_free + n, ())
        _same(twin)
    assert twin.fast_inserts  # the tier took the unchecked insert
