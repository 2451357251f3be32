"""The offline optimum, the reuse-aware policy and the block replay they are tuned on."""

from __future__ import annotations

import numpy as np
import pytest

from kvmgr.errors import ConfigError
from kvmgr.policy import FutureUses, OptimalPolicy, ReusePolicy, make_policy
from kvmgr.sim.ceiling import reuse_ceiling
from kvmgr.sim.replay import replay
from kvmgr.sim.trace import TraceRequest, default_trace_path, load_trace

ANY = lambda key: True  # noqa: E731
k = [bytes([n]) * 4 for n in range(20)]


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return load_trace(default_trace_path(), limit=2000)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_future_uses_move_as_requests_are_served() -> None:
    future = FutureUses([[k[0], k[1]], [k[0]], [k[0], k[1], k[2]]])
    assert [future.next_use(x) for x in k[:3]] == [0, 0, 2]
    assert (future.depth(k[2]), future.never, future.next_use(k[9])) == (2, 3, 3)
    moved: list[list[bytes]] = []
    future.subscribe(lambda keys: moved.append(list(keys)))
    future.consume(1)  # served out of order: request 0 still counts for k0
    assert future.next_use(k[0]) == 0 and moved == [[k[0]]]
    future.consume(0)
    future.consume(0)  # twice (a preempted request admitted again): no change
    assert [future.next_use(x) for x in k[:3]] == [2, 2, 2] and len(moved) == 2
    future.consume(2)
    assert future.next_use(k[0]) == future.never


def test_opt_evicts_furthest_next_use_leaves_deepest_first() -> None:
    # request 0 stores the chain k0 <- k1 <- k2 and k5; request 1 uses k0 k1; request 2
    # uses k5; nothing uses k2 again
    future = FutureUses([[k[0], k[1], k[2]], [k[0], k[1]], [k[5]], [k[0]]])
    opt = make_policy("opt", 8, future=future)
    assert isinstance(opt, OptimalPolicy)
    opt.insert([k[0], k[1], k[2]], [None, k[0], k[1]])
    opt.insert([k[5]], [None])
    future.consume(0)
    # k2 is never used again; k5 at request 2; k1 at 1; k0 at 1 but it is k1's parent
    assert opt.evict(1, ANY) == [k[2]]
    assert opt.evict(1, ANY) == [k[5]]
    # a pinned k1 keeps its parent k0 too: no victim
    assert opt.evict(1, lambda key: key != k[1]) is None and len(opt) == 2
    future.consume(1)  # now k1 is never used again and k0 at request 3
    assert opt.evict(2, ANY) == [k[1], k[0]]


def test_replay_opt_bounds_every_online_policy(trace: list[TraceRequest]) -> None:
    results = {name: replay(trace, name, 1_000_000) for name in ("lru", "arc", "s3fifo", "reuse")}
    best = replay(trace, "opt", 1_000_000)
    assert all(best.ratio > r.ratio for r in results.values()), results
    assert best.ratio <= reuse_ceiling(trace).ratio
    # unbounded: everything reusable is reused
    assert replay(trace, "opt", 10**9).ratio == pytest.approx(reuse_ceiling(trace).ratio)
    assert replay(trace, "lru", 10**9).ratio == pytest.approx(reuse_ceiling(trace).ratio)


def test_reuse_policy_takes_a_clock_and_checks_options() -> None:
    clock = Clock()
    policy = make_policy("reuse", 8, clock=clock)
    assert isinstance(policy, ReusePolicy)
    with pytest.raises(ConfigError):
        ReusePolicy(8, dead_quantile=0.2)
    with pytest.raises(ConfigError):
        ReusePolicy(8, min_probation=0.9, max_probation=0.5)


def test_reuse_policy_promotes_reused_segments_and_filters_new_ones() -> None:
    clock = Clock()
    policy = ReusePolicy(10, clock=clock, min_probation=0.2, max_probation=0.2)
    policy.insert([k[0], k[1], k[2]], [None, k[0], k[1]])  # conversation A, turn 1
    clock.now = 100.0
    policy.touch([k[0], k[1], k[2]])  # its second turn looked it up: proven
    policy.insert([k[3], k[4]], [k[2], k[3]])  # A's new blocks (turn 2)
    clock.now = 101.0
    policy.insert([k[5], k[6], k[7]], [None, k[5], k[6]])  # conversation B, turn 1
    assert policy.horizon_s > policy.probation_gap_s > 0
    # the store rate says the gap outlasts the cache: unproven segments go first, tips first
    assert policy._queues.is_filtering()
    assert policy.evict(3, ANY) == [k[4], k[3], k[7]]
    assert all(key in policy for key in (k[0], k[1], k[2]))
    # B's keys evicted while unproven are ghosts: storing them again proves B
    clock.now = 150.0
    policy.insert([k[7]], [k[6]])
    seg = policy._seg_of[k[7]]
    assert seg.proven and seg.turn == 2


def test_reuse_policy_declines_a_class_it_learned_is_dead() -> None:
    clock = Clock()
    policy = ReusePolicy(4, clock=clock, min_reuse=0.3, min_trials=5, prior=1.0)
    for n in range(30):  # single-block requests that never come back
        clock.now = 100.0 * n
        key = b"dead%04d" % n
        if len(policy) == 4:
            assert policy.evict(1, ANY) is not None
        policy.insert([key], [None])
    clock.now = 10_000.0
    policy.insert([b"last"], [None])  # expires the open trials
    assert policy.reuse_rates()[0, 0] < 0.3
    accepted = policy.admit([b"new1", b"new2"], [None, None])
    assert accepted.dtype == np.bool_ and not accepted.any()
    assert policy.num_declined == 2


def test_reuse_matches_lru_with_room_and_beats_it_when_tight(trace: list[TraceRequest]) -> None:
    # tuned on the first half of the bundled trace; this is its first 2,000 requests
    for tokens in (1_000_000, 2_000_000):
        lru, ours = replay(trace, "lru", tokens), replay(trace, "reuse", tokens)
        assert ours.ratio > lru.ratio, tokens
    lru, ours = replay(trace, "lru", 8_000_000), replay(trace, "reuse", 8_000_000)
    assert ours.ratio >= lru.ratio
