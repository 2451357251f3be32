"""One batch's settlement on its completion thread (private to :mod:`kvmgr.transfer.streams`):
the end event's ``synchronize``, then release, counts, the future; and its ``device_s``.

Offers:
    InFlight        one batch in flight, as its completion thread gets it
    Held            the events of the last batch settled, held back from their pool
    settle          wait for one batch's end event, release what it kept, count, resolve
    device_seconds  a batch's device time from its start (fence) and end events
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any

from kvmgr.errors import TransferError
from kvmgr.transfer.engine import BatchResult
from kvmgr.transfer.issued import CopyCounters

__all__ = ["PLAN", "Held", "InFlight", "device_seconds", "settle"]

#: One batch in flight, as its completion thread gets it: ``[handle, fence (or start) event,
#: plan, issued, pool, num_bytes, num_descriptors]``: the plan is kept until the end event (rule
#: 7), ``pool`` is where the pair goes back, or None; the counts are the plan's at submit.
InFlight = list[Any]
PLAN = 2  # the plan's index in an InFlight
#: The events of the last batch a completion thread finished: ``(pool or None, fence or start,
#: end)``, held back from the pool until the next batch's timing has read its end event.
Held = tuple[Any, Any, Any] | None


def device_seconds(start: Any, end: Any, previous: Held) -> float:
    """Seconds from a batch's start to its ``end`` event: it started at the later of ``start``
    (its fence, or the start recorded after its waits) and the previous batch's end."""
    elapsed = start.elapsed_time(end)
    if previous is not None:
        elapsed = min(elapsed, previous[2].elapsed_time(end))
    return elapsed / 1e3


def settle(counters: CopyCounters, item: InFlight, previous: Held) -> Held:
    """Wait for one batch's end event, release what it kept, count it, resolve its future.

    ``previous``: the events of the batch before it on this stream (held back from their
    pool until now: its end event times this batch's start), or None. Returns this batch's
    to hold for the next one (None after a device error: its pair is dropped)."""
    handle, start, _, issued, pool, num_bytes, num_descriptors = item
    end = handle.end_event
    device_s, error = 0.0, issued.error
    try:
        end.synchronize()  # blocking-sync event: sleeps, GIL released
        if error is None:
            device_s = device_seconds(start, end, previous)
    except Exception as exc:  # an asynchronous CUDA error surfaced at the event
        error = error or TransferError(f"batch {handle.batch_id} failed on the device: {exc}")
    if previous is not None and previous[0] is not None:
        previous[0].append((previous[1], previous[2]))  # its future resolved long ago
    # The copies have ended: arrays and tables may go, buffers be reused (rule 7).
    item[PLAN] = None  # the plan may go before the future resolves
    release = issued.release
    issued.keep_alive, issued.release = (), None
    if release is not None:
        release()
    counters.count_done(handle.direction, num_bytes, device_s, error is not None)
    # A cancelled future raises InvalidStateError: nobody is left to tell.
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            handle.future.set_exception(error)
        else:
            handle.future.set_result(
                BatchResult(
                    batch_id=handle.batch_id,
                    direction=handle.direction,
                    num_bytes=num_bytes,
                    num_descriptors=num_descriptors,
                    device_s=device_s,
                    path=issued.path,
                )
            )
    return (pool, start, end) if error is issued.error else None  # not after a device error
