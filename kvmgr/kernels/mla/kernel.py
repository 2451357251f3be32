"""Triton kernels of the MLA cache insert (private to :mod:`kvmgr.kernels.mla`).

Offers:
    grouped_insert_kernel   grid (token tiles, layers): every layer's caches through a device
                            table of base addresses; its runtime arguments are all
                            ``do_not_specialize`` (:data:`GROUPED_RUNTIME_ARGS`)
    layer_insert_kernel     grid (token tiles,): one layer's cache
    GROUPED_RUNTIME_ARGS    the grouped kernel's runtime parameters, in order

The checks are in :mod:`kvmgr.kernels.mla.checks`, the launches in ``plan`` and ``insert``; the semantics in
:mod:`kvmgr.kernels.mla.api`. Imports nothing of kvmgr.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["GROUPED_RUNTIME_ARGS", "grouped_insert_kernel", "layer_insert_kernel"]

# The grouped kernel's runtime arguments, in order: none is specialized, so every step size
# shares one compiled kernel (what the compiler needs to know is a constexpr).
GROUPED_RUNTIME_ARGS = (
    "kv_c_ptr", "k_pe_ptr", "cache_table_ptr", "slot_ptr", "scale_ptr",
    "num_tokens", "stride_kv_l", "stride_pe_l", "stride_slot_l",
)  # fmt: skip


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


@triton.jit(do_not_specialize=GROUPED_RUNTIME_ARGS)
def grouped_insert_kernel(  # type: ignore[no-untyped-def]
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
def layer_insert_kernel(  # type: ignore[no-untyped-def]
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
