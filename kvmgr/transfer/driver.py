"""CUDA driver entry points for page copies, resolved at run time (docs/transfer.md, rule 1).

Offers:
    CopyDriver          the resolved entry points; one batched copy (two call paths) or a per-copy loop
    resolve_batch_abi   which ``cuMemcpyBatchAsync`` ABI to use for a driver version (pure logic)
    batch_or_loop       ``"batch"`` or ``"loop"`` for a requested path, ABI and stream (pure logic)
    access_order        ``CUmemcpySrcAccessOrder`` value for a copy direction (rule 3)
    MemcpyAttributes    ctypes mirror of ``CUmemcpyAttributes_v1`` (24 bytes)
    attrs_layout_matches    byte check of ``MemcpyAttributes`` against cuda-python's struct
    cuda_python_resolver    ``cuGetProcAddress`` through ``cuda.bindings.driver``

``cuMemcpyBatchAsync`` has two ABIs: CUDA 12.8 (``cuGetProcAddress(..., 12080)``) takes nine
arguments with ``size_t *failIdx`` before the stream; CUDA 13.0 (``13000``) dropped ``failIdx`` and
takes eight. The version is never taken from headers: the highest ABI not newer than the driver is
requested explicitly and the call signature follows the version that was granted.

Two call paths reach the batched copy:

- ``"ctypes"``: the resolved function pointer called through ctypes with the plan's int64 numpy
  buffers (no Python object per page). This is the default: on the H200 it measured 2.5 ms for
  3,072 descriptors against 2.2 ms + 3.1 ms for building ``CUdeviceptr`` lists and calling the
  cuda-python binding (BENCHMARKS.md); ``kvmgr bench swap`` records both.
- ``"lists"``: ``cuda.bindings.driver.cuMemcpyBatchAsync`` with Python lists, kept for comparison.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmgr.errors import TransferError
from kvmgr.transfer.plan import Direction

__all__ = [
    "ABI_12080",
    "ABI_13000",
    "SRC_ACCESS_ORDER_ANY",
    "SRC_ACCESS_ORDER_STREAM",
    "CopyDriver",
    "MemcpyAttributes",
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


class CopyDriver:
    """Resolved copy entry points for the calling process.

    Args:
        resolver: symbol lookup; ``cuda_python_resolver`` by default.
        driver_version: CUDA version of the driver; queried through cuda-python by default.
        binding: module providing ``cuMemcpyBatchAsync``/``CUdeviceptr``/``CUmemcpyAttributes``
            for the ``"lists"`` path; ``cuda.bindings.driver`` by default (imported lazily).

    Attributes:
        batch_abi: ``12080``, ``13000`` or ``None`` (batched copy unavailable).
        driver_version: as given or queried.

    Raises:
        RuntimeError: no CUDA driver (only when ``driver_version`` or ``resolver`` are defaults).
    """

    def __init__(
        self,
        resolver: Resolver | None = None,
        driver_version: int | None = None,
        binding: Any = None,
    ) -> None:
        resolver = resolver or cuda_python_resolver
        self.driver_version = _driver_version() if driver_version is None else driver_version
        self._binding = binding
        found = resolve_batch_abi(self.driver_version, resolver)
        self.batch_abi: int | None = None
        self._batch_fn: Any = None
        if found is not None:
            self.batch_abi, address = found
            proto = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_ARGS[self.batch_abi])
            self._batch_fn = proto(address)
        loop_address = resolver("cuMemcpyAsync", _CUMEMCPYASYNC_ABI)
        self._loop_fn: Any = None
        if loop_address:
            proto = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, ctypes.c_size_t, _P)
            self._loop_fn = proto(int(loop_address))
        self._attrs = {order: _make_attrs(order) for order in (1, 3)}
        self._attrs_addrs = {order: ctypes.addressof(a) for order, a in self._attrs.items()}
        self._attrs_idx = np.zeros(1, dtype=np.uint64)  # attrsIdxs = [0]: one entry (rule 2)
        self._attrs_idx_addr = self._attrs_idx.ctypes.data
        self._fail_idx = ctypes.c_size_t(_SIZE_MAX)  # 12.8 ABI's failIdx, reused by every call
        self._fail_idx_addr = ctypes.addressof(self._fail_idx)

    # -- public ---------------------------------------------------------------------------------

    def copy(
        self,
        requested: str,
        dsts: np.ndarray,
        srcs: np.ndarray,
        sizes: np.ndarray,
        stream_handle: int,
        order: int,
        *,
        call: str = "ctypes",
    ) -> str:
        """Enqueue ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for all ``i`` on a stream.

        Args:
            requested: ``"batch"`` or ``"loop"``; ``"batch"`` falls back to the loop when the entry
                point is missing or the stream is the legacy default stream.
            dsts, srcs, sizes: int64 ``[n]``, C-contiguous; kept alive by the caller until the
                stream has passed the copies (rule 7).
            stream_handle: raw ``CUstream`` value (``torch.cuda.Stream.cuda_stream``).
            order: ``SRC_ACCESS_ORDER_STREAM`` or ``SRC_ACCESS_ORDER_ANY`` (see ``access_order``).
            call: batched call path, ``"ctypes"`` or ``"lists"``.

        Returns:
            The path used, ``"batch"`` or ``"loop"``.

        Raises:
            TransferError: the driver refused a call; ``fail_index`` is the failing copy's index
                when known (12.8 ABI ``failIdx``, or the loop position).
        """
        path = batch_or_loop(requested, self.batch_abi, stream_handle)
        if len(sizes) == 0:
            return path
        if path == "loop":
            self.loop(dsts, srcs, sizes, stream_handle)
        elif call == "lists":
            self.batch_lists(dsts, srcs, sizes, stream_handle, order)
        else:
            self.batch_ctypes(dsts, srcs, sizes, stream_handle, order)
        return path

    def batch_ctypes(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_handle: int, order: int
    ) -> None:
        """One ``cuMemcpyBatchAsync`` through the resolved pointer, with the numpy buffers.

        Raises:
            TransferError: no batched entry point, or the driver refused the call.
        """
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.int64) for a in (dsts, srcs, sizes))
        self.batch_at(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
                      stream_handle, order)  # fmt: skip

    def batch_at(
        self, dsts: int, srcs: int, sizes: int, count: int, stream_handle: int, order: int
    ) -> None:
        """One ``cuMemcpyBatchAsync`` over ``count`` descriptors given as the addresses of three
        C-contiguous 8-byte integer arrays (the engines' hot path: no array is built per call).

        Raises:
            TransferError: no batched entry point, or the driver refused the call.
        """
        if self._batch_fn is None:
            raise TransferError("cuMemcpyBatchAsync is not available on this driver")
        attrs_addr = self._attrs_addrs.get(order)
        if attrs_addr is None:
            self._attrs[order] = _make_attrs(order)
            attrs_addr = self._attrs_addrs[order] = ctypes.addressof(self._attrs[order])
        # numAttrs = 1: one attribute entry for the whole batch (rule 2)
        if self.batch_abi == ABI_12080:
            self._fail_idx.value = _SIZE_MAX
            code = self._batch_fn(dsts, srcs, sizes, count, attrs_addr, self._attrs_idx_addr, 1,
                                  self._fail_idx_addr, stream_handle)  # fmt: skip
            failed = self._fail_idx.value
            failed_at = None if failed == _SIZE_MAX else int(failed)
        else:
            code = self._batch_fn(dsts, srcs, sizes, count, attrs_addr, self._attrs_idx_addr, 1,
                                  stream_handle)  # fmt: skip
            failed_at = None
        if code != 0:
            raise TransferError(
                f"cuMemcpyBatchAsync (ABI {self.batch_abi}, {count} copies) failed: "
                f"{_error_name(code)}",
                fail_index=failed_at,
            )

    def memcpy(self, dst: int, src: int, num_bytes: int, stream_handle: int) -> None:
        """One ``cuMemcpyAsync`` of ``num_bytes`` on a stream (the copy kernel's table upload).

        Raises:
            TransferError: the driver refused the copy.
        """
        if self._loop_fn is None:
            one = np.array([dst, src, num_bytes], dtype=np.int64)
            self.loop(one[0:1], one[1:2], one[2:3], stream_handle)
            return
        code = self._loop_fn(dst, src, num_bytes, stream_handle)
        if code != 0:
            raise TransferError(f"cuMemcpyAsync ({num_bytes} B) failed: {_error_name(code)}")

    def batch_lists(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_handle: int, order: int
    ) -> None:
        """One ``cuMemcpyBatchAsync`` through cuda-python's binding, with Python lists.

        Raises:
            TransferError: the driver refused the call.
        """
        cu = self._binding_module()
        attrs = cu.CUmemcpyAttributes()
        attrs.srcAccessOrder = cu.CUmemcpySrcAccessOrder(order)
        result = cu.cuMemcpyBatchAsync(
            [cu.CUdeviceptr(a) for a in np.asarray(dsts).tolist()],
            [cu.CUdeviceptr(a) for a in np.asarray(srcs).tolist()],
            np.asarray(sizes).tolist(),
            len(sizes),
            [attrs],
            [0],
            1,
            stream_handle,
        )
        result = result if isinstance(result, tuple) else (result,)  # (err,) on 13.x
        code = int(result[0])
        if code != 0:
            failed_at = int(result[1]) if len(result) > 1 and result[1] is not None else None
            raise TransferError(
                f"cuMemcpyBatchAsync (cuda-python, {len(sizes)} copies) failed: "
                f"{_error_name(code)}",
                fail_index=None if failed_at == _SIZE_MAX else failed_at,
            )

    def loop(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_handle: int
    ) -> None:
        """One ``cuMemcpyAsync`` per descriptor (the fallback and the benchmark baseline).

        Raises:
            TransferError: a copy was refused; ``fail_index`` is its position (earlier ones are
                already enqueued).
        """
        if self._loop_fn is not None:
            fn = self._loop_fn
        else:
            cu = self._binding_module()

            def fn(dst: int, src: int, size: int, stream: int) -> int:
                return int(cu.cuMemcpyAsync(dst, src, size, stream)[0])

        for i, (dst, src, size) in enumerate(
            zip(np.asarray(dsts).tolist(), np.asarray(srcs).tolist(), np.asarray(sizes).tolist())
        ):
            code = fn(dst, src, size, stream_handle)
            if code != 0:
                raise TransferError(
                    f"cuMemcpyAsync of copy {i} ({size} B) failed: {_error_name(code)}",
                    fail_index=i,
                )

    def _binding_module(self) -> Any:
        if self._binding is None:
            from cuda.bindings import driver

            self._binding = driver
        return self._binding


def _make_attrs(order: int) -> MemcpyAttributes:
    attrs = MemcpyAttributes()  # zeroed: no location hints, no flags
    attrs.srcAccessOrder = order
    return attrs
