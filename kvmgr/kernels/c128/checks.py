"""Tensor checks of the c128 kernels' host side: "expected X, got Y" errors, cheap predicates.

Offers (to the modules of :mod:`kvmgr.kernels.c128`):
    fail                    the ``GeometryError`` of one failed expectation
    check                   type, shape, dtype, device and unit last stride of one tensor
    is_index, is_rows       the same test as ``check`` for index vectors and row arrays, without
                            building an error (the per-step fast path)
    count_tokens            ``T`` from a 1-D ``positions`` tensor
    INDEX_DTYPES, FLOAT_DTYPES   accepted dtypes
"""

from __future__ import annotations

from typing import TypeGuard

import torch

from kvmgr.errors import GeometryError

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check",
    "count_tokens",
    "fail",
    "is_index",
    "is_rows",
]

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fail(name: str, expected: str, got: object) -> GeometryError:
    """``GeometryError("{name}: expected {expected}, got {got}")``."""
    return GeometryError(f"{name}: expected {expected}, got {got}")


def check(
    t: object, name: str, shape: tuple[int | None, ...], dtypes: tuple[torch.dtype, ...],
    device: torch.device | None, *, contiguous: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Check type, sizes (``None``: any), dtype, device and unit last stride; return ``t``."""
    if not isinstance(t, torch.Tensor):
        raise fail(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != len(shape) or any(
        s not in (None, n) for s, n in zip(shape, t.shape, strict=False)
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise fail(name, f"shape {want}", list(t.shape))
    if t.dtype not in dtypes:
        raise fail(name, "dtype in " + "/".join(str(d) for d in dtypes), t.dtype)
    if device is not None and t.device != device:
        raise fail(name, f"device {device}", t.device)
    if contiguous and not t.is_contiguous():
        raise fail(name, "a contiguous tensor", f"strides {t.stride()}")
    if t.numel() and t.stride(-1) != 1:
        raise fail(name, "unit last stride", f"strides {t.stride()}")
    return t


def is_index(t: object, num_tokens: int, device: torch.device) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` passes ``check(t, name, (num_tokens,), INDEX_DTYPES, device)``; no allocation."""
    return (
        isinstance(t, torch.Tensor)
        and t.shape == (num_tokens,)
        and t.dtype in INDEX_DTYPES
        and t.device == device
        and (num_tokens == 0 or t.stride(0) == 1)
    )


def is_rows(
    t: object, num_tokens: int, width: int, dtypes: tuple[torch.dtype, ...], device: torch.device
) -> TypeGuard[torch.Tensor]:
    """Whether ``t`` passes ``check(t, name, (num_tokens, width), dtypes, device)``."""
    return (
        isinstance(t, torch.Tensor)
        and t.shape == (num_tokens, width)
        and t.dtype in dtypes
        and t.device == device
        and (num_tokens == 0 or t.stride(1) == 1)
    )


def count_tokens(positions: object) -> int:
    """``T`` from a 1-D ``positions`` tensor; -1 (fails every check) for anything else."""
    if isinstance(positions, torch.Tensor) and positions.dim() == 1:
        return positions.size(0)
    return -1
