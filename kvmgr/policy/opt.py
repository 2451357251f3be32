"""The offline optimum: Belady's furthest-next-use rule on the leaves of the cached prefix tree.

Offers:

- `FutureUses`: the future of a trace, request by request (which keys each request will look
  up), consumed as requests are served; built by the simulator, which knows the trace.
- `OptimalPolicy` (``"opt"``): evicts the evictable leaf whose next use is furthest away,
  deepest first among ties. It needs ``future=``; no online cache can match it, it is the bound
  the other policies are measured against.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np

from kvmgr.errors import ConfigError
from kvmgr.policy.base import KeyPredicate, _check_capacity
from kvmgr.policy.tracked import TrackedPolicy
from kvmgr.policy.tree import PrefixTree, VictimSet

__all__ = ["FutureUses", "OptimalPolicy"]


class FutureUses:
    """Which request uses which key, in request order, and which requests were served.

    Args:
        request_keys: ``request_keys[i]``: the prefix keys request ``i`` looks up, in prompt order (key ``j``
            extends key ``j - 1``). Requests are numbered in arrival order.

    Notes
    -----
    The next use of a key is the lowest-numbered request that uses it and was not served yet
    (`consume`); ``len(request_keys)`` stands for "never". Memory: one dict entry per distinct
    key and one int32 per (request, key) pair.
    """

    def __init__(self, request_keys: Sequence[Sequence[bytes]]) -> None:
        self._id_of: dict[bytes, int] = {}
        self._request_keys = request_keys
        depth: list[int] = []
        pairs_key: list[int] = []
        pairs_req: list[int] = []
        for i, keys in enumerate(request_keys):
            for j, key in enumerate(keys):
                kid = self._id_of.get(key)
                if kid is None:
                    kid = self._id_of[key] = len(depth)
                    depth.append(j)
                pairs_key.append(kid)
                pairs_req.append(i)
        key_ids = np.asarray(pairs_key, dtype=np.int64)
        order = np.argsort(key_ids, kind="stable")  # uses grouped by key, in request order
        self._uses = np.asarray(pairs_req, dtype=np.int32)[order]
        counts = np.bincount(key_ids, minlength=len(depth))
        self._start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self._next = self._start[:-1].copy()  # per key: index into _uses of its next use
        self._depth = np.asarray(depth, dtype=np.int32)
        self._served = np.zeros(len(request_keys), dtype=bool)
        self.never: int = len(request_keys)
        self._listeners: list[Callable[[Iterable[bytes]], None]] = []

    def subscribe(self, listener: Callable[[Iterable[bytes]], None]) -> None:
        """Call ``listener(keys)`` after `consume` with the keys whose next use changed."""
        self._listeners.append(listener)

    def consume(self, request: int) -> None:
        """Mark request ``request`` served: its keys' next uses move to later requests.

        Serving a request twice (a preempted request admitted again) changes nothing.

        Raises:
            IndexError: If ``request`` is not a request index.
        """
        if self._served[request]:
            return
        self._served[request] = True
        keys = self._request_keys[request]
        uses, nxt, end, served = self._uses, self._next, self._start[1:], self._served
        for key in keys:
            kid = self._id_of[key]
            k = nxt[kid]
            while k < end[kid] and served[uses[k]]:
                k += 1
            nxt[kid] = k
        for listener in self._listeners:
            listener(keys)

    def next_use(self, key: bytes) -> int:
        """Index of the next unserved request using ``key``; `never` if none (or unknown)."""
        kid = self._id_of.get(key)
        if kid is None:
            return self.never
        k = self._next[kid]
        return int(self._uses[k]) if k < self._start[kid + 1] else self.never

    def depth(self, key: bytes) -> int:
        """Position of ``key`` in the prompts using it (0 = first block); 0 if unknown."""
        kid = self._id_of.get(key)
        return 0 if kid is None else int(self._depth[kid])


class OptimalPolicy(TrackedPolicy):
    """Belady's MIN on the cached prefix tree: offline, exact for a prefix cache.

    Data structures
        A max-heap (``heapq`` of negated values) of ``(next use, depth, key)`` with lazy
        deletion: an entry is valid while the key is tracked and its next use is unchanged;
        `FutureUses.consume` pushes a fresh entry for every tracked key it moves. A dict of
        tracked key -> parent and a `PrefixTree` for prefix consistency.

    Flow
        ``evict`` pops entries in order (furthest next use first, deeper first among ties,
        so never-used-again chains go from their tips) and offers each valid key to a
        `VictimSet`: only leaves of the cached tree are taken, and a parent goes right after
        its last child. Entries popped but not taken are pushed back. ``touch`` is ignored:
        the future, not the past, orders keys.

    Why it is optimal here
        A lookup reuses the leading run of cached keys, and a key's next use is never later
        than its children's (every request using a child uses the parent), so evicting the
        leaf used furthest in the future is the classic exchange argument of Belady's MIN
        applied to the leaves; on ties the deepest goes first since it cannot serve a hit
        without its ancestors.

    Complexity
        ``insert``: O(k log N). ``evict``: O((n + skipped + stale) log N). ``touch``: O(1).

    Args:
        capacity: Number of CPU blocks (unused by the rule; shared constructor signature).
        future: The trace's future; the caller consumes each request as it is served.

    Raises:
        ConfigError: If ``capacity`` is not an ``int`` greater than 0 or ``future`` is not a
            `FutureUses`.
    """

    name: str = "opt"

    def __init__(self, capacity: int, *, future: FutureUses | None = None) -> None:
        self.capacity: int = _check_capacity(capacity)
        if not isinstance(future, FutureUses):
            raise ConfigError(
                "policy 'opt' is offline: it needs future=FutureUses(...) (the simulator "
                "passes it; `kvmgr simulate --policy opt`)"
            )
        self._future = future
        self._tracked: dict[bytes, bytes | None] = {}  # key -> parent
        self._tree = PrefixTree()
        self._heap: list[tuple[int, int, bytes]] = []
        future.subscribe(self._moved)

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track new keys. See `EvictionPolicy.insert` (same errors)."""
        self._check_new(keys, parents)
        self._tracked.update(zip(keys, parents))
        self._push(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Ignored: the next use, not the last, decides."""

    def _evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes]
    ) -> list[bytes] | None:
        """The ``n`` leaves used furthest in the future (removed heap entries go stale)."""
        victims = VictimSet(self._tree, self._tracked, n, can_evict, protected)
        heap, future, tracked = self._heap, self._future, self._tracked
        popped: list[tuple[int, int, bytes]] = []
        while heap and not victims.is_full:
            entry = heapq.heappop(heap)
            key = entry[2]
            if key not in tracked or -entry[0] != future.next_use(key):
                continue  # stale
            popped.append(entry)
            victims.offer(key)
        if not victims.is_full:
            victims.rollback()
            for entry in popped:
                heapq.heappush(heap, entry)
            return None
        taken = set(victims.keys)
        for entry in popped:
            if entry[2] not in taken:
                heapq.heappush(heap, entry)
        for key in victims.keys:
            del tracked[key]
        return victims.keys

    def _push(self, keys: Iterable[bytes]) -> None:
        future, heap = self._future, self._heap
        for key in keys:
            heapq.heappush(heap, (-future.next_use(key), -future.depth(key), key))

    def _moved(self, keys: Iterable[bytes]) -> None:
        self._push([key for key in keys if key in self._tracked])
