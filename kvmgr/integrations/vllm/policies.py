"""kvmgr's eviction policies as vLLM ``CachePolicy`` implementations (vLLM 0.33).

Offers:
    KvmgrCachePolicy    the adapter: vLLM's per-key ``CachePolicy`` calls onto one kvmgr
                        ``EvictionPolicy`` (``kvmgr.policy``), with prefix parents recovered
                        from the request's key positions
    KvmgrLRUPolicy      ``"lru"``        least recently used leaf first
    KvmgrARCPolicy      ``"arc"``        ARC (Megiddo & Modha, FAST'03), prefix-consistent
    KvmgrS3FIFOPolicy   ``"s3fifo"``     S3-FIFO (Yang et al., SOSP'23)
    KvmgrReusePolicy    ``"reuse"``      kvmgr's reuse-aware policy (its eviction half: vLLM's
                        ``CachePolicy`` is not asked before a store, so ``admit`` is not used)
    kvmgr_<name>        any other policy in ``kvmgr.policy.POLICIES`` (module ``__getattr__``)

vLLM loads a class of this module by name, without registration::

    "kv_connector_extra_config": {
        "eviction_policy": "KvmgrARCPolicy",
        "cache_policy_module_path": "kvmgr.integrations.vllm.policies", ...}

and builds it as ``policy_cls(cache_capacity=num_chunks)`` inside its ``CPUOffloadingManager``
(or the primary tier of ``TieringOffloadingSpec``), which keeps the chunk pool, reference counts
and events; the policy orders keys and picks victims (docs/guides/vllm.md).

How the vLLM calls map (``P`` is the kvmgr policy):

==========================  =================================================================
vLLM ``CachePolicy``        kvmgr
==========================  =================================================================
``insert(key, chunk, ctx)`` ``P.insert([key], [parent])``; the parent is the key of the same
                            request and KV cache group at the nearest lower token position
                            seen so far (``ReqContext.get_offload_key_position``), else ``None``
``evict(n, protected)``     ``P.evict(n, can_evict=ref_cnt == 0, protected)``: exactly ``n``
                            victims, leaves of a prefix before its root, or ``None`` with
                            nothing changed
``remove(key)``             ``P.remove([key])`` (a failed store)
``touch(keys, ctx)``        ``P.touch(keys)`` (first key most recent); policies that count a
                            touch as a use skip keys whose store has not landed (vLLM ARC's
                            rule for PENDING keys)
``on_store_miss``           nothing: kvmgr's ARC adapts when a ghost key is *stored* (insert)
``on_request_access``       records key positions; LRU also refreshes the resident keys
``on_request_finished``     LRU: ``P.touch`` of every key of the request, head last touched
                            (most recent); the others: ``P.touch`` of the reused keys only
``clear()``                 a fresh ``P``
==========================  =================================================================

Where the results depart from vLLM's own LRU/ARC on the same calls (prefix consistency, ARC's
ghost adaptation), see docs/guides/vllm.md; tests/integrations/vllm/test_vllm_policies.py checks both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from kvmgr.integrations.vllm._request_keys import RequestKeys
from kvmgr.policy import POLICIES, EvictionPolicy, make_policy

__all__ = [
    "KvmgrARCPolicy",
    "KvmgrCachePolicy",
    "KvmgrLRUPolicy",
    "KvmgrReusePolicy",
    "KvmgrS3FIFOPolicy",
]

_DYNAMIC_PREFIX = "kvmgr_"
_OFFLINE_ONLY = frozenset({"opt"})  # needs the future of the trace (simulator only)


class KvmgrCachePolicy(CachePolicy):
    """A vLLM ``CachePolicy`` that delegates ordering and victim choice to a kvmgr policy.

    Subclasses set ``policy_name`` (a key of ``kvmgr.policy.POLICIES``). vLLM's manager owns the
    chunks' reference counts (``ChunkStatus.ref_cnt``: -1 while the store is in flight, n while
    n loads read it); this class holds the key -> chunk map and asks the kvmgr policy for
    victims among chunks with ``ref_cnt == 0``.

    Args:
        cache_capacity: Number of CPU chunks of the tier (vLLM's ``num_chunks``); a tier of 0
            chunks gets a policy of capacity 1 that is never asked for anything.

    Raises:
        ConfigError: ``policy_name`` is not registered in kvmgr.

    Complexity: ``get``/``insert``/``remove`` O(1) plus the kvmgr policy's per-key cost;
    ``evict(n)`` O(n + keys skipped); ``on_request_finished`` O(keys of the request).
    """

    policy_name: ClassVar[str] = "lru"
    #: a touch only refreshes recency (LRU), so request accesses refresh and PENDING keys count
    touch_is_recency: ClassVar[bool] = False

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.policy: EvictionPolicy = make_policy(self.policy_name, max(1, int(cache_capacity)))
        self._generation = 0
        self._chunks_get = self.chunks.get

    # -- vLLM CachePolicy -------------------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks_get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        position = req_context.get_offload_key_position(key)
        parent = None
        if position is not None:
            seen = self._request_keys(req_context)
            parent = seen.parent(key, position)
            seen.add(key, position)
        self.policy.insert([key], [parent])
        self.chunks[key] = chunk

    def remove(self, key: OffloadKey) -> None:
        self.policy.remove([key])
        del self.chunks[key]

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        if not self.touch_is_recency:
            keys = [k for k in keys if (c := self._chunks_get(k)) is not None and c.ref_cnt >= 0]
        if keys:
            self.policy.touch(keys)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: a kvmgr policy learns from a ghost key when it is inserted again."""

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        seen = self._request_keys(req_context)
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is not None:
                seen.add(key, position)
        if self.touch_is_recency:
            resident = [k for k in keys if k in self.chunks]
            if resident:
                self.policy.touch(resident)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        keys = order_request_keys(key_groups, req_context)
        if self.touch_is_recency:
            keys = [k for k in keys if k in self.chunks]
        else:
            keys = [k for k in keys if k in reused_keys and k in self.chunks]
        if keys:
            self.policy.touch(keys)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        chunks = self.chunks
        victims = self.policy.evict(n, lambda key: chunks[key].ref_cnt == 0, protected)
        if victims is None:
            return None
        return [(key, chunks.pop(key)) for key in victims]

    def clear(self) -> None:
        self.chunks.clear()
        self.policy = make_policy(self.policy_name, max(1, int(self.cache_capacity)))
        self._generation += 1

    # -- private ------------------------------------------------------------------------------

    def _request_keys(self, req_context: ReqContext) -> RequestKeys:
        return RequestKeys.of(req_context, self, self._generation)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.policy!r}, num_chunks={len(self.chunks)})"


