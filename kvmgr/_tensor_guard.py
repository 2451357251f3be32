"""torch's C++ check of tensor metadata, built for some tensors (private to ``kvmgr``).

Offers:
    tensor_guard    a ``torch._C._dynamo.guards.TensorGuards`` of some tensors as they are now
    any_meta        whether any of some tensors is on the ``meta`` device (the check by device
                    index that the families' fast paths key on cannot tell it from the CPU)

``torch.compile`` checks its inputs with it: dtype, device, every size and stride, dispatch keys
and ``requires_grad`` (under the grad mode it was built in), one C++ call for all the tensors
(about 0.28 us per tensor on the 2-core CPU host, against 0.75-0.85 us for four attribute reads).
Pointers are not compared. Used by the worker's moved-tensor check (:mod:`kvmgr.worker.tensors`)
and the kernel families' per-step fast paths (MLA insert, c128); imports torch only, so neither
side depends on the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # torch's C++ check of tensor metadata (dynamo's guards); the callers' reads without it
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a torch without dynamo
    _TensorGuards = None

__all__ = ["any_meta", "tensor_guard"]


def tensor_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """torch's C++ check of ``tensors`` as they are now, or None where this torch has none that
    accepts them. ``guard.check(*others)`` is True when ``others`` are as many tensors, each of
    the dtype, device, sizes and strides of its counterpart (and its dispatch keys and
    ``requires_grad`` under the grad mode the guard was built in: ``torch.compile``'s input
    check, ``torch._C._dynamo.guards.TensorGuards``); pointers are not compared. Raises
    ``TypeError`` for another number of tensors."""
    if _TensorGuards is None:
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])  # fmt: skip
    except Exception:  # another torch's signature, or not tensors
        return None


def any_meta(*tensors: torch.Tensor | None) -> bool:
    """Whether one of ``tensors`` (None skipped) is on the ``meta`` device: storage-less, its
    ``get_device()`` is -1 as a CPU tensor's, so a check or key by device index alone takes it
    for a CPU tensor (where the kernels run interpreted, on CPU memory). A guard built from CPU
    tensors refuses it (its dispatch keys)."""
    return any(t is not None and t.is_meta for t in tensors)
