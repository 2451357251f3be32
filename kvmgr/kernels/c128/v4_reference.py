"""Torch references of the DeepSeek-V4 cache writers kvmgr has no kernel for (no Triton needed).

Offers:
    compressor_state_write_ref   the state write of any compressor: ``[kv | score + ape[pos % r]]``
    c4_compress_ref              the ratio-4 (CSA) compressor: overlapping 8-token windows, entries
                                 in the c128 layout (``c128_entry_bytes(D)``, 584 B for D = 512)
    indexer_compress_ref         the lightning indexer's ratio-4 compressor: FP8 keys with one
                                 power-of-two fp32 scale (``indexer_entry_bytes``, 132 B)
    swa_insert_ref               the sliding-window cache insert: one entry per token, RoPE at the
                                 token's own position, in the c128 layout
    indexer_entry_bytes          bytes of one indexer entry (``head_dim + 4``)

Semantics follow vLLM's DeepSeek-V4 compressor (``save_partial_states`` and the fused
compress-norm-rope-store kernels): a compressor of ratio ``r`` with overlap keeps a state row of
width ``2 * coff * D`` per token (``coff = 2`` with overlap, 1 without): ``coff * D`` kv values,
then ``coff * D`` scores plus the learned bias ``ape[pos % r]``. A token at a boundary
(``(pos + 1) % r == 0``) pools the window of ``coff * r`` positions ``pos - coff*r + 1 .. pos``:
without overlap every row gives its whole ``D``-wide kv/score; with overlap the first ``r`` rows
give dims ``[0, D)`` of their kv and score halves and the last ``r`` rows dims ``[D, 2D)``.
Positions below 0 (the first window of a sequence) take no part in the softmax. Then per channel
``pooled = sum softmax(score) * kv``, RMSNorm with the layer's weight, interleaved-pair RoPE on
the last 64 dims at ``(pos // r) * r``, quantize, store.

Quantization differs from vLLM in one place, on purpose: vLLM rounds the normed values to bf16
before taking the FP8 scales; these references (like :mod:`kvmgr.kernels.c128.reference`) do the
math in fp64 and quantize the fp32 result. The layouts are kvmgr's: an entry is contiguous (vLLM
keeps a block's scales after its data); pages are copied whole, so either layout round-trips.

Like the c128 references, a token writes nothing when its slot or table row is out of range, or
when a window position ``>= 0`` maps to a table entry outside the state cache: a dropped block is
never read as if it held state. Every function mutates its output tensor in place only at the
slots it writes, on any device, deterministically.
"""

from __future__ import annotations

import torch

from kvmgr.kernels.c128.reference import (
    _boundaries,
    _fp8_pow2,
    _normed_roped,
    _pack_ref,
    _rope,
    _write_state,
)

__all__ = [
    "c4_compress_ref",
    "compressor_state_write_ref",
    "indexer_compress_ref",
    "indexer_entry_bytes",
    "swa_insert_ref",
]

C4_RATIO = 4


def indexer_entry_bytes(head_dim: int = 128) -> int:
    """Bytes of one indexer entry: ``head_dim`` FP8 bytes, then one fp32 scale (132 for 128)."""
    return head_dim + 4


def compressor_state_write_ref(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_slot_mapping: torch.Tensor,
    state_cache: torch.Tensor,
    *,
    ratio: int,
) -> None:
    """Write every token's state row ``[kv | score + ape[pos % ratio]]`` (fp32).

    Args:
        kv, score: ``[T, W]`` any float dtype (``W = coff * D``: 2D for the c4 and indexer
            compressors, D for c128).
        ape: ``[ratio, W]`` fp32, the learned position bias of the scores.
        positions: ``[T]`` int absolute positions.
        state_slot_mapping: ``[T]`` int; slot ``s`` is block ``s // S``, row ``s % S``. Negative
            slots, slots past the cache and negative positions write nothing.
        state_cache: ``[num_blocks, S, 2W]`` fp32, mutated in place.
    """
    _write_state(kv, score, ape, positions, state_slot_mapping, state_cache, ratio)


