"""A guard over KV tensors: did any of them move or change shape since the worker was built?

Private to ``kvmgr.worker``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from kvmgr._native import checked_data_ptrs
from kvmgr._tensor_guard import tensor_guard
from kvmgr.worker._guard_c import same_check

__all__ = ["TensorGuard"]

_data_ptr = torch.Tensor.data_ptr
_shape = operator.attrgetter("shape")
_stride = torch.Tensor.stride
_dtype = operator.attrgetter("dtype")


class TensorGuard:
    """Remembers each tensor's data pointer, shape, strides and dtype.

    Args:
        tensors: the KV tensors (kept, never copied); their metadata as they are now is what
            :meth:`moved` compares against.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors
        self._ptrs = list(map(_data_ptr, tensors))
        self._ptr_tuple = tuple(self._ptrs)  # what ``_read`` returns for unmoved tensors
        self._read = checked_data_ptrs()  # the check's verdict and the pointers in one C call
        self._shapes = list(map(_shape, tensors))
        self._strides = list(map(_stride, tensors))
        self._dtypes = list(map(_dtype, tensors))
        self._check: Any = tensor_guard(tensors)  # None: this torch has none for them
        self._rebuilt = False  # ``_check`` was rebuilt by ``moved`` and has not passed since
        self._same = same_check(tensors)  # the shim's check (``_guard_c``), or None

    def moved(self) -> str | None:
        """Why a KV tensor no longer matches, or ``None``: its data pointer, shape, strides or
        dtype changed (``resize_``, ``set_``, ``as_strided_``, ``.data =``, an in-place view
        op). Exact, once per flush. Fastest path, where it builds: one C call reads every
        tensor's pointer, sizes, strides, dtype and device through torch's stable C shim and
        compares them with a snapshot (:mod:`kvmgr.worker._guard_c`; 0.75 us for 48 tensors
        hot against ~4.8); where all are the same, nothing moved. Else: torch's C++ tensor
        check built from the tensors as remembered (``torch._C._dynamo.guards.TensorGuards``:
        dtype, device, every size and stride; about 0.3 us a tensor on a 2-core VM) and, where
        it accepts them, their
        ``data_ptr()``s, in one C call (:func:`kvmgr._native.checked_data_ptrs`; the same in
        Python where kvmgr's C module does not build); where the check passes and every
        pointer is the one remembered, nothing moved. Anything else (the check refuses, e.g.
        under another grad mode or dispatch keys, or this torch has none) is decided by the
        four-list compare of pointers, shapes, strides and dtypes (4 C calls a tensor), which
        also words the message. A check that refused tensors the compare accepts is rebuilt in
        the current mode, unless it was just rebuilt and has not passed since (a loop that
        changes grad mode pays one build per change; tensors the check always refuses, one
        build in all). A shim check that refused tensors the compare accepts is rebuilt too,
        under the same rule."""
        same = self._same
        if same is not None and same():
            self._rebuilt = False
            return None
        tensors = self._tensors
        check = self._check
        if check is not None:
            try:
                if self._read(check.check, *tensors) == self._ptr_tuple:
                    self._rebuilt = False
                    return None
            except Exception:  # e.g. another number of tensors: the compare decides
                pass
        reason = self._compare()
        if reason is None and (check is not None or same is not None) and not self._rebuilt:
            self._check = tensor_guard(tensors) if check is not None else None
            self._same = same_check(tensors) if same is not None else None
            self._rebuilt = True
        return reason

    def _compare(self) -> str | None:
        """The exact four-list compare and its message (``None``: nothing moved)."""
        tensors = self._tensors
        if (
            list(map(_data_ptr, tensors)) == self._ptrs
            and list(map(_shape, tensors)) == self._shapes
            and list(map(_stride, tensors)) == self._strides
            and list(map(_dtype, tensors)) == self._dtypes
        ):
            return None
        for i, (tensor, ptr, shape, stride, dtype) in enumerate(
            zip(tensors, self._ptrs, self._shapes, self._strides, self._dtypes)
        ):
            if (
                tensor.data_ptr() != ptr or tensor.shape != shape
                or tensor.stride() != stride or tensor.dtype != dtype
            ):  # fmt: skip
                return (
                    f"KV tensor {i} moved or changed shape after the manager was built "
                    f"(data_ptr {ptr:#x} -> {tensor.data_ptr():#x}, shape {list(shape)} -> "
                    f"{list(tensor.shape)}, strides {stride} -> {tensor.stride()}, dtype "
                    f"{dtype} -> {tensor.dtype}): resize_()/set_()/as_strided_()/.data= on a "
                    "managed KV tensor"
                )
        return None
