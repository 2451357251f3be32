"""OffloadManager: the asyncio facade. It HOLDS a Bookkeeper, a swap queue and an engine.

Swaps only queue work and return an ``asyncio.Future`` (one per call, whatever its number of
blocks); ``step()`` (or, with ``flush="tick"``, the end of the event-loop tick) turns the queue
into one plan per direction and submits it. The engine reports completion from its own thread;
the manager applies the bookkeeping of the whole batch on the loop thread
(``call_soon_threadsafe``), then resolves the batch's futures, in submission order.

Cancelling a task that awaits a swap's future cancels that future, never the copy: the copy
runs to its end and the bookkeeping completes as if nobody had cancelled. ``wait()`` shields
the future, so cancelling it leaves the future intact. docs/architecture.md draws the life of a
swap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvmgr.config import ManagerConfig
from kvmgr.errors import (
    ClosedError,
    ConfigError,
    InvalidArgumentError,
)
from kvmgr.hooks import StepContext, StepHook
from kvmgr.manager.build import build_local, build_ranked
from kvmgr.manager.core import check_timeout
from kvmgr.manager.keyed import KeyedCalls
from kvmgr.manager.lookups import LookupCalls
from kvmgr.manager.observe import Observing
from kvmgr.manager.request_calls import RequestCalls
from kvmgr.manager.staged_calls import StagedCalls
from kvmgr.reports import (
    StepReport,
)
from kvmgr.transfer.engine import TransferEngine

__all__ = ["OffloadManager"]


class OffloadManager(KeyedCalls, LookupCalls, RequestCalls, StagedCalls, Observing):
    """Manages a KV cache across GPU memory and a CPU tier; embed one per serving loop.

    Args:
        gpu_kv_caches: the KV tensors, each with ``num_gpu_blocks`` as dim 0 and contiguous
            blocks (``[num_blocks, ...]``; viewed as ``[num_blocks, page_bytes]``). CUDA tensors
            for the CUDA engines, CPU tensors for the host engine. Not copied: kept alive here,
            and they must not be resized or re-pointed afterwards (a flush that finds them moved
            fails its batch with ``StaleKVTensorError``).
        config: settings; ``num_cpu_blocks`` is required.
        hooks: step hooks run in order by ``step()``.
        engine: an engine instance to use instead of ``config.engine`` (for example a
            ``kvmgr.testing.FaultyEngine``); the manager closes it on ``close()``.
        tiers: lower tiers under the CPU tier, in order (``kvmgr.tiers.DiskTier``,
            ``kvmgr.tiers.SharedTier`` or any ``TierBackend``); the caller closes them. See
            ``fetch``, ``lookup_tiers`` and docs/tiers.md.
        tier_namespace: the ``kvmgr.tiers.TierNamespace`` folded into every stored key (model,
            layout, tenant salt); ``None`` = this layout, model ``"unnamed"``, no salt.

    Ownership of GPU blocks: with ``manage_gpu_blocks=True`` (the default) the manager owns
    the GPU pool and every GPU block id a swap names must be held by a request (handed out by
    ``allocate``); naming any other block raises ``InvalidBlockError`` before anything changes,
    so no allocation can hand out a block a queued copy still reads or writes. With
    ``manage_gpu_blocks=False`` the caller owns the blocks and must not reuse a block before
    the swap's future resolved.

    Raises:
        GeometryError: the tensors cannot be managed, or do not suit the engine's device.
        ConfigError: invalid settings, or ``engine``, ``hooks``, ``tiers`` or ``tier_namespace``
            of the wrong type (raised before any memory is allocated).
        HostMemoryError: the CPU tier's memory could not be allocated.

    Use it as ``async with OffloadManager(...) as mgr:``, or call ``await mgr.aclose()``.
    Every public method validates its input and raises before changing any state.
    """

    def __init__(
        self,
        gpu_kv_caches: Sequence[torch.Tensor],
        config: ManagerConfig,
        *,
        hooks: Sequence[StepHook] = (),
        engine: TransferEngine | None = None,
        tiers: Sequence[Any] = (),
        tier_namespace: Any = None,
    ) -> None:
        if not isinstance(config, ManagerConfig):
            raise ConfigError(f"expected a ManagerConfig, got {type(config).__name__}")
        hooks, tiers = _listed(hooks, "hooks"), _listed(tiers, "tiers")  # a generator: once
        for hook in hooks:
            if not isinstance(hook, StepHook):
                raise ConfigError(f"expected a StepHook, got {type(hook).__name__}")
        self._adopt(
            build_local(gpu_kv_caches, config, engine, tiers, tier_namespace, self._enqueue),
            config,
            hooks,
        )

    @classmethod
    def over_ranks(cls, group: Any, config: ManagerConfig) -> OffloadManager:
        """A manager whose copies run in the rank processes of ``group`` (tensor parallelism).

        The manager is the scheduler side only: the same keyed and request-level API, the
        same futures, bookkeeping and invariants; every job goes to every rank
        (``kvmgr.transport.RankGroup``) and completes when all of them reported success.
        Results count one rank's bytes (``SwapResult.num_bytes``); step reports count every
        rank's. A rank that fails a job fails it on every rank (``RankError`` naming it); a
        rank that dies or misses the group's deadline stops the offload: jobs in flight and
        every later swap fail with ``RankError`` / ``RankTimeoutError``, nothing hangs (a
        timed-out job's blocks stay fenced for good: the late rank may still copy). No
        hooks, no lower tiers; ``engine``, ``gpu_layout`` and ``cpu_pool`` are ``None``.
        The caller closes the group after the manager.

        Raises:
            ConfigError: invalid settings.
        """
        if not isinstance(config, ManagerConfig):
            raise ConfigError(f"expected a ManagerConfig, got {type(config).__name__}")
        manager = cls.__new__(cls)
        manager._adopt(build_ranked(group, config, manager._enqueue), config, ())
        return manager

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> OffloadManager:
        self._loop = asyncio.get_running_loop()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self, timeout_s: float | None = 30.0) -> None:
        """Close: fail queued swaps with ``ClosedError``, wait (up to ``timeout_s`` seconds) for
        the copies in flight and apply their bookkeeping, then close the engine. Idempotent.

        Raises:
            InvalidArgumentError: ``timeout_s`` is not ``None`` or a finite number >= 0 (raised
                before anything closes).
            TransferTimeoutError: the engine's copies outlived ``timeout_s`` (the manager is
                closed all the same).
        """
        timeout_s = check_timeout(timeout_s)
        if self._closed:
            return
        self._settle_deferred()  # recorded stores are queued swaps like the others
        self._closing = True  # from here on, new swaps raise ClosedError
        self._fast_loop = None  # the next call checks the loop (and raises ClosedError)
        self._abort_layerwise()
        self._room.fail(ClosedError("manager closed while the store waited for room"))
        if self._queue.in_flight:
            await self._transport.wait(list(self._queue.in_flight), timeout_s)
            await asyncio.sleep(0)  # let completion callbacks scheduled by the engine run
        if self._tiers is not None:
            self._tiers.write_evicted(self._books.take_evicted(), asyncio.get_running_loop())
            await self._tiers.drain(timeout_s)
        self.close(timeout_s)

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Synchronous close: fail queued swaps, wait for the engine (bounded), then settle
        every in-flight batch here. Idempotent.

        Raises:
            InvalidArgumentError, TransferTimeoutError: as ``aclose``.
        """
        timeout_s = check_timeout(timeout_s)
        if self._closed:
            return
        self._settle_deferred()  # recorded stores are queued swaps like the others
        self._closed = True
        self._fast_loop = None  # the next call checks the loop (and raises ClosedError)
        self._abort_layerwise()
        self._flusher.fail_queued(ClosedError("manager closed before the swap was submitted"))
        try:
            self._transport.close(timeout_s)  # may raise TransferTimeoutError: copies running
        finally:
            self._flusher.settle_at_close()
            self._room.fail(ClosedError("manager closed while the store waited for room"))
            self._books.events.cleared()
            self._books.events.close()

    # ------------------------------------------------------------------ step

    async def step(self, ctx: StepContext | None = None) -> StepReport:
        """Run the hooks in order on the compute stream, then submit everything queued since the
        last step as one plan per direction (more only when a hazard forces ordered batches).

        Args:
            ctx: what the scheduler knows about the step; ``None`` = an empty context. When
                ``ctx.stream`` is set, the batches are submitted with it as the current stream,
                so stores wait for the work queued on it so far (docs/transfer.md, rules 3-4).

        Returns:
            The step report: batches submitted, hooks, batches completed since the last step,
            host seconds spent here.

        Raises:
            ClosedError: the manager is closed.
            InvalidArgumentError: ``ctx`` is not a StepContext, or a hook returned no HookReport.
            Exception: whatever a hook raises (the queue is left untouched then); or what an
                engine's ``submit`` raised that is no ``KVMgrError`` (a bug: an engine refuses a
                copy with ``TransferError``, which fails only its swaps): that batch's swaps are
                rolled back and fail with it, the other lanes are still submitted, then it is
                raised here.
        """
        self._check_open()
        if ctx is not None and not isinstance(ctx, StepContext):
            raise InvalidArgumentError(f"expected a StepContext or None, got {type(ctx).__name__}")
        start = time.perf_counter()
        step = self._step + 1
        hooks = self._hooks
        hook_reports: tuple[Any, ...] = ()
        if hooks:  # without hooks no context is needed
            if ctx is None:
                ctx = StepContext(step=step)
            hook_reports = tuple(hook(ctx) for hook in hooks)
            self._flusher.check_hook_reports(hooks, hook_reports)
            if self._deferred.fan is not None:  # per-call stores a hook recorded: this step's
                self._settle_deferred()
        self._step = step
        if self._books.cpu.grow():  # pieces of the CPU tier pinned since: stores may retry,
            self._room.wake()  # and those that find room are submitted by this very step
        if ctx is not None and ctx.stream is not None:  # fence the copies on the compute stream
            with torch.cuda.stream(ctx.stream):
                d2h, h2d = self._flush()
        else:
            d2h, h2d = self._flush()
        completed = self._flusher.take_completed()
        self._books.counters.steps += 1
        report = StepReport(
            step=step if ctx is None or ctx.step is None else ctx.step,
            d2h=d2h,
            h2d=h2d,
            hooks=hook_reports,
            completed=completed,
            host_s=time.perf_counter() - start,
        )
        await asyncio.sleep(0)
        return report

    def _flush(self) -> tuple[Any, Any]:
        """Flush the queue; once more if a lane failed at submit freed room for waiting
        stores during this flush (they were queued behind it and would wait a whole step)."""
        room = self._room
        room.num_requeued = 0
        loop = self._loop
        assert loop is not None
        d2h, h2d = self._flusher.flush(loop)
        if room.num_requeued and len(self._queue):
            room.num_requeued = 0
            more_d2h, more_h2d = self._flusher.flush(loop)
            d2h, h2d = _sum_reports(d2h, more_d2h), _sum_reports(h2d, more_h2d)
        return d2h, h2d


def _sum_reports(a: Any, b: Any) -> Any:
    """Two flushes' ``DirectionReport`` of one direction, summed (an empty one is the unit)."""
    if not b.batches:
        return a
    if not a.batches:
        return b
    return a + b


def _listed(parts: object, what: str) -> tuple[Any, ...]:
    """``parts`` as a tuple, read once (a generator of hooks or tiers is consumed here).

    Raises:
        ConfigError: not an iterable (``None`` included: pass ``()`` for none), or a string.
    """
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Iterable):
        raise ConfigError(f"{what}: expected a sequence (() for none), got {type(parts).__name__}")
    return tuple(parts)
