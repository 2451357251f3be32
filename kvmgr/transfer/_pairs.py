"""The arithmetic under ``build_plan``: block ids -> runs, runs -> descriptors (private).

Offers (to :mod:`kvmgr.transfer.plan`):
    LayoutPair      the geometry of a (source, destination) layout pair, checked once: dense
                    tensors, block bytes, and the stacked base/stride/page arrays descriptors
                    are computed from in a few numpy operations (``descriptors``)
    layout_pair     the cached ``LayoutPair`` of two layouts (keyed by identity, last 64 kept)
    Runs            block pairs sorted and cut into runs of consecutive ids on both sides
    find_runs       checked block ids -> ``Runs``, O(pairs) in about a dozen numpy operations

Host cost is the point of this module: a serving loop calls ``build_plan`` once per step with
cold caches, where each numpy call costs several microseconds, so the common cases take as few
calls as possible: consecutive ids (one run) are found, range-checked and hazard-checked in
five, and no per-pair or per-tensor Python runs anywhere. A layout's arrays are never written
after it is built (``KVLayout`` is frozen; the copy kernel's stager caches by identity too).
"""

from __future__ import annotations

import threading

import attrs
import numpy as np

from kvmgr.errors import GeometryError, HazardError, InvalidBlockError
from kvmgr.pool.layout import KVLayout

__all__ = ["LayoutPair", "Runs", "find_runs", "layout_pair"]

_I64 = np.dtype(np.int64)
_MAX_PAIRS = 64
_PAIRS: dict[tuple[KVLayout, KVLayout], LayoutPair] = {}
_PAIRS_LOCK = threading.Lock()
_MAX_IOTA = 1 << 21  # the cached range of block ids: at most 16 MiB
_IOTA = np.arange(4096, dtype=np.int64)


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


@attrs.define(eq=False)
class Runs:
    """Block pairs in copy order and their runs.

    Not frozen (a frozen attrs ``__init__`` costs ~3x on the step's path): read-only by use.

    Attributes:
        src_ids, dst_ids: int64 ``[num_pairs]``: source and destination block of each pair
            (sorted by source block when merged).
        run_src, run_dst: int64 ``[num_runs]``: first source and destination block of each run
            (``src_ids`` and ``dst_ids`` themselves when no pairs merged).
        lengths: int64 ``[num_runs]`` blocks per run, or ``None`` when every run is one block.
        max_run: the longest run, in blocks.
    """

    src_ids: np.ndarray
    dst_ids: np.ndarray
    run_src: np.ndarray
    run_dst: np.ndarray
    lengths: np.ndarray | None
    max_run: int

    def run_table(self) -> np.ndarray:
        """int64 ``[3, num_runs]``: first source block, first destination block, blocks (or
        ``pair_table()`` when every run is one block)."""
        if self.lengths is None:
            return self.pair_table()
        return np.array((self.run_src, self.run_dst, self.lengths), dtype=np.int64)

    def pair_table(self) -> np.ndarray:
        """int64 ``[2, num_pairs]``: source block, destination block."""
        return np.array((self.src_ids, self.dst_ids), dtype=np.int64)


