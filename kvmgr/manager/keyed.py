"""The keyed calls of ``OffloadManager``: stores and loads by key (lookups and invalidation:
``kvmgr.manager.lookups``).

Private to ``kvmgr.manager``. A plain ``swap_out`` is recorded (``kvmgr.scheduler.deferred``)
and prepared with the others at the next settle; every other store goes through
``Bookkeeper.prepare_store`` now, or waits for room (``backpressure``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from kvmgr.errors import (
    PoolExhaustedError,
)
from kvmgr.events.tokens import check_token_ids
from kvmgr.manager.backpressure import WaitingFuture, WaitingStore
from kvmgr.manager.core import ManagerCore, _get_ident
from kvmgr.reports import (
    LoadResult,
    StoreResult,
    SwapResult,
)
from kvmgr.scheduler.keys import check_keys

__all__ = ["KeyedCalls"]


class KeyedCalls(ManagerCore):
    """Keyed stores and loads (mixed into ``OffloadManager``)."""

    def swap_out(
        self,
        gpu_block_ids: Sequence[int],
        keys: Sequence[bytes],
        parents: Sequence[bytes | None] | None = None,
        *,
        token_ids: Any = None,
        hint: Any = None,
    ) -> asyncio.Future[SwapResult]:
        """Queue a store of GPU blocks into the CPU tier under ``keys`` (``keys[i]`` names
        ``gpu_block_ids[i]``). ``parents[i]`` is the key ``keys[i]`` extends (``None``: a root);
        by default ``keys[i]`` extends ``keys[i - 1]`` and ``keys[0]`` is a root (pass ``parents``
        when the call continues a chain stored earlier). The policy evicts a chain's leaves first.

        Keys already in the CPU tier (any state) are skipped, and so are keys not admitted yet
        (``store_threshold``). The others get CPU blocks (free ones first, then by evicting
        READY blocks without loads in flight, never a key of this call) and are PENDING until
        the copy completes, READY after. The GPU blocks must not be overwritten before the
        copy ended (a cancelled future's copy still runs: ``snapshot().gpu_busy``).

        Returns:
            A future resolving to ``SwapResult`` (``cpu_block_ids``: the blocks written), or
            failing with ``TransferError`` (the PENDING keys are then dropped, blocks freed);
            a plain call's is a ``CallFuture`` (``asyncio.Future`` but for its class).

        Raises:
            InvalidBlockError: bad ids, or (owned pool) ids no request holds.
            InvalidKeyError: bad or repeated keys, different counts, or parents whose chain
                comes back to a new key (a key cycle, within the call or through stored keys).
            InvalidArgumentError: bad ``token_ids``.
            PoolExhaustedError: no room even after eviction; nothing changed (with
                ``backpressure="wait"`` the future waits for room instead, holding its GPU
                blocks like a queued store; cancelling it drops the store).
            ClosedError, EventLoopError: closed, or no running loop.

        ``hint``: a ``kvmgr.policy.StoreHint`` for every key (or one per key, or ``None``),
        used by policies that take hints (``"online"``); bad hints raise
        ``InvalidArgumentError`` before any change.
        """
        loop: Any = self._fast_loop  # (``_open_loop``'s first test, without its frame)
        if loop is None or loop._thread_id != _get_ident():
            loop = self._open_loop()  # raises ClosedError / EventLoopError, or binds the loop
        plain = parents is None and token_ids is None and hint is None
        if plain and type(keys) is list and type(gpu_block_ids) is list:  # recorded now,
            try:  # prepared with the others at the settle
                if len(keys) == 1 == len(gpu_block_ids):
                    future = self._deferred.record_one(gpu_block_ids[0], keys[0], loop)
                else:
                    future = self._deferred.record(gpu_block_ids, keys, loop)
            except PoolExhaustedError as exc:  # the policy was asked once: not again
                self._settle_deferred()
                return self._when_room(exc, gpu_block_ids, keys, None, None, batched=False)
            if future is not None:
                if self._flush_on_tick:
                    self._tick_soon(loop)
                return future  # type: ignore[return-value]  # asyncio.Future's protocol
        return self._store(gpu_block_ids, keys, parents, token_ids, batched=False, hints=hint)

    def store_many(
        self,
        gpu_block_ids: Any,
        keys: Sequence[bytes],
        *,
        parents: Sequence[bytes | None] | None = None,
        token_ids: Any = None,
        hints: Any = None,
    ) -> asyncio.Future[StoreResult]:
        """Queue one store of many requests' blocks: ONE future, array results.

        Args:
            gpu_block_ids: int ``[n]`` (numpy array or list): distinct GPU blocks to store.
            keys: ``n`` ``bytes`` keys; ``keys[i]`` names ``gpu_block_ids[i]``. A key repeated
                in the call (two requests that filled the same prefix block in one step) is
                stored once, from its first occurrence; the others count as present.
            parents: ``n`` entries: the key ``keys[i]`` extends, or ``None`` for a root.
                Default: one chain (``keys[i]`` extends ``keys[i - 1]``). As with ``swap_out``,
                a key given as its own parent is an ``InvalidKeyError`` (new, already stored
                or repeated: nothing changed), a parent may come later in the call, and a
                cycle is refused. A repeated key's later entries count as present: their
                parents are not used, so the default chain's ``keys[i - 1]`` of an adjacent
                repeat (the key itself) is no error.
            token_ids: optional int ``[n, block_size]``: the tokens of each block, for the
                ``stored`` KV event (as ``swap_out``).
            hints: ``None``, one ``kvmgr.policy.StoreHint`` for all keys, or ``n`` entries
                (``StoreHint`` or ``None``; the requests of a batch differ), for policies that
                take hints (``"online"``).

        Returns:
            A future resolving to ``StoreResult`` (which keys were stored, which were already
            present, the CPU blocks written), or failing with ``TransferError``.

        Raises:
            KVMgrError: as ``swap_out``.
        """
        return self._store(gpu_block_ids, keys, parents, token_ids, batched=True, hints=hints)

    def _store(
        self,
        gpu_block_ids: Any,
        keys: Sequence[bytes],
        parents: Any,
        token_ids: Any,
        *,
        batched: bool,
        hints: Any = None,
    ) -> asyncio.Future[Any]:
        """Queue a store (per call or batched), or hand it to backpressure."""
        loop = self._check_open()
        future: asyncio.Future[Any] = loop.create_future()
        try:
            part = self._books.prepare_store(
                gpu_block_ids,
                keys,
                parents,
                future,
                batched=batched,
                token_ids=token_ids,
                hints=hints,
            )
        except PoolExhaustedError as exc:
            return self._when_room(
                exc, gpu_block_ids, keys, parents, token_ids, batched=batched, hints=hints
            )
        self._enqueue(part)
        return future

    def _when_room(
        self,
        exc: PoolExhaustedError,
        gpu_block_ids: Any,
        keys: Sequence[bytes],
        parents: Any,
        token_ids: Any,
        *,
        batched: bool,
        hints: Any = None,
    ) -> asyncio.Future[Any]:
        """Backpressure: fail now, or register the store to wait for room (it holds its GPU
        blocks meanwhile, like a queued store; see ``backpressure``)."""
        counters = self._books.counters
        if self.config.backpressure != "wait" or exc.needed > self.config.num_cpu_blocks:
            counters.reject(exc.reason)
            raise exc
        loop = self._check_open()
        books = self._books
        # validated again (cheap, and it copies what the caller may reuse): the ids are held
        gpu = books.gpu_ids(gpu_block_ids, "store")
        keys = check_keys(keys, distinct=False)
        parents = None if parents is None else list(parents)
        tokens = None if token_ids is None or not keys else check_token_ids(token_ids, len(keys))
        options = {"batched": batched, "held": True, "token_ids": tokens, "hints": hints}
        attempt = partial(books.prepare_store, gpu, keys, parents, **options)  # (future) -> Part
        future = WaitingFuture(loop=loop)
        held = np.array(gpu, dtype=np.int64)
        self._room.wait(
            loop, WaitingStore(future, attempt, held, keys, exc), self.config.store_wait_s
        )
        return future

    def swap_in(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int]
    ) -> asyncio.Future[SwapResult]:
        """Queue a load of READY keys into GPU blocks (``keys[i]`` into ``gpu_block_ids[i]``).

        The keys' CPU blocks are pinned (not evictable) until the copy ends. Compute must not
        read the GPU blocks before the future resolves (or before ``stream_wait_loads``).

        Returns:
            A future resolving to ``SwapResult`` (``gpu_block_ids``: the blocks written), or
            failing with ``TransferError`` (the GPU blocks then hold undefined bytes).

        Raises:
            InvalidBlockError: bad ids, or (owned pool) ids no request holds.
            InvalidKeyError: bad keys, or different counts.
            UnknownKeyError: a key is not in the CPU tier. BlockStateError: a key is PENDING.
            ClosedError, EventLoopError: closed, or no running loop.
        """
        loop = self._check_open()
        future: asyncio.Future[SwapResult] = loop.create_future()
        self._enqueue(self._books.prepare_load(keys, gpu_block_ids, future, batched=False))
        return future

    def load_many(self, keys: Sequence[bytes], gpu_block_ids: Any) -> asyncio.Future[LoadResult]:
        """Queue one load of many requests' blocks: ONE future, array results.

        Args:
            keys: ``n`` READY keys (repeats allowed).
            gpu_block_ids: int ``[n]`` (numpy array or list), distinct GPU blocks to write.

        Raises:
            KVMgrError: as ``swap_in``.
        """
        loop = self._check_open()
        future: asyncio.Future[LoadResult] = loop.create_future()
        self._enqueue(self._books.prepare_load(keys, gpu_block_ids, future, batched=True))
        return future
