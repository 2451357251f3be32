"""Lower tiers under the CPU tier: write-back on eviction, write-through, fetch (promote).

Private to ``kvmgr.manager``; the public face is ``OffloadManager(..., tiers=[...])`` with
``fetch``, ``lookup_tiers`` and ``tier_statistics``.

- **Write-back** (``ManagerConfig.tier_write_back``): blocks the CPU tier's policy evicts are
  gathered into blobs before anything can overwrite them (at the next flush, before any D2H
  copy is submitted, or before a promote reuses them) and written to the first lower tier in
  the background. A failed write drops the block (it is never half-stored).
- **Write-through** (``ManagerConfig.tier_write_through``): the blocks of every completed store
  are gathered when the copy completes and written to every lower tier in the background.
- **Fetch**: keys after the CPU tier's ready prefix are looked up in each lower tier in turn;
  hits are staged into CPU blocks (PENDING while the read runs, READY once verified); a miss,
  corrupt value or tier error ends the usable prefix and the caller recomputes from there.
  Nothing read from a lower tier is ever served unverified (``kvmgr.tiers.blob``). A cancelled
  fetch (``task.cancel()``, ``asyncio.wait_for``) frees its staged blocks only after the
  promote's scatter thread has finished with them (``TierBridge``), then re-raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from kvmgr.errors import PoolExhaustedError, TierError
from kvmgr.scheduler.bookkeeping import Bookkeeper, Landed, check_keys
from kvmgr.scheduler.cpu_tier import CpuTier
from kvmgr.tiers.base import TierBackend
from kvmgr.tiers.blob import TierNamespace
from kvmgr.tiers.bridge import StagedBlobs, TierBridge

__all__ = ["LowerTiers", "default_namespace"]

#: Background writes running at once per lower tier, and waiting behind them.
MAX_WRITES_IN_FLIGHT = 4
MAX_WRITE_BACKLOG = 64


def default_namespace(
    books: Bookkeeper, dtype_names: Sequence[str], block_size: int
) -> TierNamespace:
    """A namespace for this manager's layout (model ``"unnamed"``, no tenant salt)."""
    return TierNamespace(
        model="unnamed",
        page_bytes=tuple(books.geometry.page_bytes),
        dtype_names=tuple(dtype_names),
        block_size=block_size,
    )


