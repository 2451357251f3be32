"""Torch reference of the MLA cache insert (any device; imports none of the kernels).

Offers:
    mla_insert_reference   the specification :func:`kvmgr.kernels.mla.api.grouped_mla_insert`
                           and :func:`~kvmgr.kernels.mla.api.per_layer_mla_insert` are tested
                           against
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmgr.kernels.mla.checks import (
    FP8_FORMATS,
    check_caches,
    check_dtype_and_scales,
    check_step,
    layer_slots,
)

__all__ = ["mla_insert_reference"]


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

    Same arguments and in-place effect as :func:`~kvmgr.kernels.mla.api.grouped_mla_insert`. FP8 values are clamped
    before the cast (torch 2.11 turns ``|x| >= 480`` into NaN when casting to e4m3). Which token
    wins when one layer maps two valid tokens to the same slot is unspecified, as in the kernels.

    Raises:
        ConfigError, GeometryError: As :func:`~kvmgr.kernels.mla.api.per_layer_mla_insert`.
    """
    check_dtype_and_scales(kv_cache_dtype, kv_scales)
    meta = check_caches(caches, kv_cache_dtype)
    step = check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, meta, allow_cpu=True)
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    for layer, cache in enumerate(caches):
        block_size = cache.shape[1]
        slots = layer_slots(step, layer)
        keep = (slots >= 0) & (slots < cache.shape[0] * block_size)
        rows, target = torch.cat([kv_c[layer][keep], k_pe[layer][keep]], dim=-1), cache
        if kv_scales is not None and fp8 is not None:
            scaled = (rows.to(torch.float32) / kv_scales[layer]).clamp(-fp8[1], fp8[1])
            rows, target = scaled.to(fp8[0]).view(torch.uint8), cache.view(torch.uint8)
        kept = slots[keep]
        target[kept // block_size, kept % block_size] = rows
