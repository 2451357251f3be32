"""The protocol every eviction policy implements (v2, batch-oriented), and shared checks.

Offers:

- `EvictionPolicy`: the structural protocol (``insert``, ``touch``, ``remove``, ``evict``,
  ``__len__``, ``__contains__``, ``name``), one call per batch of keys.
- `AdmissionPolicy`: a policy that also offers ``admit`` (admission control); the manager
  calls it when present.
- `KeyPredicate`: the type of the ``can_evict`` callback.

A policy orders keys and picks victims, nothing else. The manager owns block states, reader
counts and free lists; it tells the policy what it may evict through ``can_evict`` (READY and
no readers). Policies import no torch, asyncio or CUDA code.

Prefix consistency is part of the contract: a lookup counts only the leading run of cached
keys, so a key whose child (a key that extends it) stays resident is worth more than the child.
``evict`` therefore never returns a key while a tracked key whose parent it is stays tracked
after the eviction: every victim set is closed under "tracked children". A key whose child is
not evictable (``can_evict`` false, or protected) is not evictable either. The shared helper
`kvmgr.policy.tree.PrefixTree` gives every policy this rule.

A policy may also offer ``insert_new(keys, parents)``: `EvictionPolicy.insert` without its
checks, for a caller that vouches for the batch (one parent per key; the keys distinct, not
tracked, and none of them the parent of a tracked key). The CPU tier knows all of this from its
index and chains and calls it when present (``LRUPolicy`` has it); a wrong batch there corrupts
the policy silently, so nothing else should call it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

from kvmgr.errors import ConfigError

__all__ = ["AdmissionPolicy", "EvictionPolicy", "KeyPredicate"]

KeyPredicate = Callable[[bytes], bool]
"""A callback that answers a yes/no question about one key (``can_evict``)."""


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the keys resident in the CPU tier and chooses which to evict.

    A key is *tracked* (resident) from `insert` until `remove` or until `evict` returns it.
    Policies never look at block contents or states; the manager passes a predicate instead.
    Each method takes a whole batch so the manager's hot path calls it once per batch.
    """

    name: str
    """Registry name of the policy (``"lru"``, ``"arc"``, ...)."""

    def insert(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Start tracking keys whose store was just queued (PENDING) or completed (READY).

        Args:
            keys: Block hashes in prompt order, distinct, none tracked already.
            parents: ``parents[i]`` is the key that ``keys[i]`` extends (``None``: a root, or unknown).
                A parent may be tracked, untracked, or an earlier element of ``keys``.

        Raises:
            BlockStateError: If a key is already tracked or repeated; nothing changed then.
            ValueError: If ``len(parents) != len(keys)``; nothing changed then.
        """
        ...

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record hits (lookup hits, loads, skipped keys of a store), in prefix order.

        The FIRST key becomes the most recently used: after ``touch([a, b, c])`` the
        recency order ends ``..., c, b, a``. Untracked keys are ignored.
        """
        ...

    def remove(self, keys: Sequence[bytes]) -> None:
        """Stop tracking keys that left the index (failed store, invalidation).

        Raises:
            UnknownKeyError: If a key is not tracked; nothing changed then.
        """
        ...

    def evict(
        self, n: int, can_evict: KeyPredicate, protected: Collection[bytes] = ()
    ) -> list[bytes] | None:
        """Choose and untrack exactly ``n`` victims, or change nothing.

        A victim is a tracked key with ``can_evict(key)`` true that is not in ``protected``
        and whose tracked children are all victims of the same call (prefix consistency,
        see the module docstring). Candidates are collected without mutating; only when
        ``n`` were found are they all removed.

        Args:
            n: Number of victims, ``>= 0``.
            can_evict: The manager's "READY and no readers" test.
            protected: Keys never to evict (for example the keys of the store making room).

        Returns:
            list[bytes] or None: ``n`` distinct keys in eviction order (children before their parents), or
                ``None`` when fewer than ``n`` keys qualify; ``None`` means nothing changed.

        Raises:
            ValueError: If ``n`` is negative or not an ``int``.
        """
        ...

    def __len__(self) -> int:
        """Number of tracked (resident) keys."""
        ...

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked (resident); ghost entries do not count."""
        ...


@runtime_checkable
class AdmissionPolicy(EvictionPolicy, Protocol):
    """An `EvictionPolicy` with admission control.

    The manager calls ``admit(keys, parents)`` before storing a batch and stores only the
    keys it accepts (the others are reported as skipped and cost no copy).
    """

    def admit(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> Any:
        """Which of the keys to store.

        Args:
            keys, parents:

        Returns:
            numpy.ndarray: ``bool`` array of shape ``[len(keys)]``, True = store it. The accepted set is
                closed under parents within the batch: a rejected key's extensions are rejected.
        """
        ...


def _check_capacity(capacity: object) -> int:
    """Validate a policy capacity (number of CPU blocks).

    Raises:
        ConfigError: If ``capacity`` is not an ``int`` greater than 0.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise ConfigError(f"policy capacity: expected an int, got {type(capacity).__name__}")
    if capacity <= 0:
        raise ConfigError(f"policy capacity: expected > 0, got {capacity}")
    return capacity


def _check_evict_count(n: object) -> int:
    """Validate the victim count passed to ``evict``.

    Raises:
        ValueError: If ``n`` is not an ``int`` or is negative.
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
