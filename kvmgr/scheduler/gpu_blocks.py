"""The GPU side of the bookkeeping: which GPU blocks copies use, and the owned pool.

Private to ``kvmgr.scheduler``.

States of a GPU block (``GpuState``), when the manager owns the pool (``manage_gpu_blocks``):

- ``FREE``: in the allocator; ``allocate`` may hand it out.
- ``HELD``: allocated to a request (``allocate``, a resume). Only held blocks may be named by a
  swap, so no allocation can hand out a block that a queued copy still reads or writes.
- ``DRAINING``: its request freed it (or a preempt gave it back) while a queued or in-flight
  copy still used it; it returns to ``FREE`` when the last such copy ends.

Without an owned pool every block is the caller's; only the busy count is kept. Per block the
*busy count* is the number of queued or in-flight copies that read or write it.
"""

from __future__ import annotations

import array
import enum

import numpy as np

from kvmgr._ids_c import ids_c
from kvmgr._index_c import index_c
from kvmgr.errors import InvalidBlockError
from kvmgr.pool.allocator import BlockAllocator
from kvmgr.pool.block_ids import as_id_array, sorted_distinct
from kvmgr.scheduler.keys import SMALL

__all__ = ["GpuBlocks", "GpuState"]


class GpuState(enum.IntEnum):
    """State of an owned GPU block (see the module docstring)."""

    FREE = 0
    HELD = 1
    DRAINING = 2


#: plain ints for array compares: numpy compares an array with an ``IntEnum`` member ~15x
#: slower than with an ``int`` (30 against 2 us for 512 ids here)
_HELD, _DRAINING = int(GpuState.HELD), int(GpuState.DRAINING)
_INT64 = np.dtype(np.int64)  #: native int64: arrays of it carry this very object


