"""The ``cuMemcpyBatchAsync`` ABI facts and their pure logic (private to ``kvmgr.transfer``;
``kvmgr.transfer.driver`` re-exports the public names).

Offers:
    ABI_12080, ABI_13000    the two ``cuMemcpyBatchAsync`` ABIs (9 and 8 arguments)
    MemcpyAttributes        ctypes mirror of ``CUmemcpyAttributes_v1`` (24 bytes)
    access_order            ``CUmemcpySrcAccessOrder`` value for a copy direction (rule 3)
    resolve_batch_abi       which ABI to use for a driver version
    batch_or_loop           ``"batch"`` or ``"loop"`` for a requested path, ABI and stream
    cuda_python_resolver    ``cuGetProcAddress`` through ``cuda.bindings.driver``
    attrs_layout_matches    byte check of ``MemcpyAttributes`` against cuda-python's struct

Everything here is data or pure logic except the two cuda-python look-ups, which import
cuda-python only when called; ``CopyDriver`` (``kvmgr.transfer.driver``) calls through them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from kvmgr._direction import Direction

__all__ = [
    "ABI_12080",
    "ABI_13000",
    "SRC_ACCESS_ORDER_ANY",
    "SRC_ACCESS_ORDER_STREAM",
    "MemcpyAttributes",
    "Resolver",
    "access_order",
    "attrs_layout_matches",
    "batch_or_loop",
    "cuda_python_resolver",
    "resolve_batch_abi",
]

ABI_12080 = 12080  #: 9 arguments, with ``size_t *failIdx``
ABI_13000 = 13000  #: 8 arguments
_CUMEMCPYASYNC_ABI = 4000  # PFN_cuMemcpyAsync_v4000
SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
SRC_ACCESS_ORDER_ANY = 3  # CU_MEMCPY_SRC_ACCESS_ORDER_ANY
_CU_STREAM_LEGACY = 1  # CU_STREAM_LEGACY; handle 0 is the legacy default stream as well
_GET_PROC_LEGACY_STREAM = 1  # CU_GET_PROC_ADDRESS_LEGACY_STREAM
_SIZE_MAX = (1 << 64) - 1  # failIdx when the error is not tied to one copy

#: ``(symbol, cuda_version) -> function address or None``.
Resolver = Callable[[str, int], "int | None"]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]  # CUmemLocation_v1


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes_v1`` from ``cuda.h``: order, two location hints, flags; 24 bytes.

    ``tests/transfer/test_cuda_engine.py`` checks the bytes against cuda-python's own struct.
    """

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


assert ctypes.sizeof(MemcpyAttributes) == 24, "CUmemcpyAttributes_v1 must be 24 bytes"

_P = ctypes.c_void_p
_BATCH_ARGS = {
    ABI_12080: (_P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P, _P),
    ABI_13000: (_P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P),
}


def access_order(direction: Direction) -> int:
    """Source access order for a direction: STREAM for D2H, ANY only for H2D (rule 3)."""
    return SRC_ACCESS_ORDER_STREAM if direction is Direction.D2H else SRC_ACCESS_ORDER_ANY


def resolve_batch_abi(driver_version: int, resolver: Resolver) -> tuple[int, int] | None:
    """Pick the ``cuMemcpyBatchAsync`` ABI: the newest one the driver supports and grants.

    Only versions ``<= driver_version`` are requested, so the granted entry point always has the
    signature of the requested version.

    Args:
        driver_version: ``cuDriverGetVersion()``, e.g. ``13000``.
        resolver: looks up ``(symbol, version)``; returns the address or ``None``.

    Returns:
        ``(abi_version, address)``, or ``None`` when no ABI is available.
    """
    for version in (ABI_13000, ABI_12080):
        if driver_version >= version:
            address = resolver("cuMemcpyBatchAsync", version)
            if address:
                return version, int(address)
    return None


def batch_or_loop(requested: str, batch_abi: int | None, stream_handle: int) -> str:
    """``"batch"`` only when asked for, resolved, and not on the legacy default stream (rule 1)."""
    if (
        requested == "batch"
        and batch_abi is not None
        and stream_handle not in (0, _CU_STREAM_LEGACY)
    ):
        return "batch"
    return "loop"


def cuda_python_resolver(symbol: str, version: int) -> int | None:
    """``cuGetProcAddress(symbol, version, LEGACY_STREAM)`` through cuda-python.

    Returns:
        The function address, or ``None`` if the symbol or version is not available.

    Raises:
        RuntimeError: no CUDA driver could be loaded (cuda-python's ``DynamicLibNotFoundError``).
    """
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    if err != cu.CUresult.CUDA_SUCCESS:
        return None
    err, pfn, status = cu.cuGetProcAddress(symbol.encode(), version, _GET_PROC_LEGACY_STREAM)
    ok = cu.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS
    if err != cu.CUresult.CUDA_SUCCESS or status != ok or not pfn:
        return None
    return int(pfn)


def attrs_layout_matches() -> bool | None:
    """Whether ``MemcpyAttributes`` has the bytes of cuda-python's ``CUmemcpyAttributes``.

    Needs no driver. Returns ``None`` when cuda-python is not installed.
    """
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    theirs = cu.CUmemcpyAttributes()
    theirs.srcAccessOrder = cu.CUmemcpySrcAccessOrder(SRC_ACCESS_ORDER_STREAM)
    theirs.srcLocHint.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    theirs.srcLocHint.id = 0x5A
    theirs.dstLocHint.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
    theirs.dstLocHint.id = 0x3C
    theirs.flags = 0x0BADF00D
    ours = MemcpyAttributes(
        SRC_ACCESS_ORDER_STREAM,
        _MemLocation(int(theirs.srcLocHint.type), 0x5A),
        _MemLocation(int(theirs.dstLocHint.type), 0x3C),
        0x0BADF00D,
    )
    size = ctypes.sizeof(MemcpyAttributes)
    return ctypes.string_at(theirs.getPtr(), size) == ctypes.string_at(ctypes.addressof(ours), size)


def _driver_version() -> int:
    from cuda.bindings import driver as cu

    err, version = cu.cuDriverGetVersion()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuDriverGetVersion failed: {err}")
    return int(version)


def _error_name(code: int) -> str:
    try:
        from cuda.bindings import driver as cu

        return f"{cu.CUresult(code).name} ({code})"
    except (ImportError, ValueError):
        return f"CUresult {code}"


def _make_attrs(order: int) -> MemcpyAttributes:
    attrs = MemcpyAttributes()  # zeroed: no location hints, no flags
    attrs.srcAccessOrder = order
    return attrs
