"""Triton kernels of the c128 compressor (private to :mod:`kvmgr.kernels.c128`).

Offers:
    state_write_kernel   one program per token: ``[kv | score + ape[pos % 128]]`` into its state row
    compress_kernel      one program per candidate token: pools, norms, ropes and packs a window
    WINDOW_CHUNK         state rows the compress kernel pools per loop iteration

Semantics, the entry layout and the bounds rules are in :mod:`kvmgr.kernels.c128.api`. Without
Triton this module still imports, and the kernels are the plain Python functions (never called).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "WINDOW_CHUNK", "compress_kernel", "state_write_kernel"]

HAS_TRITON = triton is not None
WINDOW_CHUNK = 8  # state rows the compress kernel pools per loop iteration


def _jit(**options: Any) -> Callable[[Callable[..., None]], Any]:
    """``triton.jit(**options)`` where Triton is installed; the plain function otherwise."""

    def wrap(fn: Callable[..., None]) -> Any:
        return triton.jit(fn, **options) if triton is not None else fn

    return wrap


@_jit()
def state_write_kernel(  # type: ignore[no-untyped-def]
    kv_ptr, score_ptr, ape_ptr, pos_ptr, slot_ptr, state_ptr,
    stride_kv, stride_score, stride_state_block, stride_state_row, state_capacity,
    STATE_BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, RATIO: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    # 1. padding tokens (slot < 0), slots past the cache and negative positions write nothing
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    if (slot < 0) | (slot >= state_capacity) | (pos < 0):
        return
    offs = tl.arange(0, HEAD_DIM)
    # 2. the row: kv as fp32, score plus the learned position bias of pos % RATIO
    kv = tl.load(kv_ptr + tok * stride_kv + offs).to(tl.float32)
    score = tl.load(score_ptr + tok * stride_score + offs).to(tl.float32)
    ape = tl.load(ape_ptr + (pos % RATIO) * HEAD_DIM + offs)
    row = (
        state_ptr
        + (slot // STATE_BLOCK_SIZE) * stride_state_block
        + (slot % STATE_BLOCK_SIZE) * stride_state_row
    )
    tl.store(row + offs, kv)
    tl.store(row + HEAD_DIM + offs, score + ape)


# the table's shape varies with the step's requests: never recompile for it
@_jit(do_not_specialize=["stride_table", "num_reqs", "table_width"])
def compress_kernel(  # type: ignore[no-untyped-def]
    state_ptr, table_ptr, req_ptr, pos_ptr, slot_ptr, weight_ptr, cos_sin_ptr, out_ptr,
    stride_state_block, stride_state_row, stride_table, eps,
    num_reqs, table_width, num_state_blocks, num_rope_positions, compressed_capacity,
    STATE_BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr,
    RATIO: tl.constexpr, WINDOW_CHUNK: tl.constexpr, ENTRY_BYTES: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    # 1. only boundary tokens with a real slot compress; everything else leaves at once. A token
    #    whose slot, table row, window blocks or RoPE row lie outside the tensors it was given
    #    is skipped too (pos >= RATIO - 1 also keeps the window's first position >= 0).
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    if ((pos + 1) % RATIO != 0) | (pos < RATIO - 1):
        return
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    req = tl.load(req_ptr + tok).to(tl.int64)
    bad = (slot < 0) | (slot >= compressed_capacity) | (req < 0) | (req >= num_reqs)
    bad = bad | (pos // STATE_BLOCK_SIZE >= table_width)
    if bad | ((pos // RATIO) * RATIO >= num_rope_positions):
        return
    offs_d = tl.arange(0, HEAD_DIM)
    offs_w = tl.arange(0, WINDOW_CHUNK)
    # 2. online per-channel softmax pooling over the window, WINDOW_CHUNK rows at a time
    run_max = tl.full([HEAD_DIM], float("-inf"), tl.float32)
    run_sum = tl.zeros([HEAD_DIM], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    num_bad = 0  # window rows whose table entry is not a state block: the token is skipped
    for w0 in range(0, RATIO, WINDOW_CHUNK):
        p = pos - (RATIO - 1) + w0 + offs_w
        blk = tl.load(table_ptr + req * stride_table + p // STATE_BLOCK_SIZE).to(tl.int64)
        is_block = (blk >= 0) & (blk < num_state_blocks)
        num_bad += tl.sum((~is_block).to(tl.int32), axis=0)
        blk = tl.where(is_block, blk, 0)
        rows = state_ptr + blk * stride_state_block + (p % STATE_BLOCK_SIZE) * stride_state_row
        kv = tl.load(rows[:, None] + offs_d[None, :], mask=is_block[:, None], other=0.0)
        score = tl.load(rows[:, None] + HEAD_DIM + offs_d[None, :], mask=is_block[:, None],
                        other=0.0)  # fmt: skip
        new_max = tl.maximum(run_max, tl.max(score, axis=0))
        alpha = tl.exp(run_max - new_max)
        weight = tl.exp(score - new_max[None, :])
        run_sum = run_sum * alpha + tl.sum(weight, axis=0)
        acc = acc * alpha + tl.sum(weight * kv, axis=0)
        run_max = new_max
    if num_bad > 0:
        return
    pooled = acc / run_sum
    # 3. RMSNorm in fp32 with the learned weight
    inv_rms = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / HEAD_DIM + eps)
    y = pooled * inv_rms * tl.load(weight_ptr + offs_d).to(tl.float32)
    # 4. interleaved-pair RoPE on the last ROPE_DIM dims; NoPE pairs get cos 1, sin 0
    even, odd = tl.split(tl.reshape(y, [HEAD_DIM // 2, 2]))
    pair = tl.arange(0, HEAD_DIM // 2) - (HEAD_DIM - ROPE_DIM) // 2
    is_rope = pair >= 0
    cs_row = cos_sin_ptr + (pos // RATIO) * RATIO * ROPE_DIM  # rows are contiguous [cos | sin]
    cos = tl.load(cs_row + pair, mask=is_rope, other=1.0)
    sin = tl.load(cs_row + ROPE_DIM // 2 + pair, mask=is_rope, other=0.0)
    y = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), [HEAD_DIM])
    # 5. UE8M0 exponent per 64-dim group, exact from the fp32 bits of amax:
    #    amax = m * 2**E, m in [1, 2): ceil(log2(amax / 448)) = E - 8 + (m > 1.75)
    groups = tl.reshape(y, [HEAD_DIM // 64, 64])
    amax = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-4)
    bits = amax.to(tl.int32, bitcast=True)
    expo = ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    inv_scale = ((127 - expo) << 23).to(tl.float32, bitcast=True)
    q = tl.clamp(groups * inv_scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
    # 6. store: FP8 NoPE groups, bf16 RoPE tail, scale bytes with the RoPE group's byte zero
    entry = out_ptr + slot * ENTRY_BYTES
    offs_g = tl.arange(0, HEAD_DIM // 64)
    is_nope = offs_g < (HEAD_DIM - ROPE_DIM) // 64
    grid = offs_g[:, None] * 64 + tl.arange(0, 64)[None, :]
    tl.store(entry + grid, q.to(tl.uint8, bitcast=True), mask=is_nope[:, None])
    rope_ptr = (entry + HEAD_DIM - ROPE_DIM).to(tl.pointer_type(tl.bfloat16))
    rope_offs = offs_d - (HEAD_DIM - ROPE_DIM)
    tl.store(rope_ptr + rope_offs, y.to(tl.bfloat16), mask=rope_offs >= 0)
    scale_bytes = tl.where(is_nope, expo + 127, 0).to(tl.uint8)
    tl.store(entry + HEAD_DIM + ROPE_DIM + offs_g, scale_bytes)
