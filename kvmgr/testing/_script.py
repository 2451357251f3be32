"""What a ``ScriptedEngine`` does to each batch: its fate, and what a failed store leaves.

Private to ``kvmgr.testing``. Offers:
    FaultScript    the batch numbers to fail, hang or refuse (at submit or at issue), a predicate
                   and a seeded rate of failures; decides each batch's fate (``"ok"``,
                   ``"fail"``, ``"hang"``, ``"refused"``) at submit and records what it
                   injected; poisons a failed store's destination
    POISON_BYTE    the byte a failed store's CPU pages are overwritten with
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Callable, Collection

from kvmgr.errors import ConfigError, TransferError
from kvmgr.transfer.plan import Direction, TransferPlan

__all__ = ["POISON_BYTE", "FaultScript"]

#: Byte written over every destination page of a failed store (GPU -> CPU) after its copy ran,
#: so a manager that treated the store as complete would serve this instead of the KV.
POISON_BYTE = 0xA5


class FaultScript:
    """The faults of one engine (``ScriptedEngine`` documents the arguments).

    Raises:
        ConfigError: ``fail_rate`` outside ``[0, 1]``.
    """

    def __init__(
        self,
        fail_batches: Collection[int],
        hang_batches: Collection[int],
        refuse_batches: Collection[int],
        fail_when: Callable[[int, TransferPlan], bool] | None,
        fail_rate: float,
        fail_directions: Collection[Direction],
        seed: int,
        poison: bool,
        refuse_issue_batches: Collection[int] = (),
    ) -> None:
        if not 0.0 <= fail_rate <= 1.0:
            raise ConfigError(f"fail_rate: expected a probability in [0, 1], got {fail_rate!r}")
        self._fail_batches = frozenset(fail_batches)
        self._hang_batches = frozenset(hang_batches)
        self._refuse_batches = frozenset(refuse_batches)
        self._refuse_issue_batches = frozenset(refuse_issue_batches)
        self._fail_when = fail_when
        self._fail_rate = fail_rate
        self._fail_directions = frozenset(fail_directions)
        self._rng = random.Random(seed)
        self.poison = poison
        #: batch id -> "fail", "hang", "refuse" (at submit) or "refuse_issue"
        self.injected: dict[int, str] = {}

    @property
    def is_empty(self) -> bool:
        """Whether no batch can fail, hang or be refused."""
        return not (
            self._fail_batches
            or self._hang_batches
            or self._refuse_batches
            or self._refuse_issue_batches
            or self._fail_when
            or self._fail_rate
        )

    def fate(self, batch_id: int, plan: TransferPlan) -> str:
        """``"ok"``, ``"fail"``, ``"hang"`` or ``"refused"`` (its issue refused: nothing is
        copied, the batch fails) for a new batch (recorded in ``injected``).

        Raises:
            TransferError: the batch is in ``refuse_batches``.
        """
        failed_draw = self._rng.random() < self._fail_rate  # drawn for every batch
        failed_draw &= plan.direction in self._fail_directions
        if batch_id in self._refuse_batches:
            self.injected[batch_id] = "refuse"
            raise TransferError(f"injected fault: batch {batch_id} refused at submit")
        if batch_id in self._refuse_issue_batches:
            self.injected[batch_id] = "refuse_issue"
            return "refused"
        fate = "hang" if batch_id in self._hang_batches else "ok"
        if fate == "ok" and (batch_id in self._fail_batches or failed_draw):
            fate = "fail"
        if fate == "ok" and self._fail_when is not None and self._fail_when(batch_id, plan):
            fate = "fail"
        if fate != "ok":
            self.injected[batch_id] = fate
        return fate

    def fail(self, batch_id: int) -> None:
        """Fail a batch after its copy (a test's late decision)."""
        self.injected[batch_id] = "fail"

    @property
    def num_failed(self) -> int:
        """Batches failed on purpose so far."""
        return sum(1 for fate in self.injected.values() if fate == "fail")

    def poison_store(self, plan: TransferPlan) -> None:
        """Overwrite a failed store's destination pages (CPU memory) with ``POISON_BYTE``."""
        if self.poison and plan.direction is Direction.D2H:
            for addr, size in zip(plan.dst_addrs.tolist(), plan.sizes.tolist()):
                ctypes.memset(addr, POISON_BYTE, size)