def _pool(
    state_cache: torch.Tensor, table: torch.Tensor, reqs: torch.Tensor, pos: torch.Tensor,
    ratio: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Overlapping-window softmax pooling (fp64) of boundary tokens; (whole mask, pooled)."""
    num_blocks, block_size = state_cache.shape[0], state_cache.shape[1]
    window = 2 * ratio
    offs = torch.arange(window, device=pos.device)
    p = pos[:, None] - window + 1 + offs  # [n, 2r] window positions
    real = p >= 0
    blocks = table.long()[reqs[:, None], (p.clamp_min(0) // block_size)]
    whole = ((blocks >= 0) & (blocks < num_blocks) | ~real).all(dim=1)
    rows = state_cache[blocks.clamp(0, num_blocks - 1), p.clamp_min(0) % block_size].double()
    half = (offs >= ratio).long() * head_dim  # later rows read the second D dims
    dims = half[:, None] + torch.arange(head_dim, device=pos.device)  # [2r, D]
    width = state_cache.shape[2] // 2
    kv = rows.gather(2, dims.expand(rows.shape[0], -1, -1))
    score = rows.gather(2, (dims + width).expand(rows.shape[0], -1, -1))
    score = score.masked_fill(~real[..., None], float("-inf"))
    kv = kv.masked_fill(~real[..., None], 0.0)
    return whole, (torch.softmax(score, dim=1) * kv).sum(dim=1)


def _compress4(
    state_cache: torch.Tensor, table: torch.Tensor, req_indices: torch.Tensor,
    positions: torch.Tensor, slot_mapping: torch.Tensor, norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor, out: torch.Tensor, eps: float, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """Shared body of the two ratio-4 compressors: (slots, fp32 rows) to store, or None."""
    pos, slots, reqs = _boundaries(table, req_indices, positions, slot_mapping, out,
                                   cos_sin_cache, C4_RATIO, state_cache.shape[1])  # fmt: skip
    if pos.numel() == 0:
        return None
    whole, pooled = _pool(state_cache, table, reqs, pos, C4_RATIO, head_dim)
    if not bool(whole.any()):
        return None
    y = _normed_roped(pooled[whole], pos[whole], C4_RATIO, norm_weight, cos_sin_cache, eps)
    return slots[whole], y


def c4_compress_ref(
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
    """Ratio-4 compressor of the CSA layers: overlapping 8-token windows into c128-layout entries.

    Args:
        state_cache: ``[num_blocks, S, 4D]`` fp32, rows ``[kv (2D) | score + ape (2D)]`` written
            by :func:`compressor_state_write_ref` with ``ratio=4``.
        state_block_table: ``[num_reqs, width]`` int; ``[r, p // S]`` holds position ``p``.
        req_indices, positions, compressed_slot_mapping: ``[T]`` int, as for
            :func:`~kvmgr.kernels.c128.api.c128_compress`.
        norm_weight: ``[D]`` RMSNorm weight.
        cos_sin_cache: ``[max_positions, 64]`` fp32 (32 cos, 32 sin per row).
        compressed_cache: ``[num_blocks, block_size, D + 64 + D // 64]`` uint8; boundary
            tokens (``(pos + 1) % 4 == 0``) write their entry at their slot.
        eps: RMSNorm epsilon.
    """
    head_dim = state_cache.shape[2] // 4
    out = _compress4(state_cache, state_block_table, req_indices, positions,
                     compressed_slot_mapping, norm_weight, cos_sin_cache, compressed_cache, eps,
                     head_dim)  # fmt: skip
    if out is not None:
        compressed_cache.view(-1, compressed_cache.shape[-1])[out[0]] = _pack_ref(out[1])


def indexer_compress_ref(
    state_cache: torch.Tensor,
    state_block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    index_slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    index_cache: torch.Tensor,
    *,
    eps: float = 1e-6,
) -> None:
    """The indexer's ratio-4 compressor: FP8 keys with one power-of-two fp32 scale per entry.

    Same windows, norm and RoPE as :func:`c4_compress_ref` with the indexer head dim ``Di``
    (128); the entry is ``fp8(clamp(y * 2**-e, -448, 448))`` for all ``Di`` dims, then the fp32
    scale ``2**e`` (little-endian), with ``e = ceil(log2(max(amax, 1e-4) / 448))``.

    Args:
        state_cache: ``[num_blocks, S, 4 * Di]`` fp32 indexer compressor state.
        index_cache: ``[num_blocks, block_size, Di + 4]`` uint8, mutated at boundary slots.
        others: as :func:`c4_compress_ref`.
    """
    head_dim = state_cache.shape[2] // 4
    out = _compress4(state_cache, state_block_table, req_indices, positions,
                     index_slot_mapping, norm_weight, cos_sin_cache, index_cache, eps,
                     head_dim)  # fmt: skip
    if out is None:
        return
    slots, y = out
    q, exponents = _fp8_pow2(y)
    scale = torch.exp2(exponents).float()[:, None].contiguous().view(torch.uint8)
    index_cache.view(-1, index_cache.shape[-1])[slots] = torch.cat([q, scale], dim=1)


def swa_insert_ref(
    kv: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    swa_cache: torch.Tensor,
) -> None:
    """Insert each token's (already normed) kv into the sliding-window cache, c128 layout.

    The last 64 dims are rotated at the token's own position (interleaved pairs); the entry is
    packed like a c128 entry (FP8 NoPE with UE8M0 scales, bf16 RoPE).

    Args:
        kv: ``[T, D]`` any float dtype.
        positions: ``[T]`` int absolute positions (a row of ``cos_sin_cache`` each).
        slot_mapping: ``[T]`` int; negative or past-the-cache slots, and positions outside the
            table, write nothing.
        cos_sin_cache: ``[max_positions, 64]`` fp32.
        swa_cache: ``[num_blocks, block_size, D + 64 + D // 64]`` uint8, mutated in place.
    """
    slots, pos = slot_mapping.long(), positions.long()
    capacity = swa_cache.shape[0] * swa_cache.shape[1]
    keep = (slots >= 0) & (slots < capacity) & (pos >= 0) & (pos < cos_sin_cache.shape[0])
    if not bool(keep.any()):
        return
    y = _rope(kv[keep].double(), cos_sin_cache, pos[keep]).float()
    swa_cache.view(-1, swa_cache.shape[-1])[slots[keep]] = _pack_ref(y)
