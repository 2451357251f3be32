"""kvmgr's ``KvmgrOffloadingManager`` against vLLM 0.33's ``CPUOffloadingManager`` on the same calls.

The workloads and the request driver are the policy tests' (tests/integrations/vllm/test_vllm_policies.py): request
after request, lookup, load the hit prefix, store the rest, finish, as vLLM's scheduler drives
a manager. kvmgr's manager must give vLLM's answers where kvmgr's policies agree with vLLM's
(LRU; ARC without ghost hits), and the answers of kvmgr's own policy inside vLLM's manager
(same policy, other bookkeeping) except for the order of one store's keys. Then the API one call at a time:
lookup states, ``None`` from ``prepare_store``, failed stores, events, stats, reset.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from test_vllm_policies import (
    answers,
    context,
    key,
    kvmgr_manager,
    random_calls,
    run_request,
    same_answers,
    shared_prefix_workload,
    workload_without_ghost_hits,
)
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvmgr.errors import BlockStateError, UnknownKeyError
from kvmgr.integrations.vllm._fault_table import FaultTable
from kvmgr.integrations.vllm.backend import KvmgrOffloadingManager

HIT, MISS, HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def ours(policy: str, num_chunks: int, **kw: object) -> KvmgrOffloadingManager:
    return KvmgrOffloadingManager(num_chunks, policy, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_gives_vllms_answers(seed: int) -> None:
    want = same_answers(
        ours("lru", 48), CPUOffloadingManager(48, "lru"), shared_prefix_workload(seed, 400)
    )
    assert sum(len(w[2] or ()) for w in want) > 500  # the tier was full most of the time


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arc_gives_vllms_answers_without_ghost_hits(seed: int) -> None:
    requests = workload_without_ghost_hits(seed, 400, 48)
    want = same_answers(ours("arc", 48), CPUOffloadingManager(48, "arc"), requests)
    assert sum(w[0] for w in want) > 200


@pytest.mark.parametrize(
    ("policy", "adapter"), [("lru", "KvmgrLRUPolicy"), ("reuse", "KvmgrReusePolicy")]
)
def test_same_answers_as_kvmgrs_policy_inside_vllms_manager(policy: str, adapter: str) -> None:
    """With ghost hits too: the bookkeeping differs, the decisions do not."""
    same_answers(ours(policy, 48), kvmgr_manager(adapter, 48), shared_prefix_workload(5, 400))


def test_arc_departs_only_in_the_order_of_one_stores_keys() -> None:
    """kvmgr's manager inserts a store's keys as one batch (its first key most recent), vLLM's
    one by one (its last key most recent). Without ghost hits ARC's answers are the same as
    kvmgr's ARC inside vLLM's manager; after ghost hits they differ a little (docs/guides)."""
    same = workload_without_ghost_hits(2, 400, 48)
    same_answers(ours("arc", 48), kvmgr_manager("KvmgrARCPolicy", 48), same)
    ghosts = shared_prefix_workload(5, 400)
    got = answers(ours("arc", 48), ghosts)
    want = answers(kvmgr_manager("KvmgrARCPolicy", 48), ghosts)
    assert got != want
    hits, their_hits = sum(g[0] for g in got), sum(w[0] for w in want)
    assert abs(hits - their_hits) <= 0.02 * their_hits


@pytest.mark.parametrize("make", [lambda: ours("lru", 4), lambda: CPUOffloadingManager(4)])
def test_one_call_at_a_time(make) -> None:
    """The same narrated calls on both managers, the same answers."""
    mgr: OffloadingManager = make()
    a, b, c, d, e = (key(x) for x in "abcde")
    ctx = context("1", [a, b, c])
    mgr.on_new_request(ctx)
    # nothing stored: MISS
    assert mgr.lookup(a, ctx) is MISS
    # store a, b, c: PENDING until complete_store
    out = mgr.prepare_store([a, b, c], ctx)
    assert out is not None and out.keys_to_store == [a, b, c] and out.evicted_keys == []
    assert list(out.store_spec.block_ids) == [0, 1, 2]  # type: ignore[attr-defined]
    assert [mgr.lookup(k, ctx) for k in (a, b, c)] == [HIT_PENDING] * 3
    # a second offer of stored keys stores nothing
    again = mgr.prepare_store([a], ctx)
    assert again is not None and again.keys_to_store == []
    mgr.complete_store([a, b, c], ctx)
    assert [mgr.lookup(k, ctx) for k in (a, b, c)] == [HIT] * 3
    # load a, b: pinned
    spec = mgr.prepare_load([a, b], ctx)
    assert list(spec.block_ids) == [0, 1]  # type: ignore[attr-defined]
    # 3 new keys into a 4-chunk tier with a, b pinned and c offered: too few -> None
    ctx2 = context("2", [d, e, c])
    mgr.on_new_request(ctx2)
    assert mgr.prepare_store([d, e, c, key("f")], ctx2) is None
    assert [mgr.lookup(k, ctx) for k in (a, b, c, d)] == [HIT, HIT, HIT, MISS]
    # d fits in the free chunk; e needs a victim: c (unpinned, not offered)
    out = mgr.prepare_store([d, e], ctx2)
    assert out is not None and out.keys_to_store == [d, e] and out.evicted_keys == [c]
    # e's store fails: its chunk is freed, d lands
    mgr.complete_store([e], ctx2, success=False)
    mgr.complete_store([d], ctx2)
    assert [mgr.lookup(k, ctx) for k in (c, d, e)] == [MISS, HIT, MISS]
    mgr.complete_load([a, b], ctx)
    mgr.on_request_finished(ctx)
    mgr.on_request_finished(ctx2)


def test_events_match_vllms() -> None:
    requests = shared_prefix_workload(1, 120)
    a, b = ours("lru", 16, enable_events=True), CPUOffloadingManager(16, "lru", enable_events=True)
    for i, keys in enumerate(requests):
        run_request(a, str(i), keys)
        run_request(b, str(i), keys)
    got = [(e.keys, e.removed, e.metadata_only) for e in a.take_events()]
    want = [(e.keys, e.removed, e.metadata_only) for e in b.take_events()]
    assert any(removed for _, removed, _ in want) and got == want
    assert list(a.take_events()) == []


def test_stats_match_vllms_gauges() -> None:
    a, b = ours("lru", 8), CPUOffloadingManager(8)
    for mgr in (a, b):
        ctx = context("1", [key("a"), key("b"), key("c")])
        out = mgr.prepare_store([key("a"), key("b"), key("c")], ctx)
        assert out is not None
        mgr.complete_store([key("a")], ctx)  # b, c still PENDING
        mgr.prepare_load([key("a")], ctx)  # a pinned by a load
    got, want = a.get_stats(), b.get_stats()
    assert got is not None and want is not None
    for name in (
        CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC,
        CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC,
        CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC,
    ):
        assert got.data["data"][name] == pytest.approx(want.data["data"][name]), name


def test_prepare_load_raises_typed_errors_and_changes_nothing() -> None:
    mgr = ours("lru", 4)
    ctx = context("1", [key("a"), key("b")])
    mgr.prepare_store([key("a")], ctx)
    with pytest.raises(UnknownKeyError):
        mgr.prepare_load([key("b")], ctx)
    with pytest.raises(BlockStateError, match="not READY"):
        mgr.prepare_load([key("a")], ctx)
    assert mgr.tier.num_loading == 0


def test_a_store_a_rank_failed_is_dropped(tmp_path: Path) -> None:
    """vLLM calls complete_store(success=True); the fault table says rank 1 failed chunk 1."""
    faults = FaultTable(tmp_path / "t.faults", world_size=2, num_chunks=2)
    mgr = ours("lru", 2, faults=faults, enable_events=True)
    worker_view = FaultTable(tmp_path / "t.faults", world_size=2, num_chunks=2)  # a worker's
    ctx = context("1", [key("a"), key("b")])
    first = mgr.prepare_store([key("a")], ctx)
    second = mgr.prepare_store([key("b")], ctx)
    assert first is not None and second is not None
    seq = second.store_spec.store_seq  # type: ignore[attr-defined]
    assert seq != first.store_spec.store_seq  # type: ignore[attr-defined]
    # an old entry of chunk 0 (another store's number) does not count
    worker_view.record(0, np.array([0]), np.array([seq + 12345]))
    worker_view.record(1, np.array([1]), np.array([seq]))
    mgr.complete_store([key("a"), key("b")], ctx)
    assert mgr.lookup(key("a"), ctx) is HIT and mgr.lookup(key("b"), ctx) is MISS
    events = [(e.keys, e.removed, e.metadata_only) for e in mgr.take_events()]
    assert events == [([key("a")], False, False), ([key("b")], True, True)]
    # the freed chunk is reused; its next store is not taken for the failed one
    third = mgr.prepare_store([key("c")], context("2", [key("c")]))
    assert third is not None and list(third.store_spec.block_ids) == [1]  # type: ignore[attr-defined]
    mgr.complete_store([key("c")], ctx)
    assert mgr.lookup(key("c"), ctx) is HIT
    worker_view.close()
    mgr.shutdown()
    assert not (tmp_path / "t.faults").exists()


def test_reset_keeps_chunks_in_flight_out_of_the_allocator() -> None:
    mgr = ours("arc", 4)
    ctx = context("1", [key(x) for x in "abcd"])
    out = mgr.prepare_store([key(x) for x in "abcd"], ctx)
    assert out is not None
    mgr.complete_store([key("a"), key("b")], ctx)  # c, d: stores still in flight
    mgr.prepare_load([key("a")], ctx)  # a: a load in flight
    mgr.reset_cache()
    assert all(mgr.lookup(key(x), ctx) is MISS for x in "abcd")
    # only b's chunk is free: a 2-chunk store must wait for the flush
    ctx2 = context("2", [key("e"), key("f")])
    assert mgr.prepare_store([key("e"), key("f")], ctx2) is None
    one = mgr.prepare_store([key("e")], ctx2)
    assert one is not None and list(one.store_spec.block_ids) == [1]  # type: ignore[attr-defined]
    # a stale completion (vLLM never sends one; it changes nothing if it did)
    mgr.complete_store([key("c")], ctx)
    mgr.on_reset_flushed()  # the workers reported every job of before the reset
    two = mgr.prepare_store([key("f"), key("g")], ctx2)
    assert two is not None and sorted(two.store_spec.block_ids) == [0, 2]  # type: ignore[attr-defined]
    assert mgr.tier.num_pending == 3 and mgr.tier.num_loading == 0


def test_random_calls_keep_the_invariants() -> None:
    """Random requests with loads left in flight and failed stores (the policy tests' check):
    a victim is never pinned, PENDING or offered; ``None`` changes nothing; every resident key
    is HIT and every victim MISS."""
    mgr = ours("arc", 24)

    def same_count(resident: set[bytes]) -> None:
        assert len(mgr.tier.index) == len(resident)

    random_calls(mgr, random.Random(11), shared_prefix_workload(4, 300), 24, same_count)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_touch_protects_like_vllms(policy: str) -> None:
    """Three one-chunk requests fill a 3-chunk tier; touching the oldest makes the next
    store evict the second oldest instead, on both managers."""
    victims = []
    for mgr in (ours(policy, 3), CPUOffloadingManager(3, policy)):
        for name in "abc":
            run_request(mgr, name, [key(name)])
        mgr.touch([key("a")], ReqContext(req_id="t"))
        out = mgr.prepare_store([key("d")], context("d", [key("d")]))
        assert out is not None
        victims.append(out.evicted_keys)
    assert victims[0] == victims[1] == [key("b")]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_complete_load_without_a_load_in_flight_raises_and_changes_nothing(policy: str) -> None:
    """A load ended twice (or never prepared) raises before any reader count moves: a count
    below the loads in flight would let a later load's chunk be evicted, and handed to a new
    store, while that load still copies from it (vLLM's own manager asserts here)."""
    mgr = ours(policy, 4)
    ctx = context("1", [key("a"), key("b"), key("p")])
    mgr.prepare_store([key("a"), key("b")], ctx)
    mgr.complete_store([key("a"), key("b")], ctx)
    mgr.prepare_store([key("p")], ctx)  # p: PENDING, never loaded
    mgr.prepare_load([key("a")], ctx)
    mgr.complete_load([key("a")], ctx)
    for keys in ([key("a")], [key("b"), key("a")], [key("p")]):
        with pytest.raises(BlockStateError, match="no load in flight"):
            mgr.complete_load(keys, ctx)
    mgr.prepare_load([key("a")], ctx)
    with pytest.raises(BlockStateError):  # one load in flight, two ended
        mgr.complete_load([key("a"), key("a")], ctx)
    assert list(mgr.tier.readers) == [1 if k == key("a") else 0 for k in _keys_by_block(mgr)]
    assert mgr.tier.num_loading == 1
    # only b is evictable (a is read, p PENDING): a store of two new keys finds no room
    assert mgr.prepare_store([key("c"), key("d")], context("2", [key("c"), key("d")])) is None
    mgr.complete_load([key("a")], ctx)  # the one load in flight ends: accepted
    assert mgr.tier.num_loading == 0


def _keys_by_block(mgr: KvmgrOffloadingManager) -> list[bytes | None]:
    by_block: list[bytes | None] = [None] * mgr.num_chunks
    for k, block in mgr.tier.index.items():
        by_block[block] = k
    return by_block


def test_prepare_load_of_a_non_bytes_key_raises_a_typed_error() -> None:
    with pytest.raises(UnknownKeyError):
        ours("lru", 4).prepare_load(["not bytes"], context("1", []))  # type: ignore[list-item]
