"""Torch references and host helpers for the c128 compressor (:mod:`kvmgr.kernels.c128.api`; imports none of the kernels).

Offers:
    c128_state_write_ref   reference of ``c128_state_write`` (fp32 math, same effect)
    c128_compress_ref      reference of ``c128_compress`` (fp64 pooling, norm and RoPE)
    c128_unpack            decode packed entries into dequantized NoPE, RoPE and exponents
    rope_cos_sin_cache     a plain ``[max_positions, 64]`` cos/sin table for the RoPE step

The references take the kernels' arguments, mutate the same tensors in the same places, and
run on any device. They are the specification the kernels are tested against. Their private
steps (state write, boundary selection, norm and RoPE, the power-of-two FP8 scaling, packing)
also serve the DeepSeek-V4 references in :mod:`kvmgr.kernels.c128.v4_reference`.
"""

from __future__ import annotations

import torch

from kvmgr.errors import GeometryError
from kvmgr.kernels.c128.layout import C128_RATIO, C128_ROPE_DIM, GROUP, c128_entry_bytes

__all__ = ["c128_compress_ref", "c128_state_write_ref", "c128_unpack", "rope_cos_sin_cache"]

_FP8_MAX = 448.0
_AMAX_FLOOR = 1e-4


def rope_cos_sin_cache(
    max_positions: int, *, base: float = 10000.0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A plain RoPE table ``[max_positions, 64]`` fp32: ``cos(p * f_i)`` then ``sin(p * f_i)``.

    ``f_i = base ** (-2i / 64)`` for pair ``i`` in ``0..31`` (no YaRN scaling; pass your own
    table to :func:`c128_compress` for scaled variants).
    """
    inv_freq = base ** (-torch.arange(0, C128_ROPE_DIM, 2, dtype=torch.float64) / C128_ROPE_DIM)
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float().to(device)


def c128_unpack(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode packed entries ``[..., D + 64 + D // 64]`` uint8 (any device).

    Returns:
        ``(nope, rope, exponents)``: dequantized NoPE ``[..., D - 64]`` fp32, RoPE
        ``[..., 64]`` fp32 (from bf16), and the scale exponents ``[..., D // 64 - 1]`` int32
        (``e_g``; the stored byte is ``e_g + 127``).

    Raises:
        GeometryError: ``entries`` is not uint8 with a valid entry size as its last dim.
    """
    if not isinstance(entries, torch.Tensor) or entries.dtype != torch.uint8:
        got = getattr(entries, "dtype", type(entries).__name__)
        raise GeometryError(f"entries: expected a uint8 tensor, got {got}")
    head_dim = (entries.shape[-1] - C128_ROPE_DIM) * GROUP // (GROUP + 1)
    if (
        head_dim < 128
        or head_dim & (head_dim - 1)
        or entries.shape[-1] != c128_entry_bytes(head_dim)
    ):
        raise GeometryError(
            "entries.shape[-1]: expected D + 64 + D // 64 for a power-of-two D >= 128 (584 for"
            f" D = 512), got {entries.shape[-1]}"
        )
    nope_dim = head_dim - C128_ROPE_DIM
    lead = entries.shape[:-1]
    e = entries[..., head_dim + C128_ROPE_DIM : head_dim + C128_ROPE_DIM + nope_dim // GROUP]
    exponents = e.to(torch.int32) - 127
    q = entries[..., :nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = torch.exp2(exponents.double()).float().repeat_interleave(GROUP, dim=-1)
    rope_bytes = entries[..., nope_dim : head_dim + C128_ROPE_DIM].contiguous()
    rope = rope_bytes.view(torch.bfloat16).float().reshape(*lead, C128_ROPE_DIM)
    return q * scale, rope, exponents


def c128_state_write_ref(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_slot_mapping: torch.Tensor,
    state_cache: torch.Tensor,
) -> None:
    """Torch reference of :func:`c128_state_write` (fp32 math, same arguments and effect).

    Slots outside ``[0, num_state_blocks * S)`` and negative positions write nothing.
    """
    _write_state(kv, score, ape, positions, state_slot_mapping, state_cache, C128_RATIO)


def c128_compress_ref(
    state_cache: torch.Tensor,
    state_block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    compressed_slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    compressed_cache: torch.Tensor,
    *,
    eps: float = 1e-6,
) -> None:
    """Torch reference of :func:`c128_compress` (fp64 pooling, norm and RoPE; same effect).

    Like the kernel, a boundary token writes nothing when its slot, table row, window block
    indices, table entries or RoPE row fall outside the tensors given.
    """
    num_state_blocks, block_size, head_dim = state_cache.shape[0], state_cache.shape[1], state_cache.shape[2] // 2  # fmt: skip
    pos, slots, reqs = _boundaries(state_block_table, req_indices, positions,
                                   compressed_slot_mapping, compressed_cache, cos_sin_cache,
                                   C128_RATIO, block_size)  # fmt: skip
    first = pos >= C128_RATIO - 1  # the whole window at positions >= 0
    pos, slots, reqs = pos[first], slots[first], reqs[first]
    if pos.numel() == 0:
        return
    # 1. gather each window [n, 128, 2D] through the block table; a window with an entry that
    #    is not a state block is dropped
    window = pos[:, None] - (C128_RATIO - 1) + torch.arange(C128_RATIO, device=pos.device)
    blocks = state_block_table.long()[reqs[:, None], window // block_size]
    whole = ((blocks >= 0) & (blocks < num_state_blocks)).all(dim=1)
    if not bool(whole.any()):
        return
    pos, slots, window, blocks = pos[whole], slots[whole], window[whole], blocks[whole]
    rows = state_cache[blocks, window % block_size].double()
    kv, score = rows[..., :head_dim], rows[..., head_dim:]
    # 2. per-channel softmax pooling, 3. RMSNorm, 4. interleaved-pair RoPE at (pos // 128) * 128
    pooled = (torch.softmax(score, dim=1) * kv).sum(dim=1)
    y = _normed_roped(pooled, pos, C128_RATIO, norm_weight, cos_sin_cache, eps)
    compressed_cache.view(-1, compressed_cache.shape[-1])[slots] = _pack_ref(y)  # 5. pack, store


def _boundaries(
    table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor,
    slot_mapping: torch.Tensor, out: torch.Tensor, cos_sin_cache: torch.Tensor, ratio: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Boundary tokens (``(pos + 1) % ratio == 0``) whose slot in ``out``, table row, block
    index of ``pos`` and RoPE row are in range: their positions, slots and requests (int64)."""
    pos, slots, reqs = positions.long(), slot_mapping.long(), req_indices.long()
    todo = ((pos + 1) % ratio == 0) & (slots >= 0) & (slots < out.shape[0] * out.shape[1])
    todo &= (reqs >= 0) & (reqs < table.shape[0]) & (pos // block_size < table.shape[1])
    todo &= pos // ratio * ratio < cos_sin_cache.shape[0]
    return pos[todo], slots[todo], reqs[todo]


def _pack_ref(y: torch.Tensor) -> torch.Tensor:
    """Pack fp32 rows ``[n, D]`` into entries ``[n, D + 64 + D // 64]`` uint8."""
    n = y.shape[0]
    q, exponents = _fp8_pow2(y[:, :-C128_ROPE_DIM].reshape(n, -1, GROUP))
    rope = y[:, -C128_ROPE_DIM:].to(torch.bfloat16).view(torch.uint8)
    pad = torch.zeros(n, 1, dtype=torch.uint8, device=y.device)
    exponent_bytes = (exponents.to(torch.int32) + 127).to(torch.uint8)
    return torch.cat([q.reshape(n, -1), rope, exponent_bytes, pad], dim=1)


def _fp8_pow2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 (e4m3) bytes of fp32 ``x [..., G]`` with one power-of-two scale per row of ``G``:
    ``fp8(clamp(x * 2**-e, -448, 448))``, ``e = ceil(log2(max(amax, 1e-4) / 448))``.

    Returns:
        ``(q, e)``: ``q`` uint8 like ``x``, ``e`` fp64 ``x.shape[:-1]`` (integral values).
    """
    amax = x.abs().amax(dim=-1).clamp_min(_AMAX_FLOOR)
    exponents = torch.ceil(torch.log2(amax.double() / _FP8_MAX))
    scaled = x * torch.exp2(-exponents).float()[..., None]
    return scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), exponents


def _write_state(
    kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
    state_slot_mapping: torch.Tensor, state_cache: torch.Tensor, ratio: int,
) -> None:  # fmt: skip
    """The state write of a compressor of ``ratio``: rows ``[kv | score + ape[pos % ratio]]``."""
    block_size = state_cache.shape[1]
    slots = state_slot_mapping.long()
    keep = (slots >= 0) & (slots < state_cache.shape[0] * block_size) & (positions >= 0)
    bias = ape.float()[positions.long() % ratio]
    rows = torch.cat([kv.float(), score.float() + bias], dim=1)[keep]
    state_cache[slots[keep] // block_size, slots[keep] % block_size] = rows


def _normed_roped(
    pooled: torch.Tensor, pos: torch.Tensor, ratio: int, norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    """RMSNorm of fp64 ``pooled [n, D]``, then interleaved-pair RoPE of the last 64 dims at
    ``(pos // ratio) * ratio``; fp32."""
    y = pooled * torch.rsqrt(pooled.square().mean(dim=-1, keepdim=True) + eps)
    return _rope(y * norm_weight.double(), cos_sin_cache, (pos // ratio) * ratio).float()


def _rope(y: torch.Tensor, cos_sin_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of the last 64 dims of fp64 ``y [n, D]`` by table ``rows``."""
    cs = cos_sin_cache.double()[rows]
    cos, sin = cs[:, : C128_ROPE_DIM // 2], cs[:, C128_ROPE_DIM // 2 :]
    even, odd = y[:, -C128_ROPE_DIM::2], y[:, -C128_ROPE_DIM + 1 :: 2]
    rope = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return torch.cat([y[:, :-C128_ROPE_DIM], rope.flatten(1)], dim=1)