class GpuBlocks:
    """Busy counts of every GPU block and, when owned, the pool and block states."""

    def __init__(self, num_blocks: int, *, owned: bool) -> None:
        self.num_blocks = num_blocks
        self.pool: BlockAllocator | None = BlockAllocator(num_blocks, name="gpu") if owned else None
        self.state = bytearray(num_blocks)
        self.state_np = np.frombuffer(self.state, dtype=np.uint8)
        self._scratch = np.zeros(num_blocks, dtype=np.int64)
        self._positions = np.arange(num_blocks, dtype=np.int64)
        self.busy = array.array("q", [0]) * num_blocks
        self.busy_np = np.frombuffer(self.busy, dtype=np.int64)
        self.num_draining = 0  #: owned blocks DRAINING (``release`` looks for them only then)

    # ------------------------------------------------------------------ validation

    def checked_ids(self, block_ids: object, what: str) -> list[int] | np.ndarray:
        """Validated GPU ids: a list for short calls, an int64 array otherwise (a copy either
        way: the caller may reuse its list or array).

        Raises:
            InvalidBlockError: not ints, out of range, repeated, or (owned pool) not held.
        """
        if type(block_ids) is list and len(block_ids) <= SMALL:
            if self.check_small(block_ids, what):
                return block_ids[:]  # exact ints already
            return [int(b) for b in block_ids]
        ids: np.ndarray
        if type(block_ids) is np.ndarray and block_ids.dtype is _INT64 and block_ids.ndim == 1:
            ids = block_ids.copy()  # what ``as_id_array`` gives an int64 array, copied
        else:
            ids = as_id_array(block_ids, "gpu", self.num_blocks)
            if ids is block_ids:
                ids = ids.copy()
        self.check_array(ids, what)
        return ids

    def check_small(self, ids: list[int], what: str) -> bool:
        """Validate a short list of ids (range, distinct, held when owned) without numpy;
        whether every id is exactly an ``int`` (else integers of other types, such as numpy's).

        Raises:
            InvalidBlockError: an id is not an int, out of range, repeated, or not held.
        """
        n, state, owned, exact = self.num_blocks, self.state, self.pool is not None, True
        for b in ids:
            if type(b) is not int:
                as_id_array(ids, "gpu", n)  # raises the typed error for non-ints
                b, exact = int(b), False
            if not 0 <= b < n:
                raise InvalidBlockError(f"gpu block id {b} out of range [0, {n})")
            if owned and state[b] != _HELD:
                raise self._not_held(b, what)
        if len(ids) > 1 and len(set(ids)) != len(ids):
            raise InvalidBlockError(f"duplicate gpu block ids in {ids}")
        return exact

    def check_array(self, ids: np.ndarray, what: str) -> None:
        """Validate an int64 array of ids (range, distinct, held when owned).

        Raises:
            InvalidBlockError: an id is out of range, repeated, or not held.
        """
        n, owned = len(ids), self.pool is not None
        if n == 0:
            return
        module = index_c()  # strictly increasing, in range and held: one C pass
        if module is not None and module.increasing_ok(
            ids, self.state if owned else None, _HELD, self.num_blocks
        ):
            return
        if n > 2 and ids[0] < ids[1] and ids[-2] < ids[-1] and (ids[1:] > ids[:-1]).all():
            # strictly increasing: distinct, and the ends are the bounds (one pass fewer)
            bad = ids[0] < 0 or ids[-1] >= self.num_blocks
            if not bad and (not owned or (self.state_np[ids] == _HELD).all()):
                return
        else:  # one pass for both bounds: as uint64 a negative id is beyond any pool's size
            bad = int(ids.view(np.uint64).max()) >= self.num_blocks
        if bad:
            lo, hi = int(ids.min()), int(ids.max())
            raise InvalidBlockError(
                f"gpu block id {lo if lo < 0 else hi} out of range [0, {self.num_blocks})"
            )
        if 1 < n <= self.num_blocks:  # held and distinct in one test (``distinct``'s scratch)
            positions = self._positions[:n]
            self._scratch[ids] = positions
            ok = self._scratch[ids] == positions
            if owned:
                ok &= self.state_np[ids] == _HELD
            if ok.all():
                return
        if owned:  # the first error, in the order: not held, then repeated
            held = self.state_np[ids] == _HELD
            if not held.all():
                raise self._not_held(int(ids[np.flatnonzero(~held)[0]]), what)
        if n > 1 and not self.distinct(ids):
            raise InvalidBlockError(f"duplicate gpu block ids in {ids.tolist()[:16]}")

    def distinct(self, ids: np.ndarray) -> bool:
        """Whether ``ids`` (in range) are distinct: write each id's position into a scratch
        array and read it back (a repeated id keeps only its last position); O(n), no sort."""
        if len(ids) > self.num_blocks:
            return False
        positions = self._positions[: len(ids)]
        scratch = self._scratch
        scratch[ids] = positions
        return bool((scratch[ids] == positions).all())

    def _not_held(self, block_id: int, what: str) -> InvalidBlockError:
        state = GpuState(self.state[block_id]).name
        return InvalidBlockError(
            f"gpu block {block_id} is {state}, not held by any request: with "
            f"manage_gpu_blocks=True a {what} may name only blocks allocated with allocate() "
            "(a free block could be handed to another request while the copy runs)"
        )

    # ------------------------------------------------------------------ pool

    def allocate(self, n: int) -> np.ndarray | None:
        """``n`` blocks from the owned pool, now HELD, or ``None``."""
        assert self.pool is not None
        ids = self.pool.take(n)
        if ids is not None:
            self.state_np[ids] = GpuState.HELD
        return ids

    def give_back(self, ids: np.ndarray) -> None:
        """A request no longer holds these owned blocks: FREE now, or DRAINING while busy."""
        assert self.pool is not None
        if len(ids) == 0:
            return
        busy = self.busy_np[ids] > 0
        if busy.any():
            draining = ids[busy]
            self.state_np[draining] = GpuState.DRAINING
            self.num_draining += len(draining)
            ids = ids[~busy]
        self.state_np[ids] = GpuState.FREE
        self.pool.give(ids)

    # ------------------------------------------------------------------ busy counts

    def acquire(self, ids: list[int] | np.ndarray) -> None:
        """A copy of these (distinct, validated) blocks was queued."""
        if isinstance(ids, list):
            busy = self.busy
            for b in ids:
                busy[b] += 1
        else:  # one C loop where it builds (``kvmgr._ids_c``; numpy's fancy add: ~2 us)
            module = ids_c()
            if module is None or not module.add_at(self.busy, ids, 1):
                self.busy_np[ids] += 1

    def acquire_each(self, ids: np.ndarray) -> None:
        """``acquire`` of int64 ids that may repeat (recorded calls storing one GPU block):
        a count per occurrence."""
        module = ids_c()
        if module is None or not module.add_at(self.busy, ids, 1):
            if self.distinct(ids):
                self.busy_np[ids] += 1
            else:
                np.add.at(self.busy_np, ids, 1)

    def release(self, ids: np.ndarray) -> None:
        """Copies of these blocks ended (one count per occurrence); DRAINING blocks whose last
        copy ended go back to the pool."""
        if len(ids) == 1:
            self.busy[int(ids[0])] -= 1
        else:
            module = ids_c()
            if module is None or not module.add_at(self.busy, ids, -1):
                np.subtract.at(self.busy_np, ids, 1)
        if self.pool is None or not self.num_draining:
            return
        draining = ids[self.state_np[ids] == _DRAINING]
        if len(draining):
            done = sorted_distinct(draining[self.busy_np[draining] == 0])
            self.state_np[done] = GpuState.FREE
            self.num_draining -= len(done)
            self.pool.give(done)
