"""``KvmgrOffloadingManager``: kvmgr's CPU-tier bookkeeping as vLLM 0.33's ``OffloadingManager``.

Private to ``kvmgr.integrations.vllm``; ``KvmgrOffloadingSpec.get_manager()`` builds it.

One vLLM *chunk* (``blocks_per_chunk`` GPU blocks under one ``OffloadKey``) is one block of
kvmgr's CPU tier (``_seam.scheduler_tier``): states ``PENDING`` (a store in flight: not
readable, not evictable), ``READY`` (readable; not evictable while loads read it), the key
index, and victims chosen by a kvmgr policy, leaves of a prefix before its root.

Two phases, and what stays pinned in between:

- ``prepare_store(keys)`` allocates (evicting if needed, all or nothing) and marks the new keys
  PENDING; ``complete_store(keys)`` makes them READY, or frees them if the fault table says a
  rank's copy failed (vLLM itself never reports a failed store: module ``_fault_table``).
- ``prepare_load(keys)`` adds a reader to every chunk (READY, not evictable) until
  ``complete_load(keys)``.
- ``reset_cache()`` forgets every key at once; chunks a copy may still touch (PENDING, or READY
  with readers) are handed out again only after ``on_reset_flushed()``, when vLLM's workers
  reported every job in flight at the reset.

``lookup`` answers MISS (not indexed), HIT_PENDING (PENDING) or HIT (READY); never RETRY: every
answer of a CPU tier is known at once (RETRY is for tiers that look up asynchronously).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvmgr.errors import BlockStateError, PoolExhaustedError, UnknownKeyError
from kvmgr.integrations.vllm import _seam
from kvmgr.integrations.vllm._backend_access import Access, finished_keys, saw_loaded, split_offer
from kvmgr.integrations.vllm._fault_table import FaultTable
from kvmgr.integrations.vllm._request_keys import positions_of
from kvmgr.integrations.vllm._store_seqs import KvmgrChunkSpec, StoreSeqs

__all__ = ["KvmgrOffloadingManager"]

_PENDING, _READY = int(_seam.CpuState.PENDING), int(_seam.CpuState.READY)
_HIT, _MISS, _HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


class KvmgrOffloadingManager(OffloadingManager):
    """vLLM's scheduler-side ``OffloadingManager`` on kvmgr's CPU-tier bookkeeping.

    Args:
        num_chunks: CPU chunks of the tier (>= 1).
        policy: a kvmgr policy name (``"lru"``, ``"arc"``, ``"s3fifo"``, ``"reuse"``, ...).
        faults: the engine's fault table (``None``: no worker can report a failed store).
        enable_events: keep ``OffloadingEvent``s for ``take_events``.
        config_info: the labels ``config_info()`` returns.

    Raises:
        ConfigError: ``policy`` is not registered in kvmgr.

    Complexity: ``lookup`` O(1); ``prepare_store`` O(keys + victims); ``complete_*`` O(keys)
    (plus one O(num_chunks) scan after a worker recorded a fault); ``reset_cache`` O(keys).
    """

    def __init__(
        self,
        num_chunks: int,
        policy: str = "lru",
        *,
        faults: FaultTable | None = None,
        enable_events: bool = False,
        config_info: ConfigInfoMapping | None = None,
    ) -> None:
        self.medium = Medium.CPU
        self.policy_name = policy
        self.num_chunks = num_chunks
        self._evicted: list[list[bytes]] = []
        self.tier = _seam.scheduler_tier(num_chunks, policy, self._evicted.append)
        self._index_get = self.tier.index.get
        self._state = self.tier.state
        self._touch_is_recency = policy == "lru"
        self._seqs = StoreSeqs(num_chunks, faults)
        self._quarantine: list[np.ndarray] = []  # chunks freed by a reset, still in flight
        self._generation = 0
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._config_info: ConfigInfoMapping = dict(config_info or {})
        self._allocation_sizes: list[int] = []

    # -- lookups and loads ----------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        block = self._index_get(key)
        if block is None:
            return _MISS
        return _HIT if self._state[block] == _READY else _HIT_PENDING

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> KvmgrChunkSpec:
        """Pin ``keys`` (READY) against eviction until ``complete_load``; their chunk ids.

        Raises:
            UnknownKeyError: a key is not in the tier (nothing changed).
            BlockStateError: a key is not READY yet (nothing changed).
        """
        keys = keys if type(keys) is list else list(keys)
        ids = list(map(self._index_get, keys))
        state = self._state
        if None in ids or bytes(map(state.__getitem__, ids)).count(_READY) != len(ids):  # type: ignore[arg-type]
            for key, block in zip(keys, ids):
                if block is None:
                    raise UnknownKeyError(f"prepare_load: key {key!r:.40} not offloaded")
                if state[block] != _READY:
                    raise BlockStateError(f"prepare_load: key {key!r:.40} not READY")
        self.tier.add_readers(ids)  # type: ignore[arg-type]
        fresh = saw_loaded(self._access(req_context), keys, positions_of(req_context))
        if fresh and self._touch_is_recency:  # with LRU a key shown first is a use: refresh
            self.tier.policy.touch(fresh)
        return KvmgrChunkSpec(ids)  # type: ignore[arg-type]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        if not self._touch_is_recency:  # a touch is a use: only of landed keys
            get, state = self._index_get, self._state
            keys = [k for k in keys if (b := get(k)) is not None and state[b] == _READY]
        if keys:
            self.tier.policy.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin the chunks ``prepare_load(keys)`` pinned.

        Raises:
            UnknownKeyError: a key is not in the tier (nothing changed).
            BlockStateError: a key has no load in flight (its load ended already, or was never
                prepared); nothing changed.
        """
        ids = list(map(self._index_get, keys))
        if None in ids:
            raise UnknownKeyError("complete_load: a key is not offloaded")
        if ids:
            _seam.loads_ended(self.tier, ids)  # type: ignore[arg-type]

    # -- stores -------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate chunks for the keys not in the tier (PENDING until ``complete_store``),
        evicting READY chunks without readers if needed; ``None`` (nothing changed) when too few
        are free or evictable. Keys of the offer are never evicted by it."""
        keys = keys if type(keys) is list else list(keys)
        offer = split_offer(
            Access.of(req_context, self, self._generation),
            keys,
            list(map(self._index_get, keys)),
            self._state,
            positions_of(req_context),
        )
        if self._touch_is_recency and offer.fresh:
            self.tier.policy.touch(offer.fresh)
        new, resident = offer.new, offer.resident
        if not new:
            return PrepareStoreOutput([], KvmgrChunkSpec([]), [])
        try:
            ids = self.tier.make_room_small(
                len(new), resident if len(resident) <= 8 else set(resident)
            )
        except PoolExhaustedError:
            return None
        batches = self._evicted
        if not batches:
            evicted: list[OffloadKey] = []
        elif len(batches) == 1:
            evicted = batches[0]  # type: ignore[assignment]  # the policy's list, ours now
        else:
            evicted = [k for batch in batches for k in batch]  # type: ignore[misc]
        batches.clear()
        # one batch, first key most recent; vouched: looked up absent, eviction only unindexes
        self.tier.add_pending(new, ids, offer.parents, vouched=True)  # type: ignore[arg-type]
        seq = self._seqs.number(ids)
        self._allocation_sizes.append(len(new))
        if evicted and self.events is not None:
            self.events.append(OffloadingEvent(keys=evicted, medium=self.medium, removed=True))
        return PrepareStoreOutput(new, KvmgrChunkSpec(ids, seq), evicted)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """The store of ``keys`` ended: PENDING keys become READY, or are freed (and announced
        as ``metadata_only`` removals) when ``success`` is false or a rank's copy failed. Keys
        not PENDING (stored earlier, or forgotten by a reset) are left alone."""
        get, state = self._index_get, self._state
        pending = [(k, b) for k in keys if (b := get(k)) is not None and state[b] == _PENDING]
        if not pending:
            return
        state = self._state
        landed, failed = self._seqs.split(pending, success, lambda b: state[b] == _PENDING)
        if landed:
            _seam.stores_landed(self.tier, [b for _, b in landed])
            if self.events is not None:
                self.events.append(
                    OffloadingEvent([k for k, _ in landed], self.medium, removed=False)
                )
        if failed:
            ids = np.array([b for _, b in failed], dtype=np.int64)
            self._seqs.forget(ids)
            self.tier.stores_failed([k for k, _ in failed], ids)
            if self.events is not None:
                self.events.append(
                    OffloadingEvent(
                        [k for k, _ in failed], self.medium, removed=True, metadata_only=True
                    )
                )

    # -- requests -----------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._access(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Refresh the request's keys in the policy: with LRU every resident key of the request
        (its head most recent), with the others the keys it read from the tier."""
        access = req_context.get_state(Access)
        if access is None or access.owner is not self or access.generation != self._generation:
            return
        keys = finished_keys(access, self._index_get, self._state, self._touch_is_recency,
                             positions_of(req_context))  # fmt: skip
        if keys:
            self.tier.policy.touch(keys)

    # -- events, stats, reset -----------------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self.events:
            return ()
        events, self.events = self.events, []
        return events

    def get_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's CPU-tier gauges (fractions of chunks pinned by stores and by loads) and the
        allocation-size histogram since the last call."""
        stats = OffloadingConnectorStats()
        n = max(1, self.num_chunks)
        write = self.tier.num_pending / n
        read = self.tier.num_loading / n
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, write + read)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read)
        for size in self._allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def reset_cache(self) -> None:
        """Forget every key (no events, as vLLM's manager). Chunks a copy may still touch stay
        out of the allocator until ``on_reset_flushed``."""
        busy = _seam.forget_all(self.tier, self.policy_name)
        if len(busy):
            self._quarantine.append(busy)
        self._seqs.forget()
        self._evicted.clear()
        self._generation += 1

    def on_reset_flushed(self) -> None:
        """Every job in flight at the last reset has been reported: free its chunks."""
        for ids in self._quarantine:
            _seam.release_forgotten(self.tier, ids)
        self._quarantine.clear()

    def shutdown(self) -> None:
        self._seqs.close()

    def _access(self, req_context: ReqContext) -> Access:
        return Access.of(req_context, self, self._generation)

    def __repr__(self) -> str:
        return (
            f"KvmgrOffloadingManager(policy={self.policy_name!r}, num_chunks={self.num_chunks}, "
            f"keys={len(self.tier.index)})"
        )
