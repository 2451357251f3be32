"""Per-call stores recorded at the call, prepared together at the next settle (issue 27).

Private to ``kvmgr.scheduler``. A plain ``swap_out(ids, keys)`` (a list of a few GPU ids, a
list of fresh keys, the default chain, no tokens, no hints, no admission control) only passes a
few checks and is *recorded*: its ids and keys are appended to flat buffers, its future to a
list, and its blocks are counted in ``CpuTier.reserved`` (the room it was promised: every other
consumer of CPU blocks sees that much less). When the free blocks run short, the victims are
evicted in one policy call at the settle if the tier surely has them, else at the call.
``settle`` prepares every recorded call in one go, with the array operations of the batched
API (allocation, PENDING keys, policy insert, GPU busy counts), as ONE ``Part`` whose future is
a ``StoreFanOut`` that resolves each call's future with its own ``SwapResult``.

The owner settles before anything reads or changes the bookkeeping (every other call of the
manager, the step, the tick, close), so what any call observes is exactly what it would have
observed had every recorded store been prepared at its call. A call that does not pass the
checks (a key already present or recorded, a block not held, no room, ...) is not recorded:
the owner settles and runs it through the general path, which raises the typed error.
"""

from __future__ import annotations

import array
from typing import Any

import numpy as np

from kvmgr.errors import KVMgrError, PoolExhaustedError
from kvmgr.reports import SwapResult
from kvmgr.scheduler.cpu_tier import CpuTier
from kvmgr.scheduler.gpu_blocks import GpuBlocks, GpuState
from kvmgr.scheduler.keys import SMALL
from kvmgr.scheduler.queue import Kind, Part
from kvmgr.scheduler.store import Stores

__all__ = ["DeferredStores", "StoreFanOut", "settle"]

_HELD = int(GpuState.HELD)
_new = tuple.__new__  # a SwapResult from its fields without the NamedTuple's Python __new__


class StoreFanOut:
    """The future of a part that stands for many recorded per-call stores.

    ``set_result`` / ``set_exception`` resolve every call's future (those not cancelled), in
    call order; call ``i`` covers entries ``ends[i - 1]:ends[i]`` of ``gpu_ids`` / ``cpu_ids``.
    """

    __slots__ = ("block_bytes", "cpu_ids", "ends", "futures", "gpu_ids")

    def __init__(
        self,
        futures: list[Any],
        ends: array.array[int],
        gpu_ids: np.ndarray,
        cpu_ids: np.ndarray,
        block_bytes: int,
    ) -> None:
        self.futures = futures
        self.ends = ends
        self.gpu_ids = gpu_ids
        self.cpu_ids = cpu_ids
        self.block_bytes = block_bytes

    @property
    def num_calls(self) -> int:
        """The per-call stores this part stands for."""
        return len(self.futures)

    def done(self) -> bool:
        return False  # each call's future is resolved on its own

    def set_result(self, _value: object) -> None:
        """Resolve each call's future with its ``SwapResult`` (blocks, bytes, ids)."""
        gpu, cpu, size = self.gpu_ids.tolist(), self.cpu_ids.tolist(), self.block_bytes
        start = 0
        for future, end in zip(self.futures, self.ends):
            if not future.cancelled():
                n = end - start
                if n == 1:
                    ids = (cpu[start],), (gpu[start],)
                else:
                    ids = tuple(cpu[start:end]), tuple(gpu[start:end])
                future.set_result(_new(SwapResult, (n, n * size, 0, *ids)))
            start = end

    def set_exception(self, error: BaseException) -> None:
        """Fail each call's future not resolved yet with ``error`` (marked retrieved)."""
        for future in self.futures:
            if not future.done():
                future.set_exception(error)
                future.exception()

    def exception(self) -> None:
        return None


