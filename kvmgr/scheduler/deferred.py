"""Per-call stores recorded at the call, prepared together at the next settle (issue 27).

Private to ``kvmgr.scheduler``. A plain ``swap_out(ids, keys)`` (a list of a few GPU ids, a
list of fresh keys, the default chain, no tokens, no hints, no admission control) only passes a
few checks and is *recorded*: its ids and keys are appended to flat buffers, it gets a
``CallFuture`` (its number in the ``StoreFanOut`` of the calls recorded since the last settle,
``fanout``), and its blocks are counted in ``CpuTier.reserved`` (the room it was promised: every
other consumer of CPU blocks sees that much less). When the free blocks run short, the victims are
evicted in one policy call at the settle if the tier surely has them, else at the call.
``settle`` (``kvmgr.scheduler.settle``) prepares every recorded call in one go, with the array operations of the batched
API (allocation, PENDING keys, policy insert, GPU busy counts), as ONE ``Part`` whose future is
that ``StoreFanOut``: resolved once, each call's ``SwapResult`` built when asked for.

The owner settles before anything reads or changes the bookkeeping (every other call of the
manager, the step, the tick, close), so every call observes the keys, states and results it
would have observed had every recorded store been prepared at its call. One thing differs: the
victims. The settle evicts the step's shortfall at once, before the step's inserts; under LRU
that picks the same victims as call by call, but ARC's list balance and S3-FIFO's queues
depend on the interleaving and may pick others (valid decisions of the policy; no KV is
wrong). Evicting call by call instead costs ARC's per-call store 0.17x -> 1.62x of vLLM's
manager (BENCHMARKS.md, round 4 session 7); pass ``parents`` to prepare a store at its call.
A call that does not pass the checks (a key already present or recorded, a block not held, no
room, ...) is not recorded: the owner settles and runs it through the general path, which
raises the typed error.
"""

from __future__ import annotations

import array
from collections.abc import Collection
from typing import Any

import numpy as np

from kvmgr.scheduler.cpu_tier import CpuTier
from kvmgr.scheduler.fanout import CallFuture, StoreFanOut
from kvmgr.scheduler.gpu_blocks import GpuBlocks, GpuState
from kvmgr.scheduler.keys import SMALL

__all__ = ["CallFuture", "DeferredStores", "StoreFanOut"]

_HELD = int(GpuState.HELD)


