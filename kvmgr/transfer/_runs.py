"""The arithmetic under ``build_plan``, first half: block ids -> runs (private; runs ->
descriptors is ``kvmgr.transfer._pairs``).

Offers (to :mod:`kvmgr.transfer.plan`):
    Runs            block pairs sorted and cut into runs of consecutive ids on both sides
    find_runs       checked block ids -> ``Runs``, O(pairs): one C call where it builds, else
                    ``find_runs_numpy``, about a dozen numpy operations
    int_ids         ids as a 1-D int64 array (no copy for one already)
    check_hazards   reject a batch that writes one destination twice

Host cost is the point: a serving loop calls ``build_plan`` once per step with cold caches,
where each numpy call costs several microseconds, so consecutive ids (one run) are found,
range-checked and hazard-checked by one byte comparison with a slice of a cached range.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvmgr.errors import HazardError, InvalidBlockError
from kvmgr.transfer._plan_c import sort_pairs

__all__ = ["Runs", "check_hazards", "find_runs", "find_runs_numpy", "int_ids"]

_I64 = np.dtype(np.int64)
_MAX_IOTA = 1 << 21  # the cached range of block ids: at most 16 MiB
_IOTA = np.arange(4096, dtype=np.int64)
_ONE_RUN: dict[int, np.ndarray] = {}  # n -> read-only int64 [n]: one run's lengths, 64 kept
_MAX_ONE_RUN = 64


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

    Merged pairs that are valid are checked and sorted in one C call where kvmgr's C modules
    build (:mod:`kvmgr.transfer._plan_c`; its result is exactly the numpy path's); anything
    else, and every error, takes the numpy path (:func:`find_runs_numpy`).

    Raises:
        InvalidBlockError: an id is outside ``[0, num_src)`` / ``[0, num_dst)``.
        HazardError: a destination block repeats.
    """
    n = len(s)
    if merge and n > 1 and (sort := sort_pairs()) is not None:
        code = sort(s, d, num_src, num_dst, None, None)
        if code == 0:  # both consecutive: one run
            return Runs(s, d, s[:1], d[:1], _one_run(n), n)
        if code == 3:  # else sorted into new arrays
            s_out, d_out = np.empty(n, dtype=_I64), np.empty(n, dtype=_I64)
            code = sort(s, d, num_src, num_dst, s_out, d_out)
            if code == 1:  # sorted, no pair continues its neighbour on both sides
                return Runs(s_out, d_out, s_out, d_out, None, 1)
            if code == 2:
                breaks = s_out[1:] - s_out[:-1] != 1
                breaks |= d_out[1:] - d_out[:-1] != 1
                return _merged(s_out, d_out, breaks)
    return find_runs_numpy(s, d, num_src, num_dst, merge)


def find_runs_numpy(s: np.ndarray, d: np.ndarray, num_src: int, num_dst: int, merge: bool) -> Runs:  # fmt: skip
    """``find_runs`` in numpy alone (the same arguments, result and errors).

    The numpy calls are chosen for a cold cache (C methods, no ufunc where a byte comparison
    does): consecutive ids are recognised by comparing their bytes with a range's."""
    n = len(s)
    d_range = _is_range(d, n, num_dst)  # consecutive destinations: in range, no repeat
    if merge and d_range and _is_range(s, n, num_src):  # the common case: one run
        return Runs(s, d, s[:1], d[:1], _one_run(n), n)
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
    return _merged(s, d, breaks)


def _one_run(n: int) -> np.ndarray:
    """``[n]`` as a read-only int64 array, kept for the last ``_MAX_ONE_RUN`` counts (a steady
    loop's plans share it; nobody writes a plan's arrays, and a write would raise)."""
    lengths = _ONE_RUN.get(n)
    if lengths is None:
        lengths = np.array([n], dtype=np.int64)
        lengths.flags.writeable = False
        if len(_ONE_RUN) >= _MAX_ONE_RUN:
            _ONE_RUN.clear()
        _ONE_RUN[n] = lengths
    return lengths


def _merged(s: np.ndarray, d: np.ndarray, breaks: np.ndarray) -> Runs:
    """The runs of sorted pairs ``s -> d`` given where they break (bool ``[n - 1]``)."""
    starts = np.flatnonzero(breaks)
    starts += 1
    bounds = np.concatenate(((0,), starts, (len(s),)))
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
