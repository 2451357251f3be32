"""The arithmetic under ``build_plan``, second half: runs -> descriptors (private; the first
half, block ids -> runs, is ``kvmgr.transfer._runs``).

Offers (to :mod:`kvmgr.transfer.plan`):
    LayoutPair      the geometry of a (source, destination) layout pair, checked once: dense
                    tensors, block bytes, and the stacked base/stride/page arrays descriptors
                    are computed from in a few numpy operations (``descriptors``)
    layout_pair     the cached ``LayoutPair`` of two layouts (keyed by identity, last 64 kept)

Host cost is the point of this module: a serving loop calls ``build_plan`` once per step with
cold caches, where each numpy call costs several microseconds, so one dense run's descriptors
are one ``np.dot`` and no per-pair or per-tensor Python runs anywhere. A layout's arrays are
never written after it is built (``KVLayout`` is frozen; the copy kernel's stager caches by
identity too).
"""

from __future__ import annotations

import threading

import numpy as np

from kvmgr.errors import GeometryError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer._runs import Runs

__all__ = ["LayoutPair", "layout_pair"]

_MAX_PAIRS = 64
_PAIRS: dict[tuple[KVLayout, KVLayout], LayoutPair] = {}
_PAIRS_LOCK = threading.Lock()


class _Tensors:
    """Some tensors of a pair as two ``[3, T, 1]`` int64 tables, so that a descriptor is
    ``scale * (run source block, run destination block, run length) + base`` for all of them in
    one broadcast: ``scale`` holds the source and destination block strides and the page bytes,
    ``base`` the source and destination base addresses and 0."""

    __slots__ = ("base", "count", "matrix", "scale")

    def __init__(self, src: KVLayout, dst: KVLayout, pick: np.ndarray) -> None:
        pages = src.page_bytes[pick]
        self.count = count = len(pages)
        zeros = np.zeros_like(pages)
        self.scale = np.stack((src.block_strides[pick], dst.block_strides[pick], pages))[..., None]
        self.base = np.stack((src.base_addrs[pick], dst.base_addrs[pick], zeros))[..., None]
        # [3 * count, 4]: row r of tensor t is scale[r, t] in column r and base[r, t] in column 3,
        # so that matrix @ (src block, dst block, length, 1) is one run's descriptors (one C call)
        matrix = np.zeros((3, count, 4), dtype=np.int64)
        for row in range(3):
            matrix[row, :, row] = self.scale[row, :, 0]
        matrix[:, :, 3] = self.base[:, :, 0]
        self.matrix = matrix.reshape(3 * count, 4)

    def fill_one(self, out: np.ndarray, src_block: int, dst_block: int, length: int) -> None:
        """Write one run's descriptors into ``out`` (int64 ``[3, count]``, C-contiguous)."""
        run = np.array((src_block, dst_block, length, 1), dtype=np.int64)
        np.dot(self.matrix, run, out=out.reshape(-1))

    def fill(self, out: np.ndarray, runs: np.ndarray) -> None:
        """Write into ``out`` (int64 ``[3, count * K]``, rows contiguous) the descriptors of
        ``runs`` (int64 ``[3, K]``: first source block, first destination block, blocks; or
        ``[2, K]`` when every run is one block), tensor-major."""
        view = out.reshape(3, self.count, runs.shape[1])
        if len(runs) == 3:
            np.multiply(self.scale, runs[:, None, :], out=view)
            view += self.base
            return
        addrs = view[:2]
        np.multiply(self.scale[:2], runs[:, None, :], out=addrs)
        addrs += self.base[:2]
        view[2] = self.scale[2]  # one page each


class LayoutPair:
    """A source and a destination layout with equal page bytes per tensor.

    Attributes:
        src, dst: the layouts.
        num_tensors: tensors of each.
        block_bytes: bytes of one block over all tensors.
        num_dense: tensors dense on both sides (block stride == page bytes), whose runs of
            consecutive blocks are one descriptor each.

    Raises:
        GeometryError: the layouts differ in tensor count or page bytes.
    """

    __slots__ = ("_dense", "_paged", "block_bytes", "dst", "num_dense", "num_tensors", "src")

    def __init__(self, src: KVLayout, dst: KVLayout) -> None:
        if src.num_tensors != dst.num_tensors or not np.array_equal(src.page_bytes, dst.page_bytes):
            raise GeometryError(
                f"expected equal page bytes per tensor, got {src.page_bytes.tolist()} and "
                f"{dst.page_bytes.tolist()}"
            )
        self.src, self.dst = src, dst
        self.num_tensors = src.num_tensors
        self.block_bytes = int(src.page_bytes.sum())
        dense = src.is_dense & dst.is_dense
        self._dense = _Tensors(src, dst, dense)
        self._paged = _Tensors(src, dst, ~dense)
        self.num_dense = self._dense.count

    def num_descriptors(self, num_pairs: int, num_runs: int) -> int:
        """Descriptors of a plan of ``num_pairs`` block pairs in ``num_runs`` runs."""
        return num_runs * self.num_dense + num_pairs * (self.num_tensors - self.num_dense)

    def descriptors(self, runs: Runs, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[3, num_descriptors]``: source addresses, destination addresses and bytes;
        tensor-major, one descriptor per run in the tensors dense on both sides (listed first),
        then one per page in the others. Written into ``out`` (a C-contiguous array of that
        shape) if given, else into a new array."""
        dense, paged = self._dense, self._paged
        merged = dense.count * len(runs.run_src)
        if out is None:
            out = np.empty((3, merged + paged.count * len(runs.src_ids)), dtype=np.int64)
        if len(runs.run_src) == 1 and not paged.count:  # one run, every tensor dense
            length = 1 if runs.lengths is None else int(runs.lengths[0])
            dense.fill_one(out, int(runs.run_src[0]), int(runs.run_dst[0]), length)
            return out
        if dense.count:
            dense.fill(out[:, :merged] if paged.count else out, runs.run_table())
        if paged.count:
            paged.fill(out[:, merged:] if dense.count else out, runs.pair_table())
        return out


def layout_pair(src: KVLayout, dst: KVLayout) -> LayoutPair:
    """The ``LayoutPair`` of ``src`` and ``dst``, built once per pair of layout objects.

    Raises:
        GeometryError: the layouts differ in tensor count or page bytes.
    """
    key = (src, dst)
    pair = _PAIRS.get(key)
    if pair is None:
        pair = LayoutPair(src, dst)
        with _PAIRS_LOCK:  # a miss: rare, and the oldest pair is dropped under the lock
            if len(_PAIRS) >= _MAX_PAIRS:
                _PAIRS.pop(next(iter(_PAIRS)), None)
            _PAIRS[key] = pair
    return pair
