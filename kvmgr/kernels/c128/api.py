"""DeepSeek-V4 c128 KV compressor: state write and windowed compression (Triton).

Offers:
    c128_state_write         every token writes ``[kv | score + ape[pos % 128]]`` (fp32) into a
                             paged state cache (Triton)
    c128_compress            every boundary token (``(pos + 1) % 128 == 0``) pools its request's
                             last 128 state rows into one compressed entry (Triton)
    c128_entry_bytes         bytes of one compressed entry (584 for head dim 512)
    c128_boundary            the host gate, re-exported from :mod:`kvmgr.kernels.c128.gate`

Layout of :mod:`kvmgr.kernels.c128` (dependencies one-way): ``layout`` (constants, entry size)
<- ``gate`` (numpy host gate), ``reference`` (torch references, the unpacker, a RoPE table) and
``kernel`` (Triton) <- ``host`` (checks, launches through :mod:`kvmgr.kernels.launch`) <- ``api``
(this module) <- ``hook`` (the step hook). ``direct_launch=False`` takes Triton's own launch.

Compression of one boundary token at position ``pos`` of request ``r``:

1. gather the state rows of positions ``pos-127 .. pos`` through ``state_block_table[r]``
   (position ``p`` lives in block ``state_block_table[r, p // S]``, row ``p % S``, where ``S``
   is the state block size);
2. per channel ``c``: ``pooled[c] = sum_i softmax_i(score[i, c]) * kv[i, c]`` over the 128 rows;
3. RMSNorm in fp32: ``y = pooled * rsqrt(mean(pooled**2) + eps) * norm_weight``;
4. interleaved-pair RoPE on the last 64 dims (pairs ``(2i, 2i+1)``) at rotation position
   ``(pos // 128) * 128``, reading ``cos_sin_cache[rotation position]``;
5. quantize and store at the token's compressed slot.

Compressed entry layout (one token; ``D = head_dim``, ``G = D // 64``, of which ``G - 1`` NoPE
groups of 64 dims; the column shows D = 512)::

    bytes [0, D-64)        [0, 448)     NoPE dims 0..D-65 as FP8 e4m3fn; group g = dims
                                        64g .. 64g+63, stored as fp8(clamp(x * 2**-e_g, -448, 448))
    bytes [D-64, D+64)     [448, 576)   RoPE dims D-64..D-1 as bf16, little-endian, in dim order
    bytes [D+64, D+63+G)   [576, 583)   one UE8M0 byte per NoPE group: e_g + 127
    byte  D+63+G           583          zero pad
    total D + 64 + G                    584 bytes

``e_g = ceil(log2(max(amax_g, 1e-4) / 448))`` with ``amax_g`` the group's largest ``|x|``, so the
dequantized value is ``fp8 * 2**e_g``. Entries are rows of a contiguous uint8 cache
``[num_blocks, block_size, entry_bytes]``; compressed slot ``s`` is block ``s // block_size``,
row ``s % block_size``.

Kernel inputs, per candidate token ``i`` (any subset of the step's tokens; under CUDA-graph
capture pass all of them): ``positions[i]`` (absolute position), ``req_indices[i]`` (its row of
``state_block_table``) and ``compressed_slot_mapping[i]``. The compress kernel skips, on the
device, tokens that are not at a boundary or have a negative slot, so one launch over every
token of a step is always correct; the host gate only decides whether launching can be skipped.

Bounds: neither kernel reads or writes outside the tensors it was given. On the device, a state
slot or compressed slot outside ``[0, capacity)``, a negative position, a ``req_indices`` entry
outside the table's rows, a window whose block index reaches past the table row's width, a table
entry outside ``[0, num_state_blocks)`` and a RoPE position past the cos/sin table all make the
token write nothing. ``check_slots=True`` (the launchers and the hook) raises
:class:`~kvmgr.errors.InvalidBlockError` for those instead, at the cost of one device->host sync.

Without Triton this module still imports (the layout helpers work) and the launchers raise
``ImportError``; the gate lives in a numpy-only module that ``import kvmgr`` exports.
"""

from __future__ import annotations

import torch

from kvmgr.kernels.c128.bounds import check_compress_bounds, check_write_bounds
from kvmgr.kernels.c128.gate import c128_boundary
from kvmgr.kernels.c128.host import Layer
from kvmgr.kernels.c128.layout import C128_RATIO, C128_ROPE_DIM, c128_entry_bytes

__all__ = [
    "C128_RATIO",
    "C128_ROPE_DIM",
    "c128_boundary",
    "c128_compress",
    "c128_entry_bytes",
    "c128_state_write",
]


