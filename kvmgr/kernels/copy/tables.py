"""The copy kernels' tables, built and checked on the host (numpy; no Triton, no device).

Offers (to :mod:`kvmgr.kernels.copy`):
    build_descriptor_table  (src, dst, bytes) arrays -> int64 ``[3, num_items]`` work table of the
                            descriptor kernel, descriptors above ``chunk_bytes`` sliced
    check_descriptors       descriptors as int64 arrays, or ``GeometryError``
    build_layout_table      two layouts -> int64 ``[5, num_tensors]`` table of the paged kernel
    max_run_blocks          blocks per work item so that one item copies about ``chunk_bytes``
    build_run_table         runs of blocks -> int64 ``[3, rows]`` work table, long runs split
    check_runs              runs as int64 arrays inside both caches, or ``InvalidBlockError``

Every builder is a few numpy operations per table, O(rows): no Python loop per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmgr.errors import GeometryError, InvalidBlockError
from kvmgr.kernels.copy.row import DEFAULT_CHUNK_BYTES
from kvmgr.pool.layout import KVLayout

__all__ = [
    "build_descriptor_table",
    "build_layout_table",
    "build_run_table",
    "check_descriptors",
    "check_runs",
    "max_run_blocks",
]


def _as_int64(name: str, values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise GeometryError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise GeometryError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_descriptors(
    src_addrs: Any, dst_addrs: Any, sizes: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src = _as_int64("src_addrs", src_addrs)
    dst = _as_int64("dst_addrs", dst_addrs)
    size = _as_int64("sizes", sizes)
    if not len(src) == len(dst) == len(size):
        raise GeometryError(
            f"expected equal lengths, got src {len(src)}, dst {len(dst)}, sizes {len(size)}"
        )
    if not size.size:
        return src, dst, size
    if size.min() < 0:
        raise GeometryError(f"expected sizes >= 0, got {int(size[size < 0][0])}")
    if min(src.min(), dst.min()) <= 0:  # rare: look again, ignoring empty descriptors
        busy = size > 0
        if busy.any() and (src[busy].min() <= 0 or dst[busy].min() <= 0):
            raise GeometryError("expected positive addresses for every non-empty descriptor")
    return src, dst, size


def build_descriptor_table(
    src_addrs: Any, dst_addrs: Any, sizes: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> np.ndarray:
    """Turn descriptors into the kernel's work table, slicing large ones.

    Args:
        src_addrs: int ``[n]`` source byte addresses.
        dst_addrs: int ``[n]`` destination byte addresses.
        sizes: int ``[n]`` bytes per descriptor; empty descriptors are dropped.
        chunk_bytes: largest slice, a positive multiple of 16 (slices keep each row's alignment).

    Returns:
        int64 ``[3, num_items]``, C-contiguous: source addresses, destination addresses and
        bytes of each item (structure of arrays: three contiguous copies to build), in
        descriptor order.

    Raises:
        GeometryError: lengths differ, a size is negative, an address is not positive, or
            ``chunk_bytes`` is not a positive multiple of 16.
    """
    if chunk_bytes < 16 or chunk_bytes % 16:
        raise GeometryError(f"chunk_bytes: expected a positive multiple of 16, got {chunk_bytes}")
    src, dst, size = check_descriptors(src_addrs, dst_addrs, sizes)
    if size.size and size.min() == 0:
        keep = size > 0
        src, dst, size = src[keep], dst[keep], size[keep]
    if size.size == 0 or size.max() <= chunk_bytes:  # the common case: one row per descriptor
        table = np.empty((3, len(size)), dtype=np.int64)
        table[0], table[1], table[2] = src, dst, size
        return table
    counts = (size + chunk_bytes - 1) // chunk_bytes
    owner = np.repeat(np.arange(len(size)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offsets = (np.arange(len(owner), dtype=np.int64) - first) * chunk_bytes
    table = np.empty((3, len(owner)), dtype=np.int64)
    table[0] = src[owner] + offsets
    table[1] = dst[owner] + offsets
    table[2] = np.minimum(size[owner] - offsets, chunk_bytes)
    return table


def build_layout_table(src: KVLayout, dst: KVLayout) -> np.ndarray:
    """The kernel's layout table of a pair of KV caches.

    Args:
        src, dst: layouts of the source and destination caches, equal page bytes per tensor.

    Returns:
        int64 ``[5, num_tensors]``, C-contiguous: source base addresses, destination base
        addresses, source block strides, destination block strides, page bytes.

    Raises:
        GeometryError: the layouts differ in tensor count or page bytes.
    """
    if src.num_tensors != dst.num_tensors or not np.array_equal(src.page_bytes, dst.page_bytes):
        raise GeometryError(
            f"expected equal page bytes per tensor, got {src.page_bytes.tolist()} and "
            f"{dst.page_bytes.tolist()}"
        )
    return np.stack(
        [src.base_addrs, dst.base_addrs, src.block_strides, dst.block_strides, src.page_bytes]
    ).astype(np.int64, copy=False)


def max_run_blocks(page_bytes: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Blocks per work item so that no item copies more than ``chunk_bytes`` in any tensor
    (at least 1: a page larger than ``chunk_bytes`` is one item)."""
    largest = int(np.max(page_bytes)) if len(page_bytes) else 0
    return max(1, chunk_bytes // max(largest, 1))


def build_run_table(
    src_block_ids: np.ndarray, dst_block_ids: np.ndarray, num_blocks: np.ndarray, max_blocks: int
) -> np.ndarray:
    """Turn runs of blocks into the kernel's run table, splitting runs above ``max_blocks``.

    O(runs + blocks / max_blocks), a few numpy operations in all; no Python loop per run.

    Args:
        src_block_ids, dst_block_ids: int64 ``[num_runs]``: first block of each run.
        num_blocks: int64 ``[num_runs]``: blocks of each run (>= 1).
        max_blocks: most blocks per row (>= 1).

    Returns:
        int64 ``[3, rows]``, C-contiguous: first source block, first destination block and blocks
        of each row; the rows of one run are consecutive, in run order.
    """
    count = len(num_blocks)
    if count == 0 or int(num_blocks.max()) <= max_blocks:  # the common case: nothing to split
        table = np.empty((3, count), dtype=np.int64)
        table[0], table[1], table[2] = src_block_ids, dst_block_ids, num_blocks
        return table
    pieces = (num_blocks + (max_blocks - 1)) // max_blocks
    owner = np.repeat(np.arange(count), pieces)
    offsets = np.arange(len(owner), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    offsets *= max_blocks
    table = np.empty((3, len(owner)), dtype=np.int64)
    np.add(src_block_ids[owner], offsets, out=table[0])
    np.add(dst_block_ids[owner], offsets, out=table[1])
    np.minimum(num_blocks[owner] - offsets, max_blocks, out=table[2])
    return table


def check_runs(
    src: KVLayout, dst: KVLayout, src_block_ids: Any, dst_block_ids: Any, num_blocks: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    runs = [np.asarray(a).reshape(-1) for a in (src_block_ids, dst_block_ids, num_blocks)]
    if not len(runs[0]) == len(runs[1]) == len(runs[2]):
        raise InvalidBlockError(f"expected equal run counts, got {[len(a) for a in runs]}")
    if runs[0].size and any(a.dtype.kind not in "iu" for a in runs):
        raise InvalidBlockError(f"run tables: expected integers, got {[a.dtype for a in runs]}")
    if runs[0].size and any(a.dtype.kind == "u" and a.max() > np.iinfo(np.int64).max for a in runs):
        raise InvalidBlockError("run tables: a value does not fit int64")
    s, d, n = (a.astype(np.int64, copy=False) for a in runs)
    if n.size and n.min() < 1:
        raise InvalidBlockError(f"expected runs of >= 1 block, got {int(n.min())}")
    for name, first, layout in (("source", s, src), ("destination", d, dst)):
        # n <= num_blocks - first: no sum that could wrap around int64
        if first.size and (first.min() < 0 or (n > layout.num_blocks - first).any()):
            raise InvalidBlockError(f"a {name} run leaves blocks [0, {layout.num_blocks})")
    if _self_overlap(d, n):
        raise InvalidBlockError("destination runs overlap (docs/transfer.md, rule 5)")
    if bool(np.array_equal(src.base_addrs, dst.base_addrs)) and _cross_overlap(s, n, d, n):
        raise InvalidBlockError("a source run overlaps a destination run of the same cache")
    return s, d, n


def _self_overlap(first: np.ndarray, num: np.ndarray) -> bool:
    """Whether two of the block ranges ``[first[i], first[i] + num[i])`` overlap."""
    if len(first) < 2:
        return False
    order = np.argsort(first, kind="stable")
    starts, ends = first[order], first[order] + num[order]
    return bool((starts[1:] < ends[:-1]).any())


def _cross_overlap(a_first: np.ndarray, a_num: np.ndarray, b_first: np.ndarray, b_num: np.ndarray) -> bool:  # fmt: skip
    """Whether a range of ``a`` overlaps a range of ``b`` (the ``b`` ranges are disjoint)."""
    if len(a_first) == 0 or len(b_first) == 0:
        return False
    order = np.argsort(b_first, kind="stable")
    b_start, b_end = b_first[order], b_first[order] + b_num[order]
    last = np.searchsorted(b_start, a_first + a_num, side="left") - 1  # last b starting before
    hit = last >= 0
    return bool((b_end[last[hit]] > a_first[hit]).any())
