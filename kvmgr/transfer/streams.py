"""Streams, events and completion shared by the CUDA engines.

Offers:
    CopyStreams     per-direction copy streams, compute fences, end events and FIFO
                    completion threads around an issuer's work (``kvmgr.transfer.issued``'s
                    names are re-exported)

Ordering (docs/transfer.md): each direction has its own non-default copy stream, H2D at higher
priority. Before a batch, its copy stream waits on an event recorded on the compute stream (rules
3, 4) and on the end events of ``wait_for`` batches; an end event follows the issuer's copies.
Batches of one direction therefore run and complete in FIFO order.

Events per batch: ``(fence, end)``, both timing events; no start record on the copy stream (an
event call cost 3-4 us in the step on the H200 host) unless the batch waits for ``wait_for``
batches not yet done: then the fence event is recorded again on the copy stream after those
waits (a wait takes an event's state at its call). A batch starts when its fence is reached and
the previous batch of its stream has ended, so ``device_s`` is the smaller of fence -> end and
previous end -> end; the completion thread holds each pair back from the pool until the next
batch of its direction was timed (work put on ``stream(direction)`` by a caller counts too).

Completion: one thread per direction sleeps in ``end_event.synchronize()`` (blocking-sync events,
no polling, GIL released) for each batch in submission order, then drops what the issuer asked to
keep alive (rule 7), hands its reusable buffers back, updates the totals, resolves the future and
makes a spare one for a later submit (a ``Future`` costs ~15 us of a cold step).

Host cost. With torch's own CUDA events (not a CPU test's stand-in) a submit takes its fence/end
events from a per-direction pool instead of creating two (a new event with its first record cost
3.7-4.0 us on the H200 host, a record of an existing one 1.7 us) and records the compute fence
on the current stream's ``torch.cuda.Stream``, rebuilt only when the raw current-stream handle
changes (``Event.record()`` without a stream builds one per call: 9.0 against 2.6 us on the H200
host, BENCHMARKS.md round 4 session 7); the fence and end records and the fence's wait
go to the driver's ``cuEventRecord`` / ``cuStreamWaitEvent`` from C where that builds, else to
torch's C methods past their Python wrappers (``cuda_current.event_calls``; the same calls
through ctypes measured slower, 5.7-8.1 us each: BENCHMARKS.md, round 3). A pair goes back
to the pool after its batch's future resolved and the next batch was timed (never after a device
error), so a handle's ``end_event`` may later mark a newer batch of the same direction: waits are
only issued for handles whose future has not resolved, and a wait on a re-recorded event waits
for a later batch of the same FIFO stream, never for less.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvmgr.errors import TransferError, TransferTimeoutError
from kvmgr.transfer._settle import Held as _Held
from kvmgr.transfer._settle import InFlight as _InFlight
from kvmgr.transfer._settle import settle
from kvmgr.transfer.cuda_current import CurrentStream, device_check, event_calls
from kvmgr.transfer.cuda_current import real_cuda_events as _real_cuda_events  # tests patch it
from kvmgr.transfer.engine import BatchHandle, BatchResult
from kvmgr.transfer.issued import CopyCounters, CopyIssuer, Issued, StreamTotals
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["CopyCounters", "CopyIssuer", "CopyStreams", "Issued", "StreamTotals"]

_PRIORITIES = {"high": -1, "normal": 0}  # lower is higher; torch clamps to the device's range
_SPARE_FUTURES = 4  # futures the completion threads make ahead for the next submits


class CopyStreams:
    """Per-direction copy streams with fences, events and FIFO completion.

    Args:
        device: the CUDA device.
        compute_stream: stream the copies are ordered after (and ``stream_wait`` targets by
            default); the current stream at each submit if ``None``.
        h2d_priority: ``"high"`` or ``"normal"`` priority for the load stream.
        name: thread name prefix.

    Attributes:
        counters: the engine's totals.
    """

    def __init__(self, device: torch.device, compute_stream: Any = None, *, h2d_priority: str = "high", name: str = "cuda") -> None:  # fmt: skip
        self._device = device
        self._current = CurrentStream(device)
        self._compute_stream = compute_stream
        same = compute_stream is None or getattr(compute_stream, "device", None) == device
        # another (or an unknown) device's fence cannot time a copy here: own fences, starts
        self._fences = None if same else {d: torch.cuda.Event() for d in Direction}
        self._streams = {
            Direction.D2H: torch.cuda.Stream(device, priority=_PRIORITIES["normal"]),
            Direction.H2D: torch.cuda.Stream(device, priority=_PRIORITIES[h2d_priority]),
        }
        # Real CUDA events are pooled (a fake torch.cuda in CPU tests gets a fresh pair per batch)
        self._pooled = _real_cuda_events()
        self._record, self._wait = event_calls(self._pooled)  # on its own streams, events
        self._is_current = device_check(device, self._pooled)  # no switch needed?
        self._pools: dict[Direction, list[tuple[Any, Any]]] = {d: [] for d in Direction}
        self.counters = CopyCounters()
        self._spare_futures: list[concurrent.futures.Future[BatchResult]] = []
        self._next_batch_id = 0
        self._queues: dict[Direction, queue.SimpleQueue[_InFlight | None]] = {
            d: queue.SimpleQueue() for d in Direction
        }
        done = self._complete_in_order
        self._threads = [threading.Thread(target=done, args=(self._queues[d],), name=f"kvmgr-{name}-{d.value}-done", daemon=True) for d in Direction]  # fmt: skip
        for thread in self._threads:
            thread.start()
        self._stopped = False

    def stream(self, direction: Direction) -> Any:
        """The copy stream of a direction."""
        return self._streams[direction]

    def submit(self, plan: TransferPlan, issuer: CopyIssuer, wait_for: Sequence[BatchHandle], entered: float, _guarded: bool = False) -> BatchHandle:  # fmt: skip
        """Fence, ``issuer.issue(plan, stream)``, end event, queue the completion.

        ``entered`` is the ``perf_counter`` at which the engine's ``submit`` began (for
        ``submit_s``). Returns at once; the handle's future resolves on the completion thread.
        On another current device it runs again under ``torch.cuda.device`` (``_guarded``).
        """
        if not _guarded and not self._is_current():
            with torch.cuda.device(self._device):
                return self.submit(plan, issuer, wait_for, entered, True)
        direction = plan.direction
        stream = self._streams[direction]
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        pooled = self._pooled
        pool = self._pools[direction] if pooled else None
        events = pool.pop() if pool else self._new_pair()
        record, wait = self._record, self._wait
        fences = self._fences  # the batch's fence is its start, unless it waits for others
        fence = events[0] if fences is None else fences[direction]
        if self._compute_stream is not None:
            fence.record(self._compute_stream)
        elif pooled:  # torch's events: the current stream's object, built once per stream
            record(fence, self._current.current())
        else:
            fence.record(torch.cuda.current_stream(self._device))
        wait(fence, stream)
        if (wait_for and self._wait_for(wait_for, stream)) or fences is not None:
            record(events[0], stream)  # the start, after the waits (they are made already)
        issued_at = time.perf_counter()
        issued = issuer.issue(plan, stream)
        issue_s = time.perf_counter() - issued_at
        record(events[1], stream)
        return self._queue(plan, issued, entered, issue_s, direction, batch_id, events, pool)

    def _wait_for(self, wait_for: Sequence[BatchHandle], stream: Any) -> bool:
        """Make ``stream`` wait for the end events of the ``wait_for`` batches not yet done;
        whether it waits for any."""
        waited, pooled = False, self._pooled
        for other in wait_for:
            if other.end_event is not None and not (pooled and other.future.done()):
                stream.wait_event(other.end_event)
                waited = True
        return waited

    @staticmethod
    def _new_pair() -> tuple[Any, Any]:
        """A (fence or start, end) pair of timing events, the end one blocking-sync."""
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=True)  # fmt: skip

    def _queue(self, plan: TransferPlan, issued: Issued, entered: float, issue_s: float, direction: Direction, batch_id: int, events: tuple[Any, Any], pool: list[tuple[Any, Any]] | None) -> BatchHandle:  # fmt: skip
        """Count the submitted batch and hand it to its direction's completion thread."""
        if issued.error is not None:
            issued.error = TransferError(
                f"batch {batch_id}: {issued.error}", fail_index=issued.error.fail_index
            )
        start, end = events
        spares = self._spare_futures  # made on the completion threads, off this path
        future = spares.pop() if spares else concurrent.futures.Future()
        handle = BatchHandle(batch_id, direction, future, end, issued.error)
        item = [handle, start, plan, issued, pool, plan.num_bytes, plan.num_descriptors]
        counters = self.counters
        with counters.lock:  # counted before the completion thread can see the batch
            counters.batches_submitted += 1
            counters.in_flight += 1
            counters.chunks_submitted += issued.num_chunks
            if issued.num_fallbacks:
                counters.loop_fallbacks += issued.num_fallbacks
            if issued.path == "kernel":
                counters.kernel_batches += 1
            else:
                counters.dma_batches += 1
            counters.issue_s += issue_s
            counters.submit_s += time.perf_counter() - entered
        self._queues[direction].put(item)
        return handle

    def stream_wait(self, handle: BatchHandle, stream: Any = None) -> None:
        """Make ``stream`` (the compute stream, else the current one) wait for the batch's end
        event on the device; the host does not block (rule 4)."""
        if handle.end_event is None or (self._pooled and handle.future.done()):
            return  # (a done batch's pooled event may mark a newer batch: nothing to wait for)
        if stream is None:
            stream = self._compute_stream or torch.cuda.current_stream(self._device)
        stream.wait_event(handle.end_event)

    def stop(self) -> None:
        """Stop accepting batches: the threads finish what is queued, then exit. Idempotent."""
        if not self._stopped:
            self._stopped = True
            for q in self._queues.values():
                q.put(None)

    def join(self, timeout_s: float | None) -> None:
        """Wait for the completion threads (after ``stop``).

        Raises:
            TransferTimeoutError: batches were still in flight after ``timeout_s`` seconds.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in self._threads):
            raise TransferTimeoutError(
                f"{self.counters.in_flight} batches still in flight after {timeout_s} s"
            )

    def _complete_in_order(self, inbox: queue.SimpleQueue[_InFlight | None]) -> None:
        """Completion thread of one direction: one event synchronize per batch, FIFO."""
        spares = self._spare_futures
        previous: _Held = None
        while (item := inbox.get()) is not None:
            previous = settle(self.counters, item, previous)
            if len(spares) < _SPARE_FUTURES:
                spares.append(concurrent.futures.Future())
