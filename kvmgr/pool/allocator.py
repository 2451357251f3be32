"""Block allocator: hands out block ids of one pool.

Offers:
    BlockAllocator  fresh ids first, in order; then freed ids, last freed batch first, each
                    batch smallest id first

Block ids enter through ``kvmgr.pool.block_ids.as_id_array``.
"""

from __future__ import annotations

import array
from collections.abc import Iterable

import numpy as np

from kvmgr.errors import InvalidBlockError, PoolExhaustedError
from kvmgr.pool.block_ids import ALLOCATED, FREED, as_id_array, check_allocated_ids

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """Allocator of the ids ``[0, num_blocks)`` of one pool.

    Order: ids never handed out come first, in increasing order; after those run out, freed ids
    are reused last-freed-first (a stack), so recently written pages are reused while still warm.
    A batch freed in one call (``give``/``free``) is stacked smallest id on top, so its ids come
    back in increasing order, whether taken at once or one by one: blocks evicted together are
    reused as runs of consecutive ids, which ``build_plan`` merges into one descriptor per tensor
    (a store of consecutive GPU blocks into LIFO-reversed ids would need one per page).

    Data: a cursor over fresh ids, a stack of freed ids (an ``array`` of ``num_blocks`` slots
    with a numpy view and a top index: a batch is pushed and popped as one slice), and a state
    byte per id (fresh, allocated, freed: ``kvmgr.pool.block_ids``) that catches double frees
    and ids this pool never handed out, in a ``bytearray`` viewed as a numpy array:
    ``take``/``give`` take and return int64 arrays; ``allocate``/``free`` are list-based twins,
    ``take_few``/``give_few`` loops.

    Progressive availability: with ``num_ready < num_blocks`` only the ids below ``num_ready``
    are handed out (the CPU tier's memory beyond them is still being pinned); ``make_ready``
    raises the bound as more memory becomes usable. Ids are handed out fresh in increasing
    order, so the bound is a cap on the fresh cursor and costs nothing per call.

    Args:
        num_blocks: ids ``[0, num_blocks)``.
        name: for error messages.
        num_ready: ids below it may be handed out now; ``num_blocks`` if ``None``.
    """

    def __init__(
        self, num_blocks: int, *, name: str = "pool", num_ready: int | None = None
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise InvalidBlockError(f"{name}: expected an int num_blocks, got {num_blocks!r}")
        if num_blocks < 1:
            raise InvalidBlockError(f"{name}: expected num_blocks >= 1, got {num_blocks}")
        self.name = name
        self.num_blocks = int(num_blocks)
        self._num_ready = self.num_blocks
        self._next_fresh = 0
        #: ids available to ``allocate`` now (only ready ids count): ``_num_ready -
        #: _next_fresh + _top``, kept as a plain attribute (read on every per-call store)
        self.num_free = self.num_blocks
        if num_ready is not None:
            self._num_ready = self.num_free = 0
            self.make_ready(num_ready)
        #: freed ids, ``[0, _top)`` (top = next reused); never more than ``num_blocks``
        self._stack = array.array("q", [0]) * self.num_blocks
        self._stack_np = np.frombuffer(self._stack, dtype=np.int64)
        self._top = 0
        self._bytes = bytearray(self.num_blocks)
        self._state = np.frombuffer(self._bytes, dtype=np.uint8)

    @property
    def num_ready(self) -> int:
        """Ids below this may be handed out (``num_blocks`` once all are ready)."""
        return self._num_ready

    def make_ready(self, num_ready: int) -> None:
        """Let ids below ``num_ready`` be handed out (a smaller value changes nothing: the
        bound only grows).

        Raises:
            InvalidBlockError: ``num_ready`` is not an int in ``[0, num_blocks]``.
        """
        if (
            isinstance(num_ready, bool)
            or not isinstance(num_ready, (int, np.integer))
            or not 0 <= num_ready <= self.num_blocks
        ):
            raise InvalidBlockError(
                f"{self.name}: expected num_ready in [0, {self.num_blocks}], got {num_ready!r}"
            )
        grown = int(num_ready) - self._num_ready
        if grown > 0:
            self._num_ready += grown
            self.num_free += grown

    @property
    def num_allocated(self) -> int:
        """Ids currently handed out."""
        return self._next_fresh - self._top

    def is_allocated(self, block_id: int) -> bool:
        """Whether ``block_id`` is currently handed out (False for out-of-range ids)."""
        return 0 <= block_id < self.num_blocks and self._bytes[block_id] == ALLOCATED

    def allocated_mask(self) -> np.ndarray:
        """bool ``[num_blocks]``: which ids are handed out (a copy)."""
        return self._state == ALLOCATED

    def take(self, n: int) -> np.ndarray | None:
        """Allocate ``n`` ids as an int64 array, or return ``None`` (nothing changed).

        Raises:
            InvalidBlockError: ``n`` is negative or not an int; nothing changed then.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InvalidBlockError(f"{self.name}: expected an int n >= 0, got {n!r}")
        if n > self.num_free:
            return None
        ids = self.peek(n)
        self.commit(ids)
        return ids

    def peek(self, n: int) -> np.ndarray:
        """The int64 ids ``take(n)`` would return now; nothing changes (``n`` an int in
        ``[0, num_free]``, not checked)."""
        start = self._next_fresh
        num_fresh = min(n, self._num_ready - start)
        if num_fresh == n:
            return np.arange(start, start + n, dtype=np.int64)
        top = self._top
        reused = self._stack_np[top - (n - num_fresh) : top][::-1]  # a view: copied
        if num_fresh:
            return np.concatenate([np.arange(start, start + num_fresh, dtype=np.int64), reused])
        return np.array(reused)  # a copy

    def fresh_start(self, n: int) -> int | None:
        """``s`` when ``peek(n)`` is ``arange(s, s + n)`` (ids never handed out), else ``None``."""
        start = self._next_fresh
        return start if n <= self._num_ready - start else None

    def commit(self, ids: np.ndarray | slice) -> None:
        """Allocate the ids ``peek(n)`` returned (their ``slice`` if ``fresh_start``), nothing
        taken or given since (the caller checks, then commits: a failed check changes none)."""
        n = len(ids) if type(ids) is not slice else ids.stop - ids.start
        num_fresh = min(n, self._num_ready - self._next_fresh)
        self.num_free -= n
        self._next_fresh += num_fresh
        self._top -= n - num_fresh
        self._state[ids] = ALLOCATED

    def take_one(self) -> int | None:
        """Allocate one id, or return ``None``."""
        if self._next_fresh < self._num_ready:
            block_id = self._next_fresh
            self._next_fresh += 1
        elif self._top:
            self._top -= 1
            block_id = self._stack[self._top]
        else:
            return None
        self.num_free -= 1
        self._bytes[block_id] = ALLOCATED
        return block_id

    def take_few(self, n: int) -> list[int]:
        """``take_one`` ``n`` times in one call, as a list (the per-call path's few ids).

        Raises:
            PoolExhaustedError: fewer than ``n`` ids are free; nothing changed then.
        """
        if n > self.num_free:
            self.allocate(n)  # raises PoolExhaustedError
        start = self._next_fresh  # fresh ids first, then the stack's top
        ids = list(range(start, min(start + n, self._num_ready)))
        self._next_fresh = start + len(ids)
        top = self._top - (n - len(ids))
        ids += reversed(self._stack[top : self._top])  # popped one by one: the top first
        self._top, states = top, self._bytes
        for block_id in ids:
            states[block_id] = ALLOCATED
        self.num_free -= n
        return ids

    def give(self, ids: np.ndarray, *, vouched: bool = False) -> None:
        """Return ids (an int64 array of distinct allocated ids; the smallest is reused first).

        ``vouched``: the owner knows ``ids`` is a non-empty 1-D int64 array of distinct ids it
        holds allocated (the CPU tier freeing blocks whose keys it just dropped), so only the
        order is computed, not the checks.

        Raises:
            InvalidBlockError, DoubleFreeError: as ``check_allocated`` (and for anything but a
                1-D integer array); nothing is freed then.
        """
        if vouched:  # (blocks evicted leaf first often come strictly descending: no sort)
            ordered = ids[::-1] if (ids[1:] < ids[:-1]).all() else np.sort(ids)
        else:
            ordered = check_allocated_ids(ids, self._state, self.num_blocks, self.name)
            if len(ids) == 0:
                return
        self._state[ids] = FREED
        top = self._top
        self._stack_np[top : top + len(ids)] = ordered[::-1]  # the smallest on top of the stack
        self._top = top + len(ids)
        self.num_free += len(ids)

    def give_one(self, block_id: int) -> None:
        """Return one allocated id (the caller checked it is allocated)."""
        self._bytes[block_id] = FREED
        self._stack[self._top] = block_id
        self._top += 1
        self.num_free += 1

    def give_few(self, block_ids: list[int]) -> None:
        """``give_one`` of each id in order, in one call (ids checked allocated, distinct)."""
        stack, states = self._stack, self._bytes
        for top, block_id in enumerate(block_ids, self._top):
            stack[top] = block_id
            states[block_id] = FREED
        self._top += len(block_ids)
        self.num_free += len(block_ids)

    def try_allocate(self, n: int) -> list[int] | None:
        """Allocate ``n`` ids, or return ``None`` (and change nothing) if fewer are free.

        Raises:
            InvalidBlockError: ``n`` is negative or not an int.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InvalidBlockError(f"{self.name}: expected an int n >= 0, got {n!r}")
        ids = self.take(int(n))
        return None if ids is None else ids.tolist()

    def allocate(self, n: int) -> list[int]:
        """Allocate ``n`` ids.

        Raises:
            PoolExhaustedError: fewer than ``n`` ids are free; nothing changed.
            InvalidBlockError: ``n`` is negative or not an int.
        """
        ids = self.try_allocate(n)
        if ids is None:
            raise PoolExhaustedError(
                f"{self.name}: need {n} blocks, {self.num_free} free",
                needed=int(n),
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
        ids = as_id_array(block_ids, self.name, self.num_blocks)
        check_allocated_ids(ids, self._state, self.num_blocks, self.name)
        return ids.tolist()

    def free(self, block_ids: Iterable[int]) -> None:
        """Return ids to the pool; the smallest of ``block_ids`` is the next one reused.

        Raises:
            InvalidBlockError, DoubleFreeError: as ``check_allocated``; nothing is freed then.
        """
        self.give(as_id_array(block_ids, self.name, self.num_blocks))
