"""Policies: shared behaviour, exact orders, ARC adaptation and ghosts, a stateful model."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvmgr.errors import BlockStateError, ConfigError, UnknownKeyError
from kvmgr.policy import (
    POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    ReusePolicy,
    S3FIFOPolicy,
    make_policy,
)

a, b, c, d, e, f, g, h, i = (bytes([ch]) * 3 for ch in b"abcdefghi")
P = TypeVar("P", bound=EvictionPolicy)
ANY = lambda key: True  # noqa: E731  (can_evict accepting every key)


def _fill(policy: P, *keys: bytes) -> P:
    """Insert ``keys`` in order and return the policy."""
    for key in keys:
        policy.insert([key], [None])
    return policy


def _resident(policy: EvictionPolicy) -> list[bytes]:
    """Tracked keys: LRU order for LRU, T1 then T2 for ARC, small then main for S3-FIFO."""
    if isinstance(policy, ARCPolicy):
        return policy.t1 + policy.t2
    if isinstance(policy, S3FIFOPolicy):
        return policy.small + policy.main
    if isinstance(policy, ReusePolicy):
        return [k for k in [*KEYS, a, b, c, d, e, f, g, h, i] if k in policy]
    return policy.ordered_keys()  # type: ignore[attr-defined, no-any-return]


def _snapshot(policy: EvictionPolicy) -> object:
    if isinstance(policy, ARCPolicy):
        return (policy.t1, policy.t2, policy.b1, policy.b2, policy.target)
    if isinstance(policy, S3FIFOPolicy):
        return (policy.small, policy.main, policy.ghost, dict(policy._freq))
    return _resident(policy)


ONLINE = sorted(name for name in POLICIES if name != "opt")


@pytest.fixture(params=["arc", "lru"])
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    """The recency policies, whose exact orders these tests spell out."""
    return make_policy(request.param, 8)


@pytest.fixture(params=ONLINE)
def online(request: pytest.FixtureRequest) -> EvictionPolicy:
    """Every online policy (the prefix rules hold for all of them)."""
    return make_policy(request.param, 8)


def test_touch_walks_in_reverse_first_key_most_recent(policy: EvictionPolicy) -> None:
    assert isinstance(policy, EvictionPolicy) and type(policy) is POLICIES[policy.name]
    _fill(policy, a, b, c, d)
    # touch [c, a] plus an untracked key: a, then c become most recent; x is ignored
    policy.touch([c, a, b"x"])
    assert len(policy) == 4 and b"x" not in policy
    # both policies now evict the untouched b, d first, then a, and c last
    assert policy.evict(4, ANY) == [b, d, a, c] and len(policy) == 0


def test_a_root_stored_again_after_its_removal_is_one_victim(online: EvictionPolicy) -> None:
    # issue 20: reuse listed the re-stored root in two segments, offered it twice, and evict
    # raised KeyError halfway through committing
    # 1. a chain a <- b; the root a leaves (invalidated, or its store failed); b stays
    online.insert([a, b], [None, a])
    online.remove([a])
    # 2. a is stored again (a new root), then an unrelated c
    online.insert([a], [None])
    online.insert([c], [None])
    # 3. evicting everything returns each key once and leaves the policy empty and usable
    victims = online.evict(3, ANY)
    assert victims is not None and sorted(victims) == sorted([a, b, c]) and len(online) == 0
    online.insert([a, b], [None, a])
    assert sorted(online.evict(2, ANY) or []) == sorted([a, b])


def test_evict_is_atomic(policy: EvictionPolicy) -> None:
    _fill(policy, a, b, c, d, e)
    before = _snapshot(policy)
    evictable = {b, e}
    # 3 victims wanted, only 2 evictable: None and nothing changed
    assert policy.evict(3, lambda key: key in evictable) is None
    assert _snapshot(policy) == before and len(policy) == 5
    # 2 wanted: exactly the evictable ones, oldest first
    assert policy.evict(2, lambda key: key in evictable) == [b, e]
    assert _resident(policy) == [a, c, d]


def test_protected_and_pinned_keys_are_skipped(policy: EvictionPolicy) -> None:
    _fill(policy, a, b, c, d, e)
    asked: list[bytes] = []

    def can_evict(key: bytes) -> bool:
        asked.append(key)
        return key != b

    # n = 0: nothing asked, nothing evicted
    assert policy.evict(0, can_evict) == [] and asked == []
    # a protected (given as a list), b pinned: both skipped; protected keys are not even asked
    assert policy.evict(2, can_evict, protected=[a]) == [c, d]
    assert asked == [b, c, d]
    # left: protected a, pinned b, and e: two victims cannot be found
    assert policy.evict(2, can_evict, protected={a}) is None
    assert _resident(policy) == [a, b, e]


def test_remove_and_bad_input(policy: EvictionPolicy) -> None:
    _fill(policy, a, b, c)
    policy.remove([b])
    assert b not in policy and _resident(policy) == [a, c]
    before = _snapshot(policy)
    with pytest.raises(UnknownKeyError, match="not tracked"):
        policy.remove([c, b])  # c is tracked, b is not: c stays
    with pytest.raises(BlockStateError, match="already tracked"):
        policy.insert([d, a], [None, d])
    with pytest.raises(BlockStateError, match="already tracked"):
        policy.insert([d, d], [None, None])
    with pytest.raises(ValueError, match="one parent per key"):
        policy.insert([d], [])
    with pytest.raises(ValueError, match="expected >= 0, got -1"):
        policy.evict(-1, ANY)
    assert _snapshot(policy) == before


def test_unknown_policy_name_lists_supported() -> None:
    supported = ", ".join(repr(name) for name in sorted(POLICIES))
    with pytest.raises(ConfigError, match=f"policy 'lfu'; supported: {supported}$"):
        make_policy("lfu", 4)
    with pytest.raises(ConfigError, match="bad options"):
        make_policy("lru", 4, clock=lambda: 0.0)
    with pytest.raises(ConfigError, match="offline"):
        make_policy("opt", 4)
    for capacity in (0, -3, True, 2.0):
        with pytest.raises(ConfigError, match="policy capacity"):
            make_policy("lru", capacity)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected > 0, got 0"):
        ARCPolicy(0)


def test_arc_touch_promotes_every_tracked_key() -> None:
    arc = _fill(ARCPolicy(4), a, b, c)
    # v2 touches only real uses: a T1 hit is promoted (first key most recent), ghosts ignored
    arc.touch([a, b, b"x"])
    assert (arc.t1, arc.t2) == ([c], [b, a])
    # T2 hits refresh, T1 hits join at the MRU end, in reverse order
    arc.touch([c, b])
    assert (arc.t1, arc.t2) == ([], [a, b, c])


def test_chain_store_evicts_deepest_first(policy: EvictionPolicy) -> None:
    # one store of a chain: a <- b <- c <- d; a must never be the first victim
    policy.insert([a, b, c, d], [None, a, b, c])
    _fill(policy, e)
    assert policy.evict(1, ANY) == [d]
    # d's parent c is next for LRU; ARC (T1 = [d, c, b, a, e] in that order) agrees
    assert policy.evict(2, ANY) == [c, b]
    assert policy.evict(2, ANY) == [a, e]


def test_parent_waits_for_children_even_out_of_order(policy: EvictionPolicy) -> None:
    # a is older than its children b and c (touches that skipped a): it goes right after them
    _fill(policy, a, f)
    policy.insert([b], [a])
    policy.insert([c], [a])
    assert policy.evict(3, ANY) == [f, b, c]  # a waits for c, the last child
    assert _resident(policy) == [a]


def test_pinned_or_protected_child_keeps_its_parent(policy: EvictionPolicy) -> None:
    policy.insert([a, b, c], [None, a, b])
    _fill(policy, d)
    before = _snapshot(policy)
    # c is pinned (being read): b and a are not evictable either, only d is
    assert policy.evict(2, lambda key: key != c) is None
    assert _snapshot(policy) == before
    assert policy.evict(1, ANY, protected={c}) == [d]
    assert policy.evict(1, ANY, protected={c}) is None
    # a removed parent (invalidation) leaves an orphan that is evictable by itself
    policy.remove([a])
    assert policy.evict(2, ANY) == [c, b]


def test_prefix_rules_hold_for_every_online_policy(online: EvictionPolicy) -> None:
    # two chains in one batch, a <- b <- c and d <- e, then f extending b
    online.insert([a, b, c, d, e], [None, a, b, None, d])
    online.insert([f], [b])
    assert isinstance(online, EvictionPolicy) and len(online) == 6
    before = sorted(k for k in (a, b, c, d, e, f) if k in online)
    # c and f pinned: a and b cannot go (their children stay), only e then d
    assert online.evict(3, lambda key: key not in (c, f)) is None
    assert sorted(k for k in (a, b, c, d, e, f) if k in online) == before
    assert online.evict(2, lambda key: key not in (c, f)) == [e, d]
    victims = online.evict(4, ANY)
    assert victims is not None and sorted(victims) == sorted([a, b, c, f])
    for child, parent in ((b, a), (c, b), (f, b)):
        assert victims.index(child) < victims.index(parent)
    assert len(online) == 0
    with pytest.raises(UnknownKeyError):
        online.remove([a])


def test_batch_parents_within_and_across_batches(policy: EvictionPolicy) -> None:
    # two requests' blocks in one batch: a <- b and c <- d, d's parent c precedes it
    policy.insert([a, b, c, d], [None, a, None, c])
    # a later batch extends b with e, while b stays tracked
    policy.insert([e], [b])
    # leaves first, then parents; b waits for e
    victims = policy.evict(5, ANY)
    assert victims is not None and sorted(victims) == sorted([a, b, c, d, e])
    for child, parent in ((b, a), (d, c), (e, b)):
        assert victims.index(child) < victims.index(parent)


def test_arc_adaptation_grows_shrinks_and_floors() -> None:
    arc = _fill(ARCPolicy(8), a, b, c, d)
    # hit b, c, d: T2 = [d, c, b] (b most recent), T1 = [a]
    arc.touch([b, c, d])
    # p = 0: T1 first, then T2 from its LRU end
    assert arc.evict(4, ANY) == [a, d, c, b]
    assert (arc.b1, arc.b2) == ([a], [d, c, b])
    # store a again (B1 hit): p grows by |B2|/|B1| = 3; a goes to T2
    arc.insert([a], [None])
    assert arc.target == 3 and arc.t2 == [a] and arc.b1 == []
    _fill(arc, e, f, g, h, i)
    # |T1| = 5 > 3: e, f; then |T1| = 3 is not > 3 but a (T2) is pinned: fall back to T1
    assert arc.evict(5, lambda key: key != a) == [e, f, g, h, i]
    assert (arc.b1, arc.b2) == ([e, f, g, h, i], [d, c, b])
    # store d (B2 hit): p shrinks by |B1|/|B2| = 5/3
    arc.insert([d], [None])
    assert arc.target == pytest.approx(3 - 5 / 3) and arc.t2 == [a, d]
    # store c (B2 hit): shrink by 5/2, floored at 0
    arc.insert([c], [None])
    assert arc.target == 0 and arc.b2 == [b]


def test_arc_target_is_capped_and_prefers_t2_below_target() -> None:
    arc = _fill(ARCPolicy(4), a, b, c, d)
    arc.touch([a, b, c])  # T2 = [c, b, a], T1 = [d]
    assert arc.evict(4, ANY) == [d, c, b, a]
    # B1 hit with |B2|/|B1| = 3: p = 3
    arc.insert([d], [None])
    _fill(arc, e, f, g)
    # |T1| = 3 is not > 3: T2's d goes first, then T1 (T2 exhausted)
    assert arc.evict(3, ANY) == [d, e, f]
    assert (arc.b1, arc.b2) == ([e, f], [c, b, a, d])
    # B1 hit with |B2|/|B1| = 2: 3 + 2 capped at capacity 4
    arc.insert([e], [None])
    assert arc.target == 4
    # B2 hit with |B1|/|B2| = 1/4: shrink by the minimum step 1
    arc.insert([c], [None])
    assert arc.target == 3 and (arc.t1, arc.t2) == ([g], [e, c])


def test_arc_evict_tracks_t1_shrinking_as_it_picks() -> None:
    arc = _fill(ARCPolicy(8), a, b)
    arc.touch([b])  # T1 = [a], T2 = [b]
    assert arc.evict(1, ANY) == [a]
    # B1 hit with B2 empty: minimum step, p = 1; T2 = [b, a]
    arc.insert([a], [None])
    assert arc.target == 1 and arc.t2 == [b, a]
    _fill(arc, c, d, e)
    # |T1| = 3 > 1: c; 2 > 1: d; then 1 is not > 1: T2 from its LRU end, e stays
    assert arc.evict(4, ANY) == [c, d, b, a]
    assert (arc.t1, arc.b1, arc.b2) == ([e], [c, d], [b, a])


def test_arc_ghost_bounds() -> None:
    arc = _fill(ARCPolicy(3), a, b, c)
    # evict a from T1: B1 = [a]; |T1| + |B1| = 3
    assert arc.evict(1, ANY) == [a] and arc.b1 == [a]
    # store d: |T1| + |B1| would be 4 > 3, so the LRU ghost a is dropped
    arc.insert([d], [None])
    assert arc.t1 == [b, c, d] and arc.b1 == []
    # promote all (T2 = [d, c, b]), evict them into B2, then 3 more: B2 keeps the newest 3
    arc.touch([b, c, d])
    assert arc.evict(3, ANY) == [d, c, b]
    _fill(arc, e, f, g)
    arc.touch([e, f, g])
    assert arc.evict(3, ANY) == [g, f, e]
    assert arc.b2 == [g, f, e] and len(arc) == 0
    # fill B1 too: 6 ghosts, the directory (resident + ghosts) is at 2 * capacity
    _fill(arc, a, b, c)
    assert arc.evict(3, ANY) == [a, b, c]
    assert (arc.b1, arc.b2) == ([a, b, c], [g, f, e])
    # B1 hit moves a to T2 (directory still 6); a new key d makes it 7: B2's LRU g goes
    arc.insert([a], [None])
    arc.insert([d], [None])
    assert (arc.t1, arc.t2, arc.b1, arc.b2) == ([d], [a], [b, c], [f, e])


KEYS = [bytes([k]) * 2 for k in range(12)]
CAPACITY = 5
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)


class PolicyMachine(RuleBasedStateMachine):
    """Drives a policy like the manager does and checks it against a model of resident keys
    (LRU order and parent per key), including prefix consistency of every eviction."""

    policy_name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.policy = make_policy(self.policy_name, CAPACITY)
        self.model: OrderedDict[bytes, None] = OrderedDict()  # LRU order for LRU; a set for ARC
        self.parent: dict[bytes, bytes | None] = {}
        self.pending: set[bytes] = set()

    @rule(keys=key_lists, root=st.sampled_from([None, *KEYS]), is_pending=st.booleans())
    def insert_chain(self, keys: list[bytes], root: bytes | None, is_pending: bool) -> None:
        keys = list(dict.fromkeys(keys))[: CAPACITY - len(self.model)]
        parents = [root, *keys[:-1]][: len(keys)]
        if any(key in self.model for key in keys):
            before = _snapshot(self.policy)
            with pytest.raises(BlockStateError):
                self.policy.insert(keys, parents)
            assert _snapshot(self.policy) == before
            return
        self.policy.insert(keys, parents)
        for key, up in zip(reversed(keys), reversed(parents)):
            self.model[key] = None
            self.parent[key] = up
        if is_pending:
            self.pending.update(keys)

    @rule(key=st.sampled_from(KEYS))
    def complete_store(self, key: bytes) -> None:
        self.pending.discard(key)

    @rule(keys=key_lists)
    def touch(self, keys: list[bytes]) -> None:
        self.policy.touch(keys)
        for key in reversed(keys):
            if key in self.model:
                self.model.move_to_end(key)
        arc = self.policy
        if isinstance(arc, ARCPolicy):  # every touched resident key is in T2, most recent
            touched = [k for k in keys if k in self.model]
            assert set(arc.t2[len(arc.t2) - len(set(touched)) :]) == set(touched)
            assert not touched or arc.t2[-1] == touched[0]

    @rule(keys=key_lists)
    def remove(self, keys: list[bytes]) -> None:
        if all(key in self.model for key in keys):
            self.policy.remove(keys)
            for key in keys:
                self.model.pop(key, None)
                self.parent.pop(key, None)
                self.pending.discard(key)
            return
        before = _snapshot(self.policy)
        with pytest.raises(UnknownKeyError):
            self.policy.remove(keys)
        assert _snapshot(self.policy) == before

    @rule(n=st.integers(0, CAPACITY + 1), pinned=key_lists, protected=key_lists)
    def evict(self, n: int, pinned: list[bytes], protected: list[bytes]) -> None:
        def can_evict(key: bytes) -> bool:
            assert key in self.model, "asked about an untracked key"
            return key not in self.pending and key not in pinned

        def is_leaf(key: bytes, gone: set[bytes]) -> bool:
            return not any(up == key and k not in gone for k, up in self.parent.items())

        # reference: repeatedly the oldest eligible key whose tracked children are all gone
        eligible = [k for k in self.model if can_evict(k) and k not in protected]
        expected: list[bytes] = []
        while len(expected) < n:
            leaves = [k for k in eligible if k not in expected and is_leaf(k, set(expected))]
            if not leaves:
                break
            expected.append(leaves[0])
        before = _snapshot(self.policy)
        victims = self.policy.evict(n, can_evict, protected)
        if len(expected) < n:
            assert victims is None and _snapshot(self.policy) == before
            return
        assert victims is not None and len(set(victims)) == n and set(victims) <= set(eligible)
        gone = set(victims)
        assert all(is_leaf(k, gone) for k in victims), "victims not closed under children"
        if isinstance(self.policy, LRUPolicy):
            assert victims == expected
        for key in victims:
            del self.model[key]
            del self.parent[key]

    @invariant()
    def resident_keys_match_model_and_ghosts_are_bounded(self) -> None:
        resident = _resident(self.policy)
        assert len(resident) == len(self.policy) == len(self.model)
        assert set(resident) == set(self.model)
        if isinstance(self.policy, LRUPolicy):
            assert resident == list(self.model)
            return
        if not isinstance(self.policy, ARCPolicy):
            return
        arc = self.policy
        assert isinstance(arc, ARCPolicy)
        t1, t2, b1, b2 = set(arc.t1), set(arc.t2), set(arc.b1), set(arc.b2)
        assert not (b1 & b2) and not ((b1 | b2) & (t1 | t2))
        assert len(t1) + len(b1) <= CAPACITY and len(b2) <= CAPACITY
        assert len(t1) + len(t2) + len(b1) + len(b2) <= 2 * CAPACITY
        assert 0 <= arc.target <= CAPACITY


class ARCMachine(PolicyMachine):
    policy_name = "arc"


class S3FIFOMachine(PolicyMachine):
    policy_name = "s3fifo"


class ReuseMachine(PolicyMachine):
    policy_name = "reuse"


TestLRUStateful = PolicyMachine.TestCase
TestARCStateful = ARCMachine.TestCase
TestS3FIFOStateful = S3FIFOMachine.TestCase
TestReuseStateful = ReuseMachine.TestCase
for _case in (TestLRUStateful, TestARCStateful):
    _case.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
for _case in (TestS3FIFOStateful, TestReuseStateful):
    _case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("root", [None, KEYS[0]])
def test_reuse_key_stored_again_is_offered_once(root: bytes | None) -> None:
    """A key evicted from inside a segment and stored again (as a root, or under the tip it was
    once the root of) is listed by its old segment too; eviction must offer it only once
    (found by TestReuseStateful: VictimSet counted it twice and raised KeyError)."""
    machine = ReuseMachine()
    a, b, c = KEYS[2], KEYS[1], KEYS[0]
    machine.insert_chain(keys=[a, b, c], root=None, is_pending=True)
    machine.complete_store(key=a)
    machine.remove(keys=[b])
    machine.evict(n=1, pinned=[], protected=[])  # a: a leaf now, READY
    machine.insert_chain(keys=[a], root=root, is_pending=False)
    machine.evict(n=2, pinned=[], protected=[])  # raised KeyError before the fix
    machine.resident_keys_match_model_and_ghosts_are_bounded()
