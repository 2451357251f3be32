"""KeyChains keeps, per CPU block, exactly what the tier's keys and parents say (issue 27).

A CPU tier is driven through random stores (chains, roots, children stored before their
parent, chains hanging below old keys), failed stores, invalidations and evictions; after every
operation the per-block records (parent block, child counts), the orphans (indexed children of
keys not in the tier, also by child: ``loose``), ``num_parents`` and the ``parent`` snapshot
must equal what the index and the parents recorded by the test give when recomputed from
scratch, and key cycles must still be refused.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.errors import InvalidKeyError, PoolExhaustedError
from kvmgr.scheduler.cpu_tier import CpuTier


def _tier(num_blocks: int = 64) -> CpuTier:
    return CpuTier(num_blocks, "lru", lambda keys: None)


#: the parent each key was stored with (the test's own record; stale for keys gone)
_Recorded = dict[bytes, "bytes | None"]


def _store(
    tier: CpuTier,
    keys: list[bytes],
    parents: list[bytes | None],
    *,
    as_list: bool,
    recorded: _Recorded | None = None,
    default: bool = False,
):
    tier.chains.check(keys, parents)
    ids = tier.make_room(len(keys), keys)
    if default:  # the default chain, given as ``None`` (``KeyChains.add``'s own path)
        assert parents == [None, *keys[:-1]]
    tier.add_pending(keys, ids.tolist() if as_list else ids, None if default else parents)
    tier.stores_landed(ids)
    if recorded is not None:
        recorded.update(zip(keys, parents))
    return ids


def _expected(tier: CpuTier, recorded: _Recorded):
    parent = {key: recorded[key] for key in tier.index}
    assert tier.chains.parent == parent
    counts = Counter(p for p in parent.values() if p is not None)
    kids = {tier.index[p]: c for p, c in counts.items() if p in tier.index}
    orphans = {
        p: sorted(tier.index[k] for k, q in parent.items() if q == p)
        for p in counts
        if p not in tier.index
    }
    up_block = {tier.index[k]: tier.index.get(p, -1) for k, p in parent.items() if p is not None}
    loose = {tier.index[k]: p for k, p in parent.items() if p is not None and p not in tier.index}
    return kids, orphans, up_block, loose, len(counts)


def _check(tier: CpuTier, recorded: _Recorded) -> None:
    chains = tier.chains
    kids, orphans, up_block, loose, num_parents = _expected(tier, recorded)
    got_kids = {b: int(c) for b, c in enumerate(chains._kids_np) if c}
    assert got_kids == kids
    assert {p: sorted(c) for p, c in chains.orphans.items()} == orphans
    assert chains.loose == loose
    for block in tier.index.values():
        assert chains._up_block[block] == up_block.get(block, -1)
    assert chains.num_parents == num_parents


def _keys(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(4, "little") for i in range(start, start + n)]


def test_a_child_stored_before_its_parent_is_adopted_and_orphaned_again():
    tier, recorded = _tier(), {}
    p, c = _keys(0, 2)
    _store(tier, [c], [p], as_list=True, recorded=recorded)
    assert tier.chains.orphans == {p: [tier.index[c]]}
    _store(tier, [p], [None], as_list=True, recorded=recorded)
    assert tier.chains.orphans == {}
    assert tier.chains._kids[tier.index[p]] == 1
    _check(tier, recorded)
    tier.drop([p])  # invalidated: its child stays, an orphan again
    assert tier.chains.orphans == {p: [tier.index[c]]}
    assert tier.chains.loose == {tier.index[c]: p}
    _check(tier, recorded)
    with pytest.raises(InvalidKeyError):
        tier.chains.check([p], [c])  # p extends c, which extends p


@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False))
def test_per_block_chains_match_the_recorded_parents(rng):
    tier, recorded = _tier(48), {}
    next_key = 0
    absent: list[bytes] = []  # parents named by stored children, not stored themselves
    for _ in range(40):
        keys = list(tier.index)
        op = rng.choice(("chain", "chain", "roots", "late", "parent", "fail", "drop", "evict",
                         "default"))  # fmt: skip
        if op in ("chain", "roots", "late", "parent", "default"):
            n = rng.randint(1, 12)
            new = _keys(next_key, n)
            next_key += n
            if op == "roots":
                parents: list[bytes | None] = [None] * n
            elif op == "late":  # children stored before their parents
                parents = [k + b"p" for k in new]
                absent += parents
            elif op == "parent":  # some of those parents arrive
                new = [k for k in dict.fromkeys(rng.sample(absent, min(n, len(absent))))
                       if k not in tier.index]  # fmt: skip
                parents = [None] * len(new)
            elif op == "default":  # one default chain, some of its keys parents stored late
                late = [k for k in dict.fromkeys(rng.sample(absent, min(2, len(absent))))
                        if k not in tier.index]  # fmt: skip
                new = [*late, *new] if rng.random() < 0.5 else [*new, *late]
                parents = [None, *new[:-1]]
            else:
                base = rng.choice(keys) if keys and rng.random() < 0.5 else None
                parents = [base, *new[:-1]]
            if new:
                with contextlib.suppress(PoolExhaustedError):  # no room: nothing changed
                    _store(tier, new, parents, as_list=rng.random() < 0.5, recorded=recorded,
                           default=op == "default")  # fmt: skip
        elif op == "fail" and keys:
            picked = list(dict.fromkeys(rng.choice(keys) for _ in range(rng.randint(1, 4))))
            ids = np.array([tier.index[k] for k in picked], dtype=np.int64)
            tier.num_pending += len(picked)  # as if they were still PENDING
            tier.state_np[ids] = 1
            tier.stores_failed(picked, ids)
        elif op == "drop" and keys:
            tier.drop(list(dict.fromkeys(rng.choice(keys) for _ in range(rng.randint(1, 10)))))
        elif op == "evict" and keys:
            with contextlib.suppress(PoolExhaustedError):
                tier.evict_for(tier.pool.num_free + rng.randint(1, len(keys)), ())
        _check(tier, recorded)


def test_a_cycle_through_indexed_ancestors_is_refused_with_its_length():
    tier, recorded = _tier(), {}
    p, c1, c2, c3 = _keys(0, 4)
    _store(tier, [c1], [p], as_list=True, recorded=recorded)  # c1 stored before its parent p
    _store(tier, [c2, c3], [c1, c2], as_list=False, recorded=recorded)
    _check(tier, recorded)
    with pytest.raises(InvalidKeyError, match="a key cycle of 4 keys"):
        tier.chains.check([p], [c3])  # p -> c3 -> c2 -> c1 -> p
    tier.chains.check([p], [None])  # a root is fine
    _store(tier, [p], [None], as_list=True, recorded=recorded)
    _check(tier, recorded)
