"""The transfer-engine protocol: plan in, handle out, completion reported off the event loop.

Offers:
    TransferEngine      abstract base every engine implements (host, CUDA batch, copy kernel)
    BatchHandle         one submitted batch: its id, direction and a concurrent future
    BatchResult         what a completed batch reports: bytes, descriptors, device seconds, path
    EngineStatistics    totals since the engine was created

An engine never blocks the caller on the copy: ``submit`` enqueues the plan (on a CUDA stream or
a worker thread) and returns at once. Completion is detected off the event loop and resolves
``BatchHandle.future`` (a ``concurrent.futures.Future``), in submission order per direction; the
manager bridges it to asyncio with ``call_soon_threadsafe``. A failed batch resolves its future
with ``TransferError``.
"""

from __future__ import annotations

import abc
import concurrent.futures
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from kvmgr.errors import TransferError
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = [
    "BatchHandle", "BatchResult", "BatchTotals", "EngineStatistics", "TransferEngine",
    "check_orderable",
]  # fmt: skip


@attrs.frozen(kw_only=True)
class BatchResult:
    """A completed batch.

    Attributes:
        batch_id: engine-wide sequence number, in submission order.
        direction: D2H or H2D.
        num_bytes: bytes copied.
        num_descriptors: descriptors submitted (after merging, summed over split chunks).
        device_s: seconds the batch ran on the device, from its start (the later of its compute
            fence and the previous batch's end on its copy stream, or the start recorded after
            its ``wait_for`` waits) to its end event; or the worker thread's copy time for the
            host engine; ``None`` if not measured.
        path: how it was copied: ``"host"``, ``"batch"`` (cuMemcpyBatchAsync), ``"loop"``
            (per-copy cuMemcpyAsync), ``"kernel"`` (SM copy kernel) or ``"staged"`` (a device
            staging buffer and few DMA descriptors, ``kvmgr.transfer.staged``).
    """

    batch_id: int
    direction: Direction
    num_bytes: int
    num_descriptors: int
    device_s: float | None
    path: str


@attrs.define(eq=False)
class BatchHandle:
    """One submitted batch.

    Attributes:
        batch_id: engine-wide sequence number.
        direction: D2H or H2D.
        future: resolves to ``BatchResult``, or fails with ``TransferError``; resolved from an
            engine thread, never from the caller's.
        end_event: engine-specific completion marker (a CUDA event), or ``None``.
        refused: the error of a copy the engine refused while issuing (known at submit; the
            future fails with it once the copies enqueued before it ended), else ``None``.
        member_ids: for a handle that joins several engine batches (a layerwise load or
            store, ``kvmgr.transfer.layerwise.LayerBatches``), their batch ids; else ``None``.
        submitting: a joined handle whose operation may still submit batches (a layerwise
            store whose layers are not all saved): no batch can be ordered after it, on any
            engine (the host engine's FIFO thread has not seen the later batches either).
    """

    batch_id: int
    direction: Direction
    future: concurrent.futures.Future[BatchResult]
    end_event: Any = None
    refused: Any = None
    member_ids: list[int] | None = None
    submitting: bool = False

    def done(self) -> bool:
        """Whether the copy has completed (successfully or not)."""
        return self.future.done()


def check_orderable(wait_for: Sequence[BatchHandle], direction: Direction) -> None:
    """Check that a batch of ``direction`` can be ordered after every handle of ``wait_for``.

    Raises:
        TransferError: a handle is still ``submitting`` (a layerwise store whose layers are
            not all saved): no engine can run a batch after copies not yet submitted (the host
            engine's FIFO thread would run it at once, before the store read its blocks).
    """
    if any(h.submitting for h in wait_for):
        raise TransferError(
            f"the {direction.value} job touches GPU blocks of a batch still being submitted (a "
            "layerwise store whose layers are not all saved): it cannot be ordered after it; "
            "save the store's layers (or abort it) first"
        )


@attrs.define(kw_only=True)
class BatchTotals:
    """The batch counters every engine keeps, declared once: ``EngineStatistics`` freezes and
    documents them, ``kvmgr.transfer.streams.CopyCounters`` updates them."""

    batches_submitted: int = 0
    batches_completed: int = 0
    batches_failed: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    device_s_d2h: float = 0.0
    device_s_h2d: float = 0.0
    in_flight: int = 0


@attrs.frozen(kw_only=True)
class EngineStatistics(BatchTotals):
    """Totals since the engine was created (counters only grow).

    Attributes:
        batches_submitted / batches_completed / batches_failed: batch counts.
        bytes_d2h / bytes_h2d: bytes of completed batches per direction.
        device_s_d2h / device_s_h2d: summed device seconds of completed batches.
        in_flight: batches submitted and not yet completed.
        path: the copy path in use (``"host"``, ``"batch"``, ``"loop"``, ``"kernel"``, ``"auto"``).
    """

    path: str = ""


class TransferEngine(abc.ABC):
    """Moves the pages a plan describes between the GPU tier and the CPU tier.

    Subclasses implement ``allocate_host``, ``submit``, ``close`` and ``statistics``. An engine
    serves one manager; it is not thread-safe and is driven from the event-loop thread.
    """

    name: str = "abstract"

    #: Largest number of descriptors one submitted chunk may hold (docs/transfer.md, rule 6).
    max_descriptors: int = 1 << 16

    @abc.abstractmethod
    def allocate_host(self, num_bytes: int) -> torch.Tensor:
        """Allocate the CPU tier: one ``uint8`` CPU tensor of ``num_bytes`` (pinned where the
        engine copies with DMA).

        Raises:
            TransferError: the memory could not be allocated or registered.
        """

    @abc.abstractmethod
    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        """Enqueue the plan's copies and return at once.

        Args:
            plan: the descriptors; the engine keeps its arrays alive until the batch has ended.
            wait_for: batches that must complete before this one starts (ordering between
                directions, e.g. a load into a GPU block that a store is still reading).

        Raises:
            ClosedError: the engine is closed.
        """

    @abc.abstractmethod
    def close(self, timeout_s: float | None = None) -> None:
        """Wait (up to ``timeout_s`` seconds; forever if ``None``) for batches in flight, then
        release threads, streams and registered memory. Idempotent."""

    @abc.abstractmethod
    def statistics(self) -> EngineStatistics:
        """Totals since creation."""

    def stream_wait(self, handle: BatchHandle, stream: Any = None) -> None:
        """Make ``stream`` (the current stream if ``None``) wait for the batch on the device,
        without blocking the host. Engines without device streams do nothing."""
        del handle, stream
