"""SM copy kernel: a whole transfer plan (any mix of page sizes, either direction) in one launch.

Offers:
    DEFAULT_MAX_PROGRAMS    program cap of a launch (32; see below)
    DEFAULT_CHUNK_BYTES     largest slice of a descriptor one program copies at a time (64 KiB)
    KERNEL_AVAILABLE        whether Triton is installed (everything else works without it)
    build_descriptor_table  (src, dst, bytes) arrays -> int64 ``[3, num_items]`` work table
    launch_copy_pages       launch the kernel over a descriptor table already on the device
    launch_copy_table       the same over the first ``3 * num_items`` entries of a flat table
                            (the engines' hot path: no per-call checks; packed launches on the
                            copy stream with ``copy_table_launches``)
    copy_table_launches     an issuer's packed launches of the kernel (``table_launch``)
    vector_widths           the access width (16/8/4/2/1 bytes) the kernel uses for each row
    copy_pages              validate, build, upload (asynchronously) and launch; the public path
    copy_pages_reference    the same copies with ``ctypes.memmove`` (CPU addresses only)

Plans from ``build_plan`` go to the paged variant instead (``kvmgr.kernels.copy_blocks``: a
layout table and a table of block runs; addresses computed on the device); this kernel copies
hand-made or edited plans.

The kernel reads a table of raw addresses, so the host side of a copy must be mapped into the
GPU's address space: pinned or ``cudaHostRegister``-ed memory, where (on the H200, with unified
addressing) the device pointer equals the host pointer. Under ``TRITON_INTERPRET=1`` the same
kernel copies between CPU tensors, which is how CI tests it.

Work split. ``build_descriptor_table`` cuts descriptors above ``chunk_bytes`` into 16-byte-aligned
slices, so a plan of a few large merged runs still spreads over every program. Each program walks
the table with a grid stride (``item = pid, pid + P, ...``) and prefetches its next row while it
copies the current one.

Vector width. Per row, the widest of 16/8/4/2/1 bytes that divides the source address, the
destination address and the size is chosen with a branch. Each branch marks its pointers with
``tl.multiple_of`` (what the branch condition proved) and uses its own element type and tile shape,
so Triton emits 16-byte (``v4.b32``), 8-, 4-, 2- or 1-byte loads and stores without shuffling
through shared memory: pages of 576, 656 and 4096 B copy with 16-byte vectors, 584 B with 8.

Program cap. A launch never has more than ``max_programs`` programs (default 32 of the H200's
132 SMs). A copy program is one 4-warp CTA (62 registers per thread, no shared memory), so it
leaves most of an SM to compute; the cap bounds how many SMs it can hold when it cannot share one
with a register-hungry GEMM. Bandwidth-delay: a program keeps one 4-8 KiB step in flight per
~1.5-2 us PCIe round trip, about 2-4 GB/s, so 32 programs cover the 48-55 GB/s link with margin.
``kvmgr bench swap-kernel --programs`` measures other caps and the effect on a concurrent matmul:
32 programs slow a bf16 matmul by 53-58% during a D2H copy, 12 programs by 5% at 49-50 GB/s, so
the engines default to 12 programs for D2H and 32 for H2D (``DEFAULT_D2H_PROGRAMS``,
``DEFAULT_H2D_PROGRAMS``; docs/copy-kernel.md).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from kvmgr.errors import GeometryError, TransferError
from kvmgr.kernels.launch import shared_launcher
from kvmgr.kernels.table_launch import TableLaunches

try:
    import triton
    import triton.language as tl
except ImportError:  # the table helpers and the reference work without Triton; the kernel does not
    triton = None

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_D2H_PROGRAMS",
    "DEFAULT_H2D_PROGRAMS",
    "DEFAULT_MAX_PROGRAMS",
    "KERNEL_AVAILABLE",
    "build_descriptor_table",
    "copy_pages",
    "copy_pages_reference",
    "copy_table_launches",
    "launch_copy_pages",
    "launch_copy_table",
    "vector_widths",
]

DEFAULT_MAX_PROGRAMS = 32
#: Program caps the engines use per direction (BENCHMARKS.md, interference with a bf16 matmul on
#: the H200): D2H at 12 programs copies 49-50 GB/s alone with the paged kernel and slows the
#: matmul 4.9% (8 programs: 42.8 GB/s, 5.5%; 32 programs: 53%; 2026-12-01, third session); H2D
#: needs 32 programs for 50 GB/s (8 reach 18) and slows it 5-6%.
DEFAULT_D2H_PROGRAMS = 12
DEFAULT_H2D_PROGRAMS = 32
DEFAULT_CHUNK_BYTES = 64 << 10
KERNEL_AVAILABLE = triton is not None
_NUM_WARPS = 4


def _jit(fn: Any) -> Any:
    """``triton.jit`` where Triton is installed; the plain function otherwise."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def _copy_run(  # type: ignore[no-untyped-def]
    src, dst, size, SHIFT: tl.constexpr, ELEM: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr
):
    # Copy `size` bytes from `src` to `dst`; all three are multiples of WIDTH = 2**SHIFT.
    WIDTH: tl.constexpr = 1 << SHIFT
    ELEM_BYTES: tl.constexpr = ELEM.primitive_bitwidth // 8
    VEC: tl.constexpr = WIDTH // ELEM_BYTES  # elements per WIDTH-byte vector
    # The caller's branch proved the alignment; tell the compiler (fresh ops, so per branch).
    src_ptr = tl.multiple_of(src.to(tl.pointer_type(ELEM)), WIDTH)
    dst_ptr = tl.multiple_of(dst.to(tl.pointer_type(ELEM)), WIDTH)
    # Element count as a multiple of VEC, so the mask is constant over each vector.
    num_elems = tl.multiple_of((size >> SHIFT) * VEC, VEC)
    # A [ROWS, COLS] tile of consecutive elements; each branch has its own tile shape, which
    # keeps Triton from giving every branch the 16-byte branch's layout (and a shuffle through
    # shared memory between each narrow load and its store).
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    for start in range(0, num_elems, ROWS * COLS):
        idx = start + offs
        mask = idx < num_elems
        vals = tl.load(src_ptr + idx, mask=mask)
        tl.store(dst_ptr + idx, vals, mask=mask)


