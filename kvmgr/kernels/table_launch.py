"""Packed launches of the copy kernels on an explicit stream (the engines' hot path).

Offers:
    TableLaunches   one kernel's launches, bound once per argument specialization and then
                    updated in place and issued with ``cuLaunchKernel`` on a given stream

Why: the engines launch a copy kernel once per batch on their copy stream. Entering
``torch.cuda.stream(stream)`` around a launch costs about 11 us on the H200 host and Triton's
launcher (even past ``JITFunction.run``, :mod:`kvmgr.kernels.launch`) another 6-13 us; a bound
:class:`~kvmgr.kernels.packed_launch.PackedLaunch` takes the stream as an argument and costs
about one driver call (``scripts/gpu_profile.py``).

Specialization: Triton compiles a kernel per class of each argument (a pointer 16-byte aligned or
not; an int equal to 1, a multiple of 16, or neither), so one bound launch is kept per class
tuple (an int also by whether it fits 32 bits) and only values inside a class are written into
it. Under ``TRITON_INTERPRET=1`` or where
packing is unavailable the bound launch is Triton's (a ``TritonLaunch``), same results.

Not thread-safe: each issuer owns its own ``TableLaunches``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvmgr.kernels.launch import shared_launcher

__all__ = ["TableLaunches"]


def _spec(value: Any) -> Any:
    """The specialization class Triton compiles ``value`` for (pointers and ints only)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() & 15 == 0
    return (value == 1, value % 16 == 0, -(2**31) <= value < 2**31)


class TableLaunches:
    """Launches of ``kernel`` whose arguments are tensors and ints only, on a given stream.

    Args:
        kernel: a ``@triton.jit`` function.
        num_warps: warps per program of every launch.
    """

    def __init__(self, kernel: Any, num_warps: int) -> None:
        self._launcher = shared_launcher(kernel)
        self._num_warps = num_warps
        self._bound: dict[tuple[Any, ...], Any] = {}

    @property
    def num_bound(self) -> int:
        """Specializations bound so far."""
        return len(self._bound)

    def __call__(self, grid: int, stream: Any, *args: Any) -> None:
        """Enqueue ``kernel[(grid,)](*args)`` on ``stream`` (a ``torch.cuda.Stream``; None: the
        current stream)."""
        key = tuple(map(_spec, args))
        bound = self._bound.get(key)
        if bound is None:
            bound = self._launcher.bind((grid,), *args, num_warps=self._num_warps)
            self._bound[key] = bound
        else:
            for index, value in enumerate(args):
                if isinstance(value, torch.Tensor):
                    bound.set_tensor(index, value)
                else:
                    bound.set_int(index, value)
        bound.launch((grid, 1, 1), stream)
