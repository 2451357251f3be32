"""Block allocator: hands out block ids of one pool.

Offers:
    BlockAllocator  fresh ids first, in order; then freed ids, last freed first
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvmgr.errors import DoubleFreeError, InvalidBlockError, PoolExhaustedError

__all__ = ["BlockAllocator"]

_FRESH, _ALLOCATED, _FREED = 0, 1, 2


class BlockAllocator:
    """Allocator of the ids ``[0, num_blocks)`` of one pool.

    Order: ids never handed out come first, in increasing order; after those run out, freed ids
    are reused last-freed-first (a stack), so recently written pages are reused while still warm.

    Data: a cursor over fresh ids, a stack of freed ids, and a state byte per id (fresh,
    allocated, freed) that catches double frees and ids this pool never handed out.
    ``allocate`` and ``free`` cost O(n) in the ids handled.
    """

    def __init__(self, num_blocks: int, *, name: str = "pool") -> None:
        if num_blocks < 1:
            raise InvalidBlockError(f"{name}: expected num_blocks >= 1, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._next_fresh = 0
        self._freed: list[int] = []
        self._state = np.zeros(num_blocks, dtype=np.int8)

    @property
    def num_free(self) -> int:
        """Ids available to ``allocate``."""
        return self.num_blocks - self._next_fresh + len(self._freed)

    @property
    def num_allocated(self) -> int:
        """Ids currently handed out."""
        return self.num_blocks - self.num_free

    def is_allocated(self, block_id: int) -> bool:
        """Whether ``block_id`` is currently handed out (False for out-of-range ids)."""
        return 0 <= block_id < self.num_blocks and self._state[block_id] == _ALLOCATED

    def try_allocate(self, n: int) -> list[int] | None:
        """Allocate ``n`` ids, or return ``None`` (and change nothing) if fewer are free.

        Raises:
            InvalidBlockError: ``n < 0``.
        """
        if n < 0:
            raise InvalidBlockError(f"{self.name}: expected n >= 0, got {n}")
        if n > self.num_free:
            return None
        num_fresh = min(n, self.num_blocks - self._next_fresh)
        ids = list(range(self._next_fresh, self._next_fresh + num_fresh))
        self._next_fresh += num_fresh
        for _ in range(n - num_fresh):
            ids.append(self._freed.pop())
        self._state[ids] = _ALLOCATED
        return ids

    def allocate(self, n: int) -> list[int]:
        """Allocate ``n`` ids.

        Raises:
            PoolExhaustedError: fewer than ``n`` ids are free; nothing changed.
            InvalidBlockError: ``n < 0``.
        """
        ids = self.try_allocate(n)
        if ids is None:
            raise PoolExhaustedError(
                f"{self.name}: need {n} blocks, {self.num_free} free",
                needed=n,
                available=self.num_free,
                reason=f"{self.name}_full",
            )
        return ids

    def check_allocated(self, block_ids: Iterable[int]) -> list[int]:
        """Validate that every id is in range, currently allocated and listed once.

        Returns:
            The ids as a list of ints.

        Raises:
            InvalidBlockError: an id is not an int, out of range, duplicated, or never allocated.
            DoubleFreeError: an id was allocated before and is free now.
        """
        ids = _as_int_list(block_ids, self.name)
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks:
                raise InvalidBlockError(
                    f"{self.name}: block id {block_id} out of range [0, {self.num_blocks})"
                )
        if len(set(ids)) != len(ids):
            raise InvalidBlockError(f"{self.name}: duplicate block ids in {ids}")
        for block_id in ids:
            state = self._state[block_id]
            if state == _FREED:
                raise DoubleFreeError(f"{self.name}: block {block_id} is already free")
            if state == _FRESH:
                raise InvalidBlockError(f"{self.name}: block {block_id} was never allocated here")
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return ids to the pool; the last id in ``block_ids`` is the next one reused.

        Raises:
            InvalidBlockError, DoubleFreeError: as ``check_allocated``; nothing is freed then.
        """
        ids = self.check_allocated(block_ids)
        self._state[ids] = _FREED
        self._freed.extend(ids)


def _as_int_list(block_ids: Iterable[int], name: str) -> list[int]:
    if isinstance(block_ids, (str, bytes)):
        raise InvalidBlockError(f"{name}: expected a sequence of int block ids, got {block_ids!r}")
    try:
        ids = list(block_ids)
    except TypeError:
        raise InvalidBlockError(
            f"{name}: expected a sequence of int block ids, got {type(block_ids).__name__}"
        ) from None
    for block_id in ids:
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise InvalidBlockError(f"{name}: expected int block id, got {block_id!r}")
    return [int(b) for b in ids]
