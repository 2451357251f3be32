"""Grouped MLA cache insert: write a step's latent KV rows into the paged caches of all layers.

Offers:
    grouped_mla_insert     one launch for all L layers (caches of equal geometry)
    per_layer_mla_insert   L launches of a single-layer kernel: the baseline and the fallback when
                           the layers' caches differ in geometry
    mla_insert_reference   the torch reference both kernels are tested against
    KV_CACHE_DTYPES        the accepted ``kv_cache_dtype`` names

Token ``t`` of layer ``l`` goes to slot ``s = slot_mapping[l, t]`` (or ``slot_mapping[t]``): block
``s // block_size``, offset ``s % block_size``; ``kv_c[l, t]`` fills columns ``[0, R)`` and
``k_pe[l, t]`` fills ``[R, R + P)``. A slot < 0 is padding and writes nothing; so does a slot past
the cache's capacity (``check_slots=True`` rejects those instead). With ``auto`` the cache has the
input dtype and rows are copied exactly; with FP8 each value is stored as
``fp8(clamp(x / kv_scales[l], -max, max))``, rounded to nearest even (max 448 for e4m3, 57344 for
e5m2). Both launchers only enqueue work (no host reads of device data unless ``check_slots``), so
they can be captured into a CUDA graph once the kernel has been compiled and the pointer table
built by one eager call with the same caches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvmgr.errors import ConfigError, GeometryError, InvalidBlockError

__all__ = ["KV_CACHE_DTYPES", "grouped_mla_insert", "mla_insert_reference", "per_layer_mla_insert"]

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


@triton.jit
def _quantize(x, scale, OUT_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr):
    # FP8: divide in fp32 with IEEE rounding (plain `/` is approximate on NVIDIA), saturate
    # (NaN stays NaN), then convert with round-to-nearest-even. auto: an exact copy.
    if FP8_MAX > 0:
        x = tl.math.div_rn(x.to(tl.float32), scale)
        x = tl.clamp(x, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return x.to(OUT_DTYPE)


@triton.jit
def _insert_tile(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale, tile, num_tokens, capacity,
    stride_kv_t, stride_pe_t, stride_slot_t, stride_cache_b, stride_cache_s,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    # Layout of the work: one program moves BLOCK_T whole token rows of ONE layer as a
    # [BLOCK_T, R] and a [BLOCK_T, P] tile. Rows are contiguous on both sides, so loads and stores
    # vectorize to 16 bytes; BLOCK_T grows with the step's size so big steps keep several KiB in
    # flight per program while small steps still spread over many SMs.
    # 1. The tile's tokens and slots; tokens past the end read as padding (-1).
    tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(
        slot_ptr + tokens.to(tl.int64) * stride_slot_t, mask=tokens < num_tokens, other=-1
    )
    # 2. Padding and out-of-range slots write nothing (the mask is a [BLOCK_T, 1] tensor, never a
    #    scalar: Triton 3.9's interpreter rejects tensor & scalar masks).
    valid = ((slots >= 0) & (slots < capacity))[:, None]
    slots = tl.where(slots >= 0, slots, 0)
    # 3. Destination row of each token: block slot // BLOCK_SIZE, offset slot % BLOCK_SIZE.
    rows = ((slots // BLOCK_SIZE) * stride_cache_b + (slots % BLOCK_SIZE) * stride_cache_s)[:, None]
    src = tokens.to(tl.int64)[:, None]
    out_dtype = cache_ptr.dtype.element_ty
    # 4. kv_c -> columns [0, R).
    offs_r = tl.arange(0, BLOCK_R)[None, :]
    mask_r = valid & (offs_r < R)
    x = tl.load(kv_c_ptr + src * stride_kv_t + offs_r, mask=mask_r, eviction_policy="evict_first")
    tl.store(cache_ptr + rows + offs_r, _quantize(x, scale, out_dtype, FP8_MAX), mask=mask_r)
    # 5. k_pe -> columns [R, R + P).
    offs_p = tl.arange(0, BLOCK_P)[None, :]
    mask_p = valid & (offs_p < P)
    x = tl.load(k_pe_ptr + src * stride_pe_t + offs_p, mask=mask_p, eviction_policy="evict_first")
    tl.store(cache_ptr + rows + R + offs_p, _quantize(x, scale, out_dtype, FP8_MAX), mask=mask_p)


@triton.jit
def _grouped_insert_kernel(
    kv_c_ptr, k_pe_ptr, cache_table_ptr, slot_ptr, scale_ptr, num_tokens, capacity,
    stride_kv_l, stride_kv_t, stride_pe_l, stride_pe_t, stride_slot_l, stride_slot_t,
    stride_scale, stride_cache_b, stride_cache_s,
    CACHE_DTYPE: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    FP8_MAX: tl.constexpr,
):  # fmt: skip
    # Grid (token tiles, layers): consecutive programs read consecutive rows of one layer.
    tile = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    # The layer's cache base from the device pointer table; every base is 16-byte aligned
    # (checked on the host), which lets the stores vectorize.
    cache_ptr = tl.load(cache_table_ptr + layer).to(tl.pointer_type(CACHE_DTYPE))
    cache_ptr = tl.multiple_of(cache_ptr, 16)
    scale = tl.load(scale_ptr + layer * stride_scale) if FP8_MAX > 0 else 1.0
    _insert_tile(
        kv_c_ptr + layer * stride_kv_l, k_pe_ptr + layer * stride_pe_l, cache_ptr,
        slot_ptr + layer * stride_slot_l, scale, tile, num_tokens, capacity,
        stride_kv_t, stride_pe_t, stride_slot_t, stride_cache_b, stride_cache_s,
        R, P, BLOCK_R, BLOCK_P, BLOCK_SIZE, BLOCK_T, FP8_MAX,
    )  # fmt: skip


@triton.jit
def _layer_insert_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale_ptr, num_tokens, capacity,
    stride_kv_t, stride_pe_t, stride_slot_t, stride_cache_b, stride_cache_s,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    # One layer; the launcher passes that layer's views, so no layer offsets here.
    scale = tl.load(scale_ptr) if FP8_MAX > 0 else 1.0
    _insert_tile(
        kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale, tl.program_id(0), num_tokens, capacity,
        stride_kv_t, stride_pe_t, stride_slot_t, stride_cache_b, stride_cache_s,
        R, P, BLOCK_R, BLOCK_P, BLOCK_SIZE, BLOCK_T, FP8_MAX,
    )  # fmt: skip


_INPUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_FP8_FORMATS = {  # name -> (torch cache dtype, Triton cache dtype, largest finite value)
    "fp8_e4m3": (torch.float8_e4m3fn, tl.float8e4nv, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, tl.float8e5, 57344.0),
}


class _Step(NamedTuple):
    """A validated step: ``slots`` is ``[L, T]`` (a stride-0 view when shared)."""

    num_layers: int
    num_tokens: int
    rank: int  # R
    rope_dim: int  # P
    slots: torch.Tensor
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


def _check_caches(caches: Sequence[torch.Tensor], kv_cache_dtype: str) -> None:
    """Per-cache checks (any geometry): rank, one width, dtype, contiguous rows, one device."""
    if len(caches) == 0:
        raise _fail("caches", "one cache per layer", "none")
    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    first = caches[0]
    allowed = (first.dtype,) if fp8 is None else (fp8[0], torch.uint8)
    if fp8 is None and first.dtype not in _INPUT_DTYPES:
        raise _fail("caches[0].dtype for 'auto'", "bfloat16, float16 or float32", first.dtype)
    for layer, cache in enumerate(caches):
        if cache.dim() != 3 or cache.shape[2] != first.shape[-1]:
            got = tuple(cache.shape)
            raise _fail(
                f"caches[{layer}].shape", f"[num_blocks, block_size, {first.shape[-1]}]", got
            )
        if cache.dtype not in allowed or cache.stride(2) != 1 or cache.device != first.device:
            want = f"({' or '.join(map(str, allowed))}, 1, {first.device})"
            found = (cache.dtype, cache.stride(2), cache.device)
            raise _fail(f"caches[{layer}] (dtype, stride(2), device)", want, found)


def _is_uniform(caches: Sequence[torch.Tensor]) -> bool:
    """Equal shapes and strides, and every base 16-byte aligned: what the grouped kernel needs."""
    shape, strides = caches[0].shape, caches[0].stride()
    return all(
        c.shape == shape and c.stride() == strides and c.data_ptr() % 16 == 0 for c in caches
    )


def _check_step(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
    caches: Sequence[torch.Tensor],
    *,
    for_kernel: bool,
) -> _Step:
    """Per-step checks of the inputs against the (already checked) caches."""
    shapes = (tuple(kv_c.shape), tuple(k_pe.shape))
    if len(shapes[0]) != 3 or len(shapes[1]) != 3 or shapes[0][:2] != shapes[1][:2]:
        raise _fail("kv_c, k_pe shapes", "[L, T, R] and [L, T, P]", shapes)
    (num_layers, num_tokens, rank), rope_dim = shapes[0], shapes[1][2]
    dtype, device, first = kv_c.dtype, kv_c.device, caches[0]
    if dtype not in _INPUT_DTYPES or k_pe.dtype != dtype:
        raise _fail("kv_c, k_pe dtypes", "both bfloat16, float16 or float32", (dtype, k_pe.dtype))
    if kv_cache_dtype == "auto" and dtype != first.dtype:
        raise _fail("kv_c.dtype for 'auto'", f"the caches' {first.dtype}", dtype)
    if kv_c.stride(2) != 1 or k_pe.stride(2) != 1 or rank == 0 or rope_dim == 0:
        raise _fail("kv_c, k_pe last dims", "contiguous and non-empty", (kv_c.stride(), k_pe.stride()))  # fmt: skip
    if for_kernel and device.type != "cuda" and not _is_interpreted():
        raise _fail("kv_c.device", "cuda (cpu needs TRITON_INTERPRET=1)", device)
    if k_pe.device != device or first.device != device or slot_mapping.device != device:
        raise _fail("k_pe, caches, slot_mapping devices", device, (k_pe.device, first.device, slot_mapping.device))  # fmt: skip
    if len(caches) != num_layers or first.shape[2] != rank + rope_dim:
        found = f"{len(caches)} of width {first.shape[2]}"
        raise _fail("caches", f"{num_layers} of width R + P = {rank + rope_dim}", found)
    slots = slot_mapping.expand(num_layers, -1) if slot_mapping.dim() == 1 else slot_mapping
    if slot_mapping.dtype != torch.int64 or tuple(slots.shape) != (num_layers, num_tokens):
        want = f"int64 [{num_tokens}] or [{num_layers}, {num_tokens}]"
        raise _fail("slot_mapping", want, f"{slot_mapping.dtype} {list(slot_mapping.shape)}")
    if kv_scales is not None:
        scales_meta = (kv_scales.dtype, tuple(kv_scales.shape), kv_scales.device)
        if scales_meta != (torch.float32, (num_layers,), device):
            raise _fail("kv_scales (dtype, shape, device)", (torch.float32, (num_layers,), device), scales_meta)  # fmt: skip
    fp8_max = _FP8_FORMATS[kv_cache_dtype][2] if kv_cache_dtype != "auto" else 0.0
    return _Step(num_layers, num_tokens, rank, rope_dim, slots, fp8_max)


def _pow2(n: int) -> int:
    """Smallest power of two >= n (a plain int; ``triton.next_power_of_2`` costs more)."""
    return 1 << (n - 1).bit_length()


def _is_interpreted() -> bool:
    return type(_grouped_insert_kernel).__name__ == "InterpretedFunction"


def _check_slots(step: _Step, caches: Sequence[torch.Tensor]) -> None:
    """Reject slots past each layer's capacity: one reduction and ONE device->host sync."""
    if step.slots.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ConfigError("check_slots: expected False under CUDA-graph capture, got True")
    if step.num_tokens == 0:
        return
    highest = step.slots.amax(dim=1).tolist()
    for layer, (slot, cache) in enumerate(zip(highest, caches, strict=True)):
        if slot >= cache.shape[0] * cache.shape[1]:
            raise InvalidBlockError(
                f"slot_mapping for layer {layer}: expected slots < {cache.shape[0] * cache.shape[1]}"
                f" (num_blocks {cache.shape[0]} x block_size {cache.shape[1]}), got {slot}"
            )