def c128_state_write(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_slot_mapping: torch.Tensor,
    state_cache: torch.Tensor,
    *,
    check_slots: bool = False,
    direct_launch: bool = True,
) -> None:
    """Write every token's state row ``[kv | score + ape[pos % 128]]`` (fp32) into the cache.

    Args:
        kv: ``[T, D]`` fp32/bf16/fp16, unit last stride (rows may be strided).
        score: ``[T, D]``, same dtype as ``kv``, unit last stride.
        ape: ``[128, D]`` fp32 contiguous, the learned position bias.
        positions: ``[T]`` int32/int64, absolute position of each token (>= 0).
        state_slot_mapping: ``[T]`` int32/int64; slot ``s`` is block ``s // S``, row ``s % S``;
            ``s < 0`` marks padding, which writes nothing; so does ``s >= num_state_blocks * S``
            (and a negative position).
        state_cache: ``[num_state_blocks, S, 2D]`` fp32, unit last stride; mutated in place.
        check_slots: raise for slots past the cache and negative positions instead of skipping
            them (one reduction and one device->host sync; refused under graph capture).
        direct_launch: launch the compiled kernel directly (:mod:`kvmgr.kernels.launch`);
            ``False`` takes Triton's normal launch.

    Raises:
        GeometryError: a tensor has the wrong type, shape, dtype, device or layout.
        InvalidBlockError: ``check_slots`` and a slot or position is out of range.
        ConfigError: ``check_slots`` under CUDA-graph capture.
        ImportError: Triton is not installed.
    """
    layer = Layer(state_cache, ape=ape, direct_launch=direct_launch)
    bound, num_tokens = layer.prepare_write(kv, score, positions, state_slot_mapping)
    if check_slots:
        check_write_bounds(layer, positions, state_slot_mapping)
    if num_tokens:
        bound.launch((num_tokens, 1, 1))


def c128_compress(
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
    check_slots: bool = False,
    direct_launch: bool = True,
) -> None:
    """Compress the 128-row window of every boundary token into its compressed slot.

    Tokens whose position is not a boundary (``(pos + 1) % 128 != 0``) or whose compressed slot
    is negative write nothing, so one launch over all tokens of a step is correct. Boundary
    tokens whose slot, table row, window blocks or RoPE row fall outside the given tensors write
    nothing either (never read or write out of bounds; ``check_slots`` raises instead).

    Args:
        state_cache: ``[num_state_blocks, S, 2D]`` fp32, filled by :func:`c128_state_write`
            for every position of each boundary token's window.
        state_block_table: ``[num_reqs, max_state_blocks]`` int32/int64, unit last stride; entry
            ``[r, p // S]`` is the state block holding position ``p`` of request ``r``.
        req_indices: ``[T]`` int32/int64, each token's row of ``state_block_table``.
        positions: ``[T]`` int32/int64, absolute positions (>= 0).
        compressed_slot_mapping: ``[T]`` int32/int64; ``s < 0`` skips the token.
        norm_weight: ``[D]`` fp32/bf16/fp16 RMSNorm weight, contiguous.
        cos_sin_cache: ``[max_positions, 64]`` fp32, contiguous: 32 cos then 32 sin per
            position; a boundary token whose ``(pos // 128) * 128`` is past its rows is skipped.
        compressed_cache: ``[num_blocks, block_size, D + 64 + D // 64]`` uint8 contiguous;
            mutated in place at boundary slots only (layout in the module docstring).
        eps: RMSNorm epsilon (> 0).
        check_slots: raise :class:`~kvmgr.errors.InvalidBlockError` for a boundary token that
            the device would skip as out of range (one device->host sync; not under capture).
        direct_launch: as in :func:`c128_state_write`.

    Raises:
        GeometryError: a tensor has the wrong type, shape, dtype, device or layout, or
            ``eps <= 0``.
        InvalidBlockError: ``check_slots`` and a boundary token indexes out of range.
        ConfigError: ``check_slots`` under CUDA-graph capture.
        ImportError: Triton is not installed.
    """
    layer = Layer(state_cache, norm_weight=norm_weight, cos_sin_cache=cos_sin_cache,
                   compressed_cache=compressed_cache, eps=eps, direct_launch=direct_launch)  # fmt: skip
    args = (state_block_table, req_indices, positions, compressed_slot_mapping)
    bound, num_tokens = layer.prepare_compress(*args)
    if check_slots:
        check_compress_bounds(layer, *args)
    if num_tokens:
        bound.launch((num_tokens, 1, 1))
