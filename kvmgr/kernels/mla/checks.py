"""Input checks of the MLA cache insert (torch only; private to :mod:`kvmgr.kernels.mla`).

Offers:
    KV_CACHE_DTYPES, FP8_FORMATS    accepted ``kv_cache_dtype`` names; FP8 name -> (torch dtype,
                                    largest finite value)
    CacheMeta, Step                 what the caches and one step's tensors were checked as
    check_dtype_and_scales, check_caches, is_uniform, check_step, unchecked_step,
    check_slot_range, layer_slots, any_meta

Per-step checks are attribute reads only (no torch ops), so they cost a few microseconds; the
opt-in :func:`check_slot_range` is the one with a reduction and a device->host sync. Imports
neither Triton nor the kernels, so the torch reference uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvmgr._tensor_guard import any_meta, tensor_guard  # re-exported: the family's modules use them
from kvmgr.errors import ConfigError, GeometryError, InvalidBlockError

__all__ = [
    "FP8_FORMATS", "KV_CACHE_DTYPES", "CacheMeta", "Step", "any_meta", "check_caches",
    "check_dtype_and_scales", "check_slot_range", "check_step", "is_uniform", "layer_slots",
    "tensor_guard", "unchecked_step",
]  # fmt: skip

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_FORMATS = {  # name -> (torch cache dtype, largest finite value)
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}


class CacheMeta(NamedTuple):
    """What a step is checked against: the caches' count, row width, dtype and device index."""

    num_layers: int
    width: int  # R + P
    dtype: torch.dtype  # of caches[0]
    device: int  # Tensor.get_device(): -1 for CPU


class Step(NamedTuple):
    """A step's sizes and strides, read once (``slot_strides`` is (0, s) for a shared ``[T]``)."""

    num_layers: int
    num_tokens: int
    rank: int  # R
    rope_dim: int  # P
    slot_mapping: torch.Tensor  # as given: [T] or [L, T]
    slot_strides: tuple[int, ...]  # (layer, token)
    kv_strides: tuple[int, ...]
    pe_strides: tuple[int, ...]
    scale_stride: int  # 0 without scales
    fp8_max: float  # 0.0 for "auto"


def _fail(what: str, expected: object, got: object) -> GeometryError:
    return GeometryError(f"{what}: expected {expected}, got {got}")


def check_dtype_and_scales(kv_cache_dtype: str, kv_scales: torch.Tensor | None) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype != "auto" and kv_scales is None:
        raise ConfigError(f"kv_scales: expected float32 [L] for {kv_cache_dtype!r}, got None")
    if kv_cache_dtype == "auto" and kv_scales is not None:
        raise ConfigError("kv_scales: expected None for kv_cache_dtype='auto', got a tensor")


