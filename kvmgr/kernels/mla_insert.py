"""Grouped MLA cache insert: write a step's latent KV rows into the paged caches of all layers.

Offers:
    grouped_mla_insert     one launch for all L layers (caches of equal geometry)
    per_layer_mla_insert   L launches of a single-layer kernel: the baseline and the fallback when
                           the layers' caches differ in geometry
    mla_insert_reference   the torch reference both kernels are tested against
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

This module holds the kernels, their launchers and the reference. The host side (input checks;
memoized plans, pointer tables and constexprs) is in :mod:`kvmgr.kernels._mla_launch`; the grouped
kernel launches through :class:`kvmgr.kernels._launch.DirectLauncher`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvmgr.kernels._launch import DirectLauncher, shared_launcher
from kvmgr.kernels._mla_launch import (
    _FP8_FORMATS,
    _GROUPED_RUNTIME_ARGS,
    KV_CACHE_DTYPES,
    _check_caches,
    _check_dtype_and_scales,
    _check_slots,
    _check_step,
    _grouped_constexprs,
    _grouped_plan,
    _launch_config,
    _launch_spec,
    _layer_slots,
    _Plan,
    _pow2,
    _Step,
)

__all__ = ["KV_CACHE_DTYPES", "grouped_mla_insert", "mla_insert_reference", "per_layer_mla_insert"]


@triton.jit
def _quantize(x, scale, OUT_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr):  # type: ignore[no-untyped-def]
    # FP8: divide in fp32 with IEEE rounding (plain `/` is approximate on NVIDIA), saturate
    # (NaN stays NaN), then convert with round-to-nearest-even. auto: an exact copy.
    if FP8_MAX > 0:
        x = tl.math.div_rn(x.to(tl.float32), scale)
        x = tl.clamp(x, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return x.to(OUT_DTYPE)


@triton.jit
def _insert_tile(  # type: ignore[no-untyped-def]
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale, tile, num_tokens, capacity,
    stride_kv_t, stride_pe_t, stride_slot_t, stride_cache_b, stride_cache_s,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    # Layout of the work: one program moves BLOCK_T whole token rows of ONE layer as a
    # [BLOCK_T, R] and a [BLOCK_T, P] tile. Rows are contiguous on both sides, so loads and stores
    # vectorize to 16 bytes; BLOCK_T grows with the step's size so big steps keep several KiB in
    # flight per program while small steps still spread over many SMs.
    # 1. The tile's tokens and slots; tokens past the end read as padding (-1).
    tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    in_step = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens.to(tl.int64) * stride_slot_t, mask=in_step, other=-1)
    # 2. Padding and out-of-range slots write nothing (the masks are [BLOCK_T, 1] tensors, never
    #    scalars: Triton 3.9's interpreter rejects tensor & scalar masks).
    valid = ((slots >= 0) & (slots < capacity))[:, None]
    in_step = in_step[:, None]
    slots = tl.where(slots >= 0, slots, 0)
    # 3. Destination row of each token: block slot // BLOCK_SIZE, offset slot % BLOCK_SIZE.
    rows = ((slots // BLOCK_SIZE) * stride_cache_b + (slots % BLOCK_SIZE) * stride_cache_s)[:, None]
    src = tokens.to(tl.int64)[:, None]
    out_dtype = cache_ptr.dtype.element_ty
    # 4. kv_c -> columns [0, R). The loads are masked by the token bound only, not by the slots,
    #    so they overlap the slot load (small steps are latency-bound); the stores use the slots.
    offs_r = tl.arange(0, BLOCK_R)[None, :]
    in_r = offs_r < R
    x = tl.load(kv_c_ptr + src * stride_kv_t + offs_r, mask=in_step & in_r, eviction_policy="evict_first")  # fmt: skip
    tl.store(cache_ptr + rows + offs_r, _quantize(x, scale, out_dtype, FP8_MAX), mask=valid & in_r)
    # 5. k_pe -> columns [R, R + P).
    offs_p = tl.arange(0, BLOCK_P)[None, :]
    in_p = offs_p < P
    x = tl.load(k_pe_ptr + src * stride_pe_t + offs_p, mask=in_step & in_p, eviction_policy="evict_first")  # fmt: skip
    tl.store(cache_ptr + rows + R + offs_p, _quantize(x, scale, out_dtype, FP8_MAX), mask=valid & in_p)  # fmt: skip


@triton.jit(do_not_specialize=_GROUPED_RUNTIME_ARGS)
def _grouped_insert_kernel(  # type: ignore[no-untyped-def]
    kv_c_ptr, k_pe_ptr, cache_table_ptr, slot_ptr, scale_ptr, num_tokens,
    stride_kv_l, stride_pe_l, stride_slot_l,
    STRIDE_KV_T: tl.constexpr, STRIDE_PE_T: tl.constexpr, STRIDE_SLOT_T: tl.constexpr,
    STRIDE_SCALE: tl.constexpr, CAPACITY: tl.constexpr, STRIDE_CACHE_B: tl.constexpr,
    STRIDE_CACHE_S: tl.constexpr, CACHE_DTYPE: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    FP8_MAX: tl.constexpr, IO_ALIGNED: tl.constexpr,
):  # fmt: skip
    # Runtime arguments are only what changes with the step's size, none specialized, so every
    # step size shares one compiled kernel. Row strides and the caches' geometry are constexprs
    # (fixed per model); IO_ALIGNED restores the alignment facts specialization would have given.
    # Grid (token tiles, layers): consecutive programs read consecutive rows of one layer.
    tile = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    kv_c_ptr += layer * stride_kv_l
    k_pe_ptr += layer * stride_pe_l
    if IO_ALIGNED:  # checked on the host: every layer's first kv_c and k_pe row is 16-byte aligned
        kv_c_ptr = tl.multiple_of(kv_c_ptr, 16)
        k_pe_ptr = tl.multiple_of(k_pe_ptr, 16)
    # The layer's cache base from the device pointer table; every base is 16-byte aligned
    # (checked on the host), which lets the stores vectorize.
    cache_ptr = tl.load(cache_table_ptr + layer).to(tl.pointer_type(CACHE_DTYPE))
    cache_ptr = tl.multiple_of(cache_ptr, 16)
    scale = tl.load(scale_ptr + layer * STRIDE_SCALE) if FP8_MAX > 0 else 1.0
    _insert_tile(
        kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr + layer * stride_slot_l, scale, tile, num_tokens,
        CAPACITY, STRIDE_KV_T, STRIDE_PE_T, STRIDE_SLOT_T, STRIDE_CACHE_B, STRIDE_CACHE_S,
        R, P, BLOCK_R, BLOCK_P, BLOCK_SIZE, BLOCK_T, FP8_MAX,
    )  # fmt: skip


@triton.jit
def _layer_insert_kernel(  # type: ignore[no-untyped-def]
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale_ptr, num_tokens, capacity,
    stride_kv_t, stride_pe_t, stride_slot_t, stride_cache_b, stride_cache_s,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    # One layer; the launcher passes that layer's views, so no layer offsets here.
    scale = tl.load(scale_ptr) if FP8_MAX > 0 else 1.0
    _insert_tile(
        kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale, tl.program_id(0), num_tokens, capacity,
        stride_kv_t, stride_pe_t, stride_slot_t, stride_cache_b, stride_cache_s,
        R, P, BLOCK_R, BLOCK_P, BLOCK_SIZE, BLOCK_T, FP8_MAX,
    )  # fmt: skip


def _launch_grouped(
    plan: _Plan,
    step: _Step,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_scales: torch.Tensor | None,
    block_tokens: int | None = None,
    num_warps: int | None = None,
    *,
    direct: bool = True,
) -> None:
    """One launch over (token tiles, layers) on the current stream of the current device."""
    if step.num_tokens == 0:
        return
    tile, warps = _launch_config(step.num_tokens * step.num_layers, block_tokens, num_warps)
    constexprs = _grouped_constexprs(_launch_spec(plan, step, kv_c, k_pe, tile))
    _grouped_launcher(direct)(
        (-(-step.num_tokens // tile), step.num_layers, 1), kv_c, k_pe, plan.table,
        step.slot_mapping, kv_scales, step.num_tokens, step.kv_strides[0], step.pe_strides[0],
        step.slot_strides[0], *constexprs, num_warps=warps,
    )  # fmt: skip


@functools.cache
def _grouped_launcher(direct: bool) -> DirectLauncher:
    """The grouped kernel's process-wide launcher (direct launches unless ``direct`` is False)."""
    return shared_launcher(_grouped_insert_kernel, direct)


