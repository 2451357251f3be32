"""The request-level calls of ``OffloadManager``: GPU block tables, preempt, resume, free.

Private to ``kvmgr.manager``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import Any

from kvmgr.errors import (
    PoolExhaustedError,
)
from kvmgr.manager.core import ManagerCore
from kvmgr.pool.block_table import Tier
from kvmgr.reports import (
    SwapResult,
)
from kvmgr.scheduler.room import check_store_room

__all__ = ["RequestCalls"]


class RequestCalls(ManagerCore):
    """Request-level calls (mixed into ``OffloadManager``)."""

    # ------------------------------------------------------------------ request-level API

    def allocate(self, req_id: Hashable, num_blocks: int) -> list[int]:
        """Allocate GPU blocks from the owned pool and append them to the request's table
        (created on first use).

        Raises:
            ConfigError: the manager does not own GPU blocks (``manage_gpu_blocks=False``).
            BlockStateError: the request is swapped out or moving.
            InvalidArgumentError: ``num_blocks`` is not an int >= 0, or a bad request id.
            PoolExhaustedError: too few free GPU blocks (reason ``"gpu_full"``); nothing changed.
        """
        self._check_not_closed()
        try:
            return self._books.requests.allocate(req_id, num_blocks)
        except PoolExhaustedError as exc:
            self._books.counters.reject(exc.reason)
            raise

    def append_blocks(self, req_id: Hashable, gpu_block_ids: Sequence[int]) -> None:
        """Append caller-owned GPU blocks to the request's table (created on first use).

        Raises:
            ConfigError: the manager owns the GPU blocks (use ``allocate``).
            InvalidBlockError: bad ids, or ids already in the table.
            BlockStateError: the request is swapped out or moving.
        """
        self._check_not_closed()
        self._books.requests.append(req_id, gpu_block_ids)

    def check_gpu_blocks(self, gpu_block_ids: Any, what: str = "swap") -> None:
        """Check GPU block ids as ``swap_out`` / ``swap_in`` would, queueing nothing: for a
        caller whose one call spans several managers and must know every part is valid before
        it queues any (``kvmgr.groups.GroupedManager``).

        Args:
            gpu_block_ids: a sequence of ints or a 1-D integer array.
            what: the call named in the message for a block no request holds.

        Raises:
            InvalidBlockError: not a sequence of ints, out of range, repeated, or (owned pool)
                not held by a request.
            ClosedError: the manager is closed.
        """
        self._check_not_closed()
        self._books.gpu_ids(gpu_block_ids, what)

    def check_store_room(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None
    ) -> int:
        """Check that ``swap_out(ids, keys, parents)`` would find room now, queueing and
        changing nothing: for a caller whose one store spans several managers and must know
        that every part finds room before it queues any (``kvmgr.groups.GroupedManager``).

        Exact for the eviction policies' rule (a key goes only with every indexed key below
        it: a READY key above a PENDING, read or protected one is no victim), so a store that
        passed is not refused for room by a ``swap_out`` right after (nothing else between).
        Keys the store threshold has not admitted yet need no block; a policy's ``admit`` is
        not asked (it may learn from the call), so with such a policy every new key counts.

        Returns:
            The blocks the store would take (its new keys).

        Raises:
            InvalidKeyError: bad or repeated keys, bad parents, a key cycle (as ``swap_out``).
            PoolExhaustedError: too few free and evictable CPU blocks (with
                ``backpressure="wait"``: more new keys than the tier has blocks).
            ClosedError: the manager is closed.
        """
        self._check_not_closed()
        wait = self.config.backpressure == "wait"
        return check_store_room(self._books.stores, keys, parents, wait=wait)[1]

    def block_table(self, req_id: Hashable) -> list[tuple[Tier, int]]:
        """The request's blocks as ``[(tier, block_id), ...]`` in logical order.

        Raises:
            UnknownRequestError: no table for ``req_id``.
            InvalidArgumentError: ``req_id`` is not hashable.
        """
        self._settle_deferred()
        return self._books.requests.lookup(req_id).entries()

    def is_moving(self, req_id: Hashable) -> bool:
        """Whether a preempt or resume of the request is queued or in flight.

        Raises:
            UnknownRequestError, InvalidArgumentError: as ``block_table``.
        """
        self._settle_deferred()
        return self._books.requests.lookup(req_id).moving

    def preempt(self, req_id: Hashable) -> asyncio.Future[SwapResult]:
        """Queue a swap-out of all the request's GPU blocks into CPU blocks (not keyed, not
        evictable); once the copy completed the table points at the CPU blocks and the GPU
        blocks go back to the owned pool (or to the caller).

        Returns:
            A future resolving to ``SwapResult`` (``gpu_block_ids``: the GPU blocks given back).

        Raises:
            UnknownRequestError: no table. BlockStateError: swapped out already, or moving.
            PoolExhaustedError: no CPU room even after eviction; nothing changed.
        """
        loop = self._check_open()
        future: asyncio.Future[SwapResult] = loop.create_future()
        try:
            part = self._books.requests.prepare_preempt(req_id, future)
        except PoolExhaustedError as exc:
            self._books.counters.reject(exc.reason)
            raise
        self._enqueue(part)
        return future

    def resume(
        self, req_id: Hashable, gpu_block_ids: Sequence[int] | None = None
    ) -> asyncio.Future[SwapResult]:
        """Queue a swap-in of a preempted request into GPU blocks (allocated from the owned pool,
        or ``gpu_block_ids`` supplied by the caller); once complete, the table points at the GPU
        blocks and the CPU blocks are freed.

        Returns:
            A future resolving to ``SwapResult`` (``gpu_block_ids``: the blocks written).

        Raises:
            UnknownRequestError, BlockStateError: no table, not swapped out, or moving.
            InvalidBlockError: wrong number or bad caller-supplied ids.
            PoolExhaustedError: too few free GPU blocks; nothing changed.
        """
        loop = self._check_open()
        future: asyncio.Future[SwapResult] = loop.create_future()
        try:
            part = self._books.requests.prepare_resume(req_id, gpu_block_ids, future)
        except PoolExhaustedError as exc:
            self._books.counters.reject(exc.reason)
            raise
        self._enqueue(part)
        return future

    def free(self, req_id: Hashable) -> None:
        """Drop the request's table and free its blocks (owned GPU blocks or CPU blocks). An
        owned GPU block that a queued or in-flight copy still uses goes back when it ends.

        Raises:
            UnknownRequestError: no table. BlockStateError: a preempt or resume is in flight.
        """
        self._check_not_closed()
        self._books.requests.free(req_id)
        self._room.wake()
