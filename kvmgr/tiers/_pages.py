"""The CPU tier's pages as numpy arrays: gathered into blob rows, scattered back from blobs.

Private to ``kvmgr.tiers`` (``TierBridge`` holds one). Offers:
    CpuPages    checks the tensors, then ``gather`` (blocks -> blob rows, headers encoded),
                ``verify_scatter`` (blobs verified against the namespace, the good ones'
                payloads -> blocks), ``pages`` (one block's page views) and a pool of reusable
                staging arrays
    OK, LAYOUT, CORRUPT   the verdicts of one blob

Both copies are array programs: where the tensors are equal-page slices of one region
(``HostKVPool``'s layout) one strided copy per block over a ``[tensor, block, byte]`` view,
otherwise one numpy ``take``/fancy assignment per tensor per batch.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvmgr.errors import GeometryError, InvalidBlockError, InvalidKeyError
from kvmgr.tiers.blob import HEADER_BYTES, TierNamespace, encode_rows, verify_parts

__all__ = ["CORRUPT", "LAYOUT", "OK", "CpuPages"]


class CpuPages:
    """Numpy views of the CPU tier's tensors, and the copies between them and blob rows.

    Args:
        cpu_tensors: one uint8 CPU tensor ``[num_blocks, page_bytes[t]]`` per KV tensor, rows
            C-contiguous; ``page_bytes`` must equal ``namespace.page_bytes``.
        namespace: the layout (page and blob sizes).

    Raises:
        GeometryError: tensors not uint8 CPU 2-D with contiguous rows, differing block counts,
            or page bytes other than the namespace's.

    Thread-safe where the bridge needs it: staging arrays are taken and given back under a
    lock (worker threads of concurrent calls share them); the copies themselves touch only the
    blocks and rows they are given.
    """

    def __init__(self, cpu_tensors: Sequence[torch.Tensor], namespace: TierNamespace) -> None:
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
        self.namespace = namespace
        self.num_blocks = int(tensors[0].shape[0])
        self._arrays = [t.numpy() for t in tensors]
        self._stack = _as_stack(self._arrays)
        self._offsets = np.concatenate([[0], np.cumsum(page_bytes)]).tolist()
        # reusable staging arrays (fresh memory costs a page fault per 4 KiB on every batch)
        self._spare_rows: list[np.ndarray] = []
        self._spare_stage: list[np.ndarray] = []
        self._lock = threading.Lock()

    @property
    def num_tensors(self) -> int:
        """KV tensors (pages per block)."""
        return len(self._arrays)

    def check_ids(
        self, cpu_block_ids: Sequence[int] | np.ndarray, num_keys: int, *, distinct: bool
    ) -> np.ndarray:
        """``cpu_block_ids`` as int64 ``[num_keys]``, every id in range (and distinct).

        Raises:
            InvalidBlockError: not a 1-D int array, an id out of range, or repeated ids where
                ``distinct``.
            InvalidKeyError: not one id per key.
        """
        ids = np.asarray(cpu_block_ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise InvalidBlockError(f"cpu_block_ids: expected a 1-D int array, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if len(ids) != num_keys:
            raise InvalidKeyError(
                f"expected one cpu block id per key, got {len(ids)} for {num_keys}"
            )
        bad = (ids < 0) | (ids >= self.num_blocks)
        if bad.any():
            raise InvalidBlockError(
                f"cpu block id {int(ids[bad][0])} out of range [0, {self.num_blocks})"
            )
        if distinct and len(np.unique(ids)) != len(ids):
            raise InvalidBlockError("cpu_block_ids: expected distinct ids for promote")
        return ids

    def take_rows(self, num: int, row_bytes: int, *, aligned: bool) -> np.ndarray:
        """A uint8 ``[>= num, row_bytes]`` staging array (a spare one when there is one);
        ``aligned``: a new one starts on a page boundary (``mmap``)."""
        return _take(self._lock, self._spare_rows, max(1, num), row_bytes, aligned=aligned)

    def give_back_rows(self, buffer: np.ndarray) -> None:
        """Return a staging array of ``take_rows`` nothing reads any more."""
        with self._lock:
            self._spare_rows.append(buffer)

    def pages(self, block: int) -> list[np.ndarray]:
        """Block ``block``'s page of every tensor, in tensor order (views, no copy)."""
        if self._stack is not None:
            return list(self._stack[:, block])
        return [arr[block] for arr in self._arrays]

    def gather(self, ids: np.ndarray, stored_keys: list[bytes], rows: np.ndarray) -> None:
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
        encode_rows(rows, stored_keys, self.namespace)

    def scatter(self, ids: np.ndarray, payloads: list[memoryview]) -> None:
        """Write payload ``i`` (one page of every tensor, verified) into block ``ids[i]``."""
        if self._stack is not None:  # one copy per block, straight from the blob
            shape = self._stack.shape[0], self._stack.shape[2]
            for block, payload in zip(ids.tolist(), payloads):
                self._stack[:, block, :] = np.frombuffer(payload, dtype=np.uint8).reshape(shape)
            return
        payload_bytes = self.namespace.payload_bytes
        buffer = _take(self._lock, self._spare_stage, len(payloads), payload_bytes)
        stage = buffer[: len(payloads)]
        for i, payload in enumerate(payloads):
            stage[i] = np.frombuffer(payload, dtype=np.uint8)
        for t, arr in enumerate(self._arrays):
            arr[ids] = stage[:, self._offsets[t] : self._offsets[t + 1]]
        with self._lock:
            self._spare_stage.append(buffer)

    def judge(self, stored_key: bytes, header: Any, payload: Sequence[Any]) -> int:
        """``OK``, ``LAYOUT`` (another fingerprint or size) or ``CORRUPT`` for one blob."""
        # the payload's length is known when it is one page of every tensor (no need to add up)
        one_page_each = len(payload) == self.num_tensors > 1
        payload_bytes = self.namespace.payload_bytes if one_page_each else None
        if verify_parts(stored_key, header, payload, self.namespace, payload_bytes):
            return OK
        fingerprint = bytes(memoryview(header).cast("B")[8:24])
        return LAYOUT if fingerprint != self.namespace.fingerprint else CORRUPT

    def verify_scatter(
        self, stored_keys: list[bytes], ids: np.ndarray, blobs: list[Any], verdict: np.ndarray
    ) -> None:
        """Verify each blob (``verdict[i]``), then scatter the good ones into ``ids``."""
        good, payloads = [], []
        for i, blob in enumerate(blobs):
            view = memoryview(blob).cast("B")
            if view.nbytes < HEADER_BYTES:
                verdict[i] = CORRUPT
                continue
            verdict[i] = self.judge(stored_keys[i], view[:HEADER_BYTES], [view[HEADER_BYTES:]])
            if verdict[i] == OK and view.nbytes != self.namespace.blob_bytes:
                verdict[i] = LAYOUT  # (cannot pass with the namespace's fingerprint)
            if verdict[i] == OK:
                good.append(i)
                payloads.append(view[HEADER_BYTES:])
        if good:
            self.scatter(ids[good], payloads)


OK, LAYOUT, CORRUPT = 1, 2, 3  # verdicts of one blob (0: not judged)


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