def check_caches(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> CacheMeta:
    """Per-cache checks (any geometry): rank, one width, dtype, contiguous rows, one device."""
    if len(caches) == 0:
        raise _fail("caches", "one cache per layer", "none")
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    first = caches[0]
    allowed = (first.dtype,) if fp8 is None else (fp8[0], torch.uint8)
    if fp8 is None and first.dtype not in INPUT_DTYPES:
        raise _fail("caches[0].dtype for 'auto'", "bfloat16, float16 or float32", first.dtype)
    width, device = (first.shape[-1] if first.dim() else 0), first.get_device()
    if device < 0 and any_meta(*caches):  # get_device() is -1 for the CPU and meta alike
        raise _fail("caches' device", "cuda (cpu needs TRITON_INTERPRET=1)", "meta")
    for layer, cache in enumerate(caches):
        if cache.dim() != 3 or cache.shape[2] != width:
            got = tuple(cache.shape)
            raise _fail(f"caches[{layer}].shape", f"[num_blocks, block_size, {width}]", got)
        if cache.dtype not in allowed or cache.stride()[2] != 1 or cache.get_device() != device:
            want = f"({' or '.join(map(str, allowed))}, 1, {first.device})"
            found = (cache.dtype, cache.stride(2), cache.device)
            raise _fail(f"caches[{layer}] (dtype, stride(2), device)", want, found)
    return CacheMeta(len(caches), width, first.dtype, device)


def is_uniform(caches: Sequence[torch.Tensor]) -> bool:
    """Equal shapes and strides, and every base 16-byte aligned: what the grouped kernel needs."""
    shape, strides = caches[0].shape, caches[0].stride()
    return all(
        c.shape == shape and c.stride() == strides and c.data_ptr() % 16 == 0 for c in caches
    )


def check_step(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
    meta: CacheMeta,
    *,
    allow_cpu: bool,
) -> Step:
    """Per-step checks of the inputs against the (already checked) caches; attribute reads only."""
    kv_shape, pe_shape = kv_c.shape, k_pe.shape
    if len(kv_shape) != 3 or len(pe_shape) != 3 or kv_shape[:2] != pe_shape[:2]:
        raise _fail("kv_c, k_pe shapes", "[L, T, R] and [L, T, P]", (tuple(kv_shape), tuple(pe_shape)))  # fmt: skip
    (num_layers, num_tokens, rank), rope_dim = kv_shape, pe_shape[2]
    dtype, kv_strides, pe_strides = kv_c.dtype, kv_c.stride(), k_pe.stride()
    if dtype not in INPUT_DTYPES or k_pe.dtype != dtype:
        raise _fail("kv_c, k_pe dtypes", "both bfloat16, float16 or float32", (dtype, k_pe.dtype))
    if kv_cache_dtype == "auto" and dtype != meta.dtype:
        raise _fail("kv_c.dtype for 'auto'", f"the caches' {meta.dtype}", dtype)
    if kv_strides[2] != 1 or pe_strides[2] != 1 or rank == 0 or rope_dim == 0:
        raise _fail("kv_c, k_pe last dims", "contiguous and non-empty", (kv_strides, pe_strides))
    device = _step_device(kv_c, k_pe, slot_mapping, kv_scales, meta, allow_cpu)
    if meta.num_layers != num_layers or meta.width != rank + rope_dim:
        found = f"{meta.num_layers} of width {meta.width}"
        raise _fail("caches", f"{num_layers} of width R + P = {rank + rope_dim}", found)
    slot_shape, slot_strides = slot_mapping.shape, slot_mapping.stride()
    if slot_mapping.dtype != torch.int64 or (slot_shape != (num_tokens,) and slot_shape != (num_layers, num_tokens)):  # fmt: skip
        want = f"int64 [{num_tokens}] or [{num_layers}, {num_tokens}]"
        raise _fail("slot_mapping", want, f"{slot_mapping.dtype} {list(slot_shape)}")
    scale_stride = 0 if kv_scales is None else _scale_stride(kv_scales, num_layers, device)
    fp8_max = FP8_FORMATS[kv_cache_dtype][1] if kv_cache_dtype != "auto" else 0.0
    return Step(
        num_layers, num_tokens, rank, rope_dim, slot_mapping,
        (0, slot_strides[0]) if len(slot_strides) == 1 else slot_strides,
        kv_strides, pe_strides, scale_stride, fp8_max,
    )  # fmt: skip


def _step_device(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
    meta: CacheMeta,
    allow_cpu: bool,
) -> int:
    """``check_step``'s device index: the step's tensors and the caches on one CUDA device (a
    CPU one only with ``allow_cpu``, never meta); raises ``GeometryError`` else."""
    device = kv_c.get_device()
    if device < 0 and (not allow_cpu or any_meta(kv_c, k_pe, slot_mapping, kv_scales)):
        got = "meta" if any_meta(kv_c, k_pe, slot_mapping, kv_scales) else kv_c.device
        raise _fail("kv_c, k_pe, slot_mapping, kv_scales device", "cuda (cpu needs TRITON_INTERPRET=1)", got)  # fmt: skip
    if k_pe.get_device() != device or meta.device != device or slot_mapping.get_device() != device:
        raise _fail("k_pe, caches, slot_mapping device indices", device, (k_pe.get_device(), meta.device, slot_mapping.get_device()))  # fmt: skip
    return device


def _scale_stride(kv_scales: torch.Tensor, num_layers: int, device: int) -> int:
    """The stride of ``kv_scales``, float32 ``[num_layers]`` on ``device``; raises
    ``GeometryError`` else."""
    scales_meta = (kv_scales.dtype, kv_scales.shape, kv_scales.get_device())
    if scales_meta != (torch.float32, (num_layers,), device):
        raise _fail("kv_scales (dtype, shape, device index)", (torch.float32, (num_layers,), device), scales_meta)  # fmt: skip
    return kv_scales.stride()[0]


def unchecked_step(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
) -> Step:
    """What :func:`check_step` returns, without its checks (callers that vouch for the inputs)."""
    num_layers, num_tokens, rank = kv_c.shape
    slot_strides = slot_mapping.stride()
    return Step(
        num_layers, num_tokens, rank, k_pe.shape[2], slot_mapping,
        (0, slot_strides[0]) if len(slot_strides) == 1 else slot_strides,
        kv_c.stride(), k_pe.stride(), 0 if kv_scales is None else kv_scales.stride()[0],
        FP8_FORMATS[kv_cache_dtype][1] if kv_cache_dtype != "auto" else 0.0,
    )  # fmt: skip


def layer_slots(step: Step, layer: int) -> torch.Tensor:
    """The ``[T]`` slots of one layer (a view)."""
    return step.slot_mapping if step.slot_mapping.dim() == 1 else step.slot_mapping[layer]


def check_slot_range(step: Step, caches: Sequence[torch.Tensor]) -> None:
    """Reject slots past each layer's capacity: one reduction and ONE device->host sync."""
    if step.slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ConfigError("check_slots: expected False under CUDA-graph capture, got True")
    if step.num_tokens == 0:
        return
    highest = step.slot_mapping.amax(dim=-1).reshape(-1).tolist()
    for layer, cache in enumerate(caches):
        slot = highest[layer if len(highest) > 1 else 0]
        if slot >= cache.shape[0] * cache.shape[1]:
            raise InvalidBlockError(
                f"slot_mapping for layer {layer}: expected slots < {cache.shape[0] * cache.shape[1]}"
                f" (num_blocks {cache.shape[0]} x block_size {cache.shape[1]}), got {slot}"
            )
