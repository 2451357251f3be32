"""libcuda's entry points a packed launch calls, resolved once per process.

Offers (to the rest of :mod:`kvmgr.kernels.launch`):
    Libcuda     ``cuLaunchKernelEx``, ``cuCtxGetCurrent`` and ``cuGetErrorName`` of
                ``libcuda.so.1`` through ctypes
    driver      the process's :class:`Libcuda` (None without an NVIDIA driver)

``ctypes.CDLL`` releases the GIL around each call, as Triton's own launcher does.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["Libcuda", "driver"]


class Libcuda:
    """The three libcuda entry points a packed launch uses (resolved once per process).

    Attributes: ``launch`` (``cuLaunchKernelEx`` through ctypes), ``launch_address`` (its
    address, or None: then packed launches take the ctypes call).
    """

    def __init__(self, lib: Any) -> None:
        self.launch = lib.cuLaunchKernelEx
        self.launch.restype = ctypes.c_int
        #: the entry point's address, for the C call of :mod:`kvmgr.kernels.launch.native`
        self.launch_address: int | None = ctypes.cast(self.launch, ctypes.c_void_p).value
        self._get_context = lib.cuCtxGetCurrent
        self._error_name = lib.cuGetErrorName

    def current_context(self) -> int | None:
        ctx = ctypes.c_void_p()
        return ctx.value if self._get_context(ctypes.byref(ctx)) == 0 else None

    def error_name(self, result: int) -> str:
        name = ctypes.c_char_p()
        self._error_name(result, ctypes.byref(name))
        return f"{(name.value or b'CUDA error').decode()} ({result})"


@functools.cache
def driver() -> Libcuda | None:
    """libcuda's launch entry points, loaded lazily (None where they cannot be: no NVIDIA
    driver, a driver without ``cuLaunchKernelEx``)."""
    try:
        return Libcuda(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None
