"""Prefix index: ``bytes`` block keys -> CPU block, with the state of each block.

Offers:
    BlockState   PENDING (store in flight) or READY
    IndexEntry   the CPU block of a key, its state and its number of readers
    PrefixIndex  the map, ``lookup`` and the state transitions

States (docs/architecture.md): ``PENDING`` (store copy in flight: not readable, not evictable) ->
``READY`` (readable; evictable when it has no reader) -> ``READY`` with ``readers = n`` (n loads
in flight: not evictable). A failed store removes the PENDING entry.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence

import attrs

from kvmgr.errors import BlockStateError, UnknownKeyError

__all__ = ["BlockState", "IndexEntry", "PrefixIndex"]


class BlockState(enum.Enum):
    """State of a keyed CPU block."""

    PENDING = "pending"
    READY = "ready"


@attrs.define(eq=False)
class IndexEntry:
    """One keyed CPU block. Mutable: the index updates state and readers in place."""

    block_id: int
    state: BlockState = BlockState.PENDING
    readers: int = 0

    @property
    def is_evictable(self) -> bool:
        """READY and no load in flight."""
        return self.state is BlockState.READY and self.readers == 0


class PrefixIndex:
    """Map from block keys (chained prefix hashes supplied by the caller) to CPU blocks.

    A key maps to at most one block. Every method is O(number of keys given).
    """

    def __init__(self) -> None:
        self._entries: dict[bytes, IndexEntry] = {}
        self._num_pending = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    @property
    def num_pending(self) -> int:
        """Keys whose store is in flight (O(1))."""
        return self._num_pending

    def get(self, key: bytes) -> IndexEntry | None:
        """The entry of ``key``, or ``None``."""
        return self._entries.get(key)

    def entry(self, key: bytes) -> IndexEntry:
        """The entry of ``key``.

        Raises:
            UnknownKeyError: the key is not indexed.
        """
        found = self._entries.get(key)
        if found is None:
            raise UnknownKeyError(f"key {key.hex()[:16]}... is not in the CPU tier")
        return found

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of keys that are READY."""
        hits = 0
        for key in keys:
            found = self._entries.get(key)
            if found is None or found.state is not BlockState.READY:
                break
            hits += 1
        return hits

    def is_evictable(self, key: bytes) -> bool:
        """Whether ``key`` is READY with no reader (False for unknown keys)."""
        found = self._entries.get(key)
        return found is not None and found.is_evictable

    def is_ready(self, key: bytes) -> bool:
        """Whether ``key`` is READY (False for unknown keys)."""
        found = self._entries.get(key)
        return found is not None and found.state is BlockState.READY

    def add_pending(self, key: bytes, block_id: int) -> None:
        """Index a new key whose store is in flight.

        Raises:
            BlockStateError: the key is already indexed.
        """
        if key in self._entries:
            raise BlockStateError(f"key {key.hex()[:16]}... is already in the CPU tier")
        self._entries[key] = IndexEntry(block_id)
        self._num_pending += 1

    def mark_ready(self, key: bytes) -> None:
        """The key's store completed.

        Raises:
            UnknownKeyError, BlockStateError: unknown key, or not PENDING.
        """
        found = self.entry(key)
        if found.state is not BlockState.PENDING:
            raise BlockStateError(f"key {key.hex()[:16]}... is {found.state.value}, not pending")
        found.state = BlockState.READY
        self._num_pending -= 1

    def add_reader(self, key: bytes) -> int:
        """A load of the key starts; returns its block id.

        Raises:
            UnknownKeyError: unknown key.
            BlockStateError: the key is still PENDING.
        """
        found = self.entry(key)
        if found.state is not BlockState.READY:
            raise BlockStateError(f"key {key.hex()[:16]}... is {found.state.value}, not ready")
        found.readers += 1
        return found.block_id

    def remove_reader(self, key: bytes) -> None:
        """A load of the key ended (successfully or not)."""
        found = self.entry(key)
        assert found.readers > 0, "reader count underflow"
        found.readers -= 1

    def remove(self, key: bytes) -> int:
        """Drop the key; returns its block id (the caller frees the block).

        Raises:
            UnknownKeyError: unknown key.
            BlockStateError: a load of the key is in flight.
        """
        found = self.entry(key)
        if found.readers:
            raise BlockStateError(f"key {key.hex()[:16]}... has {found.readers} loads in flight")
        del self._entries[key]
        if found.state is BlockState.PENDING:
            self._num_pending -= 1
        return found.block_id
