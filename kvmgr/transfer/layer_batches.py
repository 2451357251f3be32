"""``LayerBatches``: the per-group batches of one layerwise load or store, joined into one
``BatchHandle`` (re-exported by ``kvmgr.transfer.layerwise``, whose handles submit through it).

All or nothing: the joined handle resolves only once every submitted group has ended, with
the summed result when all groups were submitted and succeeded, else with the first failure
(``LayerLoadError`` for a load, ``LayerStoreError`` for a store); a refused group closes the
operation (no later group is submitted).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable

from kvmgr.errors import LayerLoadError, LayerStoreError, LayerwiseError
from kvmgr.transfer.engine import BatchHandle, BatchResult
from kvmgr.transfer.plan import Direction

__all__ = ["LayerBatches"]


class LayerBatches:
    """The per-group batches of one layerwise load or store, and one handle over all of them.

    ``handle`` resolves once every group that was submitted has ended (never earlier, so no
    block is released while a group may still copy it): with the summed ``BatchResult`` if all
    ``num_groups`` groups were submitted and succeeded, else with the first failure
    (``LayerLoadError`` for a load, ``LayerStoreError`` for a store). Its ``end_event`` is the
    last group's, set when that group is submitted (one FIFO stream: the last group's end means
    every group ended). A group's
    ``end_event`` marks that group only until its future resolved: the CUDA engines pool their
    events, and a later batch (a later group of the same load, too) may re-record it
    (``kvmgr.transfer.streams``); ``wait_layer`` waits only on groups still in flight.

    Args:
        direction: of every group.
        num_groups: groups the operation will submit.
    """

    def __init__(self, direction: Direction, num_groups: int) -> None:
        self.direction = direction
        self.num_groups = num_groups
        self._error_type: type[LayerwiseError] = (
            LayerLoadError if direction is Direction.H2D else LayerStoreError
        )
        self.handles: list[BatchHandle] = []
        self.error: BaseException | None = None
        self.handle = BatchHandle(
            -1, direction, concurrent.futures.Future(), member_ids=[], submitting=True
        )
        self._lock = threading.Lock()
        self._ended = 0
        self._closed = False  # no more groups will be submitted

    @property
    def failed(self) -> bool:
        """Whether a group failed, or was refused, so far."""
        return self.error is not None

    def submit(self, group: int, submit: Callable[[], BatchHandle]) -> BatchHandle | None:
        """Submit group ``group`` (the next one) through ``submit()``; a refusal (an exception,
        or a handle whose issue was refused) fails the operation and closes it. Returns the
        handle, or ``None`` if it was refused (then no later group may be submitted)."""
        assert group == len(self.handles) and not self._closed
        try:
            handle = submit()
        except Exception as exc:
            self._fail(self._error_type(f"layer group {group}: could not submit: {exc}"))
            self.close()
            return None
        if self.handle.batch_id < 0:
            self.handle.batch_id = handle.batch_id
        self.handles.append(handle)
        self.handle.member_ids.append(handle.batch_id)  # type: ignore[union-attr]
        if len(self.handles) == self.num_groups:
            # only now: an earlier group's event would let a later batch that is fenced on the
            # whole operation (a load into a block a store has yet to read) start too early
            self.handle.end_event = handle.end_event
        refused = getattr(handle, "refused", None)
        if refused is not None:
            self._fail(self._error_type(f"layer group {group}: {refused}"))
        handle.future.add_done_callback(lambda f, g=group: self._ended_one(g, f))
        if len(self.handles) == self.num_groups or refused is not None:
            self.close()
        return None if refused is not None else handle

    def close(self) -> None:
        """No more groups will be submitted; fewer than ``num_groups`` fails the operation."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.handle.submitting = False
            if len(self.handles) < self.num_groups and self.error is None:
                self.error = self._error_type(
                    f"only {len(self.handles)} of {self.num_groups} layer groups were submitted"
                )
            finish = self._ended == len(self.handles)
        if finish:
            self._finish()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    def _ended_one(self, group: int, future: concurrent.futures.Future[BatchResult]) -> None:
        error = future.exception()
        with self._lock:
            if error is not None and self.error is None:
                self.error = self._error_type(f"layer group {group} failed: {error}")
            self._ended += 1
            finish = self._closed and self._ended == len(self.handles)
        if finish:
            self._finish()

    def _finish(self) -> None:
        future = self.handle.future
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if self.error is not None:
                future.set_exception(self.error)
                return
            results = [h.future.result() for h in self.handles]
            future.set_result(
                BatchResult(
                    batch_id=self.handle.batch_id,
                    direction=self.direction,
                    num_bytes=sum(r.num_bytes for r in results),
                    num_descriptors=sum(r.num_descriptors for r in results),
                    device_s=sum(r.device_s or 0.0 for r in results),
                    path=results[0].path if results else "host",
                )
            )
