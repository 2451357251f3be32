"""`KvmgrTierManager`: one kvmgr ``TierBackend`` behind vLLM 0.33's ``SecondaryTierManager``.

Threads: vLLM calls every method from its scheduler thread (under the tiering manager's lock).
Jobs run as coroutines on the tier's own event loop (`LoopThread`): a ``TierBridge`` gathers the
job's primary-tier chunks into checksummed blobs and writes them (store), or reads, verifies and
scatters them into the chunks (load). The loop thread touches only the job's chunks, which vLLM
keeps pinned until the job's result is taken; every other piece of state (the known-present keys,
the results, the counters) is changed on the scheduler thread only, when results are drained.

Failure mapping (never a wrong block; an exception into vLLM's scheduler only for a job that breaks
vLLM's own contract, last row):

==================================  ==========================================================
kvmgr outcome                       vLLM ``JobResult``
==================================  ==========================================================
store: every blob written           ``success=True``
store: a ``TierError`` (timeout,    ``success=False`` (vLLM unpins the chunks and tells the
unavailable, full) or a partial     backpressure detector; nothing is readable from this tier
write                               that was not written whole)
load: every blob read and verified  ``success=True``
load: some blobs missing, corrupt   ``success=False, successful_keys=<verified keys>``: vLLM
(checksum), of another layout, or   keeps those chunks and frees the others; the others are
a ``TierError``                     marked absent so the next lookup says MISS (recompute)
an unexpected exception             ``success=False``, logged with its traceback
a job breaking vLLM's contract      ``submit_*`` raises ``InvalidBlockError`` (chunk ids out of
(chunk ids: one per key, distinct,  range, repeated, not one per key) or ``InvalidKeyError`` (a
in range)                           store's keys repeated); nothing counted, nothing runs
==================================  ==========================================================

A job is never cancelled mid-copy: each backend call ends by its own deadline (``deadline_s``),
so a job ends within ``ceil(blocks / chunk) x deadline_s`` and `drain_jobs` waits for that.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, ClassVar

import attrs
import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvmgr.integrations.vllm._loop import LoopThread
from kvmgr.integrations.vllm._tier_jobs import (
    Counters,
    Lookups,
    Outcome,
    TierJobStatistics,
    job_chunks,
    namespace_of,
    remember,
)
from kvmgr.tiers import BridgeStatistics, TierBackend, TierBridge

__all__ = ["KvmgrTierManager"]

_log = logging.getLogger(__name__)


class KvmgrTierManager(SecondaryTierManager):
    """A vLLM secondary tier over a kvmgr ``TierBackend`` (subclasses build the backend).

    Args:
        offloading_spec, primary_kv_view, tier_type, backpressure_detector: as vLLM passes them
            (``primary_kv_view``: uint8 ``[num_chunks, row_bytes]`` over the CPU tier).
        tenant_salt: folded into every stored key (tenants with equal prompts share nothing).
        key_prefix: readable prefix of the stored keys.
        max_known_keys: keys this tier remembers as present (it stored or loaded them), and as
            absent (a load of them failed: MISS until stored again), each an LRU of this size;
            lookups of other keys ask the backend asynchronously (RETRY, then HIT/MISS).
        locality: ``"LOCAL"`` or ``"REMOTE"`` (vLLM's ``Locality``; per-request tier filters).
        **backend_options: the subclass's own (its ``_configure``).

    Raises:
        ConfigError, GeometryError: bad options or a view the bridge cannot use.
    """

    medium: ClassVar[Medium | None] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        tenant_salt: str = "",
        key_prefix: str = "kvmgr:",
        max_known_keys: int = 1 << 20,
        locality: str | None = None,
        **backend_options: Any,
    ) -> None:
        self._configure(**backend_options)  # checked before anything starts
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = self._locality(locality)
        rows = torch.from_numpy(np.asarray(primary_kv_view).view(np.uint8))  # no copy
        self._num_chunks = int(rows.shape[0])
        self.namespace = namespace_of(offloading_spec, int(rows.shape[1]), tenant_salt, key_prefix)
        self._payload_bytes = self.namespace.payload_bytes
        self.loop = LoopThread(f"kvmgr-tier-{tier_type}")
        try:
            self.backend: TierBackend = self.loop.run(self._open_backend())
            self.bridge = TierBridge([rows], self.backend, self.namespace)
        except BaseException:
            self.loop.close()
            raise
        self._lookups = Lookups(self)
        self._known: OrderedDict[OffloadKey, None] = OrderedDict()
        self._absent: OrderedDict[OffloadKey, None] = OrderedDict()  # a load of it failed
        self._max_known = max_known_keys
        self._futures: dict[int, concurrent.futures.Future[Outcome]] = {}
        self._results: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._counters = Counters()
        self._closed_bridge: BridgeStatistics | None = None
        self._events: list[OffloadingEvent] | None = (
            [] if offloading_spec.kv_events_config.enable_kv_cache_events else None
        )

    def _configure(self, *args: Any, **backend_options: Any) -> None:
        """Check and keep the backend's options (subclasses, keyword-only; ``__init__`` calls
        it first).

        Raises:
            TypeError: options this tier does not take.
        """
        if args or backend_options:
            raise TypeError(f"{type(self).__name__}: unexpected options {sorted(backend_options)}")

    def _locality(self, locality: str | None) -> Locality | None:
        """vLLM's ``Locality`` of this tier, given the ``locality`` option."""
        return Locality(locality) if locality is not None else None

    async def _open_backend(self) -> TierBackend:
        """Build the backend on the tier's loop (subclasses)."""
        raise NotImplementedError

    # -- vLLM SecondaryTierManager ------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._known:
            return LookupResult.HIT
        if key in self._absent:
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, ids = job_chunks(job_metadata, self._num_chunks, store=True)  # InvalidBlockError
        self._counters.num_store_jobs += 1
        fresh = np.fromiter((k not in self._known for k in keys), dtype=bool, count=len(keys))
        self._counters.num_blocks_skipped += int((~fresh).sum())
        coro = self._store(job_metadata.job_id, keys, ids, fresh)
        self._futures[job_metadata.job_id] = self.loop.submit(coro)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, ids = job_chunks(job_metadata, self._num_chunks, store=False)  # InvalidBlockError
        self._counters.num_load_jobs += 1
        self._futures[job_metadata.job_id] = self.loop.submit(
            self._load(job_metadata.job_id, keys, ids)
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        for job_id in [j for j, f in self._futures.items() if f.done()]:
            self._results.put(self._futures.pop(job_id).result())
        results = []
        while not self._results.empty():
            results.append(self._apply(self._results.get_nowait()))
        return results

    def has_pending_work(self) -> bool:
        return bool(self._futures) or not self._results.empty()

    def drain_jobs(self) -> None:
        concurrent.futures.wait(list(self._futures.values()))
        for job_id in list(self._futures):
            self._results.put(self._futures.pop(job_id).result())

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def shutdown(self) -> None:
        """Wait for the jobs in flight, stop the lookup thread, close the backend and the loop,
        and let go of the primary tier's memory (vLLM unmaps it next)."""
        if self._closed_bridge is not None:
            return
        try:
            self.drain_jobs()
            self._lookups.shutdown()
            self.loop.run(self.backend.aclose())
        finally:
            self.loop.close()
            self._closed_bridge = self.bridge.statistics()
            del self.bridge  # the bridge holds a numpy view of the primary tier's mmap

    def statistics(self) -> TierJobStatistics:
        """Totals since construction (see `TierJobStatistics`)."""
        return TierJobStatistics(
            **attrs.asdict(self._counters),
            backend=self.backend.statistics(),
            bridge=self._closed_bridge or self.bridge.statistics(),
        )

    # -- jobs (on the tier's loop) ------------------------------------------------------------

    async def _store(
        self, job_id: int, keys: list[OffloadKey], ids: np.ndarray, fresh: np.ndarray
    ) -> Outcome:
        t0 = time.perf_counter()
        done = ~fresh
        try:
            if fresh.any():
                done[fresh] = await self.bridge.demote(
                    [k for k, f in zip(keys, fresh) if f], ids[fresh]
                )
        except Exception:
            _log.exception("kvmgr tier %s: store job %d failed", self.tier_type, job_id)
            return Outcome(job_id, False, keys, np.zeros(len(keys), bool), 0, 0.0, 0, crashed=True)
        moved = int((done & fresh).sum())
        seconds = time.perf_counter() - t0
        return Outcome(job_id, False, keys, done, moved, seconds, moved * self._payload_bytes)

    async def _load(self, job_id: int, keys: list[OffloadKey], ids: np.ndarray) -> Outcome:
        t0 = time.perf_counter()
        try:
            done = await self.bridge.promote(keys, ids)
        except Exception:
            _log.exception("kvmgr tier %s: load job %d failed", self.tier_type, job_id)
            return Outcome(job_id, True, keys, np.zeros(len(keys), bool), 0, 0.0, 0, crashed=True)
        moved = int(done.sum())
        seconds = time.perf_counter() - t0
        return Outcome(job_id, True, keys, done, moved, seconds, moved * self._payload_bytes)

    # -- results (scheduler thread) -----------------------------------------------------------

    def _apply(self, outcome: Outcome) -> JobResult:
        c, keys, done = self._counters, outcome.keys, outcome.done
        ok = bool(done.all()) and not outcome.crashed
        c.num_unexpected_errors += outcome.crashed
        good = [k for k, d in zip(keys, done) if d]
        remember(self._known, good, self._max_known)
        for key in good:
            self._absent.pop(key, None)
        if not outcome.is_load:
            c.num_store_failed += not ok
            c.num_blocks_stored += outcome.num_moved
            if good and self._events is not None:
                self._events.append(
                    OffloadingEvent(good, self.medium, False, self.locality, self.tier_type)  # type: ignore[arg-type]
                )
            return JobResult(outcome.job_id, ok, None, outcome.seconds, outcome.num_bytes)
        c.num_load_failed += not ok
        c.num_blocks_loaded += len(good)
        c.num_blocks_missed += len(keys) - len(good)
        if not ok:  # what did not arrive is a MISS until stored again (no promotion loop)
            missed = [k for k, d in zip(keys, done) if not d]
            for key in missed:
                self._known.pop(key, None)
            remember(self._absent, missed, self._max_known)
            self._lookups.mark_miss(missed)
        return JobResult(
            outcome.job_id, ok, None if ok else good, outcome.seconds, outcome.num_bytes
        )
