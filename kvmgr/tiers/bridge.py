"""Moving blocks between the CPU tier's pages and a lower tier.

Offers:
    TierBridge          ``demote`` (CPU blocks -> blobs -> backend) and ``promote`` (backend ->
                        verified blobs -> CPU blocks) over one ``TierBackend``
    BridgeStatistics    frozen counters of one bridge (totals)

The manager calls it for write-back demotion on CPU eviction, for write-through, and to stage a
lower-tier hit through CPU blocks before the H2D copy. Gather and scatter are array programs:
one numpy ``take``/fancy assignment per KV tensor per batch, run in a worker thread when the batch
is larger than ``offload_bytes`` so the event loop keeps serving. Tier errors never escape
``demote``/``promote``: they become ``False`` entries (recompute) and are counted here and in the
backend's statistics.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.errors import GeometryError, InvalidBlockError, InvalidKeyError, TierError
from kvmgr.tiers.base import TierBackend, check_keys, join_worker
from kvmgr.tiers.blob import HEADER_BYTES, TierNamespace, encode_rows, verify

__all__ = ["BridgeStatistics", "StagedBlobs", "TierBridge"]

_log = logging.getLogger(__name__)


@attrs.frozen
class BridgeStatistics:
    """Totals since construction.

    Attributes:
        num_demoted: blocks written to the backend.
        num_demote_failed: blocks a failed ``put_many`` did not store.
        num_promoted: blocks read, verified and scattered into CPU blocks.
        num_promote_misses: blocks asked for and not promoted (miss, corrupt, error).
        num_layout_mismatch: blobs intact but of another layout (never scattered).
        num_errors: tier errors turned into ``False`` results.
        bytes_demoted / bytes_promoted: payload bytes moved.
    """

    num_demoted: int = 0
    num_demote_failed: int = 0
    num_promoted: int = 0
    num_promote_misses: int = 0
    num_layout_mismatch: int = 0
    num_errors: int = 0
    bytes_demoted: int = 0
    bytes_promoted: int = 0


@attrs.frozen(eq=False)
class StagedBlobs:
    """Blobs gathered by ``TierBridge.stage``, not written yet.

    Attributes:
        stored_keys: the namespaced keys, one per blob.
        buffer: the staging array (reused after a successful write).
        padded: ``buffer``'s first rows, each a blob padded to the backend's row size.
        rows: the same rows cut to ``blob_bytes``.
    """

    stored_keys: list[bytes]
    buffer: np.ndarray
    padded: np.ndarray
    rows: np.ndarray


@attrs.define
class _Counters:
    num_demoted: int = 0
    num_demote_failed: int = 0
    num_promoted: int = 0
    num_promote_misses: int = 0
    num_layout_mismatch: int = 0
    num_errors: int = 0
    bytes_demoted: int = 0
    bytes_promoted: int = 0


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

    The caller keeps the CPU blocks of an in-flight ``demote`` unmodified and of an in-flight
    ``promote`` unread until the await ends. However it ends (a result, an error, a
    cancellation, an ``asyncio.wait_for`` budget), no worker thread reads or writes the blocks
    afterwards: a cancellation takes effect only once the gather/scatter thread in progress has
    finished its copy (milliseconds for one batch), so the caller may hand the blocks out again
    at once. What a cancelled ``promote`` leaves in its blocks is unspecified (some may hold
    verified pages, the rest are untouched); a cancelled ``demote`` may still store blobs that
    were gathered before the cancellation (each complete and verified).
    """

    def __init__(
        self,
        cpu_tensors: Sequence[torch.Tensor],
        backend: TierBackend,
        namespace: TierNamespace,
        *,
        offload_bytes: int = 1 << 20,
    ) -> None:
        tensors = list(cpu_tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
                raise GeometryError(f"cpu tensor {i}: expected uint8 [num_blocks, page_bytes]")
            if t.device.type != "cpu" or t.stride(1) != 1:
                raise GeometryError(f"cpu tensor {i}: expected a CPU tensor with contiguous rows")
        page_bytes = tuple(int(t.shape[1]) for t in tensors)
        if page_bytes != namespace.page_bytes:
            raise GeometryError(
                f"expected page bytes {namespace.page_bytes} (namespace), got {page_bytes}"
            )
        if len({int(t.shape[0]) for t in tensors}) != 1:
            raise GeometryError("expected the same num_blocks in every cpu tensor")
        slot_bytes = getattr(backend, "slot_bytes", None)
        if isinstance(slot_bytes, int) and slot_bytes < namespace.blob_bytes:
            raise GeometryError(
                f"expected backend slots of >= {namespace.blob_bytes} B (one blob), got {slot_bytes}"
            )
        self._arrays = [t.numpy() for t in tensors]
        self._stack = _as_stack(self._arrays)
        self._offsets = np.concatenate([[0], np.cumsum(page_bytes)]).tolist()
        self.num_blocks = int(tensors[0].shape[0])
        self.backend = backend
        self.namespace = namespace
        self._offload_bytes = offload_bytes
        self._counters = _Counters()
        self._failing = False  # the last call failed (log once per run of failures)
        # reusable staging arrays (fresh memory costs a page fault per 4 KiB on every batch)
        self._spare_rows: list[np.ndarray] = []
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
        self._spare_stage: list[np.ndarray] = []
        self._spare_lock = threading.Lock()  # worker threads of concurrent calls share the lists

    def statistics(self) -> BridgeStatistics:
        """Totals since construction."""
        return BridgeStatistics(**attrs.asdict(self._counters))

    async def demote(
        self, keys: Sequence[bytes], cpu_block_ids: Sequence[int] | np.ndarray
    ) -> np.ndarray:
        """Write CPU blocks ``cpu_block_ids[i]`` to the backend under ``keys[i]``.

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
        if not keys:
            return stored
        stored_keys = self.namespace.stored_keys(keys)
        # gather chunk k + 1 while chunk k is being written (one chunk for round-trip backends)
        puts = []
        for lo in range(0, len(keys), self._chunk_blocks):
            part = slice(lo, lo + self._chunk_blocks)
            staged = self._stage_rows(stored_keys[part])
            gather = functools.partial(self._gather, ids[part], staged.stored_keys, staged.rows)
            await self._maybe_thread(len(staged.stored_keys), gather)
            task = asyncio.ensure_future(self._put(staged))
            task.add_done_callback(_retrieve)
            puts.append((part, task))
        for part, task in puts:
            stored[part] = await task
        self._count_demoted(stored)
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
            self._gather(ids, staged.stored_keys, staged.rows)
        return staged

    async def put_staged(self, staged: StagedBlobs) -> np.ndarray:
        """Write blobs gathered by ``stage``; returns bool ``[n]`` as ``demote``."""
        if not staged.stored_keys:
            return np.zeros(0, dtype=bool)
        stored = await self._put(staged)
        self._count_demoted(stored)
        return stored

    def _stage_rows(self, stored_keys: list[bytes]) -> StagedBlobs:
        num = len(stored_keys)
        buffer = _take(
            self._spare_lock, self._spare_rows, max(1, num), self._row_bytes, aligned=self._aligned
        )
        padded = buffer[:num]
        return StagedBlobs(stored_keys, buffer, padded, padded[:, : self.namespace.blob_bytes])

    async def _put(self, staged: StagedBlobs) -> np.ndarray:
        """One ``put_many``; bool ``[n]``, all ``False`` after a tier error (counted)."""
        num = len(staged.stored_keys)
        try:
            result = await self.backend.put_many(staged.stored_keys, list(staged.padded))
        except TierError as exc:
            # (the buffer is dropped, not reused: a timed-out write may still be reading it)
            self._report_failure("demote", num, exc)
            return np.zeros(num, dtype=bool)
        self._spare_rows.append(staged.buffer)
        self._failing = False
        return np.asarray(result.stored, dtype=bool)

    def _count_demoted(self, stored: np.ndarray) -> None:
        num_stored = int(stored.sum())
        self._counters.num_demoted += num_stored
        self._counters.num_demote_failed += len(stored) - num_stored
        self._counters.bytes_demoted += num_stored * self.namespace.payload_bytes

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
        stored_keys = self.namespace.stored_keys(keys)
        # all chunks' reads start at once; chunk k is scattered while later ones are read
        gets = []
        for lo in range(0, len(keys), self._chunk_blocks):
            part = slice(lo, lo + self._chunk_blocks)
            task = asyncio.ensure_future(self.backend.get_many(stored_keys[part]))
            task.add_done_callback(_retrieve)
            gets.append((lo, task))
        for lo, task in gets:
            try:
                blobs = await task
            except TierError as exc:
                num = len(stored_keys[lo : lo + self._chunk_blocks])
                self._report_failure("promote", num, exc)
                continue
            self._failing = False
            positions, payloads = [], []
            for i, blob in enumerate(blobs, start=lo):
                if blob is None:
                    continue
                payload = verify(stored_keys[i], blob, self.namespace.fingerprint, checksum=False)
                if payload is None or payload.nbytes != self.namespace.payload_bytes:
                    self._counters.num_layout_mismatch += 1
                    continue
                positions.append(i)
                payloads.append(payload)
            if payloads:
                part_ids = ids[positions]
                await self._maybe_thread(
                    len(payloads), functools.partial(self._scatter, part_ids, payloads)
                )
                hit[positions] = True
        num_hits = int(hit.sum())
        self._counters.num_promoted += num_hits
        self._counters.num_promote_misses += len(keys) - num_hits
        self._counters.bytes_promoted += num_hits * self.namespace.payload_bytes
        return hit

    # ---- internals ----------------------------------------------------------------------

    def _report_failure(self, what: str, num_blocks: int, exc: TierError) -> None:
        """Count a tier error; log a warning on the first of a run of failures, then debug."""
        self._counters.num_errors += 1
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        _log.log(
            level, "tier %s: %s of %d blocks failed: %s", self.backend.name, what, num_blocks, exc
        )

    def _check(
        self,
        keys: Sequence[bytes],
        cpu_block_ids: Sequence[int] | np.ndarray,
        *,
        distinct_ids: bool = False,
        distinct_keys: bool = False,
    ) -> tuple[list[bytes], np.ndarray]:
        keys = check_keys(keys, distinct=distinct_keys)
        ids = np.asarray(cpu_block_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise InvalidBlockError(f"cpu_block_ids: expected a 1-D int array, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if len(ids) != len(keys):
            raise InvalidKeyError(
                f"expected one cpu block id per key, got {len(ids)} for {len(keys)}"
            )
        bad = (ids < 0) | (ids >= self.num_blocks)
        if bad.any():
            raise InvalidBlockError(
                f"cpu block id {int(ids[bad][0])} out of range [0, {self.num_blocks})"
            )
        if distinct_ids and len(np.unique(ids)) != len(ids):
            raise InvalidBlockError("cpu_block_ids: expected distinct ids for promote")
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

    def _gather(self, ids: np.ndarray, stored_keys: list[bytes], rows: np.ndarray) -> None:
        """Fill uint8 ``rows [n, blob_bytes]``: row ``i`` = header + block ``ids[i]``'s pages."""
        if self._stack is not None:  # one strided copy per block (faster than one take per tensor)
            num_tensors, _num_blocks, page = self._stack.shape
            payloads = np.lib.stride_tricks.as_strided(  # a view of the rows' payload columns
                rows[:, HEADER_BYTES:],
                shape=(len(ids), num_tensors, page),
                strides=(rows.strides[0], page, 1),
            )
            for i, block in enumerate(ids.tolist()):
                payloads[i] = self._stack[:, block, :]
        else:
            for t, arr in enumerate(self._arrays):
                lo, hi = HEADER_BYTES + self._offsets[t], HEADER_BYTES + self._offsets[t + 1]
                np.take(arr, ids, axis=0, out=rows[:, lo:hi], mode="clip")
        encode_rows(rows, stored_keys, self.namespace.fingerprint)

    def _scatter(self, ids: np.ndarray, payloads: list[memoryview]) -> None:
        if self._stack is not None:  # one copy per block, straight from the blob
            shape = self._stack.shape[0], self._stack.shape[2]
            for block, payload in zip(ids.tolist(), payloads):
                self._stack[:, block, :] = np.frombuffer(payload, dtype=np.uint8).reshape(shape)
            return
        buffer = _take(
            self._spare_lock, self._spare_stage, len(payloads), self.namespace.payload_bytes
        )
        stage = buffer[: len(payloads)]
        for i, payload in enumerate(payloads):
            stage[i] = np.frombuffer(payload, dtype=np.uint8)
        for t, arr in enumerate(self._arrays):
            arr[ids] = stage[:, self._offsets[t] : self._offsets[t + 1]]
        self._spare_stage.append(buffer)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a task's exception retrieved (a cancelled demote/promote leaves tasks behind)."""
    if not task.cancelled():
        task.exception()


def _take(
    lock: threading.Lock,
    spares: list[np.ndarray],
    rows: int,
    width: int,
    *,
    aligned: bool = False,
) -> np.ndarray:
    """A spare uint8 ``[>= rows, width]`` array from ``spares`` (removed), or a new one.

    ``aligned``: a new array starts on a page (``mmap``), so rows of a multiple-of-4 KiB width
    are 4 KiB aligned.
    """
    with lock:
        for i, buf in enumerate(spares):
            if buf.shape[0] >= rows:
                return spares.pop(i)
        if spares:
            spares.pop(0)  # too small: let it go
    if aligned:
        return np.frombuffer(mmap.mmap(-1, rows * width), dtype=np.uint8).reshape(rows, width)
    return np.empty((rows, width), dtype=np.uint8)


def _as_stack(arrays: list[np.ndarray]) -> np.ndarray | None:
    """A ``[num_tensors, num_blocks, page]`` view over equally spaced, equal-page tensors.

    ``HostKVPool`` lays equal-page tensors out this way (one region, aligned offsets). Element
    ``[t, b, j]`` is byte ``j`` of block ``b`` of tensor ``t``, so the view touches nothing
    outside the tensors even though it spans the gaps between them. ``None`` otherwise.
    """
    if len(arrays) < 2 or len({a.shape for a in arrays}) != 1:
        return None
    if any(a.strides != (a.shape[1], 1) for a in arrays):
        return None
    gaps = np.diff(np.array([a.ctypes.data for a in arrays], dtype=np.int64))
    spacing = int(gaps[0])
    if spacing <= 0 or (gaps != spacing).any():
        return None
    num_blocks, page = arrays[0].shape
    return np.lib.stride_tricks.as_strided(
        arrays[0], shape=(len(arrays), num_blocks, page), strides=(spacing, page, 1)
    )
