"""The keyed lookups of ``OffloadManager``: lookup, peek, held, touch, invalidation, clear.

Private to ``kvmgr.manager``. They read or drop READY keys of the CPU tier through the
bookkeeper at once (nothing is queued); a drop wakes the stores waiting for room.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmgr.manager.core import ManagerCore

__all__ = ["LookupCalls"]


class LookupCalls(ManagerCore):
    """Keyed lookups and invalidation (mixed into ``OffloadManager``)."""

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` that are READY in the CPU tier; touches them in
        the policy (the first key becomes the most recently used).

        Raises:
            InvalidKeyError: ``keys`` is not a sequence of bytes.
            ClosedError: the manager is closed.
        """
        self._check_not_closed()
        return self._books.lookup(keys, touch=True)

    def peek(self, keys: Sequence[bytes]) -> int:
        """Like ``lookup`` (the ready-prefix length) but touches nothing: for a router or an
        admission check that must not change the eviction order.

        Raises:
            InvalidKeyError, ClosedError: as ``lookup``.
        """
        self._check_not_closed()
        return self._books.lookup(keys, touch=False)

    def held(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` the CPU tier holds in any state: READY, or PENDING (a store or a
        ``fetch`` in flight). A store skips those keys, so they need no new CPU block: a room
        check before a store counts ``len(keys) - held(keys)`` (``peek`` counts PENDING keys
        as missing). Touches nothing; a key repeated in ``keys`` counts each time.

        Raises:
            InvalidKeyError, ClosedError: as ``lookup``.
        """
        self._check_not_closed()
        return self._books.held(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark READY keys as used (the first key becomes the most recent); keys not READY in
        the CPU tier are ignored.

        Raises:
            InvalidKeyError, ClosedError: as ``lookup``.
        """
        self._check_not_closed()
        self._books.touch(keys)

    def invalidate(self, keys: Sequence[bytes]) -> int:
        """Drop READY keys (and free their CPU blocks); unknown keys are ignored. Lower tiers
        keep their copies (a later ``fetch`` stages them again; see docs/guides/tiers.md).

        Returns:
            Keys dropped. Each drop is a ``removed`` KV event.

        Raises:
            BlockStateError: a key has a store or loads in flight; nothing is dropped then
                (retry after those futures resolve).
            InvalidKeyError, ClosedError: as ``lookup``.
        """
        self._check_not_closed()
        dropped = self._books.invalidate(keys)
        self._room.wake()
        return dropped

    def clear(self) -> int:
        """Drop every READY key without loads in flight (lower tiers keep theirs); keys with a
        store or loads in flight stay (a later ``clear`` drops them). Returns the keys dropped.

        Raises:
            ClosedError: the manager is closed.
        """
        self._check_not_closed()
        dropped = self._books.clear()
        self._room.wake()
        return dropped
