"""The protocol every eviction policy implements, and the checks they share.

Offers:

- `EvictionPolicy`: the structural protocol (``insert``, ``touch``, ``remove``, ``evict``,
  ``__len__``, ``__contains__``, ``name``).
- `KeyPredicate`: the type of the ``can_evict`` and ``is_ready`` callbacks.

A policy orders keys and picks victims, nothing else. The manager owns block states, reader
counts and free lists; it tells the policy what it may evict through ``can_evict`` (READY and
no readers) and which keys are still PENDING through ``is_ready``. Policies import no torch,
asyncio or CUDA code.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol, runtime_checkable

from kvmgr.errors import ConfigError

__all__ = ["EvictionPolicy", "KeyPredicate"]

KeyPredicate = Callable[[bytes], bool]
"""A callback that answers a yes/no question about one key (``can_evict``, ``is_ready``)."""


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the keys resident in the CPU tier and chooses which to evict.

    A key is *tracked* (resident) from `insert` until `remove` or until `evict` returns it.
    Policies never look at block contents or states; the manager passes predicates instead.
    """

    name: str
    """Registry name of the policy (``"lru"``, ``"arc"``)."""

    def insert(self, key: bytes) -> None:
        """Start tracking a key whose store was just queued (PENDING) or is READY.

        Parameters
        ----------
        key : bytes
            Block hash; must not be tracked already.

        Raises
        ------
        BlockStateError
            If the key is already tracked (the manager drops existing keys first).
        """
        ...

    def touch(self, keys: Sequence[bytes], is_ready: KeyPredicate | None = None) -> None:
        """Mark keys as hit (lookup or load); the FIRST key becomes the most recently used.

        The keys are walked in reverse, so after ``touch([a, b, c])`` the recency order ends
        ``..., c, b, a``. Keys that are not tracked are ignored.

        Parameters
        ----------
        keys : Sequence[bytes]
            Hit keys, in prefix order.
        is_ready : KeyPredicate or None
            Whether a tracked key's store has completed. ``None`` means every key is READY.
            Policies that do not distinguish PENDING keys ignore it.
        """
        ...

    def remove(self, key: bytes) -> None:
        """Stop tracking a key that left the index (failed store, explicit drop).

        Raises
        ------
        UnknownKeyError
            If the key is not tracked.
        """
        ...

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Choose and untrack exactly ``n`` victims, or change nothing.

        A victim is a tracked key with ``can_evict(key)`` true that is not in ``protected``.
        Candidates are collected without mutating; only when ``n`` were found are they all
        removed from the ordering. Cost O(n + keys skipped).

        Parameters
        ----------
        n : int
            Number of victims, ``>= 0``.
        can_evict : KeyPredicate
            The manager's "READY and no readers" test.
        protected : Collection[bytes]
            Keys never to evict (for example the keys of the store making room).

        Returns
        -------
        list[bytes] or None
            ``n`` distinct keys in eviction order, or ``None`` when fewer than ``n`` keys are
            evictable; ``None`` means nothing changed.

        Raises
        ------
        ValueError
            If ``n`` is negative or not an ``int``.
        """
        ...

    def __len__(self) -> int:
        """Number of tracked (resident) keys."""
        ...

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked (resident); ghost entries do not count."""
        ...


def _check_capacity(capacity: object) -> int:
    """Validate a policy capacity (number of CPU blocks).

    Raises
    ------
    ConfigError
        If ``capacity`` is not an ``int`` greater than 0.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise ConfigError(f"policy capacity: expected an int, got {type(capacity).__name__}")
    if capacity <= 0:
        raise ConfigError(f"policy capacity: expected > 0, got {capacity}")
    return capacity


def _check_evict_count(n: object) -> int:
    """Validate the victim count passed to ``evict``.

    Raises
    ------
    ValueError
        If ``n`` is not an ``int`` or is negative.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"evict count: expected an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"evict count: expected >= 0, got {n}")
    return n


def _as_lookup(protected: Collection[bytes]) -> Collection[bytes]:
    """Return ``protected`` as something with O(1) membership (sets and dicts pass through)."""
    if isinstance(protected, (set, frozenset, dict)):
        return protected
    return frozenset(protected)
