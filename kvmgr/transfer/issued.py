"""What an issuer hands back for one plan, the issuer protocol, and an engine's running totals.

Offers:
    Issued          what one ``issue(plan, stream)`` call enqueued: path, chunks, keep-alive, error
    CopyIssuer      the protocol of ``issue``: ``DmaCopy`` (dma.py), ``KernelCopy`` (kernel.py),
                    ``ChoiceCopy`` (auto.py)
    StreamTotals    the counters the streams add to ``BatchTotals`` (declared once)
    CopyCounters    the one set of running totals of an engine (thread-safe updates)

``kvmgr.transfer.streams`` (the streams, events and completion threads around an issuer) uses
them and re-exports them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from kvmgr.errors import TransferError
from kvmgr.transfer.engine import BatchTotals
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["CopyCounters", "CopyIssuer", "Issued", "StreamTotals"]


@attrs.define(eq=False)
class Issued:
    """What an issuer enqueued for one plan.

    Attributes:
        path: ``"batch"``, ``"loop"`` or ``"kernel"``: reported as ``BatchResult.path``.
        num_chunks: driver calls or launches made.
        num_fallbacks: chunks the driver copied with the per-copy loop instead of the batch.
        keep_alive: objects the device may still read (pointer arrays, tables) until the end event.
        release: called once on the completion thread after the end event (returns a reusable
            descriptor buffer to its pool), or ``None``.
        error: a refused call, reported through the batch's future; copies enqueued before it
            still run.
    """

    path: str
    num_chunks: int = 1
    num_fallbacks: int = 0
    keep_alive: tuple[Any, ...] = ()
    release: Callable[[], None] | None = None
    error: TransferError | None = None


class CopyIssuer(Protocol):
    """Enqueues one plan's copies on a stream; everything else is ``CopyStreams``'."""

    def issue(self, plan: TransferPlan, stream: Any) -> Issued:
        """Enqueue ``plan``'s copies on ``stream`` (a ``torch.cuda.Stream``) and return at once.
        Must not raise for a refused driver call or launch: report it in ``Issued.error``."""
        ...


@attrs.define(kw_only=True, slots=False)
class StreamTotals:
    """The counters ``CopyStreams`` adds to ``BatchTotals``, declared once (their meanings:
    ``CudaEngineStatistics``, which freezes them)."""

    chunks_submitted: int = 0
    loop_fallbacks: int = 0
    kernel_batches: int = 0
    dma_batches: int = 0
    submit_s: float = 0.0
    issue_s: float = 0.0


@attrs.define(kw_only=True)
class CopyCounters(StreamTotals, BatchTotals):
    """Running totals of one engine, updated under ``lock`` (all counters only grow, except
    ``in_flight``)."""

    lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False, eq=False)

    def totals(self) -> dict[str, Any]:
        """A consistent snapshot of every counter, by field name."""
        with self.lock:
            return {k: v for k, v in attrs.asdict(self).items() if k != "lock"}

    def count_done(self, direction: Direction, num_bytes: int, device_s: float, failed: bool) -> None:  # fmt: skip
        """Count one batch that left the device: ``num_bytes`` moved in ``device_s`` seconds
        (both ignored when ``failed``)."""
        with self.lock:
            self.in_flight -= 1
            if failed:
                self.batches_failed += 1
            elif direction is Direction.D2H:
                self.batches_completed += 1
                self.bytes_d2h += num_bytes
                self.device_s_d2h += device_s
            else:
                self.batches_completed += 1
                self.bytes_h2d += num_bytes
                self.device_s_h2d += device_s
