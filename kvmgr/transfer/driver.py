"""CUDA driver entry points for page copies, resolved at run time (docs/transfer.md, rule 1).

Offers:
    CopyDriver          the resolved entry points; one batched copy (two call paths) or a per-copy loop
    (re-exported from ``kvmgr.transfer.driver_abi``: the ABI constants, ``MemcpyAttributes``,
    ``access_order``, ``resolve_batch_abi``, ``batch_or_loop``, ``cuda_python_resolver``,
    ``attrs_layout_matches``)

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

The ``"ctypes"`` path and ``memcpy`` call the entry points from C where
:mod:`kvmgr.transfer.driver_call` builds (no ctypes argument conversion: 10-13 against 40-47 us
a call with the caches cold on the 2-core CPU machine), else through ctypes; the same call.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvmgr.errors import TransferError
from kvmgr.transfer.driver_abi import (
    _BATCH_ARGS,
    _CUMEMCPYASYNC_ABI,
    _P,
    _SIZE_MAX,
    ABI_12080,
    ABI_13000,
    SRC_ACCESS_ORDER_ANY,
    SRC_ACCESS_ORDER_STREAM,
    MemcpyAttributes,
    Resolver,
    _driver_version,
    _error_name,
    _make_attrs,
    access_order,
    attrs_layout_matches,
    batch_or_loop,
    cuda_python_resolver,
    resolve_batch_abi,
)
from kvmgr.transfer.driver_call import native_call

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


class CopyDriver:
    """Resolved copy entry points for the calling process.

    Args:
        resolver: symbol lookup; ``cuda_python_resolver`` by default.
        driver_version: CUDA version of the driver; queried through cuda-python by default.
        binding: module providing ``cuMemcpyBatchAsync``/``CUdeviceptr``/``CUmemcpyAttributes``
            for the ``"lists"`` path; ``cuda.bindings.driver`` by default (imported lazily).
        from_c: call the batched copy and ``memcpy`` from C where ``driver_call`` builds
            (``False``: always through ctypes).

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
        *,
        from_c: bool = True,
    ) -> None:
        resolver = resolver or cuda_python_resolver
        self.driver_version = _driver_version() if driver_version is None else driver_version
        self._binding = binding
        found = resolve_batch_abi(self.driver_version, resolver)
        self.batch_abi: int | None = None
        self._batch_fn: Any = None
        self._batch_address = 0
        if found is not None:
            self.batch_abi, self._batch_address = found
            proto = ctypes.CFUNCTYPE(ctypes.c_int, *_BATCH_ARGS[self.batch_abi])
            self._batch_fn = proto(self._batch_address)
        loop_address = resolver("cuMemcpyAsync", _CUMEMCPYASYNC_ABI)
        self._loop_fn: Any = None
        self._loop_address = int(loop_address) if loop_address else 0
        if loop_address:
            proto = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, ctypes.c_size_t, _P)
            self._loop_fn = proto(self._loop_address)
        self._call = native_call() if from_c else None  # call(entry, *args), or None: ctypes
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
        call, fn = self._call, self._batch_fn
        if self.batch_abi == ABI_12080:
            self._fail_idx.value = _SIZE_MAX
            args = (dsts, srcs, sizes, count, attrs_addr, self._attrs_idx_addr, 1,
                    self._fail_idx_addr, stream_handle)  # fmt: skip
            code = fn(*args) if call is None else call(self._batch_address, *args)
            failed = self._fail_idx.value
            failed_at = None if failed == _SIZE_MAX else int(failed)
        else:
            args = (dsts, srcs, sizes, count, attrs_addr, self._attrs_idx_addr, 1, stream_handle)
            code = fn(*args) if call is None else call(self._batch_address, *args)
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
        if self._call is None:
            code = self._loop_fn(dst, src, num_bytes, stream_handle)
        else:
            code = self._call(self._loop_address, dst, src, num_bytes, stream_handle)
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
