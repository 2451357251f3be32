"""Block ids as they enter kvmgr: the one check of their type, and a sorted distinct set.

Offers:
    as_id_array     block ids (a sequence or an integer array) as a 1-D int64 array
    sorted_distinct the distinct values of an id array, sorted (``np.unique`` by a sort)
    check_allocated_ids
                    ids handed back to an allocator: distinct, in range, each allocated
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmgr.errors import DoubleFreeError, InvalidBlockError

__all__ = ["ALLOCATED", "FREED", "FRESH", "as_id_array", "check_allocated_ids", "sorted_distinct"]

#: State byte of each id in an allocator (``kvmgr.pool.allocator``).
FRESH, ALLOCATED, FREED = 0, 1, 2

#: The largest id an int64 id array holds.
_INT64_MAX = 2**63 - 1


def as_id_array(block_ids: object, name: str, num_blocks: int | None = None) -> np.ndarray:
    """``block_ids`` (a sequence of ints or an integer numpy array) as a 1-D int64 array.

    Args:
        block_ids: a list, tuple, range or other ``collections.abc.Sequence`` of ints, or a
            1-D integer numpy array. Iterators, generators, sets and mappings are refused (the
            check would use up an iterator; a set or a dict has no order to pair ids with keys).
        name: the pool, for error messages.
        num_blocks: the pool's size, named in the message for an id beyond the int64 range.

    Raises:
        InvalidBlockError: not a sequence of ints (bools, floats, strings and bytes refused),
            or an id beyond the int64 range (a uint64 id >= 2**63), named with the valid range.
    """
    if isinstance(block_ids, np.ndarray):
        kind = block_ids.dtype.kind
        if block_ids.ndim != 1 or (block_ids.size and kind not in "iu"):
            raise InvalidBlockError(
                f"{name}: expected a 1-D integer array of block ids, got dtype "
                f"{block_ids.dtype} and shape {block_ids.shape}"
            )
        if (
            kind == "u"
            and block_ids.itemsize == 8
            and block_ids.size
            and block_ids.max() > _INT64_MAX
        ):
            raise _out_of_range(name, int(block_ids.max()), num_blocks)
        return block_ids.astype(np.int64, copy=False)
    if type(block_ids) is not list and (
        isinstance(block_ids, (str, bytes, bytearray, memoryview))
        or not isinstance(block_ids, Sequence)
    ):
        raise InvalidBlockError(
            f"{name}: expected a sequence of int block ids (a list, a tuple or a 1-D integer "
            f"array), got {type(block_ids).__name__}"
        )
    return _list_ids(list(block_ids), name, num_blocks)


def _list_ids(ids: list[object], name: str, num_blocks: int | None) -> np.ndarray:
    for block_id in ids:
        if type(block_id) is not int and (
            isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer))
        ):
            raise InvalidBlockError(f"{name}: expected int block id, got {block_id!r}")
    try:
        return np.array(ids, dtype=np.int64)
    except OverflowError:
        bad = next(b for b in map(int, ids) if not -_INT64_MAX - 1 <= b <= _INT64_MAX)  # type: ignore[call-overload]
        raise _out_of_range(name, bad, num_blocks) from None


def _out_of_range(name: str, block_id: int, num_blocks: int | None) -> InvalidBlockError:
    valid = "[0, 2**63)" if num_blocks is None else f"[0, {num_blocks})"
    return InvalidBlockError(f"{name} block id {block_id} out of range {valid}")


def sorted_distinct(ids: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D integer array, sorted: ``np.unique(ids)`` by one sort and
    one compare (numpy 2's ``unique`` hashes, several times slower on a few hundred ids). May be ``ids`` itself (fewer than 2)."""
    if len(ids) < 2:
        return ids
    ordered = np.sort(ids)
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def check_allocated_ids(
    ids: np.ndarray, states: np.ndarray, num_blocks: int, name: str
) -> np.ndarray:
    """Validate ids handed back to an allocator: a 1-D integer array of distinct ids in
    ``[0, num_blocks)`` whose ``states`` (uint8 ``[num_blocks]``, one state byte per id) are
    all ``ALLOCATED``; returns them sorted (a copy; ``ids`` itself when empty).

    Raises:
        InvalidBlockError: not a 1-D integer array, an id out of range, repeated or never
            allocated (``name``: the pool, for the message).
        DoubleFreeError: an id was allocated before and is free now.
    """
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        got = f"{ids.ndim}-D {ids.dtype}" if isinstance(ids, np.ndarray) else type(ids).__name__
        raise InvalidBlockError(f"{name}: expected a 1-D integer id array, got {got}")
    if len(ids) == 0:
        return ids
    # one sort gives the range and the repeats (np.unique hashes: slower in numpy 2)
    ordered = np.sort(ids)
    lo, hi = int(ordered[0]), int(ordered[-1])
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise InvalidBlockError(f"{name}: block id {bad} out of range [0, {num_blocks})")
    held = states[ids]
    if not (held == ALLOCATED).all():
        bad = int(ids[bad_at := int(np.flatnonzero(held != ALLOCATED)[0])])
        if held[bad_at] == FREED:
            raise DoubleFreeError(f"{name}: block {bad} is already free")
        raise InvalidBlockError(f"{name}: block {bad} was never allocated here")
    if len(ids) > 1 and not (ordered[1:] != ordered[:-1]).all():
        raise InvalidBlockError(f"{name}: duplicate block ids in {ids.tolist()[:16]}")
    return ordered
