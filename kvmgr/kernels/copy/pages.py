"""The descriptor copy kernel: a whole transfer plan (any mix of page sizes) in one launch.

Offers:
    launch_copy_pages       launch the kernel over a descriptor table already on the device
    launch_copy_table       the same over the first ``3 * num_items`` entries of a flat table,
                            without checks (the engines' path, through an owner's
                            ``copy_table_launches()`` on a given stream)
    copy_table_launches     an owner's packed launches of the kernel
    copy_pages              validate, build, upload (asynchronously) and launch; the public path
    copy_pages_reference    the same copies with ``ctypes.memmove`` (CPU addresses only)

Its table is built on the host by :func:`kvmgr.kernels.copy.tables.build_descriptor_table`.
Plans from ``build_plan`` go to the paged kernel instead (:mod:`kvmgr.kernels.copy.blocks`: a
layout table and a table of block runs; addresses computed on the device); this kernel copies
hand-made or edited plans.

The kernel reads a table of raw addresses, so the host side of a copy must be mapped into the
GPU's address space: pinned or ``cudaHostRegister``-ed memory, where (on the H200, with unified
addressing) the device pointer equals the host pointer. Under ``TRITON_INTERPRET=1`` the same
kernel copies between CPU tensors, which is how CI tests it.

Work split. ``build_descriptor_table`` cuts descriptors above ``chunk_bytes`` into 16-byte-aligned
slices, so a plan of a few large merged runs still spreads over every program. Each program walks
the table with a grid stride (``item = pid, pid + P, ...``), prefetches its next row while it
copies the current one, and copies each row with :func:`kvmgr.kernels.copy.row.copy_row` (the
widest vector width its addresses and size allow; program caps there too).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvmgr.errors import GeometryError, TransferError
from kvmgr.kernels.copy.row import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_PROGRAMS,
    KERNEL_AVAILABLE,
    copy_row,
    jit,
    launch_programs,
    table_launches,
    tl,
)
from kvmgr.kernels.copy.tables import build_descriptor_table, check_descriptors
from kvmgr.kernels.launch import Launches

__all__ = [
    "copy_pages",
    "copy_pages_reference",
    "copy_table_launches",
    "launch_copy_pages",
    "launch_copy_table",
]


@jit
def _copy_pages_kernel(table_ptr, num_items):
    # table_ptr: int64 [3, num_items]: source addresses, destination addresses, bytes.
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    stride = tl.cast(num_items, tl.int64)  # num_items may arrive as the constexpr 1
    # Load this program's first item, then walk the table with a grid stride.
    has_row = pid < num_items
    row = table_ptr + pid
    src = tl.load(row, mask=has_row, other=0)
    dst = tl.load(row + stride, mask=has_row, other=0)
    size = tl.load(row + 2 * stride, mask=has_row, other=0)
    for item in range(pid, num_items, step):
        # Prefetch the next row so its latency overlaps this row's copy.
        nxt = item + step
        has_next = nxt < num_items
        nrow = table_ptr + nxt
        next_src = tl.load(nrow, mask=has_next, other=0)
        next_dst = tl.load(nrow + stride, mask=has_next, other=0)
        next_size = tl.load(nrow + 2 * stride, mask=has_next, other=0)
        copy_row(src, dst, size)
        src = next_src
        dst = next_dst
        size = next_size


def launch_copy_pages(table: torch.Tensor, *, max_programs: int = DEFAULT_MAX_PROGRAMS) -> int:
    """Launch the copy kernel on the current stream over a table already where the kernel runs.

    Args:
        table: int64 ``[3, num_items]`` contiguous (src, dst, bytes per item), on the GPU (or on
            the CPU under ``TRITON_INTERPRET=1``). It must stay alive until the kernel has run.
        max_programs: cap on the grid; the grid is ``min(max_programs, num_items)``.

    Returns:
        The number of programs launched (0 for an empty table: nothing is launched).

    Raises:
        GeometryError: the table has the wrong dtype, shape or layout, or ``max_programs < 1``.
        TransferError: Triton is not installed (``pip install kvmgr[kernels]``).
    """
    if max_programs < 1:
        raise GeometryError(f"max_programs: expected >= 1, got {max_programs}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != 3:
        raise GeometryError(
            f"table: expected int64 [3, num_items], got {table.dtype} {list(table.shape)}"
        )
    if not table.is_contiguous():
        raise GeometryError(f"table: expected contiguous rows, got strides {table.stride()}")
    if not KERNEL_AVAILABLE:
        raise TransferError("the copy kernel needs Triton: pip install 'kvmgr[kernels]'")
    return launch_copy_table(table, table.shape[1], max_programs)


def launch_copy_table(
    table: torch.Tensor,
    num_items: int,
    max_programs: int,
    *,
    stream: Any = None,
    launches: Launches | None = None,
) -> int:
    """Launch the kernel over a packed table, without checks.

    Args:
        table: int64, contiguous, at least ``3 * num_items`` entries, where the kernel runs:
            sources at ``[0, n)``, destinations at ``[n, 2n)``, bytes at ``[2n, 3n)`` for
            ``n = num_items`` (an int64 ``[3, n]`` table, or a larger reusable buffer filled so).
            It must stay alive until the kernel has run.
        num_items: rows to copy.
        max_programs: cap on the grid (>= 1).
        stream: the torch stream to launch on (None: the current stream).
        launches: the caller's packed launches of this kernel (``copy_table_launches()``); None:
            a one-off bind.

    Returns:
        The number of programs launched, ``min(max_programs, num_items)``.

    Raises:
        TransferError: Triton is not installed.
    """
    return launch_programs(_copy_pages_kernel, min(max_programs, num_items), stream, launches,
                           table, num_items)  # fmt: skip


def copy_table_launches() -> Launches:
    """An owner's packed launches of the descriptor-table kernel (``launch_copy_table``).

    Raises:
        TransferError: Triton is not installed.
    """
    return table_launches(_copy_pages_kernel, "ti")


def copy_pages(
    src_addrs: Any,
    dst_addrs: Any,
    sizes: Any,
    *,
    device: torch.device | str = "cuda",
    max_programs: int = DEFAULT_MAX_PROGRAMS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """Copy ``sizes[i]`` bytes from ``src_addrs[i]`` to ``dst_addrs[i]`` for all ``i`` in one launch.

    On a CUDA device the table is written into pinned memory and copied to the device with a
    non-blocking copy on the current stream, then the kernel runs on that stream; the call returns
    without waiting. Copies run in no order: destinations must not overlap each other or any
    source (docs/transfer.md, rule 5).

    Args:
        src_addrs: int ``[n]`` source addresses the kernel can dereference: device memory,
            or pinned / registered host memory (mapped; device pointer == host pointer).
        dst_addrs: int ``[n]`` destination addresses, of the same kinds.
        sizes: int ``[n]`` bytes per copy.
        device: where the kernel runs: a CUDA device, or ``"cpu"`` under ``TRITON_INTERPRET=1``.
        max_programs: cap on the grid (see the module docstring).
        chunk_bytes: largest slice one program copies at a time (a multiple of 16).

    Returns:
        The int64 ``[3, num_items]`` table on ``device``; keep it alive until the stream has run
        the kernel (an event recorded after this call has completed).

    Raises:
        GeometryError: invalid descriptors, ``chunk_bytes`` or ``max_programs``.
        TransferError: Triton is not installed.
    """
    if max_programs < 1:
        raise GeometryError(f"max_programs: expected >= 1, got {max_programs}")
    table = _stage_table(src_addrs, dst_addrs, sizes, torch.device(device), chunk_bytes)
    launch_copy_pages(table, max_programs=max_programs)
    return table


def _stage_table(
    src_addrs: Any, dst_addrs: Any, sizes: Any, device: torch.device, chunk_bytes: int
) -> torch.Tensor:
    """The descriptor table on ``device``: for CUDA, written into pinned memory and uploaded
    with a non-blocking copy on the current stream (torch's caching host allocator keeps the
    staging block until that copy has run)."""
    if device.type != "cuda":
        return torch.from_numpy(
            build_descriptor_table(src_addrs, dst_addrs, sizes, chunk_bytes=chunk_bytes)
        )
    if chunk_bytes < 16 or chunk_bytes % 16:
        raise GeometryError(f"chunk_bytes: expected a positive multiple of 16, got {chunk_bytes}")
    src, dst, size = check_descriptors(src_addrs, dst_addrs, sizes)
    if size.size and size.min() > 0 and size.max() <= chunk_bytes:
        # The common case (no empty or oversized descriptor): build the rows in place.
        staged = torch.empty((3, len(size)), dtype=torch.int64, pin_memory=True)
        rows = staged.numpy()
        rows[0], rows[1], rows[2] = src, dst, size
    else:
        table = build_descriptor_table(src, dst, size, chunk_bytes=chunk_bytes)
        staged = torch.from_numpy(table).pin_memory()
    return staged.to(device, non_blocking=True)


def copy_pages_reference(src_addrs: Any, dst_addrs: Any, sizes: Any) -> None:
    """The same copies with ``ctypes.memmove``, one descriptor after another (CPU addresses).

    Raises:
        GeometryError: lengths differ, a size is negative or an address is not positive.
    """
    src, dst, size = check_descriptors(src_addrs, dst_addrs, sizes)
    for s, d, n in zip(src.tolist(), dst.tolist(), size.tolist()):
        if n:
            ctypes.memmove(d, s, n)
