"""Paged SM copy kernel: runs of whole KV blocks, with page addresses computed on the device.

Offers:
    launch_copy_blocks      launch over a layout table and a run table already on the device
    launch_block_table      the same over packed flat buffers, without checks (the engines' path,
                            through an owner's ``block_table_launches()`` on a given stream)
    block_table_launches    an owner's packed launches of the kernel
    copy_blocks             validate, build, upload (asynchronously) and launch; the public path
    copy_blocks_reference   the same copies with ``index_copy_`` on the tensors

Its tables (``build_layout_table``, ``build_run_table``, ``max_run_blocks``) are built on the host
by :mod:`kvmgr.kernels.copy.tables`. Where the descriptor kernel (:mod:`kvmgr.kernels.copy.pages`)
reads one ``(src, dst, bytes)`` row per page, this kernel reads
a *layout table*, fixed for a pair of KV caches, and a *run table* per batch:

- layout ``[5, T]``, one column per tensor: source base address, destination base address, source
  block stride, destination block stride, page bytes (``KVLayout`` fields). The engines upload it
  once per (source layout, destination layout) pair and keep it on the device;
- runs ``[3, R]``, one column per run: first source block, first destination block, blocks. Blocks
  ``src + k -> dst + k`` for ``k < blocks`` are copied in every tensor.

So the host writes ``3 x runs`` integers per batch instead of ``3 x runs x tensors`` (or ``3 x
pages x tensors`` for scattered blocks): 512 scattered blocks of 48 tensors are 1,536 integers, not
73,728.

Work split. A work item is one (run, tensor) pair, ``item = tensor * R + run`` (tensor-major, so a
program's items cover every tensor about equally even when page sizes differ between tensors).
Program ``pid`` walks items ``pid, pid + P, ...`` (no prefetch of the next item's table entries:
see the kernel's comment, a miscompile on the H200 with it). A tensor dense on both sides (block stride == page bytes) copies the run as one
region of ``blocks x page`` bytes; any other copies it page by page. Either way each region goes
through :func:`kvmgr.kernels.copy.row.copy_row`, with its per-region choice of a 16/8/4/2/1-byte vector width.
``build_run_table`` splits runs above ``max_blocks`` (``max_run_blocks``: ``chunk_bytes`` over the
largest page, at least 1) so that one long run of consecutive blocks still spreads over every
program: 512 consecutive blocks of 4 KiB pages are 32 runs of 16 blocks, 32 x 48 items of 64 KiB.

Addresses are raw, as in the descriptor kernel: host pages must be pinned or registered (device pointer ==
host pointer), and under ``TRITON_INTERPRET=1`` the kernel copies between CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvmgr.errors import GeometryError
from kvmgr.kernels.copy.row import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_PROGRAMS,
    copy_row,
    jit,
    launch_programs,
    table_launches,
    tl,
)
from kvmgr.kernels.copy.tables import (
    build_layout_table,
    build_run_table,
    check_runs,
    max_run_blocks,
)
from kvmgr.kernels.launch import Launches
from kvmgr.pool.layout import KVLayout

__all__ = [
    "block_table_launches",
    "copy_blocks",
    "copy_blocks_reference",
    "launch_block_table",
    "launch_copy_blocks",
]


@jit
def _load_item(layout_ptr, runs_ptr, item, num_tensors, num_runs, valid):
    # The copy of one work item: (source, destination, strides, regions, bytes per region).
    t = item // num_runs
    r = item - t * num_runs
    column = layout_ptr + t
    src_base = tl.load(column, mask=valid, other=0)
    dst_base = tl.load(column + num_tensors, mask=valid, other=0)
    src_stride = tl.load(column + 2 * num_tensors, mask=valid, other=0)
    dst_stride = tl.load(column + 3 * num_tensors, mask=valid, other=0)
    page = tl.load(column + 4 * num_tensors, mask=valid, other=0)
    run = runs_ptr + r
    src_block = tl.load(run, mask=valid, other=0)
    dst_block = tl.load(run + num_runs, mask=valid, other=0)
    blocks = tl.load(run + 2 * num_runs, mask=valid, other=0)
    # Dense on both sides: the run is one region; otherwise one region per page.
    dense = (src_stride == page) & (dst_stride == page)
    num_regions = tl.where(dense, 1, blocks)
    region_bytes = tl.where(dense, blocks * page, page)
    src = src_base + src_block * src_stride
    dst = dst_base + dst_block * dst_stride
    return src, dst, src_stride, dst_stride, num_regions, region_bytes


@jit
def _copy_blocks_kernel(layout_ptr, runs_ptr, num_tensors, num_runs):
    # layout_ptr: int64 [5, num_tensors]: src base, dst base, src stride, dst stride, page bytes.
    # runs_ptr: int64 [3, num_runs]: first src block, first dst block, blocks.
    # No hand prefetch of the next item (unlike copy_pages): with the loop over an item's
    # regions, carrying the prefetched row through the outer loop miscompiled on the H200
    # (Triton 3.6: strided tensors' pages written to the wrong places; 2026-12-01, the
    # interpreter was right). An item copies up to chunk_bytes, so one table load per item is
    # small beside its copy.
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    num_t = tl.cast(num_tensors, tl.int64)  # either may arrive as the constexpr 1
    num_r = tl.cast(num_runs, tl.int64)
    num_items = num_t * num_r
    for item in range(tl.cast(pid, tl.int64), num_items, step):
        src, dst, src_step, dst_step, regions, size = _load_item(
            layout_ptr, runs_ptr, item, num_t, num_r, item < num_items
        )
        for k in range(0, regions):
            copy_row(src + k * src_step, dst + k * dst_step, size)


def launch_copy_blocks(
    layout: torch.Tensor, runs: torch.Tensor, *, max_programs: int = DEFAULT_MAX_PROGRAMS
) -> int:
    """Launch the paged copy kernel on the current stream over tables already where it runs.

    Args:
        layout: int64 ``[5, num_tensors]`` contiguous (``build_layout_table``), on the GPU (or the
            CPU under ``TRITON_INTERPRET=1``).
        runs: int64 ``[3, num_runs]`` contiguous (``build_run_table``), beside ``layout``. Both
            must stay alive until the kernel has run.
        max_programs: cap on the grid; the grid is ``min(max_programs, num_tensors * num_runs)``.

    Returns:
        The number of programs launched (0 when there is nothing to copy).

    Raises:
        GeometryError: a table has the wrong dtype, shape or layout, or ``max_programs < 1``.
        TransferError: Triton is not installed (``pip install kvmgr[kernels]``).
    """
    if max_programs < 1:
        raise GeometryError(f"max_programs: expected >= 1, got {max_programs}")
    for name, table, rows in (("layout", layout, 5), ("runs", runs, 3)):
        if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != rows:
            raise GeometryError(
                f"{name}: expected int64 [{rows}, n], got {table.dtype} {list(table.shape)}"
            )
        if not table.is_contiguous():
            raise GeometryError(f"{name}: expected contiguous rows, got strides {table.stride()}")
    return launch_block_table(layout, runs, layout.shape[1], runs.shape[1], max_programs)


def launch_block_table(
    layout: torch.Tensor,
    runs: torch.Tensor,
    num_tensors: int,
    num_runs: int,
    max_programs: int,
    *,
    stream: Any = None,
    launches: Launches | None = None,
) -> int:
    """Launch the kernel over packed tables, without checks.

    Args:
        layout: int64, contiguous, at least ``5 * num_tensors`` entries where the kernel runs,
            the ``[5, num_tensors]`` layout table packed at its start.
        runs: int64, contiguous, at least ``3 * num_runs`` entries, the ``[3, num_runs]`` run
            table packed at its start (a reusable buffer may be larger). Both must stay alive
            until the kernel has run.
        num_tensors, num_runs: columns of the two tables.
        max_programs: cap on the grid (>= 1).
        stream: the torch stream to launch on (None: the current stream).
        launches: the caller's packed launches of this kernel (``block_table_launches()``);
            None: a one-off bind.

    Returns:
        The number of programs launched, ``min(max_programs, num_tensors * num_runs)``.

    Raises:
        TransferError: Triton is not installed.
    """
    return launch_programs(_copy_blocks_kernel, min(max_programs, num_tensors * num_runs), stream,
                           launches, layout, runs, num_tensors, num_runs)  # fmt: skip


def block_table_launches() -> Launches:
    """An owner's packed launches of the paged kernel (``launch_block_table``).

    Raises:
        TransferError: Triton is not installed.
    """
    return table_launches(_copy_blocks_kernel, "ttii")


def copy_blocks(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_block_ids: Any,
    dst_block_ids: Any,
    num_blocks: Any,
    *,
    device: torch.device | str = "cuda",
    max_programs: int = DEFAULT_MAX_PROGRAMS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy blocks ``src_block_ids[r] + k -> dst_block_ids[r] + k`` (``k < num_blocks[r]``) of
    every tensor, in one launch.

    On a CUDA device both tables are written into pinned memory and copied to the device with
    non-blocking copies on the current stream, then the kernel runs on that stream; the call
    returns without waiting. Copies run in no order: destination blocks must not repeat nor
    overlap a source (docs/transfer.md, rule 5).

    Args:
        src, dst: KV caches, ``num_blocks`` as dim 0 and each block contiguous, equal page bytes
            per tensor; device memory or pinned / registered host memory (CPU tensors under
            ``TRITON_INTERPRET=1``). ``dst`` is written in place.
        src_block_ids, dst_block_ids: int ``[num_runs]``: first block of each run.
        num_blocks: int ``[num_runs]``: blocks of each run (>= 1).
        device: where the kernel runs: a CUDA device, or ``"cpu"`` under ``TRITON_INTERPRET=1``.
        max_programs: cap on the grid.
        chunk_bytes: longest run one item copies, in bytes of the largest page (``max_run_blocks``).

    Returns:
        The layout and run tables on ``device``; keep them alive until the stream has run the
        kernel.

    Raises:
        GeometryError: the caches differ in tensor count or page bytes, or a bad ``max_programs``.
        InvalidBlockError: a run is empty or leaves a cache's blocks.
        TransferError: Triton is not installed.
    """
    if max_programs < 1:
        raise GeometryError(f"max_programs: expected >= 1, got {max_programs}")
    src_layout, dst_layout = KVLayout.from_tensors(src), KVLayout.from_tensors(dst)
    layout = build_layout_table(src_layout, dst_layout)
    s, d, n = check_runs(src_layout, dst_layout, src_block_ids, dst_block_ids, num_blocks)
    runs = build_run_table(s, d, n, max_run_blocks(src_layout.page_bytes, chunk_bytes))
    target = torch.device(device)
    tables = [torch.from_numpy(t) for t in (layout, runs)]
    if target.type == "cuda":
        tables = [t.pin_memory().to(target, non_blocking=True) for t in tables]
    launch_copy_blocks(tables[0], tables[1], max_programs=max_programs)
    return tables[0], tables[1]


def copy_blocks_reference(
    src: Sequence[torch.Tensor],
    dst: Sequence[torch.Tensor],
    src_block_ids: Any,
    dst_block_ids: Any,
    num_blocks: Any,
) -> None:
    """The same copies with ``index_select`` and ``index_copy_`` per tensor (any device).

    Raises:
        GeometryError: the caches differ in tensor count or page bytes.
        InvalidBlockError: a run is empty or leaves a cache's blocks.
    """
    src_layout, dst_layout = KVLayout.from_tensors(src), KVLayout.from_tensors(dst)
    build_layout_table(src_layout, dst_layout)  # the geometry check
    s, d, n = check_runs(src_layout, dst_layout, src_block_ids, dst_block_ids, num_blocks)
    offsets = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    src_ids = torch.from_numpy(np.repeat(s, n) + offsets)
    dst_ids = torch.from_numpy(np.repeat(d, n) + offsets)
    for a, b in zip(src, dst, strict=True):
        b.index_copy_(0, dst_ids.to(b.device), a.index_select(0, src_ids.to(a.device)).to(b))