@_jit
def _copy_row(src, dst, size):
    # One branch per vector width: the widest that divides both addresses and the size.
    bits = src | dst | size
    if (bits & 15) == 0:
        _copy_run(src, dst, size, 4, tl.int32, 1, 2048)  # 8 KiB per step, 16-byte vectors
    elif (bits & 7) == 0:
        _copy_run(src, dst, size, 3, tl.int64, 1, 1024)  # 8 KiB, 8-byte
    elif (bits & 3) == 0:
        _copy_run(src, dst, size, 2, tl.int32, 2, 1024)  # 8 KiB, 4-byte
    elif (bits & 1) == 0:
        _copy_run(src, dst, size, 1, tl.int16, 4, 512)  # 4 KiB, 2-byte
    else:
        _copy_run(src, dst, size, 0, tl.uint8, 8, 256)  # 2 KiB, 1-byte


@_jit
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
        _copy_row(src, dst, size)
        src = next_src
        dst = next_dst
        size = next_size


def _as_int64(name: str, values: Any) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise GeometryError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise GeometryError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_descriptors(
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
    src, dst, size = _check_descriptors(src_addrs, dst_addrs, sizes)
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
    launches: TableLaunches | None = None,
) -> int:
    """Launch the kernel on the current stream over a packed table, without checks.

    Args:
        table: int64, contiguous, at least ``3 * num_items`` entries, where the kernel runs:
            sources at ``[0, n)``, destinations at ``[n, 2n)``, bytes at ``[2n, 3n)`` for
            ``n = num_items`` (an int64 ``[3, n]`` table, or a larger reusable buffer filled so).
            It must stay alive until the kernel has run.
        num_items: rows to copy.
        max_programs: cap on the grid (>= 1).
        stream: with ``launches``, the stream to launch on (None: the current stream).
        launches: the caller's packed launches of this kernel (``copy_table_launches()``).

    Returns:
        The number of programs launched, ``min(max_programs, num_items)``.

    Raises:
        TransferError: Triton is not installed.
    """
    if not KERNEL_AVAILABLE:
        raise TransferError("the copy kernel needs Triton: pip install 'kvmgr[kernels]'")
    grid = min(max_programs, num_items)
    if grid and launches is not None:
        launches(grid, stream, table, num_items)
    elif grid:
        shared_launcher(_copy_pages_kernel)((grid,), table, num_items, num_warps=_NUM_WARPS)
    return grid


def copy_table_launches() -> TableLaunches:
    """Packed launches of the descriptor-table kernel for one issuer (``launch_copy_table``).

    Raises:
        TransferError: Triton is not installed.
    """
    if not KERNEL_AVAILABLE:
        raise TransferError("the copy kernel needs Triton: pip install 'kvmgr[kernels]'")
    return TableLaunches(_copy_pages_kernel, _NUM_WARPS)


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
    src, dst, size = _check_descriptors(src_addrs, dst_addrs, sizes)
    if size.size and size.min() > 0 and size.max() <= chunk_bytes:
        # The common case (no empty or oversized descriptor): build the rows in place.
        staged = torch.empty((3, len(size)), dtype=torch.int64, pin_memory=True)
        rows = staged.numpy()
        rows[0], rows[1], rows[2] = src, dst, size
    else:
        table = build_descriptor_table(src, dst, size, chunk_bytes=chunk_bytes)
        staged = torch.from_numpy(table).pin_memory()
    return staged.to(device, non_blocking=True)


def vector_widths(table: np.ndarray) -> np.ndarray:
    """int64 ``[num_items]``: bytes per load/store the kernel uses for each row of ``table``
    (int64 ``[3, num_items]``): the largest of 16, 8, 4, 2, 1 dividing src, dst and size."""
    bits = np.bitwise_or.reduce(np.asarray(table, dtype=np.int64), axis=0) | 16
    return np.asarray(bits & -bits, dtype=np.int64)


def copy_pages_reference(src_addrs: Any, dst_addrs: Any, sizes: Any) -> None:
    """The same copies with ``ctypes.memmove``, one descriptor after another (CPU addresses).

    Raises:
        GeometryError: lengths differ, a size is negative or an address is not positive.
    """
    src, dst, size = _check_descriptors(src_addrs, dst_addrs, sizes)
    for s, d, n in zip(src.tolist(), dst.tolist(), size.tolist()):
        if n:
            ctypes.memmove(d, s, n)
