"""Host side of the MLA insert kernels: plans, launch constants and launches (private).

Offers (to :mod:`kvmgr.kernels.mla.api` and :mod:`kvmgr.kernels.mla.hook`):
    plans         ``grouped_plan``: checked, uniform caches with their device pointer table,
                  memoized by the caches' geometry and ``data_ptr()``s
    launches      ``launch_grouped`` (one launch for all layers, through the process-wide
                  ``grouped_launcher``), ``launch_per_layer`` (L ordinary Triton launches)
    constants     ``_launch_config`` (tile, warps); ``_launch_spec`` and ``_grouped_constexprs``:
                  the grouped kernel's constexprs per launch configuration, memoized
    IS_INTERPRETED  whether the kernels run under ``TRITON_INTERPRET=1`` (CPU tensors allowed)

Host cost: the grouped launcher is called once per step, so its host path is kept short. The
caches are checked in one pass, the step's tensors with plain attribute reads (no torch ops), the
constexprs come from a memo, and the kernel is launched through
:class:`kvmgr.kernels.launch.DirectLauncher` (the compiled kernel, past ``JITFunction.run``'s
per-call dispatch). The grouped kernel's runtime arguments are all ``do_not_specialize``, so one
compiled kernel serves every step size; what the compiler needs to know (row strides, geometry,
alignment) is a constexpr. The per-layer baseline uses Triton's normal launch, as a caller
launching a Triton kernel once per layer would.

Pointer tables and CUDA graphs: a captured grouped launch reads its plan's pointer table at every
replay. The eager memo keeps the plans of the 32 most recently used cache sets; a plan used under
capture is also kept for the life of the process (``_plan_held_for_graphs``), so a graph never
reads a freed table. That costs one ``int64 [L]`` device tensor per cache set ever captured, and
one capture query (``torch.cuda.is_current_stream_capturing``) per grouped call on CUDA.

Dependencies: :mod:`~kvmgr.kernels.mla.kernel` and :mod:`~kvmgr.kernels.mla.checks` below,
:mod:`kvmgr.kernels.launch` beside; nothing above.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton.language as tl

from kvmgr.errors import ConfigError
from kvmgr.kernels.launch import DirectLauncher, shared_launcher
from kvmgr.kernels.mla.checks import (
    FP8_FORMATS,
    CacheMeta,
    Step,
    _fail,
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
    "Plan",
    "grouped_launcher",
    "grouped_plan",
    "launch_grouped",
    "launch_per_layer",
]

_TL_INPUT_DTYPES = {
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float32: tl.float32,
}
_TL_FP8 = {"fp8_e4m3": tl.float8e4nv, "fp8_e5m2": tl.float8e5}
# the interpreter's kernels are InterpretedFunction objects (TRITON_INTERPRET=1 at definition)
IS_INTERPRETED = type(grouped_insert_kernel).__name__ == "InterpretedFunction"


class Plan(NamedTuple):
    """Uniform caches, checked once, as the grouped launch needs them."""

    meta: CacheMeta
    kv_cache_dtype: str
    table: torch.Tensor  # int64 [L] cache base addresses on the device
    geometry: tuple[int, int, int, int]  # (capacity, block_size, stride(0), stride(1))


def _clean_key(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> tuple[Any, ...] | None:
    """The :func:`_plan_for` key of caches that are plainly fit for the grouped kernel, else None.

    Plainly fit: one shape, strides, dtype and device, contiguous rows of an accepted dtype, every
    base 16-byte aligned. One pass of attribute reads; anything else takes the full checks.
    """
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    first = caches[0]
    shape, strides, dtype, device = first.shape, first.stride(), first.dtype, first.get_device()
    accepted = _TL_INPUT_DTYPES if fp8 is None else (fp8[0], torch.uint8)
    if len(shape) != 3 or strides[2] != 1 or dtype not in accepted:
        return None
    ptrs = []
    for cache in caches:
        ptr = cache.data_ptr()
        if ptr & 15 or cache.dtype != dtype or cache.get_device() != device:
            return None
        if cache.shape != shape or cache.stride() != strides:
            return None
        ptrs.append(ptr)
    return (kv_cache_dtype, device, shape, strides, dtype, tuple(ptrs))


def grouped_plan(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> Plan:
    """Check caches for the grouped kernel (cheaply when they are plainly fit) and plan its launch.

    Raises:
        GeometryError: what :func:`check_caches` rejects, or caches that are not uniform.
        ConfigError: the first call for these caches happens under CUDA-graph capture.
    """
    key = _clean_key(caches, kv_cache_dtype) if len(caches) > 0 else None
    if key is None:  # mixed uint8 / FP8 caches are accepted here; anything else raises
        meta = check_caches(caches, kv_cache_dtype)
        if not is_uniform(caches):
            got = [(tuple(c.shape), c.stride(), c.data_ptr() % 16) for c in caches]
            want = "equal shapes and strides, 0"
            raise _fail("caches (shape, strides, data_ptr % 16)", want, got)
        ptrs = tuple(cache.data_ptr() for cache in caches)
        key = (kv_cache_dtype, meta.device, caches[0].shape, caches[0].stride(), meta.dtype, ptrs)
    if key[1] >= 0 and torch.cuda.is_current_stream_capturing():
        return _plan_held_for_graphs(*key)  # a graph may replay it after _plan_for evicts it
    return _plan_for(*key)


@functools.lru_cache(maxsize=32)
def _plan_for(
    kv_cache_dtype: str,
    device: int,
    shape: tuple[int, int, int],
    strides: tuple[int, ...],
    dtype: torch.dtype,
    data_ptrs: tuple[int, ...],
) -> Plan:
    """The plan of checked, uniform caches; a pure function of its key, memoized.

    Raises:
        ConfigError: the first call for these caches happens under CUDA-graph capture.
    """
    (num_blocks, block_size, width), where = shape, torch.device("cpu")
    if device >= 0:
        where = torch.device("cuda", device)
    meta = CacheMeta(len(data_ptrs), width, dtype, device)
    geometry = (num_blocks * block_size, block_size, strides[0], strides[1])
    return Plan(meta, kv_cache_dtype, _pointer_table(where, data_ptrs), geometry)


@functools.lru_cache(maxsize=32)
def _pointer_table(device: torch.device, data_ptrs: tuple[int, ...]) -> torch.Tensor:
    """int64 ``[L]`` device tensor of cache base addresses; a pure function of its key, memoized.

    Raises:
        ConfigError: the first call for these caches happens under CUDA-graph capture.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ConfigError(
            "pointer table: expected one eager call with these caches before CUDA-graph capture, "
            "got the first call while capturing"
        )
    # A blocking copy: the table is complete before any stream can read it.
    return torch.tensor(data_ptrs, dtype=torch.int64).to(device)


