"""kvmgr's policies inside vLLM 0.33's ``CPUOffloadingManager``, against vLLM's own LRU and ARC.

Both managers get the same calls, request after request (lookup, load the hit prefix, store the
rest, finish), as vLLM's scheduler makes them. Where kvmgr is meant to agree with vLLM it must
give the same hits, the same stored keys and the same victims; where it departs (ARC's ghost
hits, prefix consistency under a pinned child) the test shows the documented difference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import vllm_support  # noqa: F401  (skips this module without vLLM, fails in CI)
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

from kvmgr.integrations.vllm import policies

MODULE = "kvmgr.integrations.vllm.policies"
TOKENS_PER_CHUNK = 16


def kvmgr_manager(name: str, num_chunks: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_chunks, cache_policy=name, cache_policy_module_path=MODULE)


def key(name: str) -> bytes:
    return make_offload_key(name.encode(), 0)


def context(req_id: str, keys: list[bytes]) -> ReqContext:
    ctx = ReqContext(req_id=req_id)
    for i, k in enumerate(keys):  # as the scheduler does: end-token position of each chunk
        ctx.set_offload_key_position(k, (i + 1) * TOKENS_PER_CHUNK)
    return ctx


def hit_prefix(mgr: OffloadingManager, keys: list[bytes], ctx: ReqContext) -> int:
    """How many of ``keys``, from the first, look up as HIT (the scheduler's prefix lookup)."""
    hits = 0
    for k in keys:
        if mgr.lookup(k, ctx) is not LookupResult.HIT:
            break
        hits += 1
    return hits


def run_request(mgr: CPUOffloadingManager, req_id: str, keys: list[bytes]) -> tuple:
    """One request as the scheduler drives it; returns (hits, stored keys, victims) or None."""
    ctx = context(req_id, keys)
    mgr.on_new_request(ctx)
    hits = hit_prefix(mgr, keys, ctx)
    if hits:
        mgr.prepare_load(keys[:hits], ctx)
        mgr.complete_load(keys[:hits], ctx)
    out = mgr.prepare_store(keys[hits:], ctx)
    if out is not None:
        mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)
    if out is None:
        return (hits, None, None)
    return (hits, tuple(out.keys_to_store), frozenset(out.evicted_keys))


def answers(mgr: OffloadingManager, requests: list[list[bytes]]) -> list[tuple]:
    """``run_request``'s answer to each of ``requests``, in order (request ids 0, 1, ...)."""
    return [run_request(mgr, str(i), keys) for i, keys in enumerate(requests)]


def same_answers(
    ours: OffloadingManager, theirs: OffloadingManager, requests: list[list[bytes]]
) -> list[tuple]:
    """Assert both managers answer ``requests`` alike; return the answers."""
    want = answers(theirs, requests)
    assert answers(ours, requests) == want
    return want


def random_calls(
    mgr: OffloadingManager,
    rng: random.Random,
    workload: list[list[bytes]],
    capacity: int,
    check: Callable[[set[bytes]], None] = lambda resident: None,
) -> set[bytes]:
    """Drive ``mgr`` through ``workload``'s requests with loads left in flight (up to 3, ended
    at random) and 10% of the stores failed, asserting vLLM's manager invariants: a victim is
    never pinned, PENDING or part of the store's offer, and looks up as MISS; ``None`` from
    prepare_store changes nothing; after each request every resident key is HIT, at most
    ``capacity`` of them, and ``check(resident)`` holds. Returns the resident keys."""
    resident: set[bytes] = set()
    pinned: list[tuple[list[bytes], ReqContext]] = []
    for r, keys in enumerate(workload):
        ctx = context(str(r), keys)
        mgr.on_new_request(ctx)
        hits = hit_prefix(mgr, keys, ctx)
        if hits:
            mgr.prepare_load(keys[:hits], ctx)
            pinned.append((keys[:hits], ctx))
        reading = {k for ks, _ in pinned for k in ks}
        before = {k: mgr.lookup(k, ctx) for k in resident}
        out = mgr.prepare_store(keys[hits:], ctx)
        if out is None:
            assert {k: mgr.lookup(k, ctx) for k in resident} == before
        else:
            victims = set(out.evicted_keys)
            assert not victims & reading and not victims & set(keys)
            resident -= victims
            ok = rng.random() > 0.1
            mgr.complete_store(out.keys_to_store, ctx, success=ok)
            if ok:
                resident |= set(out.keys_to_store)
            for k in victims:
                assert mgr.lookup(k, ctx) is LookupResult.MISS
        while pinned and (len(pinned) > 3 or rng.random() < 0.5):
            ks, pctx = pinned.pop(0)
            mgr.complete_load(ks, pctx)
        mgr.on_request_finished(ctx)
        assert all(mgr.lookup(k, ctx) is LookupResult.HIT for k in resident)
        assert len(resident) <= capacity
        check(resident)
    return resident


