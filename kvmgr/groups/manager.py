"""GroupedManager: one ``OffloadManager`` per cache group, one restorable key space over them.

Offers:
    GroupedManager   lookup / store / load / step over a model's cache groups
    GroupedStore     what a grouped store did, per group (``_results.py``, re-exported)

Composition, not inheritance: each group keeps its own ``OffloadManager`` (its tensors, block
ids, CPU pool and policy); the grouped manager holds the ``GroupIndex`` and needs only the
managers' public calls (``swap_out``, ``swap_in``, ``check_store_room``, ``peek``, ``touch``,
``invalidate``, ``take_events``, ``step``). Keys are ``OffloadKey`` bytes (block hash + group
id), so the managers' KV events name ``(block hash, group)`` as vLLM's do.

Lookups hit only at a boundary every group can restore (``find_restorable``); loads move only
the blocks that boundary needs (the window for a sliding-window group, one state for a
recurrent group). When any group's policy evicts a block, the index returns the blocks of the
other groups that no restorable boundary needs any more and the manager drops them
(``invalidate``) in the same call: no group keeps CPU memory for a prefix that another group
can no longer restore. docs/hybrid-models.md describes the rules.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import attrs

from kvmgr._futures import queue_all, quiet
from kvmgr.config import ManagerConfig
from kvmgr.errors import ClosedError, KVMgrError, UnknownKeyError
from kvmgr.groups._results import GroupedStore, by_group, grouped_store
from kvmgr.groups._tables import check_blocks, check_room, load_work, store_work
from kvmgr.groups._tracker import IndexTracker
from kvmgr.groups.errors import GroupSpecError
from kvmgr.groups.index import GroupIndex
from kvmgr.groups.restore import RestorePlan, find_restorable
from kvmgr.groups.spec import GroupedLayout
from kvmgr.manager import OffloadManager
from kvmgr.reports import KVEvent, SwapResult

__all__ = ["GroupedManager", "GroupedStore"]


class GroupedManager:
    """Offloads a hybrid model's KV cache: one ``OffloadManager`` per cache group.

    Args:
        layout: the groups; ``managers[i]`` serves ``layout.groups[i]``.
        managers: open or not yet entered managers, one per group, whose tensors' page bytes
            equal the group's ``page_bytes``, each with ``store_threshold=1`` and KV events on
            (``max_events > 0``). The grouped manager consumes their events (read them from
            ``take_events``) and closes them on ``aclose``.

    Raises:
        GroupSpecError: ``managers`` is not a sequence of ``OffloadManager`` (a mapping by
            group name is refused too), one manager serves several groups, a count or page
            size differs from the layout, or a manager's config does not suit (events off, a
            store threshold).
    """

    def __init__(self, layout: GroupedLayout, managers: Sequence[OffloadManager]) -> None:
        if not isinstance(layout, GroupedLayout):
            raise GroupSpecError(f"expected a GroupedLayout, got {type(layout).__name__}")
        managers = [] if isinstance(managers, Mapping) else list(managers)  # not by name
        if not managers or not all(isinstance(m, OffloadManager) for m in managers):
            raise GroupSpecError("expected a sequence of OffloadManager in layout group order")
        if len(managers) != len(layout.groups):
            raise GroupSpecError(f"expected {len(layout.groups)} managers, got {len(managers)}")
        if len(set(map(id, managers))) < len(managers):  # one tier's room checked per group
            raise GroupSpecError("expected one manager per group, got one for several groups")
        for spec, mgr in zip(layout.groups, managers, strict=True):
            layout_of = getattr(mgr, "gpu_layout", None)  # None: the tensors live on ranks
            pages = spec.page_bytes if layout_of is None else tuple(map(int, layout_of.page_bytes))
            if pages != spec.page_bytes:
                raise GroupSpecError(
                    f"group {spec.name!r}: page bytes {spec.page_bytes} expected, the manager's "
                    f"tensors have {pages}"
                )
            if mgr.config.max_events < 1 or mgr.config.store_threshold != 1:
                raise GroupSpecError(
                    f"group {spec.name!r}: a grouped manager needs max_events > 0 and "
                    f"store_threshold = 1, got {mgr.config.max_events}, "
                    f"{mgr.config.store_threshold}"
                )
        self.layout = layout
        self.managers = managers
        self._tracker = IndexTracker(layout, managers)
        self.index: GroupIndex = self._tracker.index

    @classmethod
    def create(
        cls,
        layout: GroupedLayout,
        gpu_caches: Mapping[str, Sequence[Any]],
        num_cpu_blocks: Mapping[str, int],
        config: ManagerConfig | None = None,
    ) -> GroupedManager:
        """Build one ``OffloadManager`` per group from one config (``num_cpu_blocks`` per group).

        Args:
            gpu_caches: group name -> that group's KV tensors (``[num_blocks, ...]`` each).
            num_cpu_blocks: group name -> CPU blocks of that group's tier.
            config: the template (``num_cpu_blocks`` is replaced); default: LRU, host engine,
                caller-owned GPU blocks (``manage_gpu_blocks=False``, as vLLM's block tables).

        Raises:
            GroupSpecError: a group has no tensors or no CPU block count, or a name is unknown.
            GeometryError, ConfigError, HostMemoryError: as ``OffloadManager``.
        """
        names = [g.name for g in layout.groups]
        for what, given in (("gpu_caches", gpu_caches), ("num_cpu_blocks", num_cpu_blocks)):
            if sorted(given) != sorted(names):
                raise GroupSpecError(f"{what}: expected the groups {names}, got {sorted(given)}")
        if config is None:
            config = ManagerConfig(num_cpu_blocks=1, engine="host", manage_gpu_blocks=False)
        managers: list[OffloadManager] = []
        try:
            for name in names:
                cfg = attrs.evolve(config, num_cpu_blocks=num_cpu_blocks[name])
                managers.append(OffloadManager(gpu_caches[name], cfg))  # checks the sequence
            return cls(layout, managers)
        except BaseException:
            for mgr in managers:
                mgr.close()
            raise

    async def __aenter__(self) -> GroupedManager:
        for mgr in self.managers:
            await mgr.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every group's manager (each waits for its copies in flight)."""
        for mgr in self.managers:
            await mgr.aclose()

    # ------------------------------------------------------------------ lookups

    def lookup(
        self, block_hashes: Sequence[bytes], *, max_tokens: int | None = None
    ) -> RestorePlan:
        """The longest boundary every group can restore, and what to load for it; touches
        the plan's blocks in each group's policy.

        Args:
            block_hashes: the request's chained block hashes, one per ``hash_block_size``
                tokens.
            max_tokens: cap on the boundary (``None``: every hash).

        Raises:
            GroupKeyError: bad hashes (or hashes contradicting a stored chain) or
                ``max_tokens``; nothing changed.
            ClosedError: a manager is closed.
        """
        plan = self.peek(block_hashes, max_tokens=max_tokens)
        for mgr, keys in zip(self.managers, plan.keys, strict=True):
            if keys:
                mgr.touch(keys)
        return plan

    def peek(self, block_hashes: Sequence[bytes], *, max_tokens: int | None = None) -> RestorePlan:
        """Like ``lookup``, touching nothing. Raises as ``lookup``."""
        if any(mgr.closed for mgr in self.managers):  # (the index outlives the managers)
            raise ClosedError("a group's manager is closed")
        self.sync()
        hashes = self.layout.check_hashes(block_hashes)
        self.index.check_chain(hashes)  # unchained hashes would plan another position's KV
        return find_restorable(self.layout, hashes, self.index.is_ready, max_tokens)

    # ------------------------------------------------------------------ swaps

    def store(
        self, block_hashes: Sequence[bytes], block_tables: Mapping[str, Sequence[int | None]]
    ) -> asyncio.Future[GroupedStore]:
        """Queue a store of every group's full blocks that the tables name.

        Args:
            block_hashes: the request's chained block hashes (hash blocks).
            block_tables: group name -> GPU block id of each logical block of that group
                (ints, numpy ints or ``None`` where the GPU no longer holds it, such as a
                sliding-window block that left the window; or a 1-D integer array); entries
                past the hashed prefix are ignored, groups not in the mapping store nothing.

        Returns:
            A future of the ``GroupedStore`` or the first group's error, once every group's
            copy ended. Cancelled, it is done at once while the copies run: reuse a block
            only once its group manager's ``snapshot().gpu_busy`` no longer names it.

        Raises:
            GroupKeyError: bad or repeated hashes (or hashes contradicting a stored chain), an
                unknown group, or a table entry that is not an int or ``None``; nothing changed.
            PoolExhaustedError: a group has no room (``OffloadManager.check_store_room``,
                exact, for every group before any store is queued: nothing changed; should a
                group refuse after others queued all the same, the future fails, above).
            InvalidBlockError, ClosedError: a group's GPU ids are bad (as
                ``OffloadManager.swap_out``), or its manager is closed; checked for every group
                before any store is queued.
            EventLoopError: as ``OffloadManager.swap_out``.
        """
        self.sync()
        hashes = self.layout.check_hashes(block_hashes)
        self.index.check_chain(hashes)
        work = store_work(self.layout, hashes, block_tables)
        check_blocks([(g, ids) for g, ids, _, _ in work], self.layout, self.managers, "store")
        check_room(work, self.layout, self.managers)
        queued: list[bytes] = []  # the queued groups' keys (a late refusal: queue_all)
        every = queue_all(partial(self._queue_store, hashes, w, queued) for w in work)
        store = grouped_store(every, [w[0] for w in work], len(self.managers))
        future = quiet(asyncio.ensure_future(store))
        self.sync()  # the stores' evictions
        return future

    def _queue_store(self, hashes: list[bytes], work: Any, queued: list[bytes]) -> Any:
        """One group's ``swap_out``, its keys PENDING in the index; its future. Refused, the
        groups queued before are rechecked (landed alone, they restore nothing)."""
        g, ids, keys, parents = work
        try:
            future = self.managers[g].swap_out(ids, keys, parents)
        except KVMgrError:
            self.index.recheck(queued)
            raise
        self.index.add_pending(hashes, g, keys)
        queued.extend(keys)
        future.add_done_callback(self._store_done(keys))
        return future

    def _store_done(self, keys: list[bytes]) -> Any:
        """A failed store's PENDING keys leave the index; the orphans that leaves behind are
        dropped at the next sync. (The futures are never cancelled: ``all_ended`` shields them.)"""

        def done(future: asyncio.Future[SwapResult]) -> None:
            if not future.cancelled() and future.exception() is not None:
                failed = [k for k in keys if self.index.is_held(k) and not self.index.is_ready(k)]
                self._tracker.defer(self.index.removed(failed))

        return done

    def load(
        self, plan: RestorePlan, block_tables: Mapping[str, Sequence[int]]
    ) -> asyncio.Future[list[SwapResult | None]]:
        """Queue the loads of a plan from ``lookup``: group ``g``'s ``plan.blocks[g]`` into
        ``block_tables[g][j]`` for each logical block ``j`` there.

        Returns:
            A future resolving to per-group ``SwapResult`` (``None``: nothing to load there).

        Raises:
            GroupKeyError: a group of the plan has no table, or a table lacks a block.
            UnknownKeyError: a planned block left the tier since the lookup (look up again);
                nothing was queued.
            InvalidBlockError, ClosedError: as ``store``, checked before any load is queued.
            EventLoopError: as ``OffloadManager.swap_in``.
        """
        self.sync()
        work = load_work(self.layout, plan, block_tables)
        check_blocks([(g, ids) for g, _, ids in work], self.layout, self.managers, "load")
        for g, keys, _ in work:
            if self.managers[g].peek(keys) != len(keys):
                name = self.layout.groups[g].name
                raise UnknownKeyError(f"group {name!r}: a planned block left the tier")
        every = queue_all(partial(self.managers[g].swap_in, keys, ids) for g, keys, ids in work)
        groups = [w[0] for w in work]
        return quiet(asyncio.ensure_future(by_group(every, groups, len(self.managers))))

    async def step(self, ctx: Any = None) -> list[Any]:
        """One scheduler step of every group's manager (hooks, then one flush each); then the
        index applies what landed and what left. Returns the groups' ``StepReport``s."""
        reports = [await mgr.step(ctx) for mgr in self.managers]
        self.sync()
        self._tracker.check_lost()
        return reports

    def sync(self) -> None:
        """Apply the managers' KV events to the index and drop the orphans they leave.

        Called by every public method; call it yourself after awaiting a store's future
        outside ``step``."""
        self._tracker.sync()

    @property
    def num_orphans_dropped(self) -> int:
        """Blocks dropped because no restorable boundary needed them any more (a total)."""
        return self._tracker.num_orphans_dropped

    def take_events(self) -> list[KVEvent]:
        """The groups' KV events since the last call, in the order the index applied them;
        keys are ``OffloadKey`` bytes (``block_hash + group id``)."""
        self.sync()
        return self._tracker.take_events()

    def statistics(self) -> list[Any]:
        """Every group's ``ManagerStatistics``, in layout order."""
        return [mgr.statistics() for mgr in self.managers]