class LowerTiers:
    """The lower tiers of one manager, in order (the first one receives write-back).

    Args:
        books: the scheduler's bookkeeper (every CPU-tier state change goes through it).
        cpu_tensors: the CPU tier's page views (the local worker's ``cpu_pool.tensors``).
        backends, namespace: the tiers and the namespace folded into their keys.
        write_back, write_through: ``ManagerConfig.tier_write_back`` / ``tier_write_through``.
    """

    def __init__(
        self,
        books: Bookkeeper,
        cpu_tensors: Sequence[object],
        backends: Sequence[TierBackend],
        namespace: TierNamespace,
        *,
        write_back: bool,
        write_through: bool,
    ) -> None:
        self.books = books
        self.bridges = [TierBridge(list(cpu_tensors), b, namespace) for b in backends]
        self.write_back = write_back and bool(self.bridges)
        self.write_through = write_through and bool(self.bridges)
        self._evicted: list[tuple[list[bytes], np.ndarray]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: (keys, CPU ids) of promotes in flight: their keys are PENDING
        self.promoting: list[tuple[list[bytes], np.ndarray]] = []
        self.num_fetch_hits = 0
        self.num_fetch_misses = 0
        #: background writes waiting or running, per bridge (bounded: see ``_spawn``)
        self._backlog = [0] * len(self.bridges)
        self._slots = [asyncio.Semaphore(MAX_WRITES_IN_FLIGHT) for _ in self.bridges]
        self.num_writes_dropped = 0

    # ------------------------------------------------------------------ demotion

    def stage_evicted(
        self, *, write: bool = True, loop: asyncio.AbstractEventLoop | None = None
    ) -> list[tuple[TierBridge, StagedBlobs, list[bytes]]]:
        """Gather every evicted block not staged yet; called before anything may overwrite
        freed CPU blocks (a D2H submit, a promote). With ``write`` the blobs are written in the
        background now; otherwise they are returned for the caller to write later (a fetch
        writes them after its own read, so that the write-back cannot push out of a small tier
        the very blocks the fetch is reading)."""
        self._evicted += self.books.take_evicted()
        if not self._evicted or not self.write_back:
            self._evicted = []
            return []
        evicted, self._evicted = self._evicted, []
        keys = [k for ks, _ in evicted for k in ks]
        ids = np.concatenate([i for _, i in evicted])
        bridge = self.bridges[0]
        job = (bridge, bridge.stage(keys, ids), keys)
        if write:
            self._spawn(*job, loop=loop)
            return []
        return [job]

    def write_evicted(
        self, evicted: list[tuple[list[bytes], np.ndarray]], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Stage ``evicted`` (the bookkeeper's evictions, taken as data) and write them in the
        background on ``loop``; run before any D2H copy is submitted."""
        self._evicted += evicted
        self.stage_evicted(write=True, loop=loop)

    def write_landed(self, landed: Landed) -> None:
        """Stores completed (the blocks are READY): write them through, when configured."""
        keys, ids = landed
        if not self.write_through or not keys:
            return
        for bridge in self.bridges:
            self._spawn(bridge, bridge.stage(keys, ids), keys)

    def _spawn(
        self,
        bridge: TierBridge,
        staged: StagedBlobs,
        keys: list[bytes],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Write in the background: at most ``MAX_WRITES_IN_FLIGHT`` writes run per tier and
        at most ``MAX_WRITE_BACKLOG`` wait; past that a write is dropped (counted), so a slow
        tier costs hits, never host memory or the loop's progress."""
        i = self.bridges.index(bridge)
        if self._backlog[i] >= MAX_WRITE_BACKLOG:
            self.num_writes_dropped += len(keys)
            return
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # closing outside the loop: nothing can run the write
                self.num_writes_dropped += len(keys)
                return
        self._backlog[i] += 1
        task = loop.create_task(self._put(i, staged, keys))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _put(self, i: int, staged: StagedBlobs, keys: list[bytes]) -> None:
        bridge = self.bridges[i]
        try:
            async with self._slots[i]:
                stored = await bridge.put_staged(staged)
        finally:
            self._backlog[i] -= 1
        done = [k for k, ok in zip(keys, stored.tolist()) if ok]
        self.books.events.emit("stored", done, bridge.backend.name)

    async def drain(self, timeout_s: float | None) -> None:
        """Wait (bounded) for the background writes."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    # ------------------------------------------------------------------ lookup and fetch

    async def lookup(self, keys: Sequence[bytes]) -> tuple[int, tuple[int, ...]]:
        """(CPU ready prefix, then how many following keys each lower tier holds in a run).

        A lower tier's answer is a hint (``contains_many``): the read may still miss.
        """
        keys = check_keys(keys, distinct=False)
        cpu = self.books.cpu.ready_prefix(keys)
        rest, runs = keys[cpu:], []
        for bridge in self.bridges:
            if not rest:
                runs.append(0)
                continue
            try:
                present = await bridge.backend.contains_many(bridge.namespace.stored_keys(rest))
            except TierError:  # a failing tier is a miss (the backend counted it)
                present = np.zeros(len(rest), dtype=bool)
            run = len(rest) if present.all() else int(np.argmin(present))
            runs.append(run)
            rest = rest[run:]
        return cpu, tuple(runs)

    async def fetch(self, keys: Sequence[bytes]) -> int:
        """Stage the lower tiers' blocks of the keys after the CPU ready prefix into the CPU
        tier; returns the new ready prefix length. See the module docstring."""
        keys = check_keys(keys, distinct=False)
        cpu = self.books.cpu
        prefix = cpu.ready_prefix(keys)
        rest = _after_prefix(cpu, keys, prefix)
        for bridge in self.bridges:
            if not rest:
                break
            try:  # a hint first: never evict CPU blocks for keys the tier does not hold
                present = await bridge.backend.contains_many(bridge.namespace.stored_keys(rest))
            except TierError:
                continue
            run = len(rest) if present.all() else int(np.argmin(present))
            # a store during the await may have indexed a key of the run: the run ends there
            run = next((i for i, k in enumerate(rest[:run]) if k in cpu.index), run)
            if run == 0:
                continue
            rest, later = rest[:run], rest[run:]
            protected = set(keys[:prefix]) | set(rest)
            try:
                ids = self.books.prepare_promote(rest, protected)
            except PoolExhaustedError:  # fetch what fits in free blocks
                rest = rest[: cpu.pool.num_free]
                if not rest:
                    break
                ids = self.books.prepare_promote(rest, protected)
            hit = await self._promote(bridge, rest, ids)
            if not hit.all():
                first_miss = int(np.argmin(hit))
                rest = [k for k, ok in zip(rest[first_miss:], hit[first_miss:].tolist()) if not ok]
            else:
                rest = later
        return cpu.ready_prefix(keys)

    async def _promote(self, bridge: TierBridge, keys: list[bytes], ids: np.ndarray) -> np.ndarray:
        """Promote ``keys`` into their prepared CPU blocks ``ids`` and settle the blocks (the
        hits READY), however the promote ends; bool ``[n]`` hits."""
        deferred = self.stage_evicted(write=False)  # victims' pages before the promote
        entry = (keys, ids)
        self.promoting.append(entry)
        try:  # (promote ends, cancelled or not, only after its scatter thread let go of
            # the blocks, so settling them here never frees memory a worker still writes)
            hit = await bridge.promote(keys, ids)
        except BaseException:
            hit = np.zeros(len(keys), dtype=bool)
            raise
        finally:
            self.promoting.remove(entry)
            num_hits = self.books.complete_promote(keys, ids, hit)
            self.num_fetch_hits += num_hits
            self.num_fetch_misses += len(keys) - num_hits
            for job in deferred:
                self._spawn(*job)
        return hit


def _after_prefix(cpu: CpuTier, keys: list[bytes], prefix: int) -> list[bytes]:
    """The keys after the ready ``prefix``, up to the first the CPU tier holds (PENDING, or a
    gap: stop at it) or a repeated one."""
    rest: list[bytes] = []
    seen = set()
    for key in keys[prefix:]:
        if key in cpu.index or key in seen:
            break
        seen.add(key)
        rest.append(key)
    return rest
