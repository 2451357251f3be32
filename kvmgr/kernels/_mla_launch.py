"""Host side of the MLA insert kernels: input checks, launch plans, launch constants (private).

Offers (to :mod:`kvmgr.kernels.mla_insert` and its hook):
    checks        ``_check_dtype_and_scales``, ``_check_caches``, ``_is_uniform``, ``_check_step``
                  (``_unchecked_step`` without the checks), ``_check_slots``
    plans         ``_grouped_plan``: checked, uniform caches with their device pointer table,
                  memoized by the caches' geometry and ``data_ptr()``s
    launch        ``_launch_config`` (tile, warps); ``_launch_spec`` and ``_grouped_constexprs``:
                  the grouped kernel's constexprs per launch configuration, memoized

Host cost: the grouped launcher is called once per step, so its host path is kept short. The
caches are checked in one pass, the step's tensors with plain attribute reads (no torch ops), the
constexprs come from a memo, and the kernel is launched through
:class:`kvmgr.kernels._launch.DirectLauncher` (the compiled kernel, past ``JITFunction.run``'s
per-call dispatch). The grouped kernel's runtime arguments are all ``do_not_specialize``, so one
compiled kernel serves every step size; what the compiler needs to know (row strides, geometry,
alignment) is a constexpr. The per-layer baseline uses Triton's normal launch, as a caller
launching a Triton kernel once per layer would.

Pointer tables and CUDA graphs: a captured grouped launch reads its plan's pointer table at every
replay. The eager memo keeps the plans of the 32 most recently used cache sets; a plan used under
capture is also kept for the life of the process (``_plan_held_for_graphs``), so a graph never
reads a freed table. That costs one ``int64 [L]`` device tensor per cache set ever captured, and
one capture query (``torch.cuda.is_current_stream_capturing``) per grouped call on CUDA.

Importing this module imports Triton's language module (for the cache dtypes), not the kernels;
the kernels are looked up from :mod:`kvmgr.kernels.mla_insert` when first compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton.language as tl

from kvmgr.errors import ConfigError, GeometryError, InvalidBlockError

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
# The grouped kernel's runtime arguments, in order: none is specialized (see the module docstring).
_GROUPED_RUNTIME_ARGS = (
    "kv_c_ptr", "k_pe_ptr", "cache_table_ptr", "slot_ptr", "scale_ptr",
    "num_tokens", "stride_kv_l", "stride_pe_l", "stride_slot_l",
)  # fmt: skip

_INPUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_FP8_FORMATS = {  # name -> (torch cache dtype, Triton cache dtype, largest finite value)
    "fp8_e4m3": (torch.float8_e4m3fn, tl.float8e4nv, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, tl.float8e5, 57344.0),
}


class _CacheMeta(NamedTuple):
    """What a step is checked against: the caches' count, row width, dtype and device index."""

    num_layers: int
    width: int  # R + P
    dtype: torch.dtype  # of caches[0]
    device: int  # Tensor.get_device(): -1 for CPU


class _Plan(NamedTuple):
    """Uniform caches, checked once, as the grouped launch needs them."""

    meta: _CacheMeta
    kv_cache_dtype: str
    table: torch.Tensor  # int64 [L] cache base addresses on the device
    geometry: tuple[int, int, int, int]  # (capacity, block_size, stride(0), stride(1))


class _Step(NamedTuple):
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


def _check_dtype_and_scales(kv_cache_dtype: str, kv_scales: torch.Tensor | None) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype != "auto" and kv_scales is None:
        raise ConfigError(f"kv_scales: expected float32 [L] for {kv_cache_dtype!r}, got None")
    if kv_cache_dtype == "auto" and kv_scales is not None:
        raise ConfigError("kv_scales: expected None for kv_cache_dtype='auto', got a tensor")


