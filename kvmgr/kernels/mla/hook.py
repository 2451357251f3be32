"""The grouped MLA cache insert as a step hook.

Offers:
    GroupedMLAInsertHook   inserts a step's latent KV into all layers' caches from ``manager.step()``

Importing this module does not import Triton; constructing a hook does.
"""

from __future__ import annotations

import contextlib
import operator
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvmgr.errors import ConfigError, GeometryError
from kvmgr.hooks import HookReport, StepContext

__all__ = ["GroupedMLAInsertHook"]

_TENSOR_NAMES = ("kv_c", "k_pe", "slot_mapping")
_step_tensors = operator.itemgetter(*_TENSOR_NAMES)
_now = time.perf_counter


class GroupedMLAInsertHook:
    """Run the grouped MLA insert once per step on the compute stream (a :class:`StepHook`).

    Each step reads from ``ctx.tensors``:

    - ``"kv_c"``: ``[L, T, R]`` latent KV of the step's tokens (bfloat16/float16/float32),
    - ``"k_pe"``: ``[L, T, P]`` their RoPE keys,
    - ``"slot_mapping"``: int64 ``[T]`` or ``[L, T]`` cache slots, < 0 for padding,

    and writes them into the caches given at construction, exactly as
    :func:`kvmgr.kernels.mla.api.grouped_mla_insert` (same semantics and dtypes). The caches
    are validated and their pointer table built here, once; each step only checks the step's
    tensors (attribute reads, no torch ops), or nothing with ``validate=False``. Caches of unequal
    geometry fall back to one launch per layer. A step of zero tokens launches nothing. Safe under
    CUDA-graph capture (no host reads of device data) unless ``check_slots``; build the hook, and
    run one step eagerly to compile, before capturing.

    Args:
        caches: L caches ``[num_blocks, block_size, R + P]``, mutated in place by every step.
        kv_cache_dtype: As in ``grouped_mla_insert``.
        kv_scales: float32 ``[L]`` on the caches' device for FP8 (read on the device at every step, so it
            may be updated in place), ``None`` for ``auto``.
        name: The name reported in :class:`HookReport`.
        check_slots: Reject slots past the capacity at each step (one device->host sync per step).
        validate: Check each step's tensors against the caches (about 2 us of host time). ``False`` skips
            those checks, for loops that build the tensors themselves: a tensor of the wrong shape,
            dtype, device or layout is then read or written out of bounds instead of raising.
        direct_launch: Check each step signature once and launch the grouped kernel with
            ``cuLaunchKernelEx`` from packed arguments (the default; :mod:`kvmgr.kernels.mla.insert`).
            ``False`` takes Triton's own launch every step (the benchmarks' baseline).

    Raises:
        ConfigError: Bad ``kv_cache_dtype`` / ``kv_scales`` combination, or construction under graph capture.
        GeometryError: Caches of mixed width, dtype or device, or ``kv_scales`` of the wrong dtype, shape or device.
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        *,
        kv_cache_dtype: str = "auto",
        kv_scales: torch.Tensor | None = None,
        name: str = "mla_insert",
        check_slots: bool = False,
        validate: bool = True,
        direct_launch: bool = True,
    ) -> None:
        from kvmgr.kernels.mla import checks, insert, plan

        caches = tuple(caches)
        checks.check_dtype_and_scales(kv_cache_dtype, kv_scales)
        meta = checks.check_caches(caches, kv_cache_dtype)
        if kv_scales is not None:
            _check_scales(kv_scales, caches)
        self.name = name
        self._checks: Any = checks  # modules held, so that importing this one imports no Triton
        self._allow_cpu = plan.IS_INTERPRETED
        self._launch_per_layer = plan.launch_per_layer
        self._caches = caches
        self._kv_cache_dtype = kv_cache_dtype
        self._kv_scales = kv_scales
        self._check_slots = check_slots
        self._validate = validate
        self._meta = meta
        self._is_grouped = checks.is_uniform(caches)
        # the hook's own insert: it holds the plan, so a captured graph's pointer table lives as
        # long as the hook; None for the per-layer fallback
        self._insert: Any = None
        if self._is_grouped:
            key = plan.checked_key(caches, kv_cache_dtype)
            self._insert = insert.GroupedInsert(plan.make_plan(key), direct=direct_launch)

    @property
    def plan(self) -> Any:
        """The caches' plan (pointer table, geometry) of the grouped path; None per layer."""
        return None if self._insert is None else self._insert.plan

    @property
    def is_grouped(self) -> bool:
        """True when one launch covers all layers; False for the per-layer fallback."""
        return self._is_grouped

    def __call__(self, ctx: StepContext) -> HookReport:
        """Enqueue the insert of ``ctx.tensors`` on ``ctx.stream`` (or the current stream).

        Raises:
            ConfigError: A tensor named above is missing from ``ctx.tensors``, or ``check_slots`` under capture.
            GeometryError: The step's tensors do not match the caches (see ``grouped_mla_insert``).
            InvalidBlockError: ``check_slots`` and a slot is past the capacity.
        """
        start_s = _now()
        try:
            kv_c, k_pe, slots = _step_tensors(ctx.tensors)
        except KeyError:
            missing = [name for name in _TENSOR_NAMES if name not in ctx.tensors]
            raise ConfigError(f"ctx.tensors: expected {list(_TENSOR_NAMES)}, missing {missing}") from None  # fmt: skip
        insert, scales = self._insert, self._kv_scales
        if insert is not None and not self._check_slots:  # the per-step path
            num_tokens = insert(kv_c, k_pe, slots, scales, self._validate, ctx.stream)
            return HookReport.of(self.name, 0 if num_tokens == 0 else 1, 0, _now() - start_s,
                                 {"num_tokens": num_tokens, "grouped": True})  # fmt: skip
        return self._checked_step(ctx, kv_c, k_pe, slots, start_s)

    def _checked_step(self, ctx: StepContext, kv_c: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor, start_s: float) -> HookReport:  # fmt: skip
        """A step with ``check_slots``, or through the per-layer fallback."""
        checks, caches, scales, dtype = self._checks, self._caches, self._kv_scales, self._kv_cache_dtype  # fmt: skip
        if self._insert is not None:
            step = checks.check_step(kv_c, k_pe, slots, scales, dtype, self._meta,
                                     allow_cpu=self._allow_cpu)  # fmt: skip
            checks.check_slot_range(step, caches)
            num_tokens = self._insert(kv_c, k_pe, slots, scales, self._validate, ctx.stream)
            return HookReport.of(self.name, 0 if num_tokens == 0 else 1, 0, _now() - start_s,
                                 {"num_tokens": num_tokens, "grouped": True})  # fmt: skip
        if self._validate:
            step = checks.check_step(kv_c, k_pe, slots, scales, dtype, self._meta,
                                     allow_cpu=self._allow_cpu)  # fmt: skip
        else:
            step = checks.unchecked_step(kv_c, k_pe, slots, scales, dtype)
        if self._check_slots:
            checks.check_slot_range(step, caches)
        stream = contextlib.nullcontext() if ctx.stream is None else torch.cuda.stream(ctx.stream)
        with stream:
            self._launch_per_layer(step, kv_c, k_pe, caches, scales, dtype)
        launches = 0 if step.num_tokens == 0 else len(caches)
        return HookReport.of(self.name, launches, 0, _now() - start_s,
                             {"num_tokens": step.num_tokens, "grouped": False})  # fmt: skip


def _check_scales(kv_scales: torch.Tensor, caches: Sequence[torch.Tensor]) -> None:
    """``kv_scales`` must be float32 ``[L]`` on the caches' device.

    Raises:
        GeometryError: another dtype, shape or device.
    """
    got = (kv_scales.dtype, tuple(kv_scales.shape), kv_scales.device)
    want = (torch.float32, (len(caches),), caches[0].device)
    if got != want:
        raise GeometryError(f"kv_scales (dtype, shape, device): expected {want}, got {got}")
