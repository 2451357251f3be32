"""The test controls of a ``ScriptedEngine``: gate, start and fail its batches, and look at the
ones still waiting.

Private to ``kvmgr.testing``: ``ScriptedEngine`` takes them in; its own module holds the engine
protocol (what the manager calls) and the copies.
"""

from __future__ import annotations

from kvmgr.testing._order import BatchOrder
from kvmgr.testing._script import FaultScript
from kvmgr.transfer.engine import BatchHandle

__all__ = ["ScriptControls"]


class ScriptControls:
    """What a test does to a scripted engine's batches (``ScriptedEngine`` documents them).

    Works on the engine's ``_order`` (its batches, in submission order), ``_script`` (its
    fates) and ``_holding`` (whether new batches are gated).
    """

    _order: BatchOrder
    _script: FaultScript
    _holding: bool

    def hold(self) -> None:
        """Gate every batch submitted from now on until ``complete_next`` or ``release``."""
        self._holding = True

    def complete_next(self, n: int = 1, *, fail: bool = False) -> list[BatchHandle]:
        """Start the copies of the ``n`` oldest gated batches (held or hung); with ``fail``,
        those batches fail after their copy. Returns their handles (fewer if fewer wait).

        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"expected n >= 0, got {n}")
        with self._order.lock:
            chosen = [b for b in self._order.batches if b.gated and not b.resolved][:n]
            for batch in chosen:
                batch.gated = False
                if fail:
                    batch.fate = "fail"
                    self._script.fail(batch.handle.batch_id)
            self._order.start_ready()
        return [batch.handle for batch in chosen]

    def fail_later(self, batch_id: int) -> None:
        """Make a batch whose copy has not started fail once it has run.

        Raises:
            ValueError: batch ``batch_id`` is resolved, started, or was never submitted.
        """
        with self._order.lock:
            batch = self._order.by_id.get(batch_id)
            if batch is None or batch.started:
                raise ValueError(f"batch {batch_id} is not waiting")
            batch.fate = "fail"
            self._script.fail(batch_id)

    def release(self) -> list[BatchHandle]:
        """Stop holding and start every gated batch, hung ones included. Returns their handles."""
        self._holding = False
        return self.complete_next(len(self._order.batches))

    @property
    def holding(self) -> bool:
        """Whether batches submitted now are gated (``hold``, until ``release``)."""
        return self._holding

    @property
    def waiting_batch_ids(self) -> list[int]:
        """Batches whose copy has not started (gated, or behind a gated batch), oldest first."""
        with self._order.lock:
            return [b.handle.batch_id for b in self._order.batches if not b.started]

    def unresolved_wait_for(self, batch_id: int) -> tuple[int, ...] | None:
        """The ``wait_for`` batch ids given with an unresolved batch; ``None`` once it resolved."""
        with self._order.lock:
            batch = self._order.by_id.get(batch_id)
            return None if batch is None else batch.wait_for_ids

    @property
    def unresolved_batch_ids(self) -> list[int]:
        """Batches submitted and not resolved yet, oldest first."""
        with self._order.lock:
            return [b.handle.batch_id for b in self._order.batches]

    @property
    def num_pending(self) -> int:
        """Batches submitted and not resolved yet."""
        return len(self._order.batches)

    @property
    def poisons(self) -> bool:
        """Whether failed stores' destination pages are overwritten with ``POISON_BYTE``."""
        return self._script.poison

    @property
    def num_submitted(self) -> int:
        """Calls to ``submit`` so far (refused ones included)."""
        return self._next_batch_id
