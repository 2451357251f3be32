"""Opt-in host checks of the c128 indices (``check_slots=True``): raise where the device skips.

Offers:
    check_write_bounds      state slots and positions of a state write
    check_compress_bounds   slots, table rows, window widths, table entries and RoPE rows of the
                            boundary tokens of a compress

Each check costs a few reductions and one device->host sync and is refused under CUDA-graph
capture. The kernels skip the same indices on the device, so without these checks an
out-of-range index writes nothing rather than raising.
"""

from __future__ import annotations

import torch

from kvmgr.errors import ConfigError, InvalidBlockError
from kvmgr.kernels.c128.host import Layer
from kvmgr.kernels.c128.layout import C128_RATIO

__all__ = ["check_compress_bounds", "check_write_bounds"]


def check_write_bounds(
    layer: Layer, positions: torch.Tensor, state_slot_mapping: torch.Tensor
) -> None:
    """Opt-in: raise for what the state write would skip (one device->host sync).

    Raises:
        ConfigError: called under CUDA-graph capture.
        InvalidBlockError: a real slot (>= 0) is >= ``num_state_blocks * S``, or a position
            of a real slot is negative.
    """
    _refuse_under_capture(positions)
    if positions.numel() == 0:
        return
    slots = state_slot_mapping.long()
    real = slots >= 0
    worst = torch.stack([torch.where(real, slots, -1).max(),
                         torch.where(real, positions.long(), 0).min()]).tolist()  # fmt: skip
    if worst[0] >= layer.state_capacity:
        raise InvalidBlockError(
            f"state_slot_mapping: expected slots < {layer.state_capacity} (num_state_blocks "
            f"{layer.num_state_blocks} x S {layer.block_size}), got {worst[0]}"
        )
    if worst[1] < 0:
        raise InvalidBlockError(f"positions: expected values >= 0, got {worst[1]}")


def check_compress_bounds(layer: Layer, state_block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, compressed_slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """Opt-in: raise for a boundary token the compress kernel would skip (one sync).

    Only tokens with a boundary position and a slot >= 0 are checked: their slot, table
    row, the width and entries of that row over the token's window, and the RoPE row.

    Raises:
        ConfigError: called under CUDA-graph capture.
        InvalidBlockError: one of those lies outside the tensor it indexes.
    """
    _refuse_under_capture(positions)
    pos, slots = positions.long(), compressed_slot_mapping.long()
    todo = ((pos + 1) % C128_RATIO == 0) & (slots >= 0)
    if positions.numel() == 0 or not bool(todo.any()):
        return
    pos, slots, reqs = pos[todo], slots[todo], req_indices.long()[todo]
    num_reqs, width = state_block_table.shape
    facts = [
        ("compressed_slot_mapping", f"slots < {layer.compressed_capacity}", slots.max()),
        ("positions at a boundary", f"values >= {C128_RATIO - 1}", pos.min()),
        ("req_indices", f"rows of the table in [0, {num_reqs})", reqs.min()),
        ("req_indices", f"rows of the table in [0, {num_reqs})", reqs.max()),
        ("positions // S", f"block indices < the table width {width}",
         pos.max() // layer.block_size),
        ("(positions // 128) * 128", f"rows of cos_sin_cache < {layer.num_rope_positions}",
         (pos.max() // C128_RATIO) * C128_RATIO),
    ]  # fmt: skip
    got = torch.stack([f[2] for f in facts]).tolist()
    bad = [got[0] >= layer.compressed_capacity, got[1] < C128_RATIO - 1, got[2] < 0,
           got[3] >= num_reqs, got[4] >= width, got[5] >= layer.num_rope_positions]  # fmt: skip
    for (name, want, _), value, is_bad in zip(facts, got, bad, strict=True):
        if is_bad:
            raise InvalidBlockError(f"{name}: expected {want}, got {value}")
    _check_window_blocks(layer, state_block_table, reqs, pos)


def _check_window_blocks(
    layer: Layer, state_block_table: torch.Tensor, reqs: torch.Tensor, pos: torch.Tensor
) -> None:
    """Raise unless every table entry of the boundary tokens' windows is a state block (the
    rows and widths were checked)."""
    window = pos[:, None] - (C128_RATIO - 1) + torch.arange(C128_RATIO, device=pos.device)
    blocks = state_block_table.long()[reqs[:, None], window // layer.block_size]
    low, high = torch.stack([blocks.min(), blocks.max()]).tolist()
    if low < 0 or high >= layer.num_state_blocks:
        raise InvalidBlockError(
            f"state_block_table entries of boundary windows: expected blocks in [0, "
            f"{layer.num_state_blocks}), got {low if low < 0 else high}"
        )


def _refuse_under_capture(t: torch.Tensor) -> None:
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ConfigError("check_slots: expected False under CUDA-graph capture, got True")