def _check_caches(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> _CacheMeta:
    """Per-cache checks (any geometry): rank, one width, dtype, contiguous rows, one device."""
    if len(caches) == 0:
        raise _fail("caches", "one cache per layer", "none")
    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    first = caches[0]
    allowed = (first.dtype,) if fp8 is None else (fp8[0], torch.uint8)
    if fp8 is None and first.dtype not in _INPUT_DTYPES:
        raise _fail("caches[0].dtype for 'auto'", "bfloat16, float16 or float32", first.dtype)
    width, device = (first.shape[-1] if first.dim() else 0), first.get_device()
    for layer, cache in enumerate(caches):
        if cache.dim() != 3 or cache.shape[2] != width:
            got = tuple(cache.shape)
            raise _fail(f"caches[{layer}].shape", f"[num_blocks, block_size, {width}]", got)
        if cache.dtype not in allowed or cache.stride()[2] != 1 or cache.get_device() != device:
            want = f"({' or '.join(map(str, allowed))}, 1, {first.device})"
            found = (cache.dtype, cache.stride(2), cache.device)
            raise _fail(f"caches[{layer}] (dtype, stride(2), device)", want, found)
    return _CacheMeta(len(caches), width, first.dtype, device)


def _is_uniform(caches: Sequence[torch.Tensor]) -> bool:
    """Equal shapes and strides, and every base 16-byte aligned: what the grouped kernel needs."""
    shape, strides = caches[0].shape, caches[0].stride()
    return all(
        c.shape == shape and c.stride() == strides and c.data_ptr() % 16 == 0 for c in caches
    )


def _clean_key(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> tuple[Any, ...] | None:
    """The :func:`_plan_for` key of caches that are plainly fit for the grouped kernel, else None.

    Plainly fit: one shape, strides, dtype and device, contiguous rows of an accepted dtype, every
    base 16-byte aligned. One pass of attribute reads; anything else takes the full checks.
    """
    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    first = caches[0]
    shape, strides, dtype, device = first.shape, first.stride(), first.dtype, first.get_device()
    accepted = _INPUT_DTYPES if fp8 is None else (fp8[0], torch.uint8)
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


def _grouped_plan(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> _Plan:
    """Check caches for the grouped kernel (cheaply when they are plainly fit) and plan its launch.

    Raises:
        GeometryError: what :func:`_check_caches` rejects, or caches that are not uniform.
        ConfigError: the first call for these caches happens under CUDA-graph capture.
    """
    key = _clean_key(caches, kv_cache_dtype) if len(caches) > 0 else None
    if key is None:  # mixed uint8 / FP8 caches are accepted here; anything else raises
        meta = _check_caches(caches, kv_cache_dtype)
        if not _is_uniform(caches):
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
) -> _Plan:
    """The plan of checked, uniform caches; a pure function of its key, memoized.

    Raises:
        ConfigError: the first call for these caches happens under CUDA-graph capture.
    """
    (num_blocks, block_size, width), where = shape, torch.device("cpu")
    if device >= 0:
        where = torch.device("cuda", device)
    meta = _CacheMeta(len(data_ptrs), width, dtype, device)
    geometry = (num_blocks * block_size, block_size, strides[0], strides[1])
    return _Plan(meta, kv_cache_dtype, _pointer_table(where, data_ptrs), geometry)


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
def _plan_held_for_graphs(*key: Any) -> _Plan:
    """:func:`_plan_for` of a key used under CUDA-graph capture, held for the process's life.

    A captured launch reads the plan's pointer table at every replay, so that table must outlive
    the graph; ``_plan_for`` alone would free it 32 newer cache sets later. Unbounded, but only
    cache sets captured into graphs enter (one ``int64 [L]`` device tensor each).

    Raises:
        ConfigError: no eager call built these caches' plan (the first call is under capture).
    """
    return _plan_for(*key)


def _check_step(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
    meta: _CacheMeta,
    *,
    for_kernel: bool,
) -> _Step:
    """Per-step checks of the inputs against the (already checked) caches; attribute reads only."""
    kv_shape, pe_shape = kv_c.shape, k_pe.shape
    if len(kv_shape) != 3 or len(pe_shape) != 3 or kv_shape[:2] != pe_shape[:2]:
        raise _fail("kv_c, k_pe shapes", "[L, T, R] and [L, T, P]", (tuple(kv_shape), tuple(pe_shape)))  # fmt: skip
    (num_layers, num_tokens, rank), rope_dim = kv_shape, pe_shape[2]
    dtype, kv_strides, pe_strides = kv_c.dtype, kv_c.stride(), k_pe.stride()
    if dtype not in _INPUT_DTYPES or k_pe.dtype != dtype:
        raise _fail("kv_c, k_pe dtypes", "both bfloat16, float16 or float32", (dtype, k_pe.dtype))
    if kv_cache_dtype == "auto" and dtype != meta.dtype:
        raise _fail("kv_c.dtype for 'auto'", f"the caches' {meta.dtype}", dtype)
    if kv_strides[2] != 1 or pe_strides[2] != 1 or rank == 0 or rope_dim == 0:
        raise _fail("kv_c, k_pe last dims", "contiguous and non-empty", (kv_strides, pe_strides))
    device = kv_c.get_device()
    if for_kernel and device < 0 and not _is_interpreted():
        raise _fail("kv_c.device", "cuda (cpu needs TRITON_INTERPRET=1)", kv_c.device)
    if k_pe.get_device() != device or meta.device != device or slot_mapping.get_device() != device:
        raise _fail("k_pe, caches, slot_mapping device indices", device, (k_pe.get_device(), meta.device, slot_mapping.get_device()))  # fmt: skip
    if meta.num_layers != num_layers or meta.width != rank + rope_dim:
        found = f"{meta.num_layers} of width {meta.width}"
        raise _fail("caches", f"{num_layers} of width R + P = {rank + rope_dim}", found)
    slot_shape, slot_strides = slot_mapping.shape, slot_mapping.stride()
    if slot_mapping.dtype != torch.int64 or (slot_shape != (num_tokens,) and slot_shape != (num_layers, num_tokens)):  # fmt: skip
        want = f"int64 [{num_tokens}] or [{num_layers}, {num_tokens}]"
        raise _fail("slot_mapping", want, f"{slot_mapping.dtype} {list(slot_shape)}")
    scale_stride = 0
    if kv_scales is not None:
        scales_meta = (kv_scales.dtype, kv_scales.shape, kv_scales.get_device())
        if scales_meta != (torch.float32, (num_layers,), device):
            raise _fail("kv_scales (dtype, shape, device index)", (torch.float32, (num_layers,), device), scales_meta)  # fmt: skip
        scale_stride = kv_scales.stride()[0]
    fp8_max = _FP8_FORMATS[kv_cache_dtype][2] if kv_cache_dtype != "auto" else 0.0
    return _Step(
        num_layers, num_tokens, rank, rope_dim, slot_mapping,
        (0, slot_strides[0]) if len(slot_strides) == 1 else slot_strides,
        kv_strides, pe_strides, scale_stride, fp8_max,
    )  # fmt: skip


def _unchecked_step(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
) -> _Step:
    """What :func:`_check_step` returns, without its checks (callers that vouch for the inputs)."""
    num_layers, num_tokens, rank = kv_c.shape
    slot_strides = slot_mapping.stride()
    return _Step(
        num_layers, num_tokens, rank, k_pe.shape[2], slot_mapping,
        (0, slot_strides[0]) if len(slot_strides) == 1 else slot_strides,
        kv_c.stride(), k_pe.stride(), 0 if kv_scales is None else kv_scales.stride()[0],
        _FP8_FORMATS[kv_cache_dtype][2] if kv_cache_dtype != "auto" else 0.0,
    )  # fmt: skip


def _layer_slots(step: _Step, layer: int) -> torch.Tensor:
    """The ``[T]`` slots of one layer (a view)."""
    return step.slot_mapping if step.slot_mapping.dim() == 1 else step.slot_mapping[layer]


def _pow2(n: int) -> int:
    """Smallest power of two >= n (a plain int; ``triton.next_power_of_2`` costs more)."""
    return 1 << (n - 1).bit_length()


def _is_interpreted() -> bool:
    from kvmgr.kernels.mla_insert import _grouped_insert_kernel

    return type(_grouped_insert_kernel).__name__ == "InterpretedFunction"


def _check_slots(step: _Step, caches: Sequence[torch.Tensor]) -> None:
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
    from kvmgr.kernels.mla_insert import _grouped_insert_kernel

    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    constexprs = {
        "STRIDE_KV_T": stride_kv_t, "STRIDE_PE_T": stride_pe_t, "STRIDE_SLOT_T": stride_slot_t,
        "STRIDE_SCALE": stride_scale, "CAPACITY": capacity, "STRIDE_CACHE_B": stride_b,
        "STRIDE_CACHE_S": stride_s, "CACHE_DTYPE": _INPUT_DTYPES[dtype] if fp8 is None else fp8[1],
        "R": rank, "P": rope_dim, "BLOCK_R": _pow2(rank), "BLOCK_P": _pow2(rope_dim),
        "BLOCK_SIZE": block_size, "BLOCK_T": block_t, "FP8_MAX": 0.0 if fp8 is None else fp8[2],
        "IO_ALIGNED": is_aligned,
    }  # fmt: skip
    assert list(constexprs) == _grouped_insert_kernel.arg_names[len(_GROUPED_RUNTIME_ARGS) :]
    return tuple(constexprs.values())


def _launch_spec(
    plan: _Plan, step: _Step, kv_c: torch.Tensor, k_pe: torch.Tensor, tile: int
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
