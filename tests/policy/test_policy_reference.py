"""Differential tests: kvmgr's LRU, ARC and S3-FIFO against libCacheSim's on the same keys.

libCacheSim (the simulator of the S3-FIFO paper) replays a sequence of object ids; kvmgr's
policies replay the same ids as block keys the way the manager drives them: a hit touches the
key, a miss evicts to make room first, then inserts the key as a root (no parent, so no
prefix effects). Hit counts must then match exactly for LRU and S3-FIFO. ARC differs by a
handful of hits per 20,000 requests, for two reasons that are not prefix rules: the manager
evicts before it stores, so ARC adapts its target at the store (after the victim was chosen)
instead of before REPLACE, and the paper's ``|T1| == p`` tie-break on a B2 hit is dropped
because ``evict`` does not see the incoming key. The last test shows where the prefix rules
make kvmgr and a flat cache differ on purpose.
"""

from __future__ import annotations

import random

import pytest

from kvmgr.policy import make_policy

lcs = pytest.importorskip("libcachesim")

ANY = lambda key: True  # noqa: E731


def _reference_hits(cls: type, capacity: int, ids: list[int]) -> int:
    cache, request, hits = cls(capacity), lcs.Request(), 0
    request.obj_size = 1
    for obj in ids:
        request.obj_id = obj
        hits += bool(cache.get(request))
    return hits


def _kvmgr_hits(name: str, capacity: int, ids: list[int]) -> int:
    policy, hits = make_policy(name, capacity), 0
    for obj in ids:
        key = obj.to_bytes(8, "little")
        if key in policy:
            hits += 1
            policy.touch([key])
            continue
        if len(policy) >= capacity:
            assert policy.evict(len(policy) - capacity + 1, ANY) is not None
        policy.insert([key], [None])
    return hits


def _sequences() -> list[tuple[int, list[int]]]:
    """Skewed (Pareto) id sequences over a few universe sizes, with capacities >= 10 (libCacheSim
    sizes its small FIFO as int(0.1 * capacity), which is 0 below 10)."""
    rng = random.Random(1)
    out = []
    for capacity, universe in ((20, 200), (50, 200), (50, 3000), (100, 1000), (300, 3000)):
        out.append((capacity, [int(rng.paretovariate(0.7)) % universe for _ in range(20_000)]))
    return out


@pytest.mark.parametrize(("name", "cls"), [("lru", "LRU"), ("s3fifo", "S3FIFO")])
def test_same_hits_as_libcachesim(name: str, cls: str) -> None:
    for capacity, ids in _sequences():
        reference = _reference_hits(getattr(lcs, cls), capacity, ids)
        assert 0 < reference < len(ids)
        assert _kvmgr_hits(name, capacity, ids) == reference, (name, capacity)


def test_arc_within_a_few_hits_of_libcachesim() -> None:
    for capacity, ids in _sequences():
        reference = _reference_hits(lcs.ARC, capacity, ids)
        ours = _kvmgr_hits("arc", capacity, ids)
        # the two departures in the module docstring: at most 0.1% of the requests
        assert abs(ours - reference) <= len(ids) // 1000, (capacity, ours, reference)
        # and ARC is not LRU: both beat LRU on these skewed sequences
        assert ours > _reference_hits(lcs.LRU, capacity, ids)


def test_prefix_rules_are_where_kvmgr_departs_on_purpose() -> None:
    # Prompts of chained blocks, each stored in one call, then looked up as a leading run.
    # After [1, 2, 3] and [1, 4, 5] a flat LRU (libCacheSim) evicts block 2, the middle of
    # the first chain, and keeps 3, which no lookup can reach any more; kvmgr evicts the tip
    # 3, so the third prompt [1, 2, 6] still hits 1 and 2.
    capacity, flat, ours = 4, lcs.LRU(4), make_policy("lru", 4)
    request = lcs.Request()
    request.obj_size = 1
    flat_hits = our_hits = 0
    prompts = [[1, 2, 3], [1, 4, 5], [1, 2, 6]]
    for prompt in prompts:
        # flat: a lookup is a get of each block in order; count the leading run of hits
        run = True
        for obj in prompt:
            request.obj_id = obj
            hit = bool(flat.get(request))
            run = run and hit
            flat_hits += run
        keys = [obj.to_bytes(8, "little") for obj in prompt]
        hits = 0
        while hits < len(keys) and keys[hits] in ours:
            hits += 1
        our_hits += hits
        ours.touch(keys[:hits])
        new, parents = keys[hits:], [keys[hits - 1] if hits else None, *keys[hits:-1]]
        if new:
            shortfall = len(ours) + len(new) - capacity
            if shortfall > 0:
                assert ours.evict(shortfall, ANY, protected=frozenset(keys[:hits])) is not None
            ours.insert(new, parents[: len(new)])
    assert (flat_hits, our_hits) == (2, 3)