class KvmgrLRUPolicy(KvmgrCachePolicy):
    """kvmgr's prefix-consistent LRU (``kvmgr.policy.LRUPolicy``) inside vLLM."""

    policy_name = "lru"
    touch_is_recency = True


class KvmgrARCPolicy(KvmgrCachePolicy):
    """kvmgr's prefix-consistent ARC (``kvmgr.policy.ARCPolicy``) inside vLLM."""

    policy_name = "arc"


class KvmgrS3FIFOPolicy(KvmgrCachePolicy):
    """kvmgr's prefix-consistent S3-FIFO (``kvmgr.policy.S3FIFOPolicy``) inside vLLM."""

    policy_name = "s3fifo"


class KvmgrReusePolicy(KvmgrCachePolicy):
    """kvmgr's reuse-aware policy (``kvmgr.policy.ReusePolicy``) inside vLLM: eviction only.

    vLLM's ``CPUOffloadingManager`` decides what to store before it calls the policy (its own
    admission filter is ``store_threshold``), so the policy's ``admit`` is never asked here;
    segments, probation and ghosts work as in kvmgr.
    """

    policy_name = "reuse"


def __getattr__(name: str) -> Any:
    """``kvmgr_<policy>``: an adapter class for any policy registered in ``kvmgr.policy``."""
    policy = name[len(_DYNAMIC_PREFIX) :] if name.startswith(_DYNAMIC_PREFIX) else None
    if policy is None or policy not in POLICIES or policy in _OFFLINE_ONLY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    attrs = {"policy_name": policy, "touch_is_recency": policy == "lru", "__module__": __name__}
    return type(name, (KvmgrCachePolicy,), attrs)
