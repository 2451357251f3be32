"""The public grouped insert's cache sets: the one owner of their plans and bound launches.

Offers (to :mod:`kvmgr.kernels.mla.api`):
    InsertMemo      cache set -> :class:`~kvmgr.kernels.mla.insert.GroupedInsert` (its plan,
                    pointer table and bound launches), for ``grouped_mla_insert``

``grouped_mla_insert`` is a function: what it learns about a set of caches (the checks, the
device pointer table, the bound launches per step signature) has to outlive the call, so one
:class:`InsertMemo` holds it, for the process. A hook holds its own
:class:`~kvmgr.kernels.mla.insert.GroupedInsert` instead and never touches the memo.

**Key.** :func:`~kvmgr.kernels.mla.plan.cache_key`: one pass of attribute reads over the caches
(shape, strides, dtype, device, ``data_ptr()`` of each), so a cache that was resized, re-strided,
re-typed or given new storage in place maps to another entry, and two lists holding the same
storage map to one. The memo keeps the 32 most recently used sets. A list seen before (by
``id``, a hint only) whose caches have the pointers, shapes, strides and dtype of that call, and
whose first cache the device, skips building and hashing the key: a loop passes the same list
every step. Those are exactly what the key holds (a pointer names its device, caches of one
set share one, and the first cache's device covers a zero-capacity set whose pointers are all
0), so the caches need not be the very tensors of that call, and the memo holds no reference
to any cache.

**The check of a known list**, paid on every call of the public function (a hook pays none):
torch's C++ tensor guard (``torch._C._dynamo.guards.TensorGuards``, what ``torch.compile``
checks its inputs with) built from the caches as remembered: dtype, device, every size and
stride, plus dispatch keys and ``requires_grad`` under the grad mode it was built in; then one
``map`` of ``data_ptr()``. About 0.28 us per cache on the 2-core CPU host, against 0.75-0.85 us
for the four attribute reads per cache (``data_ptr()``, ``dtype``, ``shape``,
``is_contiguous()``) it replaces. Where the guard refuses, those reads decide (a change of grad
mode, e.g. into ``torch.inference_mode``, changes the keys it compares, not the caches: it is
then rebuilt, once per mode change); where this torch has no guard that accepts the caches, the
reads alone. Still one pass per cache: every check that sees an in-place ``.data =`` of the same
storage has to read each cache (its version counter does not move).

**CUDA graphs.** A captured launch reads its plan's pointer table at every replay, so an entry
looked up while the stream is capturing is also held for the life of the process (one
``int64 [L]`` device tensor per cache set ever captured): the graph stays valid after any number
of newer cache sets. That costs one capture query per call on CUDA (a steady launch through the
C writer asks after its launch, and not on the legacy default stream, where CUDA begins no
capture: :attr:`PackedLaunch.stream_handle` 0). A first call for a cache set
under capture raises ``ConfigError`` (:func:`~kvmgr.kernels.mla.plan.make_plan`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from kvmgr._tensor_guard import tensor_guard
from kvmgr.kernels.launch.native import checked_data_ptrs
from kvmgr.kernels.mla.insert import GroupedInsert
from kvmgr.kernels.mla.plan import CacheKey, cache_key, checked_key, make_plan
from kvmgr.kernels.mla.steady import guard_step

__all__ = ["InsertMemo"]

_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)  # fmt: skip


class InsertMemo:
    """Grouped inserts by cache set, most recently used last.

    Args:
        max_sets: cache sets kept (those used under graph capture are kept regardless).
    """

    def __init__(self, max_sets: int = 32) -> None:
        self._max_sets = max_sets
        self._recent: OrderedDict[tuple[CacheKey, bool], GroupedInsert] = OrderedDict()
        self._held: dict[tuple[CacheKey, bool], GroupedInsert] = {}  # used under capture
        # id(list) -> (kv_cache_dtype, direct, ptrs, shape, strides, dtype, contiguous, device,
        # guard or None, key, insert)
        self._lists: OrderedDict[int, tuple[Any, ...]] = OrderedDict()
        # id(list) -> (insert, kv_cache_dtype, direct, key, the insert's guarded signature it
        # pairs with, then of the caches' and one step's guarded signature (kvmgr.kernels.mla
        # .steady) its guard's check, read, cells address or None, itself; on a GPU)
        self._steady: OrderedDict[int, tuple[Any, ...]] = OrderedDict()
        self._fresh: int | None = None  # id of the list insert_for met first in this call

    @property
    def steady_record(self) -> Any:
        """``record(id(caches))``: the steady-step record of a cache list for
        :meth:`launch_steady`, or None (the records' ``get``, bound once: a caller looks a list
        up before paying that call)."""
        return self._steady.get

    @property
    def num_sets(self) -> int:
        """Cache sets held (recent ones and those held for graphs)."""
        return len(self._recent.keys() | self._held.keys())

    def insert_for(self, caches: Sequence[torch.Tensor], kv_cache_dtype: str, direct: bool) -> GroupedInsert:  # fmt: skip
        """The grouped insert of ``caches`` (checked, planned and kept on first sight).

        Raises:
            GeometryError: the caches are unfit for the grouped kernel (as ``checked_key``).
            ConfigError: the first call for these caches happens under CUDA-graph capture.
        """
        lists, self._fresh = self._lists, None
        seen = lists.get(id(caches))
        if seen is None or seen[0] != kv_cache_dtype or seen[1] != direct:
            key, insert = self._lookup(caches, kv_cache_dtype, bool(direct))
        elif (guard := seen[8]) is not None and _guard_passes(guard, caches, seen[2]):
            key, insert = seen[-2], seen[-1]  # the usual call: one C++ pass, one map
        elif _unchanged(seen, caches):
            key, insert = seen[-2], seen[-1]
            if guard is not None:  # refused, the reads say the same: built under another mode
                lists[id(caches)] = (*seen[:8], tensor_guard(caches), key, insert)
        else:
            key, insert = self._lookup(caches, kv_cache_dtype, bool(direct))
        if key[0][1] >= 0 and _is_capturing():
            self._held[key] = insert  # a graph may replay it after it leaves the recent sets
        return insert

    def launch_steady(
        self, steady: tuple[Any, ...], caches: Sequence[torch.Tensor], kv_cache_dtype: str, direct: bool,
        kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None,
    ) -> int | None:  # fmt: skip
        """Launch a steady step of a known list in one check, or return None (nothing done);
        ``steady``: the list's record (``steady_record(id(caches))``, not None).

        :meth:`remember_steady` built ONE tensor guard over the caches and a step the insert
        launched (:mod:`kvmgr.kernels.mla.steady`). A call that passes it (dtype, device, sizes,
        strides of every cache and step tensor; the scales' presence), whose caches have the
        key's pointers and whose bases the step's alignment, with the same ``kv_cache_dtype``,
        ``direct`` and insert's guarded signature as then, is launched with that step's launch
        (the insert's ``fire``, inlined where one C call made those tests and wrote the step's
        pointers and ints into the packed launch's cells); ``T``. New step tensors (a serving
        loop) and the very same ones (persistent buffers, a cache set per call) alike."""
        insert, dtype, is_direct, key, guarded, check, read, cells, mine, on_gpu = steady
        if dtype != kv_cache_dtype or is_direct != direct or insert.guarded is not guarded:
            return None
        if cells is None:
            return self._launch_read(steady, caches, kv_c, k_pe, slot_mapping, kv_scales)
        try:  # the verdict, the caches' pointers and alignment compared, the cells written: one
            # C call; the scales' presence is the record's (else another count: None)
            ptrs = read(cells, check, caches, kv_c, k_pe, slot_mapping) if kv_scales is None else read(cells, check, caches, kv_c, k_pe, slot_mapping, kv_scales)  # fmt: skip
        except TypeError:  # not tensors
            return None
        if ptrs is None:
            return None
        # fire, inlined (a frame of 8 arguments less); the insert's last tensors forgotten (its
        # identity shortcut would relaunch these cells for them), as a refused record does
        bound, grid, ints = mine[2]
        insert.fired, insert._last = mine, None
        if grid is None:  # T == 0: nothing launched, nothing a graph could replay
            return 0
        bound.run(grid, None, None, (kv_c, k_pe, slot_mapping, kv_scales) + ints)  # noqa: RUF005
        # held as insert_for does, asked after the launch: a launch through the driver on the
        # legacy default stream (handle 0) is never captured (CUDA begins no capture there)
        if on_gpu and bound.stream_handle != 0 and _is_capturing():
            self._held[key] = insert
        return ints[0]  # type: ignore[no-any-return]

    def _launch_read(
        self, steady: tuple[Any, ...], caches: Sequence[torch.Tensor], kv_c: torch.Tensor,
        k_pe: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None,
    ) -> int | None:  # fmt: skip
        """:meth:`launch_steady` where the C writer does not serve the launch: the verdict and
        every pointer read in one call, the caches' compared here, then the insert's ``fire``."""
        insert, _, _, key, _, check, read, _, mine, on_gpu = steady
        try:  # as launch_steady: another count of tensors raises TypeError
            ptrs = read(check, *caches, kv_c, k_pe, slot_mapping) if kv_scales is None else read(check, *caches, kv_c, k_pe, slot_mapping, kv_scales)  # fmt: skip
        except TypeError:
            return None
        if ptrs is None or ptrs[: len(caches)] != key[0][5]:
            return None
        if on_gpu and _is_capturing():
            self._held[key] = insert
        return insert.fire(mine, kv_c, k_pe, slot_mapping, kv_scales, None, ptrs[len(caches) :])

    def remember_steady(
        self, caches: Sequence[torch.Tensor], insert: GroupedInsert, kv_c: torch.Tensor,
        k_pe: torch.Tensor, slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """After a call that ``insert_for(caches, ...)`` answered with ``insert`` for a list seen
        before and that launched these very tensors (``insert``'s last launch; through a plain
        signature): guard the caches and this step together for :meth:`launch_steady`. A list
        new in this call gets no record (a caller passing a new list each call would build a
        guard per call)."""
        seen, last = self._lists.get(id(caches)), insert._last
        if seen is None or seen[-1] is not insert or self._fresh == id(caches) or last is None:
            return
        if last[0] is not kv_c or last[1] is not k_pe or last[2] is not slot_mapping or last[3] is not kv_scales or not insert._plain:  # fmt: skip
            return
        step = (kv_c, k_pe, slot_mapping) if kv_scales is None else (kv_c, k_pe, slot_mapping, kv_scales)  # fmt: skip
        aligned = (last[4][0] | last[4][1]) & 15 == 0
        mine = guard_step((*caches, *step), (last[6], last[5], last[7]), aligned, seen[-2][0][5])
        if mine is None:
            return
        # the record: launch_steady's unpacking order; the last item holds the cells' memory
        self._steady[id(caches)] = (insert, seen[0], seen[1], seen[-2], insert.guarded, mine[0], *mine[4:6], mine, seen[-2][0][1] >= 0)  # fmt: skip
        self._steady.move_to_end(id(caches))
        if len(self._steady) > self._max_sets:
            self._steady.popitem(last=False)

    def _lookup(self, caches: Sequence[torch.Tensor], kv_cache_dtype: str, direct: bool) -> tuple[tuple[CacheKey, bool], GroupedInsert]:  # fmt: skip
        """The insert by key (made if new), remembered for this list too."""
        found = cache_key(caches, kv_cache_dtype)
        key = (checked_key(caches, kv_cache_dtype) if found is None else found, direct)
        recent = self._recent
        insert = recent.get(key)
        if insert is not None:
            recent.move_to_end(key)
        else:
            insert = self._held.get(key) or GroupedInsert(make_plan(key[0]), direct=direct)
            recent[key] = insert
            if len(recent) > self._max_sets:
                recent.popitem(last=False)
        _, _, shape, strides, dtype, ptrs = key[0]
        contiguous = strides == _contiguous_strides(shape)
        self._fresh = id(caches)  # a list new in this call: remember_steady skips it
        self._lists[id(caches)] = (kv_cache_dtype, direct, ptrs, shape, strides, dtype,
                                   contiguous, key[0][1], tensor_guard(caches), key, insert)  # fmt: skip
        self._lists.move_to_end(id(caches))
        if len(self._lists) > self._max_sets:
            self._lists.popitem(last=False)
        return key, insert

    def clear(self) -> None:
        """Forget every cache set, those held for graphs too (tests; graphs must be gone)."""
        self._recent.clear()
        self._held.clear()
        self._lists.clear()
        self._steady.clear()


def _unchanged(seen: tuple[Any, ...], caches: Sequence[torch.Tensor]) -> bool:
    """Whether ``caches`` have the pointers, shape, strides and dtype remembered in ``seen``, and
    the first one its device: the key they were remembered under (what an in-place ``set_``,
    ``resize_``, ``as_strided_`` or ``.data =`` changes).

    Caches remembered contiguous are tested with ``is_contiguous()`` instead of their strides
    (half the cost): with the same shape that fixes every stride but those of size-1 dims, which
    the kernel multiplies by index 0 (one block, a block of one token)."""
    _, _, ptrs, shape, strides, dtype, contiguous, device, _, _, _ = seen
    if len(ptrs) != len(caches) or caches[0].get_device() != device:
        return False
    for ptr, cache in zip(ptrs, caches):
        if (
            cache.data_ptr() != ptr or cache.dtype is not dtype or cache.shape != shape
            or not (cache.is_contiguous() if contiguous else cache.stride() == strides)
        ):  # fmt: skip
            return False
    return True


def _guard_passes(guard: Any, caches: Sequence[torch.Tensor], ptrs: tuple[int, ...]) -> bool:
    """Whether ``guard`` passes ``caches`` (as many, each of the dtype, device, sizes and strides
    it was built from) and their pointers are ``ptrs``: the key they were remembered under."""
    try:  # the verdict and the pointers in one C call (kvmgr.kernels.launch.native)
        return checked_data_ptrs()(guard.check, *caches) == ptrs
    except TypeError:  # another number of caches
        return False


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
