"""The grouped MLA insert of one plan, its checks and launch bound per step signature (private).

Offers (to :mod:`kvmgr.kernels.mla.memo`, ``api`` and ``hook``):
    GroupedInsert   one plan's grouped launches: checks once per step signature, then writes the
                    step's pointers, ``T`` and layer strides into a bound launch and launches it

**Launch key.** Everything :func:`~kvmgr.kernels.mla.checks.check_step` and the launch's
constexprs depend on but the kernel's runtime arguments (``T``, the layer strides, the
pointers: ``do_not_specialize``, so one bound launch serves every step size of a tile); the
scales' part is read once per scales object (the last 16 held). A known key skips the checks
but one (``kv_c``, ``k_pe`` and ``slot_mapping`` agree on ``T``); a new key is checked in full
(raising as :func:`~kvmgr.kernels.mla.api.grouped_mla_insert` does) and bound (compiled if
needed). Its parts: docs/kernels-mla-insert.md, "Host cost".

**Step signature.** In front of the key, each call reads the step tensors once (15 attribute
reads per call, no indexing) and looks that tuple up among the 256 most recent signatures; a
known one determines the launch key, grid and every runtime argument but the pointers, while the
rule reads every varying argument by dtype and value alone: docs/kernels-mla-insert.md.

**Guard and steady steps** (a signature found on two consecutive calls gets torch's C++
tensor check, and on a packed launch the C writer of its cells, :mod:`kvmgr.kernels.mla.steady`;
the very same tensors as the last call skip even the signature): docs/kernels-mla-insert.md,
"Host cost".
"""

from __future__ import annotations

from typing import Any

import torch

from kvmgr.kernels.launch import Launches
from kvmgr.kernels.launch.rule import PLAIN, Unsupported
from kvmgr.kernels.mla import plan as plans
from kvmgr.kernels.mla.checks import any_meta, check_step, unchecked_step
from kvmgr.kernels.mla.kernel import grouped_insert_kernel
from kvmgr.kernels.mla.plan import Plan, grouped_constexprs, launch_config
from kvmgr.kernels.mla.steady import guard_step

__all__ = ["GroupedInsert"]

_MAX_SIGNATURES = 64  # bound launches kept per plan (a loop sees a handful: tiles x layouts)
_MAX_STEPS = 256  # step signatures (with T) remembered per plan: a loop's step sizes
_MAX_SCALES = 16  # scales tensors whose key part is remembered per plan
# the runtime arguments (kv_c, k_pe, slot_mapping, kv_scales, T and the three layer strides);
# position 2, the pointer table, is the plan's
_VARYING = (0, 1, 3, 4, 5, 6, 7, 8)