def int_ids(name: str, ids: object) -> np.ndarray:
    """``ids`` as a 1-D int64 array (no copy for one already).

    Raises:
        InvalidBlockError: the ids are not integers.
    """
    if type(ids) is np.ndarray and ids.dtype is _I64 and ids.ndim == 1:
        return ids
    array = np.asarray(ids).reshape(-1)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidBlockError(f"{name} block ids: expected integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def find_runs(s: np.ndarray, d: np.ndarray, num_src: int, num_dst: int, merge: bool) -> Runs:
    """Check ``s[i] -> d[i]`` (int64 ``[n]``, ``n >= 1``, equal lengths) and cut it into runs.

    With ``merge``, pairs are sorted by source block (stable) and each run of consecutive
    source and destination blocks becomes one run; without, each pair is a run, in call order.

    The numpy calls are chosen for a cold cache (C methods, no ufunc where a byte comparison
    does): consecutive ids are recognised by comparing their bytes with a range's.

    Raises:
        InvalidBlockError: an id is outside ``[0, num_src)`` / ``[0, num_dst)``.
        HazardError: a destination block repeats.
    """
    n = len(s)
    d_range = _is_range(d, n, num_dst)  # consecutive destinations: in range, no repeat
    if merge and d_range and _is_range(s, n, num_src):  # the common case: one run
        return Runs(s, d, s[:1], d[:1], np.array([n], dtype=np.int64), n)
    if merge and n > 1:
        order = s.argsort(kind="stable")
        s, d = s[order], d[order]
        _check_range("source", int(s[0]), int(s[-1]), num_src)
    else:
        _check_range("source", int(s.min()), int(s.max()), num_src)
    if not d_range:
        _check_destinations(d, num_dst)
    if not merge or n == 1:
        return Runs(s, d, s, d, None, 1)
    breaks = s[1:] - s[:-1] != 1
    if breaks.all():  # scattered sources (the common case): no run, whatever the destinations
        return Runs(s, d, s, d, None, 1)
    breaks |= d[1:] - d[:-1] != 1
    if np.count_nonzero(breaks) == n - 1:  # consecutive sources, scattered destinations
        return Runs(s, d, s, d, None, 1)
    starts = np.flatnonzero(breaks)
    starts += 1
    bounds = np.concatenate(((0,), starts, (n,)))
    lengths = bounds[1:] - bounds[:-1]
    firsts = bounds[:-1]
    return Runs(s, d, s[firsts], d[firsts], lengths, int(lengths.max()))


def check_hazards(dst_block_ids: np.ndarray) -> None:
    """Reject a batch that writes one destination block twice (docs/transfer.md, rule 5).

    Raises:
        HazardError: a destination block id occurs more than once (the first one is named).
    """
    ids = np.asarray(dst_block_ids, dtype=np.int64)
    if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):  # strictly increasing: no repeat
        return
    _check_repeats(np.sort(ids))


def _is_range(ids: np.ndarray, n: int, num_blocks: int) -> bool:
    """Whether ``ids`` (int64 ``[n]``) is ``first, first + 1, ..., first + n - 1`` inside
    ``[0, num_blocks)``: one byte comparison with a slice of a cached range."""
    first = int(ids[0])
    if first < 0 or first + n > num_blocks:
        return False
    if first + n <= _MAX_IOTA:
        return ids.tobytes() == _iota(first + n)[first:].tobytes()
    if n <= _MAX_IOTA:  # ids beyond the cached range: one subtraction more
        return (ids - first).tobytes() == _iota(n).tobytes()
    return bool((ids[1:] - ids[:-1] == 1).all())


def _iota(count: int) -> np.ndarray:
    """``arange(count)`` (``count <= _MAX_IOTA``) as a view of a cached range grown on demand
    (to twice the largest count asked for, at most ``_MAX_IOTA``)."""
    global _IOTA
    iota = _IOTA
    if len(iota) < count:
        iota = _IOTA = np.arange(min(max(2 * count, 4096), _MAX_IOTA), dtype=np.int64)
    return iota[:count]


def _check_range(name: str, low: int, high: int, num_blocks: int) -> None:
    if low < 0 or high >= num_blocks:
        bad = low if low < 0 else high
        raise InvalidBlockError(f"{name} block id {bad} out of range [0, {num_blocks})")


def _check_destinations(d: np.ndarray, num_dst: int) -> None:
    """Range and repeats of destination ids in no particular order (one sort)."""
    ordered = np.sort(d)
    _check_range("destination", int(ordered[0]), int(ordered[-1]), num_dst)
    _check_repeats(ordered)


def _check_repeats(ordered: np.ndarray) -> None:
    """``HazardError`` naming the first id that repeats in sorted ``ordered``, if one does."""
    repeats = ordered[1:] == ordered[:-1]
    if repeats.any():
        raise HazardError(
            f"destination block {int(ordered[1:][repeats][0])} is written twice in one batch"
        )
