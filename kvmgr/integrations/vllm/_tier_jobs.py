"""What `KvmgrTierManager`'s jobs hand back and count, and the namespace of its stored keys.

Private to ``kvmgr.integrations.vllm``.

Offers:
    TierJobStatistics   totals of one tier manager (what ``statistics()`` returns)
    Counters            the running totals behind it
    Outcome             what a job's coroutine hands back to the scheduler thread
    remember            add keys at the recent end of a bounded LRU set
    job_chunks          a submitted job's keys and chunk ids, checked before it runs
    Lookups             vLLM's async lookup front end over the tier's backend
    namespace_of        a vLLM instance's model, parallel layout and chunk geometry as a
                        kvmgr ``TierNamespace``
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any

import attrs
import numpy as np
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

from kvmgr.errors import InvalidBlockError, InvalidKeyError
from kvmgr.tiers import BridgeStatistics, TierNamespace, TierStatistics

__all__ = [
    "Counters",
    "Lookups",
    "Outcome",
    "TierJobStatistics",
    "job_chunks",
    "namespace_of",
    "remember",
]


@attrs.define
class _JobTotals:
    """The counter fields of one tier manager, declared once (``TierJobStatistics`` documents
    them)."""

    num_store_jobs: int = 0
    num_load_jobs: int = 0
    num_store_failed: int = 0
    num_load_failed: int = 0
    num_blocks_stored: int = 0
    num_blocks_skipped: int = 0
    num_blocks_loaded: int = 0
    num_blocks_missed: int = 0
    num_unexpected_errors: int = 0


@attrs.frozen
class TierJobStatistics(_JobTotals):
    """Totals of one tier manager since construction (jobs and blocks are counts).

    Attributes:
        num_store_jobs / num_load_jobs: jobs submitted by vLLM.
        num_store_failed / num_load_failed: jobs reported ``success=False``.
        num_blocks_stored: blocks written by store jobs (already present ones not counted).
        num_blocks_skipped: blocks of store jobs already in the tier (not written again).
        num_blocks_loaded / num_blocks_missed: blocks of load jobs verified / not delivered.
        num_unexpected_errors: jobs that raised something other than a tier error (a bug).
        backend: the backend's own counters (timeouts, errors, malformed values, last error).
        bridge: the bridge's counters (layout mismatches, corrupt or unsealed blobs, tier errors
            turned into misses).
    """

    backend: TierStatistics = attrs.field(kw_only=True)
    bridge: BridgeStatistics = attrs.field(kw_only=True)


@attrs.define
class Counters(_JobTotals):
    """The running totals behind `TierJobStatistics` (changed on the scheduler thread)."""


@attrs.frozen
class Outcome:
    """What a job's coroutine hands back: per key, whether it landed (store) or arrived (load)."""

    job_id: int
    is_load: bool
    keys: list[OffloadKey]
    done: np.ndarray  # bool [len(keys)]
    num_moved: int  # blocks written (store: those not already there) or read (load)
    seconds: float
    num_bytes: int
    crashed: bool = False


class Lookups(AsyncLookupManager):
    """vLLM's async lookup front end of a ``KvmgrTierManager``; the batch runs on the tier's
    loop (``contains_many``)."""

    def __init__(self, tier: Any) -> None:
        self._tier = tier
        super().__init__(tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        stored = tier.namespace.stored_keys(keys)
        found = tier.loop.run(tier.backend.contains_many(stored))
        return [bool(x) for x in found]


def remember(
    keys_seen: OrderedDict[OffloadKey, None], keys: Collection[OffloadKey], limit: int
) -> None:
    """Add ``keys`` at the recent end of a bounded LRU set."""
    for key in keys:
        keys_seen[key] = None
        keys_seen.move_to_end(key)
    while len(keys_seen) > limit:
        keys_seen.popitem(last=False)


def job_chunks(job: Any, num_chunks: int, *, store: bool) -> tuple[list[OffloadKey], np.ndarray]:
    """A vLLM ``TransferJob``'s keys and chunk ids (int64 ``[n]``), checked as vLLM's tiering
    manager promises them (``SecondaryTierManager.submit_store``: "valid primary-tier slots"):
    one distinct chunk id per key, each in ``[0, num_chunks)``, and a store's keys distinct.
    A job that breaks this comes from a broken caller; it is refused before it counts or runs.

    Raises:
        InvalidBlockError: chunk ids not integers, not one per key, out of range or repeated.
        InvalidKeyError: a store's keys are not distinct ``bytes``.
    """
    keys = list(job.keys)
    ids = np.asarray(job.chunk_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise InvalidBlockError(f"job {job.job_id}: chunk_ids must be a 1-D integer array")
    if len(ids) != len(keys):
        raise InvalidBlockError(f"job {job.job_id}: {len(ids)} chunk ids for {len(keys)} keys")
    ids = ids.astype(np.int64, copy=False)
    bad = ids[(ids < 0) | (ids >= num_chunks)]
    if bad.size:
        raise InvalidBlockError(f"job {job.job_id}: chunk id {int(bad[0])} out of range [0, {num_chunks})")  # fmt: skip
    if len(np.unique(ids)) != len(ids):
        raise InvalidBlockError(f"job {job.job_id}: a chunk id twice in one job")
    if store and (len(set(keys)) != len(keys) or not all(type(k) is bytes for k in keys)):
        raise InvalidKeyError(f"job {job.job_id}: a store's keys must be distinct bytes")
    return keys, ids


def namespace_of(spec: Any, row_bytes: int, tenant_salt: str, key_prefix: str) -> TierNamespace:
    """Model, parallel layout and chunk geometry of this vLLM instance, as a kvmgr namespace.

    A chunk row holds every worker's pages in rank order (vLLM's direct layout), so the
    parallel configuration is part of the fingerprint: instances that lay rows out differently
    never read each other's blobs.
    """
    cfg = spec.config
    par = cfg.parallel
    model = (
        f"{cfg.model.name}|tp={par.tp_size}|pp={par.pp_size}|world={par.world_size}"
        f"|canonical={cfg.canonical_layout}|layout={cfg.kv_cache_layout}"
    )
    tokens_per_chunk = spec.tokens_per_block[0] * spec.blocks_per_chunk
    return TierNamespace(
        model=model,
        page_bytes=(row_bytes,),
        dtype_names=(str(cfg.model.dtype),),
        block_size=int(tokens_per_chunk),
        tenant_salt=tenant_salt.encode(),
        key_prefix=key_prefix.encode(),
    )