def _launch_config(
    num_rows: int, block_tokens: int | None, num_warps: int | None
) -> tuple[int, int]:
    """(tokens per program, warps): the tile grows only while >= 8192 programs remain."""
    if block_tokens is not None and block_tokens not in (1, 2, 4, 8, 16, 32, 64):
        raise ConfigError(f"block_tokens: expected a power of two in [1, 64], got {block_tokens}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ConfigError(f"num_warps: expected 1, 2, 4, 8 or 16, got {num_warps}")
    tile = 1
    while tile < 8 and num_rows // (2 * tile) >= 8192:
        tile *= 2
    tile = block_tokens or tile
    return tile, num_warps or max(2, min(8, tile))


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


def _launch_grouped(
    step: _Step,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: Sequence[torch.Tensor],
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
    block_tokens: int | None = None,
    num_warps: int | None = None,
    table: torch.Tensor | None = None,
) -> None:
    """One launch over (token tiles, layers); caches must be uniform (``_is_uniform``)."""
    if step.num_tokens == 0:
        return
    if table is None:
        table = _pointer_table(kv_c.device, tuple(cache.data_ptr() for cache in caches))
    first, slots = caches[0], step.slots
    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    tile, warps = _launch_config(step.num_tokens * step.num_layers, block_tokens, num_warps)
    _grouped_insert_kernel[(-(-step.num_tokens // tile), step.num_layers)](
        kv_c, k_pe, table, slots, kv_scales, step.num_tokens, first.shape[0] * first.shape[1],
        kv_c.stride(0), kv_c.stride(1), k_pe.stride(0), k_pe.stride(1), slots.stride(0),
        slots.stride(1), 0 if kv_scales is None else kv_scales.stride(0), first.stride(0),
        first.stride(1), CACHE_DTYPE=_INPUT_DTYPES[kv_c.dtype] if fp8 is None else fp8[1],
        R=step.rank, P=step.rope_dim, BLOCK_R=_pow2(step.rank),
        BLOCK_P=_pow2(step.rope_dim), BLOCK_SIZE=first.shape[1], BLOCK_T=tile,
        FP8_MAX=step.fp8_max, num_warps=warps,
    )  # fmt: skip


def _launch_per_layer(
    step: _Step,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: Sequence[torch.Tensor],
    kv_scales: torch.Tensor | None,
    kv_cache_dtype: str,
    block_tokens: int | None = None,
    num_warps: int | None = None,
) -> None:
    """L launches of the single-layer kernel; caches may differ in geometry."""
    if step.num_tokens == 0:
        return
    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    tile, warps = _launch_config(step.num_tokens, block_tokens, num_warps)
    grid = (-(-step.num_tokens // tile),)
    for layer, cache in enumerate(caches):
        if fp8 is not None and cache.dtype != fp8[0]:  # a uint8 cache: store through an FP8 view
            cache = cache.view(fp8[0])
        _layer_insert_kernel[grid](
            kv_c[layer], k_pe[layer], cache, step.slots[layer],
            None if kv_scales is None else kv_scales[layer], step.num_tokens,
            cache.shape[0] * cache.shape[1], kv_c.stride(1), k_pe.stride(1), step.slots.stride(1),
            cache.stride(0), cache.stride(1), R=step.rank, P=step.rope_dim,
            BLOCK_R=_pow2(step.rank), BLOCK_P=_pow2(step.rope_dim),
            BLOCK_SIZE=cache.shape[1], BLOCK_T=tile, FP8_MAX=step.fp8_max, num_warps=warps,
        )  # fmt: skip


def grouped_mla_insert(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    kv_scales: torch.Tensor | None = None,
    check_slots: bool = False,
    block_tokens: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Insert a step's rows into the paged caches of all L layers with ONE kernel launch.

    The caches' base addresses reach the kernel as an int64 device table, built on the first call
    for a set of caches and reused (memoized by their ``data_ptr()``s): make that first call
    outside CUDA-graph capture. Only enqueues work on the current stream.

    Parameters
    ----------
    kv_c : torch.Tensor
        ``[L, T, R]`` latent KV, bfloat16/float16/float32, last dim contiguous (others free).
    k_pe : torch.Tensor
        ``[L, T, P]`` RoPE keys, the dtype and device of ``kv_c``, last dim contiguous.
    caches : sequence of torch.Tensor
        L caches ``[num_blocks, block_size, R + P]`` of equal shape and strides, 16-byte aligned,
        last dim contiguous; mutated in place. dtype: that of ``kv_c`` for ``auto``, else
        ``float8_e4m3fn`` / ``float8_e5m2`` or ``uint8`` holding those bytes.
    slot_mapping : torch.Tensor
        int64 ``[T]`` shared by all layers, or ``[L, T]`` (a stride-0 expand works); < 0 is padding.
    kv_cache_dtype : {"auto", "fp8_e4m3", "fp8_e5m2"}
        ``auto`` copies exactly; FP8 stores ``fp8(clamp(x / kv_scales[l], -max, max))``.
    kv_scales : torch.Tensor or None
        float32 ``[L]`` on the device: required for FP8, ``None`` for ``auto``.
    check_slots : bool
        Also reject slots >= ``num_blocks * block_size`` (always skipped, never written). Costs a
        reduction kernel and one device->host sync; refused under graph capture.
    block_tokens, num_warps : int or None
        Tuning overrides (tokens per program, warps per program); ``None`` picks by step size.

    Raises
    ------
    ConfigError
        Unknown ``kv_cache_dtype``; ``kv_scales`` missing for FP8 or given for ``auto``; bad tuning
        overrides; ``check_slots`` or a first call for these caches under graph capture.
    GeometryError
        Shapes, dtypes, devices or strides that do not match; caches of unequal geometry or not
        16-byte aligned (use :func:`per_layer_mla_insert` for those).
    InvalidBlockError
        ``check_slots=True`` and a slot is past the capacity.
    """
    _check_dtype_and_scales(kv_cache_dtype, kv_scales)
    _check_caches(caches, kv_cache_dtype)
    step = _check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, caches, for_kernel=True)
    if not _is_uniform(caches):
        got = [(tuple(c.shape), c.stride(), c.data_ptr() % 16) for c in caches]
        raise _fail("caches (shape, strides, data_ptr % 16)", "equal shapes and strides, 0", got)
    if check_slots:
        _check_slots(step, caches)
    _launch_grouped(step, kv_c, k_pe, caches, kv_scales, kv_cache_dtype, block_tokens, num_warps)


def per_layer_mla_insert(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    kv_cache_dtype: str = "auto",
    kv_scales: torch.Tensor | None = None,
    check_slots: bool = False,
    block_tokens: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Insert a step's rows with one single-layer launch per layer (L launches).

    The baseline of :func:`grouped_mla_insert` and the fallback for caches whose ``num_blocks``,
    ``block_size``, strides or alignment differ between layers (their width ``R + P`` and dtype
    may not). Parameters as :func:`grouped_mla_insert`. Only enqueues work.

    Raises
    ------
    ConfigError, GeometryError, InvalidBlockError
        As :func:`grouped_mla_insert`, except that unequal cache geometry is accepted.
    """
    _check_dtype_and_scales(kv_cache_dtype, kv_scales)
    _check_caches(caches, kv_cache_dtype)
    step = _check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, caches, for_kernel=True)
    if check_slots:
        _check_slots(step, caches)
    _launch_per_layer(step, kv_c, k_pe, caches, kv_scales, kv_cache_dtype, block_tokens, num_warps)


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

    Same arguments and in-place effect as :func:`grouped_mla_insert`. FP8 values are clamped
    before the cast (torch 2.11 turns ``|x| >= 480`` into NaN when casting to e4m3). Which token
    wins when one layer maps two valid tokens to the same slot is unspecified, as in the kernels.

    Raises
    ------
    ConfigError, GeometryError
        As :func:`per_layer_mla_insert`.
    """
    _check_dtype_and_scales(kv_cache_dtype, kv_scales)
    _check_caches(caches, kv_cache_dtype)
    step = _check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, caches, for_kernel=False)  # fmt: skip
    fp8 = _FP8_FORMATS.get(kv_cache_dtype)
    for layer, cache in enumerate(caches):
        block_size = cache.shape[1]
        slots = step.slots[layer]
        keep = (slots >= 0) & (slots < cache.shape[0] * block_size)
        rows, target = torch.cat([kv_c[layer][keep], k_pe[layer][keep]], dim=-1), cache
        if kv_scales is not None and fp8 is not None:
            scaled = (rows.to(torch.float32) / kv_scales[layer]).clamp(-fp8[2], fp8[2])
            rows, target = scaled.to(fp8[0]).view(torch.uint8), cache.view(torch.uint8)
        kept = slots[keep]
        target[kept // block_size, kept % block_size] = rows