class DeferredStores:
    """The per-call stores recorded since the last ``take``.

    Args:
        cpu, gpu: the bookkeeper's CPU tier and GPU blocks (read; ``cpu.reserved`` counted).
        enabled: whether plain stores may be recorded (no admission control, threshold 1).

    Attributes:
        fan: the ``StoreFanOut`` of the calls recorded so far (``None``: none).
    """

    __slots__ = (
        "_chains", "_children", "_gpu_state", "_index", "_num_gpu", "_owned", "_seen",
        "cpu", "enabled", "ends", "fan", "gpu", "gpu_ids",
    )  # fmt: skip

    def __init__(self, cpu: CpuTier, gpu: GpuBlocks, *, enabled: bool) -> None:
        self.cpu = cpu
        self.gpu = gpu
        self.enabled = enabled
        self.fan: StoreFanOut | None = None
        self.ends: array.array[int] | None = None  # None: every call so far stored one block
        self.gpu_ids = array.array("q")
        #: the recorded keys, in call order (a dict: the order, and the test for repeats)
        self._seen: dict[bytes, None] = {}
        # never rebound by their owners: read on every call without the attribute chains
        self._index = cpu.index
        self._chains = cpu.chains
        self._children = cpu.chains.orphans  # new keys' indexed children (not indexed)
        self._num_gpu, self._gpu_state, self._owned = (
            gpu.num_blocks,
            gpu.state,
            gpu.pool is not None,
        )

    def __len__(self) -> int:
        """Calls recorded since the last ``take``."""
        return 0 if self.fan is None else self.fan.num_calls

    def record_one(self, gpu_id: object, key: object, loop: Any) -> CallFuture | None:
        """``record`` for one block (``[gpu_id]``, ``[key]``): the common per-call store,
        with the same checks and the same errors, without the loops over a call's blocks."""
        if (
            type(key) is not bytes
            or not key
            or key in self._index
            or key in self._seen
            or (self._children and key in self._children)  # indexed children: the general
            # path looks for cycles
            or type(gpu_id) is not int
            or not 0 <= gpu_id < self._num_gpu
            or (self._owned and self._gpu_state[gpu_id] != _HELD)
            or not self.enabled
        ):
            return None
        cpu = self.cpu
        reserved = cpu.reserved + 1
        short = reserved - cpu.pool.num_free  # blocks the settle must evict
        # (inlined _sure_victims: on every call once the tier is full)
        if short > 0 and short > (
            len(self._index) - cpu.num_pending - cpu.num_loading - self._chains.num_parents
        ):
            cpu.evict_for(1, (key,))  # not sure: evict now; PoolExhaustedError: no change
        cpu.reserved = reserved
        self._seen[key] = None
        self.gpu_ids.append(gpu_id)
        if self.ends is not None:
            self.ends.append(len(self._seen))
        fan = self.fan
        if fan is None:
            self.fan = fan = StoreFanOut(loop)
        call = CallFuture()  # fan.add_call(), inlined: the per-call path
        call._fan = fan
        call._i = fan.num_calls
        fan.num_calls += 1
        return call

    def record(self, gpu_ids: list[int], keys: list[bytes], loop: Any) -> CallFuture | None:
        """Record a store of ``keys[i]`` from ``gpu_ids[i]`` (default chain) if it passes every
        check of the per-call path, and return its future; ``None`` (nothing recorded) when it
        needs the general path: bad or repeated ids or keys, a key indexed or recorded already,
        a key with indexed children, an owned block not held.

        The blocks are reserved (``CpuTier.reserved``). When the free blocks do not cover
        every reservation, the settle evicts the shortfall in one policy call if the tier
        surely has that many victims (``_sure_victims``); otherwise the policy evicts it now
        (what a store prepared now would evict), raising here if it cannot.

        Raises:
            PoolExhaustedError: too few free and evictable CPU blocks; nothing changed.
        """
        n = len(keys)
        if n == 1 and len(gpu_ids) == 1:
            return self.record_one(gpu_ids[0], keys[0], loop)
        if not 0 < n <= SMALL or len(gpu_ids) != n or not self.enabled:
            return None
        index, seen, children = self._index, self._seen, self._children
        num_gpu, gpu_state, owned = self._num_gpu, self._gpu_state, self._owned
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
                return None
        if len(set(keys)) != n or len(set(gpu_ids)) != n:
            return None
        if children and not children.keys().isdisjoint(keys):
            return None  # indexed children: the general path looks for cycles
        cpu = self.cpu
        if cpu.reserved + n > cpu.pool.num_free:
            self._room_short(n, keys)
        cpu.reserved += n
        if self.ends is None:  # the calls so far stored one block each
            self.ends = array.array("q", range(1, len(seen) + 1))
        seen.update(dict.fromkeys(keys))
        self.gpu_ids.fromlist(gpu_ids)
        self.ends.append(len(seen))
        fan = self.fan
        if fan is None:
            self.fan = fan = StoreFanOut(loop)
        return fan.add_call()

    def _room_short(self, n: int, keys: Collection[bytes]) -> None:
        """The free blocks do not cover every reservation plus ``n``: evict now unless the
        tier surely has the victims for the settle.

        Raises:
            PoolExhaustedError: too few free and evictable CPU blocks; nothing changed.
        """
        cpu = self.cpu
        short = cpu.reserved + n - cpu.pool.num_free  # blocks the settle must evict
        if short > _sure_victims(cpu):  # not sure: evict now, as a store prepared now would
            cpu.evict_for(n, keys)  # evicts every recorded shortfall; PoolExhaustedError:
            # nothing changed

    def take(self) -> tuple[StoreFanOut, array.array[int] | None, np.ndarray, list[bytes]]:
        """Remove every recorded call: (their fan-out, ends or ``None`` for one block each,
        GPU ids int64 ``[n]``, keys); their reservation is released (the caller allocates
        their blocks right away). Only when ``fan`` is set."""
        fan = self.fan
        assert fan is not None
        keys = list(self._seen)
        taken = (fan, self.ends, np.frombuffer(self.gpu_ids, dtype=np.int64), keys)
        self.cpu.reserved -= len(keys)
        self.fan, self.ends = None, None
        self.gpu_ids = array.array("q")
        self._seen = {}
        return taken


def _sure_victims(cpu: CpuTier) -> int:
    """A lower bound of the keys the policy can evict now: READY keys without readers that
    are leaves of their chains (every key with an indexed child left out, and then some: a
    parent counted in ``chains.num_parents`` may not be indexed). A policy evicts any such key."""
    return len(cpu.index) - cpu.num_pending - cpu.num_loading - cpu.chains.num_parents