def shared_prefix_workload(seed: int, num_requests: int) -> list[list[bytes]]:
    """Requests over 12 documents: a prefix of one (1-9 chunks) plus 0-3 fresh chunks.

    Evicted chunks are requested again later, so stores of evicted keys (ghost hits) happen.
    """
    rng = random.Random(seed)
    fresh, requests = 0, []
    for _ in range(num_requests):
        doc, length, extra = rng.randrange(12), rng.randrange(1, 10), rng.randrange(4)
        keys = [key(f"d{doc}-{i}") for i in range(length)]
        keys += [key(f"f{fresh + i}") for i in range(extra)]
        fresh += extra
        requests.append(keys)
    return requests


def workload_without_ghost_hits(seed: int, num_requests: int, num_chunks: int) -> list[list[bytes]]:
    """Requests that reuse only the resident leading run of an earlier chain (checked on a
    probe manager with vLLM's ARC), so no evicted key is ever stored again."""
    rng = random.Random(seed)
    probe = CPUOffloadingManager(num_chunks, cache_policy="arc")
    chains: list[list[bytes]] = []
    requests: list[list[bytes]] = []
    counter = 0

    def fresh(n: int) -> list[bytes]:
        nonlocal counter
        counter += n
        return [key(f"f{i}") for i in range(counter - n, counter)]

    for r in range(num_requests):
        pick = rng.randrange(len(chains) + 1)
        resident = 0
        if pick < len(chains):
            ctx = ReqContext(req_id="probe")
            for k in chains[pick]:
                if probe.lookup(k, ctx) is not LookupResult.HIT:
                    break
                resident += 1
        if resident == 0:
            keys = fresh(rng.randrange(1, 8))
            chains.append(list(keys))
        else:
            chain, length = chains[pick], rng.randrange(1, resident + 1)
            new = fresh(rng.randrange(4))
            keys = chain[:length] + new
            if length == len(chain):
                chain.extend(new)
        requests.append(keys)
        run_request(probe, f"probe-{r}", keys)
    return requests


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_agrees_with_vllm_lru(seed: int) -> None:
    ours, theirs = kvmgr_manager("KvmgrLRUPolicy", 48), CPUOffloadingManager(48, "lru")
    want = same_answers(ours, theirs, shared_prefix_workload(seed, 400))
    assert sum(len(w[2] or ()) for w in want) > 500  # the tier was full most of the time


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arc_agrees_with_vllm_arc_without_ghost_hits(seed: int) -> None:
    ours, theirs = kvmgr_manager("KvmgrARCPolicy", 48), CPUOffloadingManager(48, "arc")
    want = same_answers(ours, theirs, workload_without_ghost_hits(seed, 400, 48))
    assert sum(len(w[2] or ()) for w in want) > 500
    assert sum(w[0] for w in want) > 200  # loads promoted chunks to T2 on both sides