class GroupedInsert:
    """The grouped launches of one plan (uniform caches), bound once per step signature.

    Args:
        plan: the caches' plan (pointer table, geometry); held for the insert's life.
        direct: False takes Triton's own launch every call.

    Attributes:
        plan: as given.
        num_bound: step signatures bound so far (at most 64 kept).
        guarded: the guarded signature (:func:`kvmgr.kernels.mla.steady.guard_step`), or None.
        fired: the guarded signature the last call launched through :meth:`fire`, or None.
    """

    def __init__(self, plan: Plan, *, direct: bool = True) -> None:
        self.plan = plan
        self._launches = Launches(grouped_insert_kernel, _VARYING, "ttt?iiii", direct=direct,
                                  max_bound=_MAX_SIGNATURES)  # fmt: skip
        self._read = self._launches.read
        # step signature -> (bound launch, grid or None for T = 0, (T, layer strides)); only
        # where the rule reads the varying arguments by dtype and value alone (all PLAIN)
        kinds = self._launches.launcher.declared
        self._plain = kinds is not None and all(kinds[i] == PLAIN for i in _VARYING)
        self._steps: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # the last call's tensors, (pointers, T), grid and launch: the same objects again skip
        # everything but the launch
        self._last: tuple[Any, ...] | None = None
        self._scales: torch.Tensor | None = None  # the last scales tensor and its key part
        self._scales_key: Any = None
        # id -> (scales tensor, its key part): the last 16 scales objects, held (a few floats each)
        self._scales_keys: dict[int, tuple[torch.Tensor, Any]] = {}
        # the last signature found (remembered) and, once found twice in a row, its guard:
        # (torch's C++ tensor check of that step, whether it has scales, its entry, alignment)
        self._prev: tuple[Any, ...] | None = None
        self.guarded: tuple[Any, ...] | None = None
        self._refused = 0  # calls of the guarded signature its guard refused, in a row
        self.fired: tuple[Any, ...] | None = None

    @property
    def num_bound(self) -> int:
        return self._launches.num_bound

    def bound(self) -> list[Any]:
        """The bound launches held (``PackedLaunch`` on a GPU, ``TritonLaunch`` otherwise)."""
        return self._launches.bound()

    def __call__(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None, validate: bool = True, stream: Any = None,
        block_tokens: int | None = None, num_warps: int | None = None,
    ) -> int:  # fmt: skip
        """Enqueue one insert on ``stream`` (None: the current one); return ``T``. Inputs and
        errors (``GeometryError``, ``ConfigError``) as :func:`~kvmgr.kernels.mla.api.grouped_mla_insert`;
        ``validate=False`` checks nothing, even for a new signature (the hook's opt-out)."""
        last = self._last  # the same tensor objects as the last call: only launch
        if (
            last is not None and kv_c is last[0] and k_pe is last[1] and slot_mapping is last[2]
            and kv_scales is last[3] and block_tokens is None and num_warps is None
            and last[4] == (kv_c.data_ptr(), k_pe.data_ptr(), slot_mapping.data_ptr(), kv_c.shape[1])
        ):  # fmt: skip
            self.fired = None
            last[6].launch(last[5], stream)
            return last[4][3]
        guarded = self.guarded  # the last repeated signature, by its guard: no reads, no key
        if guarded is not None and block_tokens is None and num_warps is None and (kv_scales is not None) is guarded[1]:  # fmt: skip
            check, scaled, _, _, read, cells, _ = guarded  # scaled: the step has scales
            try:  # the guard's verdict and the pointers in one C call (cells: written there too)
                if cells is not None:
                    ptrs = read(cells, check, (), kv_c, k_pe, slot_mapping, kv_scales) if scaled else read(cells, check, (), kv_c, k_pe, slot_mapping)  # fmt: skip
                else:
                    ptrs = read(check, kv_c, k_pe, slot_mapping, kv_scales) if scaled else read(check, kv_c, k_pe, slot_mapping)  # fmt: skip
            except TypeError:  # not tensors, or another number of them
                ptrs = None
            if ptrs is not None:
                num_tokens = self.fire(guarded, kv_c, k_pe, slot_mapping, kv_scales, stream, ptrs, cells is not None)  # fmt: skip
                if num_tokens is not None:
                    return num_tokens
        self.fired = None
        bound, grid, ints, values = self._by_signature(kv_c, k_pe, slot_mapping, kv_scales,
                                                       validate, block_tokens, num_warps)  # fmt: skip
        if grid is None:  # T == 0
            return 0
        bound.run(grid, stream, values, (kv_c, k_pe, slot_mapping, kv_scales) + ints)  # noqa: RUF005
        if block_tokens is None and num_warps is None:
            self._last = (kv_c, k_pe, slot_mapping, kv_scales, (values[0], values[1], values[2], ints[0]), grid, bound, ints)  # fmt: skip
        return ints[0]

    def fire(
        self, guarded: tuple[Any, ...], kv_c: torch.Tensor, k_pe: torch.Tensor,
        slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None, stream: Any,
        ptrs: tuple[int, ...], written: bool = False,
    ) -> int | None:  # fmt: skip
        """Launch the guarded signature ``guarded`` (:attr:`guarded`) for a step that passed its
        guard or one built from the same step (``ptrs``: the step tensors' ``data_ptr()``s, read
        with that verdict: :func:`kvmgr.kernels.launch.native.checked_data_ptrs`); return
        ``T``, or None where the bases' 16-byte alignment differs from that step's (nothing
        launched). ``written``: ``ptrs`` came from the C writer (:mod:`kvmgr.kernels.mla.steady`:
        it compared the alignment and wrote them and the ints into the launch's cells). Sets
        :attr:`fired` to ``guarded`` on a launch."""
        if not written and ((ptrs[0] | ptrs[1]) & 15 == 0) is not guarded[3]:
            return None
        bound, grid, ints = guarded[2]
        self.fired = guarded
        if grid is None:  # T == 0
            return 0
        # tuples joined with + (RUF005): 70 ns less than from starred parts, on every launch
        values = None if written else ptrs + ints if kv_scales is not None else ptrs + (0,) + ints  # noqa: RUF005
        bound.run(grid, stream, values, (kv_c, k_pe, slot_mapping, kv_scales) + ints)  # noqa: RUF005
        self._last = (kv_c, k_pe, slot_mapping, kv_scales, (ptrs[0], ptrs[1], ptrs[2], ints[0]), grid, bound, ints)  # fmt: skip
        return ints[0]

    def _by_signature(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None, validate: bool, block_tokens: int | None,
        num_warps: int | None,
    ) -> tuple[Any, tuple[int, int, int] | None, tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
        """The step's launch by its signature (remembered, or new: :meth:`_new_step`); a signature
        found twice in a row gets a guard (:attr:`guarded`, launched by :meth:`fire`). ``(bound, grid, ints, values)``."""
        try:  # the step signature: 15 attribute reads (module docstring)
            kv_ptr, pe_ptr, slot_ptr = kv_c.data_ptr(), k_pe.data_ptr(), slot_mapping.data_ptr()
            signature: tuple[Any, ...] | None = (
                kv_c.shape, k_pe.shape, slot_mapping.shape, kv_c.is_contiguous() or kv_c.stride(),
                k_pe.is_contiguous() or k_pe.stride(), slot_mapping.is_contiguous() or slot_mapping.stride(),
                kv_c.dtype, k_pe.dtype, slot_mapping.dtype, kv_c.get_device(), k_pe.get_device(),
                slot_mapping.get_device(), (kv_ptr | pe_ptr) & 15 == 0,
                None if kv_scales is None else (kv_scales.dtype, self._scales_key if kv_scales is self._scales else self._scales_part(kv_scales)), block_tokens, num_warps,
            )  # fmt: skip
            known = self._steps.get(signature) if self._plain else None
        except (AttributeError, TypeError):  # not tensors: the checks say what is wrong
            signature, known = None, None
        if known is not None and signature[9] < 0 and any_meta(kv_c, k_pe, slot_mapping, kv_scales):  # type: ignore[index]  # fmt: skip
            known = None  # a CPU signature (interpreted kernels): meta shares the index -1
        if known is None:
            self._prev = None
            return self._new_step(signature, kv_c, k_pe, slot_mapping, kv_scales, validate,
                                  block_tokens, num_warps)  # fmt: skip
        if known is self._prev and signature is not None and block_tokens is None and num_warps is None:  # fmt: skip
            self._guard_for(known, signature[12], kv_c, k_pe, slot_mapping, kv_scales)
        self._prev = known
        bound, grid, ints = known
        values = (kv_ptr, pe_ptr, slot_ptr, 0 if kv_scales is None else kv_scales.data_ptr()) + ints  # noqa: RUF005  # fmt: skip
        return bound, grid, ints, values

    def _guard_for(
        self, known: tuple[Any, ...], aligned: bool, kv_c: torch.Tensor, k_pe: torch.Tensor,
        slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """Guard ``known`` (found on two calls in a row) by this step; a guard of ``known`` that
        refused this step (its size-1 strides, another grad mode) is rebuilt only after 16
        refusals in a row, so a loop that keeps refusing pays one build per 16 calls."""
        if self.guarded is not None and self.guarded[2] is known:
            self._refused += 1
            if self._refused < 16:
                return
        self._refused = 0
        tensors = (kv_c, k_pe, slot_mapping) if kv_scales is None else (kv_c, k_pe, slot_mapping, kv_scales)  # fmt: skip
        self.guarded = guard_step(tensors, known, aligned, ())

    def _new_step(
        self, signature: tuple[Any, ...] | None, kv_c: torch.Tensor, k_pe: torch.Tensor,
        slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None, validate: bool,
        block_tokens: int | None, num_warps: int | None,
    ) -> tuple[Any, tuple[int, int, int] | None, tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
        """A step signature not seen before: its launch by the ``T``-free key (bound before, or
        checked in full and bound now), remembered under ``signature``; ``(bound launch, grid or
        None for T = 0, (T, layer strides), the runtime arguments' values)``."""
        try:
            key, bound, args, values, tile = self._keyed(kv_c, k_pe, slot_mapping, kv_scales,
                                                         block_tokens, num_warps)  # fmt: skip
        except (AttributeError, IndexError, TypeError, Unsupported):  # not tensors of rank 3
            key, bound = None, None
        if bound is None:  # a new key, or T disagrees: the full checks (they raise)
            bound, args, values, tile = self._bind(key, kv_c, k_pe, slot_mapping, kv_scales,
                                                   validate, block_tokens, num_warps)  # fmt: skip
        num_tokens = args[4]
        grid = None if num_tokens == 0 else (-(-num_tokens // tile), args[0].shape[0], 1)
        if signature is not None and self._plain:  # checked (or vouched for): remember it
            steps = self._steps
            if len(steps) >= _MAX_STEPS:
                del steps[next(iter(steps))]
            steps[signature] = (bound, grid, args[4:])
        return bound, grid, args[4:], values

    def _keyed(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None, block_tokens: int | None, num_warps: int | None,
    ) -> tuple[Any, ...]:  # fmt: skip
        """``(key, its bound launch or None, varying arguments, their values, tile)``; the bound
        launch only where the three tensors agree on ``T``. Raises what attribute reads of
        non-tensors raise."""
        ks, ps, ss = kv_c.shape, k_pe.shape, slot_mapping.shape
        kt, pt, st = kv_c.stride(), k_pe.stride(), slot_mapping.stride()
        num_layers, num_tokens, slot_rank = ks[0], ks[1], len(ss)
        args = (kv_c, k_pe, slot_mapping, kv_scales, num_tokens, kt[0], pt[0],
                st[0] if slot_rank == 2 else 0)  # fmt: skip
        classes, values = self._read(*args)
        # IO_ALIGNED: both bases and both layer strides (in bytes) are multiples of 16
        aligned = (values[0] | values[1]) & 15 == 0 and ((kt[0] | pt[0]) * kv_c.itemsize) & 15 == 0  # fmt: skip
        rows = num_tokens * num_layers  # the tile rule of plan.launch_config, inlined
        tile = block_tokens or (1 if rows < 16384 else 2 if rows < 32768 else 4)
        key = (
            classes, len(ks), num_layers, ks[2], kt[1], kt[2], kv_c.get_device(), len(ps),
            ps[0], ps[2], pt[1], pt[2], k_pe.get_device(), slot_rank,
            ss[0] if slot_rank == 2 else -1, st[-1], slot_mapping.get_device(), aligned,
            tile, num_warps,
            None if kv_scales is None else self._scales_key if kv_scales is self._scales else self._scales_part(kv_scales),
        )  # fmt: skip
        bound = self._launches.get(key) if ps[1] == num_tokens == ss[-1] else None
        if bound is not None and key[6] < 0 and any_meta(kv_c, k_pe, slot_mapping, kv_scales):
            bound = None  # as in _by_signature: the full checks refuse it
        return key, bound, args, values, tile

    def _scales_part(self, kv_scales: torch.Tensor) -> Any:
        """The scales' part of the signature, read once per scales tensor object (the last 16
        objects are remembered: a loop that alternates among a few pays no reads)."""
        known = self._scales_keys.get(id(kv_scales))
        if known is not None and known[0] is kv_scales:
            part = known[1]
        else:
            part = (kv_scales.shape, kv_scales.stride(), kv_scales.get_device())
            if len(self._scales_keys) >= _MAX_SCALES:
                del self._scales_keys[next(iter(self._scales_keys))]
            self._scales_keys[id(kv_scales)] = (kv_scales, part)
        self._scales, self._scales_key = kv_scales, part
        return part

    def _bind(
        self, key: tuple[Any, ...] | None, kv_c: torch.Tensor, k_pe: torch.Tensor,
        slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None, validate: bool,
        block_tokens: int | None, num_warps: int | None,
    ) -> tuple[Any, tuple[Any, ...], tuple[Any, ...], int]:  # fmt: skip
        """Check a new signature in full and bind its launch (compiles if needed);
        ``(bound, varying arguments, their values, tile)``."""
        plan = self.plan
        if validate:
            step = check_step(kv_c, k_pe, slot_mapping, kv_scales, plan.kv_cache_dtype,
                              plan.meta, allow_cpu=plans.IS_INTERPRETED)  # fmt: skip
        else:
            step = unchecked_step(kv_c, k_pe, slot_mapping, kv_scales, plan.kv_cache_dtype)
        tile, warps = launch_config(step.num_tokens * step.num_layers, block_tokens, num_warps)
        args = (kv_c, k_pe, slot_mapping, kv_scales, step.num_tokens, step.kv_strides[0],
                step.pe_strides[0], step.slot_strides[0])  # fmt: skip
        _, values = self._read(*args)
        is_aligned = (values[0] | values[1]) & 15 == 0 and (
            (step.kv_strides[0] | step.pe_strides[0]) * kv_c.itemsize
        ) & 15 == 0
        constexprs = grouped_constexprs(plan, step, kv_c.dtype, tile, is_aligned)
        grid = (max(1, -(-step.num_tokens // tile)), step.num_layers, 1)
        full = (*args[:2], plan.table, *args[2:4], max(step.num_tokens, 1), *args[5:], *constexprs)
        bound = self._launches.bind(key if key is not None else object(), grid, full, warps)
        return bound, args, values, tile
