"""Plans of the MLA insert: checked caches with their pointer table, launch constants (private).

Offers (to :mod:`kvmgr.kernels.mla.insert`, ``memo``, ``api`` and ``hook``):
    Plan            uniform caches, checked once, as the grouped launch needs them (their device
                    pointer table, geometry); built by ``make_plan``, owned by whoever built it
    cache_key       one pass of attribute reads over the caches: what a plan depends on, or None
    checked_key     the same after the full checks (raises the error that names the problem)
    make_plan       the plan of a key (builds the pointer table; refused under graph capture)
    launch_config   (tokens per program, warps) for a step's size
    grouped_constexprs   the grouped kernel's constexpr values for one launch configuration
    launch_per_layer     the per-layer baseline: L ordinary Triton launches
    IS_INTERPRETED  whether the kernels run under ``TRITON_INTERPRET=1`` (CPU tensors allowed)

Nothing here is memoized: a plan belongs to its owner (a hook, or the public function's memo,
:mod:`kvmgr.kernels.mla.memo`), and constexprs are computed once per bound launch.
Dependencies: :mod:`~kvmgr.kernels.mla.kernel` and :mod:`~kvmgr.kernels.mla.checks` below.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton.language as tl

from kvmgr.errors import ConfigError
from kvmgr.kernels.mla.checks import (
    FP8_FORMATS,
    CacheMeta,
    Step,
    _fail,
    any_meta,
    check_caches,
    is_uniform,
    layer_slots,
)
from kvmgr.kernels.mla.kernel import (
    GROUPED_RUNTIME_ARGS,
    grouped_insert_kernel,
    layer_insert_kernel,
)

__all__ = [
    "IS_INTERPRETED",
    "CacheKey",
    "Plan",
    "cache_key",
    "checked_key",
    "grouped_constexprs",
    "launch_config",
    "launch_per_layer",
    "make_plan",
]

_TL_INPUT_DTYPES = {
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float32: tl.float32,
}
_TL_FP8 = {"fp8_e4m3": tl.float8e4nv, "fp8_e5m2": tl.float8e5}
# the interpreter's kernels are InterpretedFunction objects (TRITON_INTERPRET=1 at definition)
IS_INTERPRETED = type(grouped_insert_kernel).__name__ == "InterpretedFunction"
_data_ptr = torch.Tensor.data_ptr

#: (kv_cache_dtype, device index, shape, strides, cache dtype, data_ptrs): what a plan is made of
CacheKey = tuple[str, int, torch.Size, tuple[int, ...], torch.dtype, tuple[int, ...]]


class Plan(NamedTuple):
    """Uniform caches, checked once, as the grouped launch needs them."""

    meta: CacheMeta
    kv_cache_dtype: str
    table: torch.Tensor  # int64 [L] cache base addresses on the device
    geometry: tuple[int, int, int, int]  # (capacity, block_size, stride(0), stride(1))


def cache_key(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> CacheKey | None:
    """The plan key of caches that are plainly fit for the grouped kernel, else None.

    Plainly fit: one shape, strides, dtype and device, contiguous rows of an accepted dtype, every
    base 16-byte aligned. One pass of attribute reads; anything else takes :func:`checked_key`.
    Two cache sets with equal keys share a plan: the key holds every base address.
    """
    if not caches:
        return None
    first = caches[0]
    shape, strides, dtype, device = first.shape, first.stride(), first.dtype, first.get_device()
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    accepted = _TL_INPUT_DTYPES if fp8 is None else (fp8[0], torch.uint8)
    if len(shape) != 3 or strides[2] != 1 or dtype not in accepted:
        return None
    ptrs = tuple(map(_data_ptr, caches))
    for cache, ptr in zip(caches, ptrs):  # torch dtypes are singletons: ``is`` compares them
        if ptr & 15 or cache.dtype is not dtype or cache.shape != shape or cache.stride() != strides:  # fmt: skip
            return None
        if cache.get_device() != device:
            return None
    if device < 0 and any_meta(*caches):  # -1: the CPU, or meta (checked_key refuses it)
        return None
    return (kv_cache_dtype, device, shape, strides, dtype, ptrs)


def checked_key(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> CacheKey:
    """:func:`cache_key` of caches that pass the full checks (mixed ``uint8`` / FP8 caches are
    accepted here, the first cache's dtype in the key).

    Raises:
        GeometryError: what :func:`~kvmgr.kernels.mla.checks.check_caches` rejects, or caches
            that are not uniform.
    """
    key = cache_key(caches, kv_cache_dtype)
    if key is not None:
        return key
    meta = check_caches(caches, kv_cache_dtype)
    if not is_uniform(caches):
        got = [(tuple(c.shape), c.stride(), c.data_ptr() % 16) for c in caches]
        raise _fail("caches (shape, strides, data_ptr % 16)", "equal shapes and strides, 0", got)
    ptrs = tuple(cache.data_ptr() for cache in caches)
    return (kv_cache_dtype, meta.device, caches[0].shape, caches[0].stride(), meta.dtype, ptrs)


def make_plan(key: CacheKey) -> Plan:
    """The plan of checked, uniform caches: their pointer table uploaded with a blocking copy
    (complete before any stream can read it).

    Raises:
        ConfigError: called under CUDA-graph capture (the table would be built inside the graph).
    """
    kv_cache_dtype, device, (num_blocks, block_size, width), strides, dtype, ptrs = key
    where = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    if device >= 0 and torch.cuda.is_current_stream_capturing():
        raise ConfigError(
            "pointer table: expected one eager call with these caches before CUDA-graph capture, "
            "got the first call while capturing"
        )
    table = torch.tensor(ptrs, dtype=torch.int64).to(where)
    geometry = (num_blocks * block_size, block_size, strides[0], strides[1])
    return Plan(CacheMeta(len(ptrs), width, dtype, device), kv_cache_dtype, table, geometry)


def _pow2(n: int) -> int:
    """Smallest power of two >= n (a plain int; ``triton.next_power_of_2`` costs more)."""
    return 1 << (n - 1).bit_length()


def launch_config(
    num_rows: int, block_tokens: int | None, num_warps: int | None
) -> tuple[int, int]:
    """(tokens per program, warps) for ``num_rows`` = tokens x layers in one launch.

    The tile grows from 1 to 2 to 4 tokens while at least 8192 programs remain; 2 warps up to
    4-token tiles, then 4 (8 tokens) or 8. From the H200 sweep at T = 16384, L = 5, FP8 e4m3 (% of
    the HBM copy peak): 4 tokens / 2 warps 78%, 8 / 4 78%, 2 / 2 76%, 8 / 8 74%, 1 / 2 62%.

    Raises:
        ConfigError: a tuning override out of range.
    """
    if block_tokens is not None and block_tokens not in (1, 2, 4, 8, 16, 32, 64):
        raise ConfigError(f"block_tokens: expected a power of two in [1, 64], got {block_tokens}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ConfigError(f"num_warps: expected 1, 2, 4, 8 or 16, got {num_warps}")
    tile = 1
    while tile < 4 and num_rows // (2 * tile) >= 8192:
        tile *= 2
    tile = block_tokens or tile
    return tile, num_warps or (2 if tile <= 4 else 4 if tile <= 8 else 8)


def grouped_constexprs(
    plan: Plan, step: Step, dtype: torch.dtype, tile: int, is_aligned: bool
) -> tuple[Any, ...]:
    """The grouped kernel's constexpr values, in parameter order, for one launch configuration:
    the step's row strides, the caches' capacity and strides, tile and ``IO_ALIGNED`` (both bases
    and both layer strides of ``kv_c`` / ``k_pe`` are multiples of 16 bytes)."""
    capacity, block_size, stride_b, stride_s = plan.geometry
    fp8 = FP8_FORMATS.get(plan.kv_cache_dtype)
    cache_dtype = _TL_INPUT_DTYPES[dtype] if fp8 is None else _TL_FP8[plan.kv_cache_dtype]
    constexprs = {
        "STRIDE_KV_T": step.kv_strides[1], "STRIDE_PE_T": step.pe_strides[1],
        "STRIDE_SLOT_T": step.slot_strides[1], "STRIDE_SCALE": step.scale_stride,
        "CAPACITY": capacity, "STRIDE_CACHE_B": stride_b, "STRIDE_CACHE_S": stride_s,
        "CACHE_DTYPE": cache_dtype, "R": step.rank, "P": step.rope_dim,
        "BLOCK_R": _pow2(step.rank), "BLOCK_P": _pow2(step.rope_dim), "BLOCK_SIZE": block_size,
        "BLOCK_T": tile, "FP8_MAX": 0.0 if fp8 is None else fp8[1], "IO_ALIGNED": is_aligned,
    }  # fmt: skip
    assert list(constexprs) == grouped_insert_kernel.arg_names[len(GROUPED_RUNTIME_ARGS) :]
    return tuple(constexprs.values())


def launch_per_layer(
    step: Step,
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
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    tile, warps = launch_config(step.num_tokens, block_tokens, num_warps)
    grid = (-(-step.num_tokens // tile),)
    for layer, cache in enumerate(caches):
        if fp8 is not None and cache.dtype != fp8[0]:  # a uint8 cache: store through an FP8 view
            cache = cache.view(fp8[0])
        layer_insert_kernel[grid](
            kv_c[layer], k_pe[layer], cache, layer_slots(step, layer),
            None if kv_scales is None else kv_scales[layer], step.num_tokens,
            cache.shape[0] * cache.shape[1], step.kv_strides[1], step.pe_strides[1], step.slot_strides[1],
            cache.stride(0), cache.stride(1), R=step.rank, P=step.rope_dim,
            BLOCK_R=_pow2(step.rank), BLOCK_P=_pow2(step.rope_dim),
            BLOCK_SIZE=cache.shape[1], BLOCK_T=tile, FP8_MAX=step.fp8_max, num_warps=warps,
        )  # fmt: skip
