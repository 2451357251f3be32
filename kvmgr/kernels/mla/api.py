"""Grouped MLA cache insert: write a step's latent KV rows into the paged caches of all layers.

Offers:
    grouped_mla_insert     one launch for all L layers (caches of equal geometry)
    per_layer_mla_insert   L launches of a single-layer kernel: the baseline and the fallback when
                           the layers' caches differ in geometry
    mla_insert_reference   the torch reference both kernels are tested against (re-exported
                           from :mod:`kvmgr.kernels.mla.reference`)
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

Layout of :mod:`kvmgr.kernels.mla` (dependencies one-way, each on those above it): ``kernel``
(the Triton kernels) and ``checks`` (input checks, torch only) <- ``plan`` (checked caches and
their pointer table, launch constants) <- ``insert`` (``GroupedInsert``: checks cached per step
signature, launches bound through :mod:`kvmgr.kernels.launch`) <- ``memo`` (the cache sets of this
module's function: the one owner of their plans) <- ``api`` (this module) <- ``hook``;
``reference`` (the torch reference) uses ``checks`` only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmgr.kernels.mla import plan
from kvmgr.kernels.mla.checks import (
    KV_CACHE_DTYPES,
    check_caches,
    check_dtype_and_scales,
    check_slot_range,
    check_step,
)
from kvmgr.kernels.mla.memo import InsertMemo
from kvmgr.kernels.mla.reference import mla_insert_reference

__all__ = ["KV_CACHE_DTYPES", "grouped_mla_insert", "mla_insert_reference", "per_layer_mla_insert"]

_MEMO = InsertMemo()  # the cache sets grouped_mla_insert has seen (kvmgr.kernels.mla.memo)
_steady_record = _MEMO.steady_record  # id(list) -> the record of its steady steps, or None
_launch_steady = _MEMO.launch_steady


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
    direct_launch: bool = True,
) -> None:
    """Insert a step's rows into the paged caches of all L layers with ONE kernel launch.

    The caches' base addresses reach the kernel as an int64 device table, built on the first call
    for a set of caches and reused (the 32 most recent sets are kept, keyed by their geometry and
    ``data_ptr()``s: :mod:`kvmgr.kernels.mla.memo`): make that first call outside CUDA-graph
    capture. A table used under capture is then kept for the life of the process, so the graph
    may replay after any number of newer cache sets. Each step signature is checked once; one
    compiled kernel serves every step size of a tile size, launched through ``cuLaunchKernelEx``
    from packed arguments (:mod:`kvmgr.kernels.mla.insert`). Only enqueues work on the current
    stream.

    Args:
        kv_c: ``[L, T, R]`` latent KV, bfloat16/float16/float32, last dim contiguous (others free).
        k_pe: ``[L, T, P]`` RoPE keys, the dtype and device of ``kv_c``, last dim contiguous.
        caches: L caches ``[num_blocks, block_size, R + P]`` of equal shape and strides, 16-byte aligned,
            last dim contiguous; mutated in place. dtype: that of ``kv_c`` for ``auto``, else
            ``float8_e4m3fn`` / ``float8_e5m2`` or ``uint8`` holding those bytes.
        slot_mapping: int64 ``[T]`` shared by all layers, or ``[L, T]`` (a stride-0 expand works); < 0 is padding.
        kv_cache_dtype: ``auto`` copies exactly; FP8 stores ``fp8(clamp(x / kv_scales[l], -max, max))``.
        kv_scales: float32 ``[L]`` on the device: required for FP8, ``None`` for ``auto``.
        check_slots: Also reject slots >= ``num_blocks * block_size`` (always skipped, never written). Costs a
            reduction kernel and one device->host sync; refused under graph capture.
        block_tokens, num_warps: Tuning overrides (tokens per program, warps per program); ``None`` picks by step size.
        direct_launch: Launch past Triton's dispatch, from packed arguments (the default);
            ``False`` takes Triton's own ``kernel[grid](...)`` launch every call (the benchmarks'
            baseline, and a way around a Triton whose internals differ).

    Raises:
        ConfigError: Unknown ``kv_cache_dtype``; ``kv_scales`` missing for FP8 or given for ``auto``; bad tuning
            overrides; ``check_slots`` or a first call for these caches under graph capture.
        GeometryError: Shapes, dtypes, devices or strides that do not match; caches of unequal geometry or not
            16-byte aligned (use :func:`per_layer_mla_insert` for those).
        InvalidBlockError: ``check_slots=True`` and a slot is past the capacity.
    """
    steady = not check_slots and block_tokens is None and num_warps is None
    record = _steady_record(id(caches)) if steady else None
    if record is not None and _launch_steady(record, caches, kv_cache_dtype, direct_launch, kv_c, k_pe, slot_mapping, kv_scales) is not None:  # fmt: skip
        return
    check_dtype_and_scales(kv_cache_dtype, kv_scales)
    insert = _MEMO.insert_for(caches, kv_cache_dtype, direct_launch)
    if record is not None:  # the record refused: the very same tensors may have changed in
        insert._last = None  # place, so the insert's identity test must not launch them
    if check_slots:
        step = check_step(kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, insert.plan.meta,
                          allow_cpu=plan.IS_INTERPRETED)  # fmt: skip
        check_slot_range(step, caches)
    insert(kv_c, k_pe, slot_mapping, kv_scales, True, None, block_tokens, num_warps)
    # a steady step (new tensors of a guarded signature, or the last call's tensors again): one
    # guard for caches and step next
    if steady and (insert.fired is not None or record is None):
        _MEMO.remember_steady(caches, insert, kv_c, k_pe, slot_mapping, kv_scales)


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
    may not). Parameters as :func:`grouped_mla_insert` (no ``direct_launch``: each layer takes
    Triton's normal launch, as a caller launching a kernel once per layer would). Only enqueues
    work.

    Raises:
        ConfigError, GeometryError, InvalidBlockError: As :func:`grouped_mla_insert`, except that unequal cache geometry is accepted.
    """
    check_dtype_and_scales(kv_cache_dtype, kv_scales)
    meta = check_caches(caches, kv_cache_dtype)
    step = check_step(
        kv_c, k_pe, slot_mapping, kv_scales, kv_cache_dtype, meta, allow_cpu=plan.IS_INTERPRETED
    )
    if check_slots:
        check_slot_range(step, caches)
    plan.launch_per_layer(
        step, kv_c, k_pe, caches, kv_scales, kv_cache_dtype, block_tokens, num_warps
    )