def test_arc_departs_on_ghost_hit() -> None:
    """vLLM adapts its target on the store miss and puts the key back in T1; kvmgr adapts
    when the ghost key is inserted and puts it in T2 (the paper's rule)."""
    ours, theirs = kvmgr_manager("KvmgrARCPolicy", 3), CPUOffloadingManager(3, "arc")
    for mgr in (ours, theirs):
        # a, b stored; a reused (-> T2); c stored; d evicts b (-> B1); b stored again
        for i, name in enumerate(["a", "b", "a", "c", "d", "b"]):
            run_request(mgr, str(i), [key(name)])
    arc = ours._policy.policy  # type: ignore[attr-defined]
    assert key("b") in arc.t2 and key("b") not in arc.t1
    assert key("b") in theirs._policy.t1 and key("b") not in theirs._policy.t2  # type: ignore[attr-defined]
    assert arc.target > 0 and theirs._policy.target_t1_size > 0  # type: ignore[attr-defined]


def test_prefix_consistency_departs_under_a_pinned_child() -> None:
    """A chain A <- B with B being read: vLLM's LRU evicts A (B's lookup then breaks at A);
    kvmgr's keeps A, since a key whose child stays resident is worth more than the child."""
    a, b, c, d = key("A"), key("B"), key("C"), key("D")
    results = {}
    for name, mgr in {
        "ours": kvmgr_manager("KvmgrLRUPolicy", 3),
        "vllm": CPUOffloadingManager(3),
    }.items():
        run_request(mgr, "1", [a, b])
        run_request(mgr, "2", [c])
        ctx = context("3", [a, b])
        mgr.on_new_request(ctx)
        mgr.prepare_load([b], ctx)  # B pinned by a load in flight
        out = mgr.prepare_store([d], context("4", [d]))
        assert out is not None
        results[name] = set(out.evicted_keys)
    assert results["vllm"] == {a}
    assert results["ours"] == {c}


@pytest.mark.parametrize(
    "name",
    ["KvmgrLRUPolicy", "KvmgrARCPolicy", "KvmgrS3FIFOPolicy", "KvmgrReusePolicy", "kvmgr_s3fifo"],
)
def test_policy_keeps_vllm_manager_invariants(name: str) -> None:
    """Random calls with loads left in flight and failed stores: a victim is never pinned,
    PENDING or part of the store's offer; ``None`` from prepare_store changes nothing; every
    resident key looks up as HIT (or HIT_PENDING) and every victim as MISS."""
    mgr = kvmgr_manager(name, 24)
    resident = random_calls(mgr, random.Random(7), shared_prefix_workload(3, 300), 24)
    assert len(mgr._policy.policy) == len(resident)  # type: ignore[attr-defined]


def test_classes_are_vllm_cache_policies() -> None:
    for cls in (policies.KvmgrLRUPolicy, policies.KvmgrARCPolicy, policies.kvmgr_arc):
        assert issubclass(cls, CachePolicy)
    assert policies.kvmgr_arc.policy_name == "arc"
    with pytest.raises(AttributeError, match="kvmgr_opt"):
        policies.kvmgr_opt  # noqa: B018  (the offline optimum needs the trace's future)
    with pytest.raises(ValueError, match="Unknown cache policy"):
        CPUOffloadingManager(4, cache_policy="KvmgrLRUPolicy")  # no module path: vLLM says so


def test_clear_resets_the_policy() -> None:
    mgr = kvmgr_manager("KvmgrARCPolicy", 4)
    run_request(mgr, "1", [key("a"), key("b")])
    mgr.reset_cache()
    ctx = ReqContext(req_id="2")
    assert mgr.lookup(key("a"), ctx) is LookupResult.MISS
    assert len(mgr._policy.policy) == 0  # type: ignore[attr-defined]
    assert run_request(mgr, "3", [key("a")]) == (0, (key("a"),), frozenset())
