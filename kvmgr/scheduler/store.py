"""Keyed stores on the scheduler side: validate, admit, reserve CPU blocks, build the ``Part``.

Private to ``kvmgr.scheduler``; the ``Bookkeeper`` holds one ``Stores``. A store runs in steps,
each a method: ``_fresh`` (which keys are not in the CPU tier), ``_admit`` (the store threshold
and the policy's admission), ``_reserve`` (CPU blocks, evicting through the policy: the last
check, all or nothing), then the commit (keys PENDING, GPU blocks busy, counters) and
``_result`` (what the future gets). Until the copy's outcome is applied the new keys are
PENDING on their CPU blocks (not readable, not evictable) and each GPU block named has one more
busy count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmgr._ids_c import ids_c
from kvmgr._index_c import index_c
from kvmgr.config import ManagerConfig
from kvmgr.errors import InvalidKeyError
from kvmgr.events.tokens import check_token_ids
from kvmgr.policy.hints import hints_per_key
from kvmgr.reports import StoreResult, SwapResult
from kvmgr.scheduler.counters import Counters
from kvmgr.scheduler.cpu_tier import CpuTier
from kvmgr.scheduler.fresh_store import add_new
from kvmgr.scheduler.gpu_blocks import GpuBlocks
from kvmgr.scheduler.keys import SMALL, check_keys, check_parents
from kvmgr.scheduler.queue import Kind, Part

__all__ = ["Stores"]


class Stores:
    """Prepares keyed stores over the CPU tier and the GPU blocks.

    Args:
        cpu, gpu, counters: the bookkeeper's parts.
        config: ``store_threshold`` (sightings before a key is stored).
        block_bytes: bytes of one block (for the results).
    """

    def __init__(
        self,
        cpu: CpuTier,
        gpu: GpuBlocks,
        counters: Counters,
        config: ManagerConfig,
        block_bytes: int,
    ) -> None:
        self.cpu = cpu
        self.gpu = gpu
        self.counters = counters
        self.block_bytes = block_bytes
        self._threshold = config.store_threshold
        #: no admission control: plain per-call stores may be recorded (``deferred``)
        self.plain_admission = config.store_threshold == 1 and not hasattr(cpu.policy, "admit")
        #: store sightings of keys not stored yet (bounded; only with store_threshold > 1)
        self._seen: dict[bytes, int] = {}
        index_c(), ids_c()  # built (or found missing) now, not at the first store

    def prepare(
        self,
        gpu_block_ids: object,
        keys: object,
        parents: object,
        future: Any,
        *,
        batched: bool,
        held: bool = False,
        token_ids: object = None,
        hints: object = None,
    ) -> Part:
        """Reserve CPU blocks for the keys not in the CPU tier yet; they become PENDING.

        ``hints`` (``StoreHint``, one per key, or ``None``; see ``kvmgr.policy.hints``) go to
        ``admit`` of a policy whose ``takes_hints`` is true; others ignore them.

        ``held``: ``gpu_block_ids`` were validated by an earlier call and a waiting store holds
        them (``backpressure``), so they are not checked again (an owned block may be
        ``DRAINING`` by now: its request was freed while the store waited). ``token_ids`` ride
        in the part to the ``stored`` event (the rows of the keys actually stored).

        Raises:
            InvalidBlockError, InvalidKeyError: bad ids or keys, or different counts.
            InvalidArgumentError: bad ``token_ids``.
            PoolExhaustedError: no room even after eviction; nothing changed.
        """
        gpu: Any = gpu_block_ids if held else self.gpu.checked_ids(gpu_block_ids, "store")
        keys = check_keys(keys, distinct=not batched)
        n = len(keys)
        if n != len(gpu):
            raise InvalidKeyError(
                f"expected one key per gpu block, got {n} keys and {len(gpu)} blocks"
            )
        all_parents = None if parents is None else check_parents(keys, parents)
        tokens = None if token_ids is None or n == 0 else check_token_ids(token_ids, n)
        per_key = hints_per_key(hints, n)
        cpu, gpu_array = self.cpu, not isinstance(gpu, list)
        cpu_ids: Any = None
        plain = parents is None and self.plain_admission and n > SMALL and gpu_array
        if plain and keys[0] not in cpu.index:  # (a prefix already stored: the general path)
            cpu_ids = add_new(cpu, keys, None)  # keys all new: one pass over the index
        fresh: Sequence[int]
        if cpu_ids is None:
            if all_parents is None:
                all_parents = check_parents(keys, None)
            fresh, waiting, num_present, cpu_ids, new_keys, new_parents = self._reserve(
                keys, parents, all_parents, per_key, gpu_array, batched
            )
        else:  # what ``_reserve`` gives when every key is new (the default chain: no list)
            fresh, waiting, num_present, new_keys, new_parents = range(n), [], 0, keys, None
        m = len(fresh)
        everything = m == n
        if tokens is not None:
            tokens = None if m == 0 else tokens if everything else tokens[fresh]
        if self._threshold > 1:
            self._count_sightings(new_keys, waiting)
        if num_present:  # the resident part of the call's prefix was just used again
            written = frozenset(new_keys)
            index = cpu.index
            cpu.policy.touch([k for k in keys if k in index and k not in written])
        if everything:
            src: Any = gpu
        else:
            src = gpu[np.array(fresh, dtype=np.int64)] if gpu_array else [gpu[i] for i in fresh]
        self.gpu.acquire(src)
        counters = self.counters
        counters.stores_queued += m
        counters.stores_skipped += num_present
        counters.stores_not_admitted += n - m - num_present
        result = self._result(keys, fresh, cpu_ids, src, batched=batched, waiting=bool(waiting))
        chain = parents is None and everything  # the default chain: the lane rebuilds it
        return Part(
            Kind.STORE, future, result, src, cpu_ids, new_keys,
            parents=None if chain else new_parents, token_ids=tokens,
        )  # fmt: skip

    # ------------------------------------------------------------------ steps

    def _reserve(
        self,
        keys: list[bytes],
        parents: object,
        all_parents: list[bytes | None],
        per_key: list[Any] | None,
        gpu_array: bool,
        batched: bool,
    ) -> tuple[list[int], list[bytes], int, Any, list[bytes], list[bytes | None]]:
        """The new keys PENDING on their blocks (the general path: ``_fresh``, ``_admit``, the
        room): (fresh indices admitted, keys turned away, keys present, their CPU blocks, the
        new keys, their parents).

        Raises:
            InvalidKeyError: a parent chain reaching the key itself; nothing changed.
            PoolExhaustedError: no room even after eviction; nothing changed.
        """
        n, cpu = len(keys), self.cpu
        fresh = self._fresh(keys, batched)
        num_present = n - len(fresh)
        # a parent chain reaching the key itself: InvalidKeyError, nothing changed. The default
        # chain of keys all new cannot close one: every walk goes to earlier keys of the call
        # and ends at keys[0], a root
        if num_present == 0:
            if parents is not None and n:
                cpu.chains.check(keys, all_parents)
        elif fresh:
            cpu.chains.check([keys[i] for i in fresh], [all_parents[i] for i in fresh])
        fresh, waiting = self._admit(keys, fresh, all_parents, per_key)
        everything = len(fresh) == n
        new_keys = keys if everything else [keys[i] for i in fresh]
        m = len(new_keys)
        # the last check: raises PoolExhaustedError with nothing changed. Only keys of the
        # call already in the tier need protecting from eviction (the others are not tracked)
        protected = keys if num_present else ()
        cpu_ids = cpu.make_room(m, protected) if gpu_array else cpu.make_room_small(m, protected)
        new_parents = all_parents if everything else [all_parents[i] for i in fresh]
        if m:  # the new keys were absent at ``_fresh``; the admission and the room-making
            cpu.add_pending(new_keys, cpu_ids, new_parents, vouched=True)  # added none
        return fresh, waiting, num_present, cpu_ids, new_keys, new_parents

    def _fresh(self, keys: list[bytes], batched: bool) -> list[int]:
        """Indices of the keys not in the CPU tier (any state); a batched call's repeated keys
        count once (the first occurrence)."""
        n, index = len(keys), self.cpu.index
        if n <= SMALL:
            fresh = [i for i in range(n) if keys[i] not in index]
        elif index.keys().isdisjoint(keys):
            fresh = list(range(n))
        else:
            fresh = np.flatnonzero(~_present(index, keys)).tolist()
        if batched and n > 1 and len(set(keys)) != n:
            first: dict[bytes, int] = {}
            for i in fresh:
                first.setdefault(keys[i], i)
            fresh = sorted(first.values())
        return fresh

    def _admit(
        self,
        keys: list[bytes],
        fresh: list[int],
        parents: list[bytes | None],
        hints: list[Any] | None = None,
    ) -> tuple[list[int], list[bytes]]:
        """(The fresh indices admitted, the keys turned away): the store threshold (keys seen
        ``store_threshold`` times, this call included), then the policy's ``admit``. No state
        changes here."""
        waiting: list[bytes] = []
        if self._threshold > 1 and fresh:
            seen, threshold = self._seen, self._threshold
            waiting = [keys[i] for i in fresh if seen.get(keys[i], 0) + 1 < threshold]
            fresh = [i for i in fresh if seen.get(keys[i], 0) + 1 >= threshold]
        admit = getattr(self.cpu.policy, "admit", None)
        if admit is not None and fresh:
            args = ([keys[i] for i in fresh], [parents[i] for i in fresh])
            if hints is not None and getattr(self.cpu.policy, "takes_hints", False):
                mask = np.asarray(admit(*args, hints=[hints[i] for i in fresh]))
            else:
                mask = np.asarray(admit(*args))
            if not mask.all():
                oks = mask.tolist()
                waiting += [keys[i] for i, ok in zip(fresh, oks) if not ok]
                fresh = [i for i, ok in zip(fresh, oks) if ok]
        return fresh, waiting

    def _count_sightings(self, stored: list[bytes], waiting: list[bytes]) -> None:
        seen = self._seen
        for key in stored:
            seen.pop(key, None)
        for key in waiting:
            seen[key] = seen.pop(key, 0) + 1
        bound = 4 * self.cpu.num_blocks
        while len(seen) > bound:  # forget the oldest sightings
            del seen[next(iter(seen))]

    def _result(
        self,
        keys: list[bytes],
        fresh: Sequence[int],
        cpu_ids: Any,
        src: Any,
        *,
        batched: bool,
        waiting: bool,
    ) -> object:
        """What the store's future gets: a ``StoreResult`` (batched) or a ``SwapResult``."""
        n, m, block_bytes = len(keys), len(fresh), self.block_bytes
        if not batched:
            gpu_ids = tuple(src) if isinstance(src, list) else tuple(src.tolist())
            cpu = tuple(cpu_ids) if isinstance(cpu_ids, list) else tuple(cpu_ids.tolist())
            return SwapResult(m, m * block_bytes, n - m, cpu, gpu_ids)
        if m == n:  # the common case: every key stored (none waiting, none present)
            stored, present = np.ones(n, dtype=bool), np.zeros(n, dtype=bool)
            cpu_block_ids = np.asarray(cpu_ids, dtype=np.int64)
        else:
            stored = np.zeros(n, dtype=bool)
            stored[fresh] = True
            cpu_block_ids = np.full(n, -1, dtype=np.int64)
            cpu_block_ids[fresh] = cpu_ids
            present = ~stored
            if waiting:
                present &= _present(self.cpu.index, keys)
        return StoreResult(
            stored=stored, present=present, cpu_block_ids=cpu_block_ids, num_bytes=m * block_bytes
        )


def _present(index: dict[bytes, int], keys: Sequence[bytes]) -> np.ndarray:
    """bool ``[len(keys)]``: which keys are indexed (PENDING or READY)."""
    return np.fromiter(map(index.__contains__, keys), dtype=bool, count=len(keys))