@functools.cache
def _plan_held_for_graphs(*key: Any) -> Plan:
    """:func:`_plan_for` of a key used under CUDA-graph capture, held for the process's life.

    A captured launch reads the plan's pointer table at every replay, so that table must outlive
    the graph; ``_plan_for`` alone would free it 32 newer cache sets later. Unbounded, but only
    cache sets captured into graphs enter (one ``int64 [L]`` device tensor each).

    Raises:
        ConfigError: no eager call built these caches' plan (the first call is under capture).
    """
    return _plan_for(*key)


def _pow2(n: int) -> int:
    """Smallest power of two >= n (a plain int; ``triton.next_power_of_2`` costs more)."""
    return 1 << (n - 1).bit_length()


def _launch_config(
    num_rows: int, block_tokens: int | None, num_warps: int | None
) -> tuple[int, int]:
    """(tokens per program, warps) for ``num_rows`` = tokens x layers in one launch.

    The tile grows from 1 to 2 to 4 tokens while at least 8192 programs remain; 2 warps up to
    4-token tiles, then 4 (8 tokens) or 8. From the H200 sweep at T = 16384, L = 5, FP8 e4m3 (% of
    the HBM copy peak): 4 tokens / 2 warps 78%, 8 / 4 78%, 2 / 2 76%, 8 / 8 74%, 1 / 2 62%.
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


@functools.lru_cache(maxsize=64)
def _grouped_constexprs(spec: tuple[Any, ...]) -> tuple[Any, ...]:
    """The grouped kernel's constexpr values, in parameter order; a pure function of ``spec``.

    ``spec`` (from :func:`_launch_spec`) is ``(input dtype, kv_cache_dtype, (capacity,
    block_size, cache strides), R, P, (kv_c, k_pe, slot_mapping token strides, kv_scales
    stride), BLOCK_T, IO_ALIGNED)``.
    """
    (
        dtype, kv_cache_dtype, (capacity, block_size, stride_b, stride_s), rank, rope_dim,
        (stride_kv_t, stride_pe_t, stride_slot_t, stride_scale), block_t, is_aligned,
    ) = spec  # fmt: skip
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    constexprs = {
        "STRIDE_KV_T": stride_kv_t, "STRIDE_PE_T": stride_pe_t, "STRIDE_SLOT_T": stride_slot_t,
        "STRIDE_SCALE": stride_scale, "CAPACITY": capacity, "STRIDE_CACHE_B": stride_b,
        "STRIDE_CACHE_S": stride_s, "CACHE_DTYPE": _TL_INPUT_DTYPES[dtype] if fp8 is None else _TL_FP8[kv_cache_dtype],
        "R": rank, "P": rope_dim, "BLOCK_R": _pow2(rank), "BLOCK_P": _pow2(rope_dim),
        "BLOCK_SIZE": block_size, "BLOCK_T": block_t, "FP8_MAX": 0.0 if fp8 is None else fp8[1],
        "IO_ALIGNED": is_aligned,
    }  # fmt: skip
    assert list(constexprs) == grouped_insert_kernel.arg_names[len(GROUPED_RUNTIME_ARGS) :]
    return tuple(constexprs.values())


def _launch_spec(
    plan: Plan, step: Step, kv_c: torch.Tensor, k_pe: torch.Tensor, tile: int
) -> tuple[Any, ...]:
    """The :func:`_grouped_constexprs` key of one launch (its last item is IO_ALIGNED)."""
    (stride_kv_l, stride_kv_t, _), (stride_pe_l, stride_pe_t, _) = step.kv_strides, step.pe_strides
    # IO_ALIGNED: both bases and both layer strides (in bytes) are multiples of 16.
    is_aligned = ((kv_c.data_ptr() | k_pe.data_ptr()) & 15) == 0
    is_aligned = is_aligned and ((stride_kv_l | stride_pe_l) * kv_c.itemsize) & 15 == 0
    return (
        kv_c.dtype, plan.kv_cache_dtype, plan.geometry, step.rank, step.rope_dim,
        (stride_kv_t, stride_pe_t, step.slot_strides[1], step.scale_stride), tile, is_aligned,
    )  # fmt: skip


def launch_grouped(
    plan: Plan,
    step: Step,
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
    grouped_launcher(direct)(
        (-(-step.num_tokens // tile), step.num_layers, 1), kv_c, k_pe, plan.table,
        step.slot_mapping, kv_scales, step.num_tokens, step.kv_strides[0], step.pe_strides[0],
        step.slot_strides[0], *constexprs, num_warps=warps,
    )  # fmt: skip


@functools.cache
def grouped_launcher(direct: bool) -> DirectLauncher:
    """The grouped kernel's process-wide launcher (direct launches unless ``direct`` is False)."""
    return shared_launcher(grouped_insert_kernel, direct)


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
    tile, warps = _launch_config(step.num_tokens, block_tokens, num_warps)
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
