"""LRU's leading-run array path (`kvmgr.policy.runs`) evicts exactly what one offer at a time does.

A twin policy is driven with a ``can_evict`` that has no batch form (``every``), so it always
collects victims through `VictimSet`; both must return the same victims and end in the same
state after every operation, over prefix forests of chains (some hanging below older keys),
touches, blocked and protected keys.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.policy import LRUPolicy
from kvmgr.policy.runs import leading_run


def _predicates(blocked: set[bytes]):
    def plain(key):
        return key not in blocked

    def batched(key):
        return key not in blocked

    batched.every = lambda keys: blocked.isdisjoint(keys)  # type: ignore[attr-defined]
    return plain, batched


def _chain(start: int, size: int) -> list[bytes]:
    return [i.to_bytes(4, "little") for i in range(start, start + size)]


def _two_chains() -> tuple[LRUPolicy, list[bytes], list[bytes]]:
    policy = LRUPolicy(64)
    a, b = _chain(0, 4), _chain(4, 3)
    policy.insert(a, [None, *a[:-1]])  # order a3 a2 a1 a0: leaves first
    policy.insert(b, [a[1], *b[:-1]])  # then b2 b1 b0; b hangs below a[1]
    return policy, a, b


def test_a_leading_run_is_taken_with_its_counts_released():
    policy, a, b = _two_chains()
    _, batched = _predicates(set())
    assert leading_run(policy._order, 2, policy._tree, batched, ()) == [a[3], a[2]]
    assert policy._tree.num_children == {a[0]: 1, a[1]: 1, b[0]: 1, b[1]: 1}


@pytest.mark.parametrize(
    ("n", "blocked", "protect"),
    [(5, set(), False), (2, {b"\x02\x00\x00\x00"}, False), (2, set(), True)],
    ids=["a-parent-waits-on-a-child-outside", "a-key-not-evictable", "a-key-protected"],
)
def test_no_run_changes_nothing(n, blocked, protect):
    policy, a, _ = _two_chains()
    before = dict(policy._tree.num_children)
    _, batched = _predicates(blocked)
    protected = frozenset([a[3]]) if protect else ()
    assert leading_run(policy._order, n, policy._tree, batched, protected) is None
    assert policy._tree.num_children == before


def test_roots_with_a_child_outside_are_no_run():
    policy = LRUPolicy(64)
    r1, r2, c = _chain(0, 3)
    policy.insert([r2], [None])
    policy.insert([r1], [None])
    policy.insert([c], [r1])  # order r2 r1 c: r1 waits for c
    _, batched = _predicates(set())
    assert leading_run(policy._order, 2, policy._tree, batched, ()) is None
    assert policy._tree.num_children == {r1: 1}


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False))
def test_leading_run_matches_one_offer_at_a_time(rng):
    fast, slow = LRUPolicy(64), LRUPolicy(64)
    blocked: set[bytes] = set()
    plain, batched = _predicates(blocked)
    next_key = 0
    for _ in range(40):
        keys = list(fast._order)
        op = rng.choice(("chain", "chain", "touch", "evict", "evict", "block"))
        if op == "chain":
            size = rng.randint(1, 8)
            new = _chain(next_key, size)
            next_key += size
            base = rng.choice(keys) if keys and rng.random() < 0.4 else None
            fast.insert(new, [base, *new[:-1]])
            slow.insert(new, [base, *new[:-1]])
        elif op == "touch" and keys:
            picked = rng.sample(keys, rng.randint(1, len(keys)))
            fast.touch(picked)
            slow.touch(picked)
        elif op == "block" and keys:
            if blocked and rng.random() < 0.5:
                blocked.clear()
            else:
                blocked.add(rng.choice(keys))
        elif op == "evict" and keys:
            n = rng.randint(2, len(keys) + 1)
            protected = frozenset(rng.sample(keys, 1)) if rng.random() < 0.2 else ()
            assert fast.evict(n, batched, protected) == slow.evict(n, plain, protected)
        assert list(fast._order.items()) == list(slow._order.items())
        assert fast._tree.num_children == slow._tree.num_children
