"""LRU's and ARC's fast eviction paths choose exactly what the one-offer-at-a-time rule chooses.

The policies evict through `VictimSet.offer_all` runs (ARC: one run per list choice) and, for one
victim, through `first_leaf`. The reference below is the rule written out plainly: candidates
offered one at a time through `VictimSet.offer` in the policy's order, ARC's list choice made
again after every offer. Random prefix forests (chains, branches, roots), random touches,
removals, non-evictable keys and protected keys drive a policy and its twin whose ``evict`` is
the reference; victims, the lists, ghosts, ARC's target and the child counts must agree after
every operation.
"""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.policy import ARCPolicy, LRUPolicy
from kvmgr.policy._arc_lists import trim_ghosts
from kvmgr.policy.tree import VictimSet


def _lru_reference(policy: LRUPolicy, n, can_evict, protected):
    if n == 0:
        return []
    victims = VictimSet(policy._tree, policy._order, n, can_evict, protected)
    for key in list(policy._order):
        victims.offer(key)
        if victims.is_full:
            break
    if not victims.is_full:
        victims.rollback()
        return None
    deque(map(policy._order.__delitem__, victims.keys), 0)
    return victims.keys


def _arc_reference(policy: ARCPolicy, n, can_evict, protected):
    if n == 0:
        return []
    victims = VictimSet(policy._tree, policy._parent_of, n, can_evict, protected)
    t1, t2 = policy._t1, policy._t2
    scans = {True: iter(list(t1)), False: iter(list(t2))}
    exhausted = {True: False, False: False}
    virtual = len(t1)
    while not victims.is_full:
        prefer = virtual > policy._target
        from_t1 = prefer if not exhausted[prefer] else not prefer
        if exhausted[from_t1]:
            victims.rollback()
            return None
        for key in scans[from_t1]:
            before = len(victims.keys)
            if not victims.offer(key):
                continue
            virtual -= sum(map(t1.__contains__, victims.keys[before:]))
            now = virtual > policy._target
            if victims.is_full or (now != prefer and not exhausted[now]):
                break
        else:
            exhausted[from_t1] = True
    for key in victims.keys:
        del policy._parent_of[key]
        if key in t1:
            del t1[key]
            policy._b1[key] = None
        else:
            del t2[key]
            policy._b2[key] = None
    trim_ghosts(len(t1), len(t2), policy._b1, policy._b2, policy.capacity)
    return victims.keys


def _state(policy):
    if isinstance(policy, LRUPolicy):
        lists = (list(policy._order.items()),)
    else:
        lists = (policy.t1, policy.t2, policy.b1, policy.b2, policy.target)
    return lists, dict(policy._tree.num_children)


_OPS = ("chain", "branch", "ghost", "touch", "remove", "evict", "evict1")


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["lru", "arc"]),
    st.integers(4, 24),
    st.randoms(use_true_random=False),
    st.booleans(),
)
def test_fast_evict_matches_one_offer_at_a_time(name, capacity, rng, batch_test):
    cls, reference = (LRUPolicy, _lru_reference) if name == "lru" else (ARCPolicy, _arc_reference)
    fast, slow = cls(capacity), cls(capacity)
    next_key = 0
    blocked: set[bytes] = set()

    def can_evict(key):
        return key not in blocked

    if batch_test:  # the manager's batch form: LRU's leading-run array path may take it
        can_evict.every = lambda keys: blocked.isdisjoint(keys)  # type: ignore[attr-defined]

    for _ in range(60):
        op, size = rng.choice(_OPS), rng.randint(1, 12)
        keys = list(fast._parent_of) if name == "arc" else list(fast._order)
        if op in ("chain", "branch"):
            new = [i.to_bytes(4, "little") for i in range(next_key, next_key + size)]
            next_key += size
            if op == "chain" or not keys:
                base = rng.choice(keys) if keys and rng.random() < 0.3 else None
                parents = [base, *new[:-1]]
            else:  # each new key extends a random tracked or earlier new key
                pool = keys + new
                parents = [rng.choice(pool[: len(keys) + i]) for i in range(size)]
            if rng.random() < 0.2:
                blocked.add(rng.choice(new))
            fast.insert(new, parents)
            slow.insert(new, parents)
        elif op == "ghost" and name == "arc":  # stores of evicted keys adapt ARC's target
            ghosts = fast.b1 + fast.b2
            if ghosts:
                again = list(dict.fromkeys(rng.choice(ghosts) for _ in range(size)))
                fast.insert(again, [None] * len(again))
                slow.insert(again, [None] * len(again))
        elif op == "touch" and keys:
            picked = [rng.choice(keys) for _ in range(size)]
            fast.touch(picked)
            slow.touch(picked)
        elif op == "remove" and keys:
            picked = list(dict.fromkeys(rng.choice(keys) for _ in range(size)))
            fast.remove(picked)
            slow.remove(picked)
        elif op.startswith("evict"):
            n = 1 if op == "evict1" else rng.randint(0, len(keys) + 1)  # up to more than tracked
            protected = frozenset(rng.sample(keys, min(len(keys), rng.randint(0, 2))))
            got = fast.evict(n, can_evict, protected)
            want = reference(slow, n, can_evict, protected)
            assert got == want
        assert _state(fast) == _state(slow)


def test_arc_leaf_runs_take_what_one_offer_at_a_time_takes(monkeypatch):
    """A full tier of chains (leaf first in T1) and roots: ``leaf_run`` answers, and its
    victims, lists, ghosts and child counts are the reference's; a blocked key or a protected
    one sends ARC back to one offer at a time, with the same result."""
    from kvmgr.policy import _arc_lists, arc

    runs = []

    def counted(*args):
        runs.append(_arc_lists.leaf_run(*args))
        return runs[-1]

    monkeypatch.setattr(arc, "leaf_run", counted)
    fast, slow = ARCPolicy(64), ARCPolicy(64)
    keys = [i.to_bytes(4, "little") for i in range(64)]
    for policy in (fast, slow):
        for c in range(6):  # six chains of eight, then sixteen roots
            chain = keys[c * 8 : c * 8 + 8]
            policy.insert(chain, [None, *chain[:-1]])
        policy.insert(keys[48:], [None] * 16)
    blocked = {keys[21]}

    def can_evict(key):
        return key not in blocked

    for n, protected in ((8, ()), (3, ()), (8, {keys[12]}), (5, ()), (8, ()), (16, ())):
        assert fast.evict(n, can_evict, protected) == _arc_reference(slow, n, can_evict, protected)
        assert _state(fast) == _state(slow)
    assert any(r is not None for r in runs) and any(r is None for r in runs)
