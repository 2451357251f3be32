"""Moving blocks between the CPU tier's pages and a lower tier.

Offers:
    TierBridge          ``stage`` + ``put_staged`` (CPU blocks -> blobs -> backend; ``demote``
                        does both) and ``promote`` (backend -> verified blobs -> CPU blocks)
                        over one ``TierBackend``
    StagedBlobs         blobs gathered by ``stage``, not written yet
    BridgeStatistics    frozen counters of one bridge (totals)

The manager calls it for write-back demotion on CPU eviction, for write-through, and to stage a
lower-tier hit through CPU blocks before the H2D copy. There is one write path: blocks are
gathered into blob rows (``stage``; the manager does it at once, before anything can overwrite
the evicted blocks) and the rows are written (``put_staged``); ``demote`` is the two in a
pipeline (gathering chunk k + 1 while chunk k is written), so ``kvmgr bench tiers`` times the
copies the manager makes. Gather and scatter are array programs (``kvmgr.tiers._pages``), run
in a worker thread when a batch is larger than ``offload_bytes`` so the event loop keeps
serving. A backend with ``get_into`` (the shared tier) receives read blobs straight into the
pages. Tier errors never escape ``demote``/``put_staged``/``promote``: they become ``False``
entries (recompute) and are counted here and in the backend's statistics.

The read path (``kvmgr.tiers._bridge_reads``) and the write path share one failure log. Every
blob read is verified against the namespace (``blob.verify_parts``: layout, the checksum, the
tenant's MAC), before its block counts as a hit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import warnings
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch

from kvmgr.errors import (
    GeometryError,
    TierError,
    TierSecurityWarning,
)
from kvmgr.tiers._bridge_reads import BridgeReads, FailureLog, retrieve
from kvmgr.tiers._bridge_records import BridgeCounters, BridgeStatistics, StagedBlobs
from kvmgr.tiers._pages import CpuPages
from kvmgr.tiers.base import TierBackend, check_keys, join_worker
from kvmgr.tiers.blob import TierNamespace

__all__ = ["BridgeStatistics", "StagedBlobs", "TierBridge"]

_log = logging.getLogger(__name__)


class TierBridge:
    """Gathers CPU blocks into blobs for a backend and scatters verified blobs back.

    Args:
        cpu_tensors: the CPU tier's pages, one uint8 CPU tensor ``[num_cpu_blocks, page_bytes[t]]``
            per KV tensor (``HostKVPool.tensors``), C-contiguous rows; read by ``demote``,
            written in place by ``promote``.
        backend: any ``TierBackend``.
        namespace: model, layout and tenant; ``namespace.page_bytes`` must equal the tensors'.
        offload_bytes: batches of more payload bytes than this gather/scatter in a worker thread.

    Raises:
        GeometryError: tensors not uint8 CPU 2-D, differing block counts, page bytes that differ
            from ``namespace.page_bytes``, or backend slots (``slot_bytes``) too small for a blob.

    Warns:
        TierSecurityWarning: a namespace without a tenant salt over a backend that declares
            ``single_tenant = False`` (a shared server not declared single-tenant): anyone who
            can write to the server can plant blobs this instance would load.

    The caller keeps the CPU blocks of an in-flight ``demote`` unmodified and of an in-flight
    ``promote`` unread until the await ends. However it ends (a result, an error, a
    cancellation, an ``asyncio.wait_for`` budget), no worker thread reads or writes the blocks
    afterwards: a cancellation takes effect only once the gather/scatter (or zero-copy I/O)
    thread in progress has let go (one batch's copy, or the backend's deadline), so the caller
    may hand the blocks out again at once. What a cancelled ``promote`` leaves in its blocks is
    unspecified (some may hold verified pages); a cancelled ``demote`` may still store blobs
    that were complete before the cancellation. A block whose blob misses or fails
    verification is never reported a hit; with a zero-copy backend its bytes may have been
    overwritten by the rejected value (the manager drops such blocks).
    """

    def __init__(
        self,
        cpu_tensors: Sequence[torch.Tensor],
        backend: TierBackend,
        namespace: TierNamespace,
        *,
        offload_bytes: int = 1 << 20,
    ) -> None:
        self._pages = CpuPages(cpu_tensors, namespace)
        slot_bytes = getattr(backend, "slot_bytes", None)
        if isinstance(slot_bytes, int) and slot_bytes < namespace.blob_bytes:
            raise GeometryError(
                f"expected backend slots of >= {namespace.blob_bytes} B (one blob), got {slot_bytes}"
            )
        self.num_blocks = self._pages.num_blocks
        self.backend = backend
        self.namespace = namespace
        self._offload_bytes = offload_bytes
        self._counters = BridgeCounters()
        self._failures = FailureLog(self._counters, backend)
        # a backend doing direct I/O asks for aligned blobs padded to its alignment, which it
        # then writes without another copy (pwritev straight from these rows)
        align = max(1, int(getattr(backend, "blob_alignment", 1)))
        self._row_bytes = -(-namespace.blob_bytes // align) * align
        self._aligned = align > 1
        # a backend without round trips (disk) takes a batch in chunks, so the bridge can
        # overlap gathering/scattering one chunk with the I/O of another
        chunk_bytes = getattr(backend, "chunk_bytes", None)
        self._chunk_blocks = (
            max(1, int(chunk_bytes) // namespace.blob_bytes) if chunk_bytes else 1 << 62
        )
        self._reads = BridgeReads(
            self._pages, backend, namespace, self._counters, self._failures, self._chunk_blocks,
            self._maybe_thread,
        )  # fmt: skip
        if not namespace.is_sealed and getattr(backend, "single_tenant", True) is False:
            _warn_unsealed(type(backend).__name__)

    def statistics(self) -> BridgeStatistics:
        """Totals since construction."""
        return BridgeStatistics(**attrs.asdict(self._counters))

    # ---- writes: stage, then put ----------------------------------------------------------

    async def demote(
        self, keys: Sequence[bytes], cpu_block_ids: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """Write CPU blocks ``cpu_block_ids[i]`` to the backend under ``keys[i]``: ``stage``
        and ``put_staged`` per chunk, gathering chunk k + 1 while chunk k is written.

        Args:
            keys: caller keys (block hashes), distinct, ``bytes``.
            cpu_block_ids: int ``[n]`` CPU block ids, in range.

        Returns:
            bool ``[n]``: ``True`` where the backend stored the block; all ``False`` after a tier
            error (counted; the CPU blocks are untouched either way).

        Raises:
            InvalidKeyError, InvalidBlockError: bad input, before anything is read.
        """
        keys, ids = self._check(keys, cpu_block_ids, distinct_keys=True)
        stored = np.zeros(len(keys), dtype=bool)
        puts = []
        for lo in range(0, len(keys), self._chunk_blocks):
            part = slice(lo, lo + self._chunk_blocks)
            staged = self._stage_rows(self.namespace.stored_keys(keys[part]))
            gather = functools.partial(
                self._pages.gather, ids[part], staged.stored_keys, staged.rows
            )
            await self._maybe_thread(len(staged.stored_keys), gather)
            task = asyncio.ensure_future(self.put_staged(staged))
            task.add_done_callback(retrieve)
            puts.append((part, task))
        for part, task in puts:
            stored[part] = await task
        return stored

    def stage(
        self, keys: Sequence[bytes], cpu_block_ids: Sequence[int] | np.ndarray
    ) -> StagedBlobs:
        """Gather CPU blocks into blobs NOW (synchronously), for ``put_staged`` later: the
        manager stages blocks it just evicted before anything overwrites them.

        Raises:
            InvalidKeyError, InvalidBlockError: bad input, before anything is read.
        """
        keys, ids = self._check(keys, cpu_block_ids)
        staged = self._stage_rows(self.namespace.stored_keys(keys))
        if keys:
            self._pages.gather(ids, staged.stored_keys, staged.rows)
        return staged

    async def put_staged(self, staged: StagedBlobs) -> np.ndarray:
        """Write blobs gathered by ``stage`` in one ``put_many``.

        Returns:
            bool ``[n]`` as ``demote``: all ``False`` after a tier error (counted).
        """
        num = len(staged.stored_keys)
        if not num:
            return np.zeros(0, dtype=bool)
        try:
            result = await self.backend.put_many(staged.stored_keys, list(staged.padded))
        except TierError as exc:
            # (the buffer is dropped, not reused: a timed-out write may still be reading it)
            self._failures.failed("demote", num, exc)
            stored = np.zeros(num, dtype=bool)
        else:
            self._pages.give_back_rows(staged.buffer)
            self._failures.succeeded()
            stored = np.asarray(result.stored, dtype=bool)
        num_stored = int(stored.sum())
        self._counters.num_demoted += num_stored
        self._counters.num_demote_failed += num - num_stored
        self._counters.bytes_demoted += num_stored * self.namespace.payload_bytes
        return stored

    def _stage_rows(self, stored_keys: list[bytes]) -> StagedBlobs:
        num = len(stored_keys)
        buffer = self._pages.take_rows(num, self._row_bytes, aligned=self._aligned)
        padded = buffer[:num]
        return StagedBlobs(stored_keys, buffer, padded, padded[:, : self.namespace.blob_bytes])

    # ---- reads: get, verify, scatter ------------------------------------------------------

    async def promote(
        self, keys: Sequence[bytes], cpu_block_ids: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """Read ``keys[i]`` from the backend into CPU block ``cpu_block_ids[i]``.

        Args:
            keys: caller keys, ``bytes``.
            cpu_block_ids: int ``[n]`` distinct CPU block ids, in range; written in place.

        Returns:
            bool ``[n]``: ``True`` where the block now holds the stored pages. A miss, a corrupt
            value, another layout's blob or a tier error gives ``False`` and leaves that CPU
            block untouched.

        Raises:
            InvalidKeyError, InvalidBlockError: bad input, before anything is read or written.
        """
        keys, ids = self._check(keys, cpu_block_ids, distinct_ids=True)
        hit = np.zeros(len(keys), dtype=bool)
        if not keys:
            return hit
        hit = await self._reads.read(self.namespace.stored_keys(keys), ids)
        num_hits = int(hit.sum())
        self._counters.num_promoted += num_hits
        self._counters.num_promote_misses += len(keys) - num_hits
        self._counters.bytes_promoted += num_hits * self.namespace.payload_bytes
        return hit

    # ---- internals ----------------------------------------------------------------------

    def _check(
        self,
        keys: Sequence[bytes],
        cpu_block_ids: Sequence[int] | np.ndarray,
        *,
        distinct_ids: bool = False,
        distinct_keys: bool = False,
    ) -> tuple[list[bytes], np.ndarray]:
        keys = check_keys(keys, distinct=distinct_keys)
        ids = self._pages.check_ids(cpu_block_ids, len(keys), distinct=distinct_ids)
        return keys, ids

    async def _maybe_thread(self, num_blocks: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` in a worker thread when the batch is large, else inline.

        ``fn`` reads or writes CPU blocks, so a cancelled await returns only after the worker
        has finished (``join_worker``): the caller may reuse the blocks as soon as it regains
        control, however the call ended.
        """
        if num_blocks * self.namespace.payload_bytes > self._offload_bytes:
            await join_worker(asyncio.get_running_loop().run_in_executor(None, fn))
        else:
            fn()


def _warn_unsealed(backend_name: str) -> None:
    message = (
        f"TierBridge over {backend_name}: the namespace has no tenant_salt, so "
        "its blobs are not sealed and anyone who can write to the server can plant KV "
        "this instance loads; set TierNamespace(tenant_salt=...) or declare the backend "
        "single_tenant=True (docs/tiers.md)"
    )
    _log.warning(message)
    warnings.warn(message, TierSecurityWarning, stacklevel=3)
