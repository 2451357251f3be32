"""Grouped MLA cache insert: write a step's latent KV rows into the paged caches of all layers.

Offers:
    grouped_mla_insert     one launch for all L layers (caches of equal geometry)
    per_layer_mla_insert   L launches of a single-layer kernel: the baseline and the fallback when
                           the layers' caches differ in geometry
    mla_insert_reference   the torch reference both kernels are tested against (re-exported
                           from :mod:`kvmgr.kernels.mla.reference`)
    KV_CACHE_DTYPES        the accepted ``kv_cache_dtype`` names

Token ``t`` of layer ``l`` goes to slot ``s = slot_mapping[l, t]`` (or ``slot_mapping[t]``): block
``s // block_size``, offset ``s % block_size``; ``kv_c[l, t]`` fills columns ``[0, R)`` and
``k_pe[l, t]`` fills ``[R, R + P)``. A slot < 0 is padding and writes nothing; so does a slot past
the cache's capacity (``check_slots=True`` rejects those instead). With ``auto`` the cache has the
input dtype and rows are copied exactly; with FP8 each value is stored as
``fp8(clamp(x / kv_scales[l], -max, max))``, rounded to nearest even (max 448 for e4m3, 57344 for
e5m2). Both launchers only enqueue work (no host reads of device data unless ``check_slots``), so
they can be captured into a CUDA graph once the kernel has been compiled and the pointer table
built by one eager call with the same caches.

Layout of :mod:`kvmgr.kernels.mla` (dependencies one-way, each on those above it):
``kernel`` (the Triton kernels) and ``checks`` (input checks, torch only) <- ``host`` (plans,
pointer tables, constexprs, launches through :mod:`kvmgr.kernels.launch`) <- ``api`` (this
module) <- ``hook``; ``reference`` (the torch reference) uses ``checks`` only.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvmgr.kernels.mla.bound import GroupedInsert, grouped_insert_for
from kvmgr.kernels.mla.checks import (
    KV_CACHE_DTYPES,
    check_caches,
    check_dtype_and_scales,
    check_slot_range,
    check_step,
)
from kvmgr.kernels.mla.host import IS_INTERPRETED, grouped_plan, launch_grouped, launch_per_layer
from kvmgr.kernels.mla.reference import mla_insert_reference

__all__ = ["KV_CACHE_DTYPES", "grouped_mla_insert", "mla_insert_reference", "per_layer_mla_insert"]


def grouped_mla_insert(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    kv_scales: torch.Tensor | None = None,
    check_slots: bool = False,
    block_tokens: int | None = None,
    num_warps: int | None = None,
    direct_launch: bool = True,
    packed_launch: bool = True,
) -> None:
    """Insert a step's rows into the paged caches of all L layers with ONE kernel launch.

    The caches' base addresses reach the kernel as an int64 device table, built on the first call
    for a set of caches and reused (memoized with their geometry by their ``data_ptr()``s): make
    that first call outside CUDA-graph capture. A table used under capture is then kept for the
    life of the process, so the graph may replay after any number of newer cache sets. One
    compiled kernel serves every step size of a tile size, launched directly, past Triton's
    per-call dispatch (see :mod:`kvmgr.kernels.launch`). Only enqueues work on the current
    stream.

    Args:
        kv_c: ``[L, T, R]`` latent KV, bfloat16/float16/float32, last dim contiguous (others free).
        k_pe: ``[L, T, P]`` RoPE keys, the dtype and device of ``kv_c``, last dim contiguous.
        caches: L caches ``[num_blocks, block_size, R + P]`` of equal shape and strides, 16-byte aligned,
            last dim contiguous; mutated in place. dtype: that of ``kv_c`` for ``auto``, else
            ``float8_e4m3fn`` / ``float8_e5m2`` or ``uint8`` holding those bytes.
        slot_mapping: int64 ``[T]`` shared by all layers, or ``[L, T]`` (a stride-0 expand works); < 0 is padding.
        kv_cache_dtype: ``auto`` copies exactly; FP8 stores ``fp8(clamp(x / kv_scales[l], -max, max))``.
        kv_scales: float32 ``[L]`` on the device: required for FP8, ``None`` for ``auto``.
        check_slots: Also reject slots >= ``num_blocks * block_size`` (always skipped, never written). Costs a
            reduction kernel and one device->host sync; refused under graph capture.
        block_tokens, num_warps: Tuning overrides (tokens per program, warps per program); ``None`` picks by step size.
        direct_launch: Launch the compiled kernel directly (the default); ``False`` takes Triton's normal launch.
        packed_launch: With ``direct_launch``: check each step signature once and launch through
            ``cuLaunchKernel`` from packed arguments (:mod:`kvmgr.kernels.mla.bound`; the default).
            ``False`` checks every call and launches through the compiled kernel's own launcher
            (the path before packed launches, kept as the benchmarks' baseline).

    Raises:
        ConfigError: Unknown ``kv_cache_dtype``; ``kv_scales`` missing for FP8 or given for ``auto``; bad tuning
            overrides; ``check_slots`` or a first call for these caches under graph capture.
        GeometryError: Shapes, dtypes, devices or strides that do not match; caches of unequal geometry or not
            16-byte aligned (use :func:`per_layer_mla_insert` for those).
        InvalidBlockError: ``check_slots=True`` and a slot is past the capacity.
    """
    check_dtype_and_scales(kv_cache_dtype, kv_scales)
    if not check_slots and packed_launch:
        insert = _recent_insert(caches, kv_cache_dtype, direct_launch)
        if insert is not None:  # the caches of the last call, unchanged
            insert(kv_c, k_pe, slot_mapping, kv_scales, block_tokens=block_tokens, num_warps=num_warps)  # fmt: skip
            return
    plan = grouped_plan(caches, kv_cache_dtype)
    if check_slots or not packed_launch:
        step = check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, plan.meta, allow_cpu=IS_INTERPRETED)  # fmt: skip
        if check_slots:
            check_slot_range(step, caches)
        if not packed_launch:
            launch_grouped(plan, step, kv_c, k_pe, kv_scales, block_tokens, num_warps, direct=direct_launch)  # fmt: skip
            return
    insert = grouped_insert_for(plan, direct_launch, True)
    _remember(caches, kv_cache_dtype, direct_launch, insert)
    insert(kv_c, k_pe, slot_mapping, kv_scales, block_tokens=block_tokens, num_warps=num_warps)


# The last cache set of a packed grouped call: (weak references to the caches, ptrs, shape,
# strides, cache dtype, kv_cache_dtype, direct, insert). A loop passes the same cache tensors every
# step; recognising them by identity plus what an in-place change can alter (data_ptr after set_,
# shape after resize_, strides after as_strided_, dtype after ``.data =``) skips the plan's key and
# two memo lookups (~1.3 us on a 2-core CPU host, an ad-hoc timeit). Weak references: the memo never keeps a cache
# set alive.
_RECENT: list[tuple[Any, ...]] = []
_data_ptr = torch.Tensor.data_ptr
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)  # fmt: skip


def _same_tensors(refs: tuple[weakref.ref[torch.Tensor], ...], caches: Sequence[torch.Tensor]) -> bool:  # fmt: skip
    return len(refs) == len(caches) and all(ref() is cache for ref, cache in zip(refs, caches))


def _remember(caches: Sequence[torch.Tensor], kv_cache_dtype: str, direct: bool, insert: GroupedInsert) -> None:  # fmt: skip
    """Remember a planned call's caches. Their pointers are read (and a later call may hit) only
    when the same tensors came in the call before too, so a loop that rotates cache sets pays one
    tuple per call; the shape and strides come from the plan (uniform caches, rows contiguous)."""
    plan = insert.plan
    if plan.meta.device >= 0 and _is_capturing():
        return  # a plan under capture is held by host.grouped_plan; never served from here
    refs = tuple(map(weakref.ref, caches))
    ptrs = shape = stride = None
    if _RECENT and _same_tensors(_RECENT[0][0], caches):
        capacity, block_size, stride_b, stride_s = plan.geometry
        shape = torch.Size((capacity // block_size, block_size, plan.meta.width))
        stride, ptrs = (stride_b, stride_s, 1), list(map(_data_ptr, caches))
    _RECENT[:] = [(refs, ptrs, shape, stride, plan.meta.dtype, kv_cache_dtype, direct, insert)]


def _recent_insert(caches: Sequence[torch.Tensor], kv_cache_dtype: str, direct: bool) -> GroupedInsert | None:  # fmt: skip
    """The bound insert of the last call if ``caches`` are its very tensors, unchanged, and no
    CUDA graph is being captured (a captured plan must be held: ``host.grouped_plan``)."""
    if not _RECENT:
        return None
    refs, ptrs, shape, stride, dtype, kv_dtype, was_direct, insert = _RECENT[0]
    if ptrs is None or kv_dtype != kv_cache_dtype or was_direct != direct:
        return None
    if not _same_tensors(refs, caches):
        return None
    for cache, ptr in zip(caches, ptrs):
        if (
            cache.data_ptr() != ptr or cache.shape != shape
            or cache.stride() != stride or cache.dtype != dtype
        ):  # fmt: skip
            return None
    if insert.plan.meta.device >= 0 and _is_capturing():
        return None
    return insert


def per_layer_mla_insert(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    kv_scales: torch.Tensor | None = None,
    check_slots: bool = False,
    block_tokens: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Insert a step's rows with one single-layer launch per layer (L launches).

    The baseline of :func:`grouped_mla_insert` and the fallback for caches whose ``num_blocks``,
    ``block_size``, strides or alignment differ between layers (their width ``R + P`` and dtype
    may not). Parameters as :func:`grouped_mla_insert` (no ``direct_launch``: each layer takes
    Triton's normal launch, as a caller launching a kernel once per layer would). Only enqueues
    work.

    Raises:
        ConfigError, GeometryError, InvalidBlockError: As :func:`grouped_mla_insert`, except that unequal cache geometry is accepted.
    """
    check_dtype_and_scales(kv_cache_dtype, kv_scales)
    meta = check_caches(caches, kv_cache_dtype)
    step = check_step(
        kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, meta, allow_cpu=IS_INTERPRETED
    )
    if check_slots:
        check_slot_range(step, caches)
    launch_per_layer(step, kv_c, k_pe, caches, kv_scales, kv_cache_dtype, block_tokens, num_warps)
