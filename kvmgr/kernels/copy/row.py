"""One row copy at the widest vector width: the body both copy kernels run per region.

Offers (to :mod:`kvmgr.kernels.copy`):
    copy_row                ``@triton.jit``: copy ``size`` bytes between raw addresses
    vector_widths           the access width (16/8/4/2/1 bytes) ``copy_row`` uses for each row
    DEFAULT_MAX_PROGRAMS    program cap of a launch (32)
    DEFAULT_D2H_PROGRAMS, DEFAULT_H2D_PROGRAMS   the engines' caps per direction (12, 32)
    DEFAULT_CHUNK_BYTES     largest slice of a descriptor (or run) one program copies at a time
    KERNEL_AVAILABLE        whether Triton is installed (everything else works without it)
    NUM_WARPS               warps per program of both kernels
    launch_programs         one launch of a copy kernel over its packed tables (an owner's
                            ``Launches``, or a one-off bind)
    table_launches          an owner's packed launches of a copy kernel

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
the engines default to 12 programs for D2H and 32 for H2D (docs/copy-kernel.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvmgr.errors import TransferError
from kvmgr.kernels.launch import Launches, shared_launcher

try:
    import triton
    import triton.language as tl
except ImportError:  # the table helpers and the references work without Triton; the kernels do not
    triton = None

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_D2H_PROGRAMS",
    "DEFAULT_H2D_PROGRAMS",
    "DEFAULT_MAX_PROGRAMS",
    "KERNEL_AVAILABLE",
    "NUM_WARPS",
    "copy_row",
    "jit",
    "launch_programs",
    "table_launches",
    "tl",
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
NUM_WARPS = 4


def jit(fn: Any) -> Any:
    """``triton.jit`` where Triton is installed; the plain function otherwise."""
    return triton.jit(fn) if triton is not None else fn


@jit
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


@jit
def copy_row(src, dst, size):
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


def vector_widths(table: np.ndarray) -> np.ndarray:
    """int64 ``[num_items]``: bytes per load/store the kernel uses for each row of ``table``
    (int64 ``[3, num_items]``): the largest of 16, 8, 4, 2, 1 dividing src, dst and size."""
    bits = np.bitwise_or.reduce(np.asarray(table, dtype=np.int64), axis=0) | 16
    return np.asarray(bits & -bits, dtype=np.int64)


def _require_triton() -> None:
    if not KERNEL_AVAILABLE:
        raise TransferError("the copy kernel needs Triton: pip install 'kvmgr[kernels]'")


def launch_programs(kernel: Any, programs: int, stream: Any, launches: Launches | None, *args: Any) -> int:  # fmt: skip
    """Enqueue ``kernel(*args)`` over ``programs`` programs (none when 0) on ``stream`` (a torch
    stream; None: the current one), through ``launches`` or a one-off bind; returns ``programs``.

    Raises:
        TransferError: Triton is not installed.
    """
    if launches is not None:  # (packed launches are only made where Triton is: table_launches)
        if programs:
            launches((programs, 1, 1), stream, *args)
        return programs
    _require_triton()
    if programs:
        shared_launcher(kernel).launch((programs, 1, 1), *args, num_warps=NUM_WARPS, stream=stream)
    return programs


def table_launches(kernel: Any, hints: str) -> Launches:
    """An owner's packed launches of a copy kernel, every argument varying (``hints``: per
    argument ``"t"`` a tensor, ``"i"`` an int).

    Raises:
        TransferError: Triton is not installed.
    """
    _require_triton()
    return Launches(kernel, tuple(range(len(hints))), hints, num_warps=NUM_WARPS)
