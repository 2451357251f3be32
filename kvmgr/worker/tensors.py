"""A guard over KV tensors: did any of them move or change shape since the worker was built?

Private to ``kvmgr.worker``.
"""

from __future__ import annotations

import operator

import torch

__all__ = ["TensorGuard"]

_data_ptr = torch.Tensor.data_ptr
_shape = operator.attrgetter("shape")
_stride = torch.Tensor.stride
_dtype = operator.attrgetter("dtype")


class TensorGuard:
    """Remembers each tensor's data pointer, shape, strides and dtype."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors
        self._ptrs = list(map(_data_ptr, tensors))
        self._shapes = list(map(_shape, tensors))
        self._strides = list(map(_stride, tensors))
        self._dtypes = list(map(_dtype, tensors))

    def moved(self) -> str | None:
        """Why a KV tensor no longer matches, or ``None``: its data pointer, shape, strides or
        dtype changed (``resize_``, ``set_``, ``as_strided_``, ``.data =``, an in-place view
        op). Exact: 4 C calls per tensor compared as four lists, once per flush (about a fifth
        of a 512-store step's host time on a 2-core VM). No cheaper exact test was found:
        ``Tensor.is_set_to`` against kept aliases costs more (a dispatcher call per tensor) and
        would keep re-pointed storage alive; ``_version`` moves with every KV write."""
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
