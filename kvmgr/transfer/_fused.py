"""A steady DMA batch in one C call: fence, wait, start, ``cuMemcpyBatchAsync``, end (private to
``kvmgr.transfer``).

Offers:
    FusedBatch  ``issue(plan, fence, current, copy, start, end)``: what ``CopyStreams.submit``
                does around ``DmaCopy.issue`` for a one-call plan (record the fence on the
                current stream, make the copy stream wait on it, record the start event, the
                batched copy, record the end event), the driver's entry points called in that
                order from one C call (``driver_call.native_fenced_batch``), the GIL released
                once; None where that plan or its events do not qualify (nothing done then)

Exactness: the same driver calls with the same arguments in the same order as the one-by-one
path (``DriverEvents.record`` / ``wait``, ``CopyDriver.batch_at``). A refused step ends the C
call there; the rest goes one by one as that path would: a ``CUDA_ERROR_INVALID_CONTEXT`` on an
event call is retried by torch's call (``DriverEvents``), any other refused event call raises its
``RuntimeError`` (before the copy: its buffer back to the pool, nothing read it), a refused copy
becomes ``Issued.error`` with ``batch_at``'s message and ``fail_index``, and the end event is
still recorded.
"""

from __future__ import annotations

from typing import Any

from kvmgr.errors import TransferError
from kvmgr.transfer.cuda_current import DriverEvents
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver_abi import _SIZE_MAX, ABI_12080, _error_name
from kvmgr.transfer.driver_call import native_fenced_batch
from kvmgr.transfer.issued import Issued
from kvmgr.transfer.plan import TransferPlan

__all__ = ["FusedBatch"]

_WORD = 8  # bytes per descriptor entry
_NO_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


class FusedBatch:
    """One C call per steady batch of ``dma`` (module docstring).

    Args:
        fn: ``driver_call.native_fenced_batch()``.
        events: the streams' ``DriverEvents``.
        dma: the issuer (its driver called from C, with the batched entry point).
    """

    def __init__(self, fn: Any, events: DriverEvents, dma: DmaCopy) -> None:
        self._fn, self._events, self._dma = fn, events, dma
        driver = self._driver = dma.driver
        self._entries = (events._record_at, events._wait_at, driver._batch_address)
        self._attrs = driver._attrs_addrs  # the driver's own attribute structs, by access order
        self._idxs = driver._attrs_idx_addr
        self._fail = driver._fail_idx_addr if driver.batch_abi == ABI_12080 else 0

    @classmethod
    def make(cls, record: Any, issuer: Any) -> FusedBatch | None:
        """For ``issuer`` a ``DmaCopy`` whose driver calls from C with the batched entry point,
        and ``record`` a ``DriverEvents``' (``event_calls``); else None."""
        events = getattr(record, "__self__", None)
        fn = native_fenced_batch()
        if fn is None or not isinstance(events, DriverEvents) or type(issuer) is not DmaCopy:
            return None
        driver = issuer.driver
        if driver._call is None or not driver._batch_address or driver._batch_fn is None:
            return None
        return cls(fn, events, issuer)

    def issue(self, plan: TransferPlan, fence: Any, current: Any, copy: Any, start: Any, end: Any) -> Issued | None:  # fmt: skip
        """The five calls for ``plan`` on ``copy`` (module docstring): the ``Issued`` of the
        copy, or None (nothing done) where the plan or an event (not yet made by torch) does
        not qualify.

        Raises:
            RuntimeError: an event call was refused (as ``DriverEvents`` raises).
        """
        handles = fence.cuda_event, start.cuda_event, end.cuda_event
        if not all(handles):
            return None
        dma = self._dma
        prepared = dma.prepare(plan, copy)
        if prepared is None:
            return None
        buffer, n, order = prepared
        at, attrs = buffer.address, self._attrs.get(order)
        if attrs is None:  # an order the driver has no struct for yet: batch_at makes it
            dma.buffers.give(buffer)
            return None
        code = self._fn(*self._entries, handles[0], current.cuda_stream, copy.cuda_stream,
                        handles[1], handles[2], at + n * _WORD, at, at + 2 * n * _WORD, n, attrs,
                        self._idxs, self._fail)  # fmt: skip
        release = lambda: dma.buffers.give(buffer)  # noqa: E731  (after the end event)
        if code == 0:
            return Issued("batch", 1, 0, (), release)
        step, code = divmod(code, 65536)
        return self._resume(step, code, prepared, release, fence, current, copy, start, end)

    def _resume(self, step: int, code: int, prepared: tuple[Any, int, int], release: Any, fence: Any, current: Any, copy: Any, start: Any, end: Any) -> Issued:  # fmt: skip
        """Step ``step`` of the C call was refused with ``code`` (the earlier ones made): the
        rest one by one, as the calls one by one would go on (module docstring)."""
        buffer, n, order = prepared
        if step <= 2:  # the copy not made
            try:
                self._events._resume(step, code, fence, current, copy, start)
            except BaseException:
                self._dma.buffers.give(buffer)  # nothing enqueued reads it
                raise
            issued = self._batch(buffer.address, n, copy.cuda_stream, order, release)
        elif step == 3:
            issued = Issued("batch", 0, 0, (), release, self._refused(code, n))
        else:  # the end record refused
            if code != _NO_CONTEXT:
                raise RuntimeError(f"cuEventRecord failed: {_error_name(code)}")
            self._events._torch_record(end, copy)
            return Issued("batch", 1, 0, (), release)
        self._events.record(end, copy)
        return issued

    def _batch(self, at: int, n: int, handle: int, order: int, release: Any) -> Issued:
        """``DmaCopy.issue``'s one batched call, one by one."""
        try:
            self._driver.batch_at(at + n * _WORD, at, at + 2 * n * _WORD, n, handle, order)
        except TransferError as exc:
            return Issued("batch", 0, 0, (), release, TransferError(str(exc), fail_index=exc.fail_index))  # fmt: skip
        return Issued("batch", 1, 0, (), release)

    def _refused(self, code: int, n: int) -> TransferError:
        """``batch_at``'s error for a refused call of ``n`` copies."""
        driver = self._driver
        failed = driver._fail_idx.value if self._fail else _SIZE_MAX
        return TransferError(
            f"cuMemcpyBatchAsync (ABI {driver.batch_abi}, {n} copies) failed: {_error_name(code)}",
            fail_index=None if failed == _SIZE_MAX else int(failed),
        )
