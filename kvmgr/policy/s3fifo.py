"""S3-FIFO eviction (Yang et al., SOSP'23), prefix-consistent.

Offers `S3FIFOPolicy`, registered as ``"s3fifo"``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvmgr.errors import ConfigError
from kvmgr.policy.base import KeyPredicate, _check_capacity
from kvmgr.policy.tracked import TrackedPolicy
from kvmgr.policy.tree import PrefixTree, VictimSet

__all__ = ["S3FIFOPolicy"]

_MAX_FREQ = 3
_Queue = OrderedDict[bytes, bytes | None]  # key -> parent, oldest first


class S3FIFOPolicy(TrackedPolicy):
    """S3-FIFO: a small FIFO filters one-hit wonders, a main FIFO with CLOCK-style reinsertion
    keeps the rest, and a ghost FIFO lets quickly re-stored keys skip the small queue.

    Data structures
        ``small`` and ``main``: ``OrderedDict[bytes, bytes | None]`` (key -> parent), oldest
        first; ``ghost``: ``OrderedDict[bytes, None]`` of keys evicted from ``small``, at most
        ``ghost_ratio * capacity`` of them; ``freq``: hits per resident key.
        ``small`` targets ``small_ratio * capacity`` keys (at least 1), ``main`` the rest.

    Flow
        - ``insert``: a ghost key goes to ``main``, any other to ``small``, freq 0; a batch
          is walked in reverse (its first key is the newest, so a chain leaves tip first).
        - ``touch``: freq + 1 for tracked keys; nothing moves (FIFO).
        - ``evict``: as in libCacheSim's ``S3FIFO.c``: while ``main`` is over its target or
          ``small`` is empty, take ``main``'s oldest key: with freq >= 1 it is reinserted at
          the end with ``min(freq, 3) - 1``, else it is a victim; otherwise take ``small``'s
          oldest key: with freq >= ``move_to_main_threshold`` it moves to ``main`` with freq
          0, else it is a victim and its key joins ``ghost``. The queue is chosen once per
          victim and walked until it yields one. The ghost is trimmed to its bound by the
          next ``insert`` after its ghost test, so a key evicted to make room for a ghost key
          cannot push that key out first (libCacheSim tests the ghost at lookup, before
          evicting: same result). Before the first eviction, a key that finds
          ``small`` full goes to ``main`` (libCacheSim's warm-up rule). Victims go through a prefix-
          consistent `VictimSet`; protected, non-evictable and waiting keys keep their place.
          Every move is journaled and undone when fewer than ``n`` victims exist, so
          ``None`` means nothing changed.

    Reference
        J. Yang, Y. Zhang, Z. Qiu, Y. Yue, R. Vinayak, "FIFO queues are all you need for cache
        eviction", SOSP 2023; parameters and reinsertion as in libCacheSim (defaults 0.1,
        0.9, 2).

    Complexity
        ``insert``, ``touch``, ``remove``: O(len(keys)). ``evict``: O(n + keys moved or
        skipped); each main key is reinserted at most 3 times per call.

    Args:
        capacity: Number of CPU blocks.
        small_ratio, ghost_ratio: Size of the small queue and of the ghost, as fractions of ``capacity``.
        move_to_main_threshold: Hits a small-queue key needs to move to ``main`` instead of being evicted.

    Raises:
        ConfigError: Bad capacity, a ratio outside [0, 1], or a threshold < 1.
    """

    name: str = "s3fifo"

    def __init__(
        self,
        capacity: int,
        *,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        move_to_main_threshold: int = 2,
    ) -> None:
        self.capacity: int = _check_capacity(capacity)
        if not (0.0 <= small_ratio <= 1.0 and 0.0 <= ghost_ratio <= 1.0):
            raise ConfigError(f"s3fifo ratios: expected [0, 1], got {small_ratio}, {ghost_ratio}")
        if move_to_main_threshold < 1:
            raise ConfigError(
                f"move_to_main_threshold: expected >= 1, got {move_to_main_threshold}"
            )
        self._small_target = max(1, int(small_ratio * capacity))
        self._main_target = capacity - self._small_target
        self._ghost_size = int(ghost_ratio * capacity)
        self._threshold = move_to_main_threshold
        self._small: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._main: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._tracked = self._freq  # a key is tracked while it has a count
        self._tree = PrefixTree()
        self._has_evicted = False

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Track new keys (ghosts into ``main``, others into ``small``). See
        `EvictionPolicy.insert` (same errors)."""
        self._check_new(keys, parents)
        ghost, small, main = self._ghost, self._small, self._main
        for key, up in zip(reversed(keys), reversed(parents)):
            if key in ghost:
                del ghost[key]
                main[key] = up
            elif not self._has_evicted and len(small) >= self._small_target:
                main[key] = up  # warm-up: the small queue is full, the cache is not
            else:
                small[key] = up
        self._freq.update(dict.fromkeys(keys, 0))
        while len(ghost) > self._ghost_size:
            ghost.popitem(last=False)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Count a hit for every tracked key; untracked keys are ignored."""
        freq = self._freq
        for key in keys:
            count = freq.get(key)
            if count is not None:
                freq[key] = count + 1

    def _forget(self, keys: list[bytes]) -> None:
        """Untrack ``keys`` (no ghost entries)."""
        for key in keys:
            del self._freq[key]
            queue = self._small if key in self._small else self._main
            self._tree.release([queue.pop(key)])

    def _evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes]
    ) -> list[bytes] | None:
        """``n`` victims in S3-FIFO order (class docstring), or ``None``: every move undone."""
        small, main, freq = self._small, self._main, self._freq
        had_evicted, self._has_evicted = self._has_evicted, True
        moves = _Moves(small, main, freq)
        victims = VictimSet(self._tree, moves, n, can_evict, protected)
        journal, popped = moves.journal, moves.popped
        while not victims.is_full and (small or main):
            use_main = len(main) > self._main_target or not small
            queue = main if use_main else small
            before = len(victims.keys)
            while queue and len(victims.keys) == before:  # one victim from this queue
                key, up = queue.popitem(last=False)
                journal.append((False, queue, key, up))
                count = freq[key]
                if use_main and count >= 1:  # CLOCK: reinsert with one hit less
                    moves.to_main(key, up, min(count, _MAX_FREQ) - 1)
                elif not use_main and count >= self._threshold:  # promoted, counting anew
                    moves.to_main(key, up, 0)
                else:
                    popped[key] = up
                    if not use_main:
                        moves.from_small.add(key)
                    if not victims.offer(key):
                        moves.held.append((queue, key, up))
        if not victims.is_full:
            victims.rollback()
            moves.undo()
            self._has_evicted = had_evicted
            return None
        moves.commit(victims.keys, self._ghost)
        return victims.keys  # the ghost is trimmed by the next insert, after its ghost test

    @property
    def small(self) -> list[bytes]:
        """Small-queue keys, oldest first; O(len)."""
        return list(self._small)

    @property
    def main(self) -> list[bytes]:
        """Main-queue keys, oldest first; O(len)."""
        return list(self._main)

    @property
    def ghost(self) -> list[bytes]:
        """Ghost keys, oldest first; O(len)."""
        return list(self._ghost)


class _Moves:
    """The queue moves of one ``evict`` call, kept to undo them if it fails; also its
    `VictimSet`'s parent lookup, across the two queues and the keys the call popped."""

    def __init__(self, small: _Queue, main: _Queue, freq: dict[bytes, int]) -> None:
        self.small, self.main, self.freq = small, main, freq
        self.popped: dict[bytes, bytes | None] = {}  # victims offered: key -> parent
        # (pushed, queue, key, parent): pushed to the queue's end, or popped from its front
        self.journal: list[tuple[bool, _Queue, bytes, bytes | None]] = []
        self.old_freq: dict[bytes, int] = {}  # before the call, of keys it moved to main
        self.held: list[tuple[_Queue, bytes, bytes | None]] = []  # offered, not taken (yet)
        self.from_small: set[bytes] = set()  # offered from the small queue: ghosts if taken

    def __getitem__(self, key: bytes) -> bytes | None:
        if key in self.popped:
            return self.popped[key]
        if key in self.small:
            return self.small[key]
        return self.main[key]

    def to_main(self, key: bytes, up: bytes | None, count: int) -> None:
        """Push a popped key to the end of ``main`` with hit count ``count``."""
        self.old_freq.setdefault(key, self.freq[key])
        self.freq[key] = count
        self.main[key] = up
        self.journal.append((True, self.main, key, up))

    def undo(self) -> None:
        """Undo every move, newest first (key-based, exact in reverse), and the counts."""
        for pushed, queue, key, up in reversed(self.journal):
            if pushed:
                del queue[key]
            else:
                queue[key] = up
                queue.move_to_end(key, last=False)
        self.freq.update(self.old_freq)

    def commit(self, victims: list[bytes], ghost: OrderedDict[bytes, None]) -> None:
        """Untrack the victims (those from the small queue join ``ghost``); keys offered but
        not taken go back to the front of their queues, in place."""
        taken = set(victims)
        for queue, key, up in reversed(self.held):
            if key not in taken:
                queue[key] = up
                queue.move_to_end(key, last=False)
        for key in victims:
            del self.freq[key]
            if key in self.from_small:
                ghost[key] = None