def _launch_per_layer(
    step: _Step,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: Sequence[torch.Tensor],
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
    block_tokens: int | None = None,
    num_warps: int | None = None,
) -> None:
    """L ordinary launches of the single-layer kernel; caches may differ in geometry."""
    if step.num_tokens == 0:
        return
    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    tile, warps = _launch_config(step.num_tokens, block_tokens, num_warps)
    grid = (-(-step.num_tokens // tile),)
    for layer, cache in enumerate(caches):
        if fp8 is not None and cache.dtype != fp8[0]:  # a uint8 cache: store through an FP8 view
            cache = cache.view(fp8[0])
        _layer_insert_kernel[grid](
            kv_c[layer], k_pe[layer], cache, _layer_slots(step, layer),
            None if kv_scales is None else kv_scales[layer], step.num_tokens,
            cache.shape[0] * cache.shape[1], step.kv_strides[1], step.pe_strides[1], step.slot_strides[1],
            cache.stride(0), cache.stride(1), R=step.rank, P=step.rope_dim,
            BLOCK_R=_pow2(step.rank), BLOCK_P=_pow2(step.rope_dim),
            BLOCK_SIZE=cache.shape[1], BLOCK_T=tile, FP8_MAX=step.fp8_max, num_warps=warps,
        )  # fmt: skip


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
) -> None:
    """Insert a step's rows into the paged caches of all L layers with ONE kernel launch.

    The caches' base addresses reach the kernel as an int64 device table, built on the first call
    for a set of caches and reused (memoized with their geometry by their ``data_ptr()``s): make
    that first call outside CUDA-graph capture. A table used under capture is then kept for the
    life of the process, so the graph may replay after any number of newer cache sets. One
    compiled kernel serves every step size of a tile size, launched directly, past Triton's
    per-call dispatch (see :mod:`kvmgr.kernels._launch`). Only enqueues work on the current
    stream.

    Parameters
    ----------
    kv_c : torch.Tensor
        ``[L, T, R]`` latent KV, bfloat16/float16/float32, last dim contiguous (others free).
    k_pe : torch.Tensor
        ``[L, T, P]`` RoPE keys, the dtype and device of ``kv_c``, last dim contiguous.
    caches : sequence of torch.Tensor
        L caches ``[num_blocks, block_size, R + P]`` of equal shape and strides, 16-byte aligned,
        last dim contiguous; mutated in place. dtype: that of ``kv_c`` for ``auto``, else
        ``float8_e4m3fn`` / ``float8_e5m2`` or ``uint8`` holding those bytes.
    slot_mapping : torch.Tensor
        int64 ``[T]`` shared by all layers, or ``[L, T]`` (a stride-0 expand works); < 0 is padding.
    kv_cache_dtype : {"auto", "fp8_e4m3", "fp8_e5m2"}
        ``auto`` copies exactly; FP8 stores ``fp8(clamp(x / kv_scales[l], -max, max))``.
    kv_scales : torch.Tensor or None
        float32 ``[L]`` on the device: required for FP8, ``None`` for ``auto``.
    check_slots : bool
        Also reject slots >= ``num_blocks * block_size`` (always skipped, never written). Costs a
        reduction kernel and one device->host sync; refused under graph capture.
    block_tokens, num_warps : int or None
        Tuning overrides (tokens per program, warps per program); ``None`` picks by step size.
    direct_launch : bool
        Launch the compiled kernel directly (the default); ``False`` takes Triton's normal launch.

    Raises
    ------
    ConfigError
        Unknown ``kv_cache_dtype``; ``kv_scales`` missing for FP8 or given for ``auto``; bad tuning
        overrides; ``check_slots`` or a first call for these caches under graph capture.
    GeometryError
        Shapes, dtypes, devices or strides that do not match; caches of unequal geometry or not
        16-byte aligned (use :func:`per_layer_mla_insert` for those).
    InvalidBlockError
        ``check_slots=True`` and a slot is past the capacity.
    """
    _check_dtype_and_scales(kv_cache_dtype, kv_scales)
    plan = _grouped_plan(caches, kv_cache_dtype)
    step = _check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, plan.meta, for_kernel=True)  # fmt: skip
    if check_slots:
        _check_slots(step, caches)
    _launch_grouped(
        plan, step, kv_c, k_pe, kv_scales, block_tokens, num_warps, direct=direct_launch
    )


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

    Raises
    ------
    ConfigError, GeometryError, InvalidBlockError
        As :func:`grouped_mla_insert`, except that unequal cache geometry is accepted.
    """
    _check_dtype_and_scales(kv_cache_dtype, kv_scales)
    meta = _check_caches(caches, kv_cache_dtype)
    step = _check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, meta, for_kernel=True)
    if check_slots:
        _check_slots(step, caches)
    _launch_per_layer(step, kv_c, k_pe, caches, kv_scales, kv_cache_dtype, block_tokens, num_warps)


def mla_insert_reference(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Torch reference of the inserts (any device, caches of any geometry; synchronises).

    Same arguments and in-place effect as :func:`grouped_mla_insert`. FP8 values are clamped
    before the cast (torch 2.11 turns ``|x| >= 480`` into NaN when casting to e4m3). Which token
    wins when one layer maps two valid tokens to the same slot is unspecified, as in the kernels.

    Raises
    ------
    ConfigError, GeometryError
        As :func:`per_layer_mla_insert`.
    """
    _check_dtype_and_scales(kv_cache_dtype, kv_scales)
    meta = _check_caches(caches, kv_cache_dtype)
    step = _check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, meta, for_kernel=False)
    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    for layer, cache in enumerate(caches):
        block_size = cache.shape[1]
        slots = _layer_slots(step, layer)
        keep = (slots >= 0) & (slots < cache.shape[0] * block_size)
        rows, target = torch.cat([kv_c[layer][keep], k_pe[layer][keep]], dim=-1), cache
        if kv_scales is not None and fp8 is not None:
            scaled = (rows.to(torch.float32) / kv_scales[layer]).clamp(-fp8[2], fp8[2])
            rows, target = scaled.to(fp8[0]).view(torch.uint8), cache.view(torch.uint8)
        kept = slots[keep]
        target[kept // block_size, kept % block_size] = rows