class DeferredStores:
    """The per-call stores recorded since the last ``take``.

    Args:
        cpu, gpu: the bookkeeper's CPU tier and GPU blocks (read; ``cpu.reserved`` counted).
        enabled: whether plain stores may be recorded (no admission control, threshold 1).
    """

    __slots__ = (
        "_children", "_gpu_state", "_index", "_num_gpu", "_owned", "_seen",
        "cpu", "enabled", "ends", "futures", "gpu", "gpu_ids", "keys",
    )  # fmt: skip

    def __init__(self, cpu: CpuTier, gpu: GpuBlocks, *, enabled: bool) -> None:
        self.cpu = cpu
        self.gpu = gpu
        self.enabled = enabled
        self.futures: list[Any] = []
        self.ends = array.array("q")
        self.gpu_ids = array.array("q")
        self.keys: list[bytes] = []
        self._seen: set[bytes] = set()
        # never rebound by their owners: read on every call without the attribute chains
        self._index = cpu.index
        self._children = cpu.chains.orphans  # new keys' indexed children (not indexed)
        self._num_gpu, self._gpu_state, self._owned = (
            gpu.num_blocks,
            gpu.state,
            gpu.pool is not None,
        )

    def __len__(self) -> int:
        return len(self.futures)

    def record(self, gpu_ids: list[int], keys: list[bytes], future: Any) -> bool:
        """Record a store of ``keys[i]`` from ``gpu_ids[i]`` (default chain) if it passes every
        check of the per-call path; ``False`` (nothing recorded) when it needs the general
        path: bad or repeated ids or keys, a key indexed or recorded already, a key with
        indexed children, an owned block not held.

        The blocks are reserved (``CpuTier.reserved``). When the free blocks do not cover
        every reservation, the settle evicts the shortfall in one policy call if the tier
        surely has that many victims (``_sure_victims``); otherwise the policy evicts it now
        (what a store prepared now would evict), raising here if it cannot.

        Raises:
            PoolExhaustedError: too few free and evictable CPU blocks; nothing changed.
        """
        n = len(keys)
        if not 0 < n <= SMALL or len(gpu_ids) != n or not self.enabled:
            return False
        index, seen, children = self._index, self._seen, self._children
        num_gpu, gpu_state, owned = self._num_gpu, self._gpu_state, self._owned
        if n == 1:
            key, b = keys[0], gpu_ids[0]
            if (
                type(key) is not bytes
                or not key
                or key in index
                or key in seen
                or key in children  # indexed children: the general path looks for cycles
                or type(b) is not int
                or not 0 <= b < num_gpu
                or (owned and gpu_state[b] != _HELD)
            ):
                return False
        else:
            for key, b in zip(keys, gpu_ids):
                if (
                    type(key) is not bytes
                    or not key
                    or key in index
                    or key in seen
                    or type(b) is not int
                    or not 0 <= b < num_gpu
                    or (owned and gpu_state[b] != _HELD)
                ):
                    return False
            if len(set(keys)) != n or len(set(gpu_ids)) != n:
                return False
            if children and not children.keys().isdisjoint(keys):
                return False  # indexed children: the general path looks for cycles
        cpu = self.cpu
        short = cpu.reserved + n - cpu.pool.num_free  # blocks the settle must evict
        if short > 0 and short > _sure_victims(cpu):  # not sure: evict now, as before
            cpu.evict_for(n, keys)  # evicts every recorded shortfall; PoolExhaustedError:
            # nothing changed
        cpu.reserved += n
        self.futures.append(future)
        self.gpu_ids.fromlist(gpu_ids)
        keys_so_far = self.keys
        keys_so_far += keys
        self.ends.append(len(keys_so_far))
        seen.update(keys)
        return True

    def take(self) -> tuple[list[Any], array.array[int], np.ndarray, list[bytes]]:
        """Remove every recorded call: (futures, ends, GPU ids int64 ``[n]``, keys); their
        reservation is released (the caller allocates their blocks right away)."""
        taken = (
            self.futures,
            self.ends,
            np.frombuffer(self.gpu_ids, dtype=np.int64),
            self.keys,
        )
        self.cpu.reserved -= len(self.keys)
        self.futures, self.keys = [], []
        self.ends, self.gpu_ids = array.array("q"), array.array("q")
        self._seen = set()
        return taken


def _sure_victims(cpu: CpuTier) -> int:
    """A lower bound of the keys the policy can evict now: READY keys without readers that
    are leaves of their chains (every key with an indexed child left out, and then some: a
    parent counted in ``chains.num_parents`` may not be indexed). A policy evicts any such key."""
    return len(cpu.index) - cpu.num_pending - cpu.num_loading - cpu.chains.num_parents


def settle(deferred: DeferredStores, stores: Stores) -> list[Part]:
    """Prepare every recorded call: one ``Part`` for all of them (empty list: none recorded).

    Uses the batched path's steps (``CpuTier.make_room`` with one eviction for all, then
    ``add_pending`` and the GPU busy counts over arrays). Should the tier refuse the room it
    promised (a policy that cannot evict every READY block without readers), each call is
    prepared on its own through ``stores.prepare`` instead, in call order, and a call that
    still finds no room gets its ``PoolExhaustedError`` through its future.
    """
    if not deferred.futures:
        return []
    futures, ends, gpu_ids, keys = deferred.take()
    cpu, gpu = stores.cpu, stores.gpu
    n = len(keys)
    try:
        cpu_ids = cpu.make_room(n, ())  # recorded keys are not in the tier: none to protect
    except PoolExhaustedError:
        return _one_by_one(stores, futures, ends, gpu_ids, keys)
    # the policy learns the calls as if inserted one by one: a later call more recent, and
    # within a call the first key most recent (one insert takes its first key most recent)
    if len(futures) == n:  # one block per call: every key a root
        parents: list[bytes | None] = [None] * n
        cpu.add_pending(keys[::-1], cpu_ids[::-1], parents)
    else:
        parents = keys[:]
        order: list[Any] = []
        start = 0
        for end in ends:
            parents[start + 1 : end] = keys[start : end - 1]
            parents[start] = None
            order.append(range(start, end))
            start = end
        order = [i for call in reversed(order) for i in call]
        cpu.add_pending([keys[i] for i in order], cpu_ids[order], [parents[i] for i in order])
    gpu_ids = gpu_ids.copy()
    if gpu.distinct(gpu_ids):
        gpu.busy_np[gpu_ids] += 1
    else:  # two calls stored one GPU block: a count per occurrence
        np.add.at(gpu.busy_np, gpu_ids, 1)
    stores.counters.stores_queued += n
    fan = StoreFanOut(futures, ends, gpu_ids, cpu_ids, stores.block_bytes)
    return [Part(Kind.STORE, fan, None, gpu_ids, cpu_ids, keys, parents=parents)]


def _one_by_one(
    stores: Stores, futures: list[Any], ends: Any, gpu_ids: np.ndarray, keys: list[bytes]
) -> list[Part]:
    parts, start, ids = [], 0, gpu_ids.tolist()
    for future, end in zip(futures, ends):
        try:
            parts.append(
                stores.prepare(ids[start:end], keys[start:end], None, future, batched=False)
            )
        except KVMgrError as exc:
            stores.counters.reject(getattr(exc, "reason", "cpu_full"))
            future.set_exception(exc)
        start = end
    return parts
