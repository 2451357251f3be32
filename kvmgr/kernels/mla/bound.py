"""The grouped MLA insert with its checks and launch cached per step signature (private).

Offers (to :mod:`kvmgr.kernels.mla.api` and :mod:`kvmgr.kernels.mla.hook`):
    GroupedInsert   one plan's grouped launches: checks once per step signature, then updates a
                    packed launch in place (pointers, ``T``, layer strides, grid) and launches
    grouped_insert_for   the process-wide :class:`GroupedInsert` of a plan (memoized)

**Step signature.** Everything :func:`~kvmgr.kernels.mla.checks.check_step` and the launch's
constexprs depend on, except the values that are runtime arguments of the kernel: the dtypes,
ranks, ``L``, ``R``, ``P``, token and column strides, devices, ``slot_mapping``'s leading dims,
the scales' dtype, shape, stride and device (read once per scales tensor object), whether
``IO_ALIGNED`` holds, and the tile (a function of ``T * L``). ``T`` itself, the layer strides and the pointers are not part of it: the
grouped kernel takes them as ``do_not_specialize`` runtime arguments. A step whose signature was
checked before skips the checks, save the one they do not cover: that ``kv_c``, ``k_pe`` and
``slot_mapping`` agree on ``T``. A new signature is checked in full (raising as
:func:`~kvmgr.kernels.mla.api.grouped_mla_insert` does) and bound: the kernel is compiled if
needed and its arguments packed (:mod:`kvmgr.kernels.packed_launch`).

A call with the very same tensor objects as the last one (same ``data_ptr()``s and ``T``)
skips even the signature: persistent step buffers cost one launch. Host cost of a repeated
signature: about 20 attribute reads, one tuple comparison, eight cell
updates and one ``cuLaunchKernel`` (a few microseconds). Under ``TRITON_INTERPRET=1`` or where
packing is unavailable the same flow ends in Triton's launch instead (a ``TritonLaunch``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvmgr.kernels.mla.checks import CacheMeta, check_step, unchecked_step
from kvmgr.kernels.mla.host import (
    IS_INTERPRETED,
    Plan,
    _grouped_constexprs,
    _launch_config,
    _launch_spec,
    grouped_launcher,
)

__all__ = ["GroupedInsert", "grouped_insert_for"]

_MAX_SIGNATURES = 64  # bound launches kept per plan (a loop sees a handful: tiles x layouts)


class GroupedInsert:
    """The grouped launches of one plan (uniform caches), bound once per step signature.

    Attributes:
        plan: the caches' plan (pointer table, geometry).
        packed: whether launches may go through packed ``cuLaunchKernel`` calls.
        num_bound: step signatures bound so far.
    """

    def __init__(self, plan: Plan, kv_cache_dtype: str, *, direct: bool = True, packed: bool = True) -> None:  # fmt: skip
        self.plan = plan
        self.packed = packed and direct
        self._kv_cache_dtype = kv_cache_dtype
        self._meta: CacheMeta = plan.meta
        self._launcher = grouped_launcher(direct)
        self._bound: dict[tuple[Any, ...], Any] = {}
        self._last_key: tuple[Any, ...] | None = None
        self._last: Any = None
        # the last call's tensors, pointers, T and grid: the same objects again skip everything
        # but the launch (in-place metadata changes such as set_ between calls are not seen)
        self._last_step: tuple[Any, ...] | None = None
        self._scales: torch.Tensor | None = None  # the last scales tensor and its key part
        self._scales_key: Any = None

    @property
    def num_bound(self) -> int:
        return len(self._bound)

    def __call__(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None,
        *,
        validate: bool = True,
        block_tokens: int | None = None,
        num_warps: int | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> int:
        """Enqueue one insert; returns ``T``. Inputs as :func:`grouped_mla_insert`.

        ``validate=False`` checks nothing, even for a new signature (the hook's opt-out).

        Raises:
            GeometryError, ConfigError: as :func:`~kvmgr.kernels.mla.api.grouped_mla_insert`.
        """
        last = self._last_step  # the same tensor objects as the last call: only launch
        if (
            last is not None and kv_c is last[0] and k_pe is last[1] and slot_mapping is last[2]
            and kv_scales is last[3] and last[4] == (kv_c.data_ptr(), k_pe.data_ptr(),
            slot_mapping.data_ptr(), kv_c.shape[1]) and block_tokens is None and num_warps is None
        ):  # fmt: skip
            repeated: int = last[4][-1]
            if repeated:
                self._last.launch(last[5], stream)
            return repeated
        try:
            ks, ps, ss = kv_c.shape, k_pe.shape, slot_mapping.shape
            kt, pt, st = kv_c.stride(), k_pe.stride(), slot_mapping.stride()
            num_layers, num_tokens = ks[0], ks[1]
            ptrs = (kv_c.data_ptr(), k_pe.data_ptr(), slot_mapping.data_ptr(), num_tokens)
            is_aligned = (ptrs[0] | ptrs[1]) & 15 == 0 and (
                (kt[0] | pt[0]) * kv_c.itemsize
            ) & 15 == 0
            rows = num_tokens * num_layers  # the tile rule of host._launch_config, inlined
            tile = block_tokens or (1 if rows < 16384 else 2 if rows < 32768 else 4)
            if kv_scales is None:
                scales_key: Any = None
            elif kv_scales is self._scales:  # the same tensor object: its metadata as seen
                scales_key = self._scales_key
            else:
                scales_key = (kv_scales.dtype, kv_scales.shape, kv_scales.stride(), kv_scales.get_device())  # fmt: skip
            slot_rank = len(ss)
            key: tuple[Any, ...] = (
                len(ks), num_layers, ks[2], kt[1], kt[2], kv_c.dtype, kv_c.get_device(),
                len(ps), ps[0], ps[2], pt[1], pt[2], k_pe.dtype, k_pe.get_device(), slot_rank,
                ss[0] if slot_rank == 2 else -1, st[-1], slot_mapping.dtype,
                slot_mapping.get_device(), is_aligned, tile, num_warps, scales_key,
            )  # fmt: skip
            same_tokens = ps[1] == num_tokens and ss[-1] == num_tokens
        except (AttributeError, IndexError, TypeError):  # not even tensors of rank 3: check
            key, same_tokens, tile = (), False, block_tokens or 1
        bound = self._last if key == self._last_key else self._bound.get(key)
        if bound is None or not same_tokens:
            # a new signature, or T disagrees: the full checks (they raise for the latter)
            bound, tile = self._bind(key, kv_c, k_pe, slot_mapping, kv_scales, validate,
                                     block_tokens, num_warps)  # fmt: skip
            ks, kt, pt, ss, st = kv_c.shape, kv_c.stride(), k_pe.stride(), slot_mapping.shape, slot_mapping.stride()  # fmt: skip
            num_layers, num_tokens = ks[0], ks[1]
            ptrs = (kv_c.data_ptr(), k_pe.data_ptr(), slot_mapping.data_ptr(), num_tokens)
        self._last_key, self._last = key, bound
        if key and kv_scales is not None and kv_scales is not self._scales:
            self._scales, self._scales_key = kv_scales, key[-1]
        if num_tokens == 0:
            return 0
        bound.set_tensor_at(0, kv_c, ptrs[0])
        bound.set_tensor_at(1, k_pe, ptrs[1])
        bound.set_tensor_at(3, slot_mapping, ptrs[2])
        if kv_scales is not None:
            bound.set_tensor(4, kv_scales)
        bound.set_int(5, num_tokens)
        bound.set_int(6, kt[0])
        bound.set_int(7, pt[0])
        bound.set_int(8, st[0] if len(ss) == 2 else 0)
        grid = (-(-num_tokens // tile), num_layers, 1)
        bound.launch(grid, stream)
        if block_tokens is None and num_warps is None:
            self._last_step = (kv_c, k_pe, slot_mapping, kv_scales, ptrs, grid)
        return num_tokens

    def _bind(
        self, key: tuple[Any, ...], kv_c: torch.Tensor, k_pe: torch.Tensor,
        slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None, validate: bool,
        block_tokens: int | None, num_warps: int | None,
    ) -> tuple[Any, int]:  # fmt: skip
        """Check a new signature in full and bind its launch (compiles if needed); (bound, tile)."""
        dtype = self._kv_cache_dtype
        if validate:
            step = check_step(kv_c, k_pe, slot_mapping, kv_scales, dtype, self._meta,
                              allow_cpu=IS_INTERPRETED)  # fmt: skip
        else:
            step = unchecked_step(kv_c, k_pe, slot_mapping, kv_scales, dtype)
        tile, warps = _launch_config(step.num_tokens * step.num_layers, block_tokens, num_warps)
        constexprs = _grouped_constexprs(_launch_spec(self.plan, step, kv_c, k_pe, tile))
        grid = (max(1, -(-step.num_tokens // tile)), step.num_layers, 1)
        bound = self._launcher.bind(
            grid, kv_c, k_pe, self.plan.table, slot_mapping, kv_scales, max(step.num_tokens, 1),
            step.kv_strides[0], step.pe_strides[0], step.slot_strides[0], *constexprs,
            num_warps=warps, packed=self.packed,
        )  # fmt: skip
        if len(self._bound) >= _MAX_SIGNATURES:
            self._bound.clear()
        self._bound[key] = bound
        return bound, tile


def grouped_insert_for(plan: Plan, direct: bool, packed: bool) -> GroupedInsert:
    """The process-wide :class:`GroupedInsert` of ``plan`` (one per plan object and mode)."""
    return _grouped_insert_for(_Identity(plan), direct, packed)


class _Identity:
    """A memo key that compares a plan by identity (a plan holds a tensor: no ``==``)."""

    __slots__ = ("plan",)

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def __hash__(self) -> int:
        return id(self.plan)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.plan is self.plan


@functools.lru_cache(maxsize=32)
def _grouped_insert_for(key: _Identity, direct: bool, packed: bool) -> GroupedInsert:
    # the memo holds the plan, so its id is not reused while the entry lives
    return GroupedInsert(key.plan, key.plan.kv_cache_dtype, direct=direct, packed=packed)
