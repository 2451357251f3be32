"""Every call the simulated scheduler makes into kvmgr's ``OffloadManager``, and their results.

Offers:
    SwapIssuer  queues loads, resumes, preempts and stores; awaits them after ``step()``;
                verifies every loaded page

Loads and resumes poison their destination pages before queueing, so a copy that does not
happen is caught by the fingerprint check as surely as a wrong one. A failed store only costs
future hits (counted); a failed preempt turns into recomputation; a failed load or resume stops
the simulation with ``TransferError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvmgr.errors import PoolExhaustedError, TransferError
from kvmgr.sim.counters import SimCounters
from kvmgr.sim.gpu_cache import GPUPrefixCache
from kvmgr.sim.pages import PageStore
from kvmgr.sim.request import SimRequest

__all__ = ["SwapIssuer"]

_Pending = tuple[
    "asyncio.Future[Any]", Callable[[Any], None], "Callable[[TransferError], None] | None"
]


@attrs.define(eq=False)
class SwapIssuer:
    """The scheduler's side of the manager API.

    Args:
        manager: an open ``OffloadManager`` over ``pages.tensors``, ``manage_gpu_blocks=False``.
        pages: GPU tensors and fingerprints.
        gpu: the GPU prefix cache (blocks are marked ready or freed when swaps complete).
        counters: totals to update.
        block_size: tokens per block.
    """

    manager: Any
    pages: PageStore
    gpu: GPUPrefixCache
    counters: SimCounters
    block_size: int
    num_draining: int = attrs.field(default=0, init=False)
    _pending: list[_Pending] = attrs.field(factory=list, init=False)
    #: published key -> the key it extends (``None`` for a prompt's first block).
    _parent_of: dict[bytes, bytes | None] = attrs.field(factory=dict, init=False)
    #: per trace request, the hint its stores carry (``None``: no hints are given)
    hints: Sequence[Any] | None = attrs.field(default=None, init=False)
    _owner: dict[bytes, int] = attrs.field(factory=dict, init=False)  # key -> its last computer

    def claim(self, keys: Sequence[bytes], request_index: int) -> None:
        """The request computes ``keys``: their stores carry its hint (only with hints)."""
        if self.hints is not None:
            self._owner.update(dict.fromkeys(keys, request_index))

    def learn_chain(self, keys: Sequence[bytes]) -> None:
        """Record that ``keys`` (one prompt's published keys) form one chain; stores name
        each key's parent to the manager from this."""
        if keys:
            self._parent_of[keys[0]] = None
            self._parent_of.update(zip(keys[1:], keys[:-1]))

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading run of ``keys`` READY in the CPU tier (touches them in the policy)."""
        return int(self.manager.lookup(keys)) if keys else 0

    def load(self, request: SimRequest, keys: list[bytes], block_ids: list[int]) -> None:
        """Queue ``swap_in`` of CPU prefix hits into the request's fresh GPU blocks."""
        self.pages.poison(block_ids)
        future = self.manager.swap_in(keys, block_ids)
        request.num_loads += 1
        self.counters.load_blocks += len(keys)

        def on_done(_: Any) -> None:
            self._verify(block_ids, keys)
            self.gpu.mark_ready([b for b in block_ids if self.gpu.is_published(b)])
            request.num_loads -= 1
            request.maybe_jump(self.block_size)

        self._pending.append((future, on_done, None))

    def resume(self, request: SimRequest, first: int, end: int) -> None:
        """Queue ``resume`` of the request's preempted tail into blocks ``first .. end - 1`` of
        its block table; the manager's table is dropped once the copy completed."""
        block_ids = request.block_ids[first:end]
        self.pages.poison(block_ids)
        future = self.manager.resume(request.index, block_ids)
        request.num_loads += 1
        request.jump_to, request.tail_tokens = request.tail_tokens, None
        self.counters.resume_blocks += len(block_ids)

        def on_done(_: Any) -> None:
            self._verify(block_ids, request.private_keys(first, len(block_ids)))
            self.manager.free(request.index)
            request.num_loads -= 1
            request.maybe_jump(self.block_size)

        self._pending.append((future, on_done, None))

    def preempt(self, request: SimRequest, tail_ids: list[int], tail_tokens: int) -> None:
        """Queue ``preempt`` of the request's private tail (valid up to ``tail_tokens``); the
        GPU blocks are released once the copy ended. If the copy fails, the tail is dropped and
        recomputed on re-admission.

        Raises:
            PoolExhaustedError: no CPU room; nothing changed (the manager's table is dropped).
        """
        self.manager.append_blocks(request.index, tail_ids)
        try:
            future = self.manager.preempt(request.index)
        except PoolExhaustedError:
            self.manager.free(request.index)
            raise
        request.tail_tokens = tail_tokens
        self.counters.preempt_blocks += len(tail_ids)

        def on_fail(_: TransferError) -> None:
            self.manager.free(request.index)
            request.tail_tokens = None
            self.counters.preempt_recomputes += 1
            self.gpu.release(tail_ids)

        self._pending.append((future, lambda _: self.gpu.release(tail_ids), on_fail))

    def store(self, block_ids: list[int], keys: list[bytes], *, drain: bool = False) -> None:
        """Queue ``swap_out`` of published blocks. ``drain``: the blocks were evicted from the
        GPU cache and go to the free list once stored (or at once, if the CPU tier is full)."""
        if not block_ids:
            return
        self.counters.store_blocks += len(block_ids)
        try:
            parents = list(map(self._parent_of.get, keys))
            if self.hints is None:
                future = self.manager.swap_out(block_ids, keys, parents)
            else:
                hint = [self.hints[self._owner[k]] for k in keys]
                future = self.manager.swap_out(block_ids, keys, parents, hint=hint)
        except PoolExhaustedError:
            self.counters.store_dropped_blocks += len(block_ids)
            if drain:
                self.gpu.finish_drain(block_ids)
            return
        if drain:
            self.num_draining += len(block_ids)

        def on_done(result: Any) -> None:
            self.counters.store_skipped_blocks += result.num_skipped
            if drain:
                self.num_draining -= len(block_ids)
                self.gpu.finish_drain(block_ids)

        def on_fail(_: TransferError) -> None:
            self.counters.store_failed_blocks += len(block_ids)
            if drain:
                self.num_draining -= len(block_ids)
                self.gpu.finish_drain(block_ids)

        self._pending.append((future, on_done, on_fail))

    async def settle(self) -> None:
        """Await every swap queued since the last call, in queue order, and apply its
        bookkeeping. Call it after ``manager.step()``.

        Raises:
            TransferError: a load or resume failed (the simulation stops).
        """
        pending, self._pending = self._pending, []
        for future, on_done, on_fail in pending:
            try:
                result = await future
            except TransferError as exc:
                if on_fail is None:
                    raise
                on_fail(exc)
            else:
                on_done(result)

    def _verify(self, block_ids: list[int], keys: list[bytes]) -> None:
        self.counters.pages_verified += len(block_ids) * self.pages.num_tensors
        self.counters.page_mismatches += self.pages.verify(block_ids, keys)
