"""PrefixIndex: PENDING -> READY -> READY with readers, and lookup = the leading READY run."""

from __future__ import annotations

import pytest

from kvmgr.errors import BlockStateError, UnknownKeyError
from kvmgr.pool.prefix_index import BlockState, PrefixIndex

K = [bytes([i]) * 8 for i in range(6)]  # chained-hash-like keys


def _dump(index: PrefixIndex) -> dict[bytes, tuple[int, BlockState, int]]:
    return {k: (e.block_id, e.state, e.readers) for k in index for e in [index.entry(k)]}


def test_state_walk_pending_ready_readers_and_removal() -> None:
    index = PrefixIndex()
    # 1. a store is queued: PENDING, not readable, not evictable
    index.add_pending(K[0], 7)
    assert index.entry(K[0]).state is BlockState.PENDING
    assert not index.is_ready(K[0]) and not index.is_evictable(K[0])
    assert index.lookup([K[0]]) == 0
    # 2. the store completes: READY, readable and evictable
    index.mark_ready(K[0])
    assert index.is_ready(K[0]) and index.is_evictable(K[0])
    # 3. two loads start: readers = 2, readable but not evictable; add_reader gives the block
    assert index.add_reader(K[0]) == 7
    assert index.add_reader(K[0]) == 7
    assert index.entry(K[0]).readers == 2
    assert index.is_ready(K[0]) and not index.is_evictable(K[0])
    # 4. removal is refused while loads are in flight
    with pytest.raises(BlockStateError):
        index.remove(K[0])
    # 5. the loads end: evictable again, removal returns the block id
    index.remove_reader(K[0])
    assert not index.is_evictable(K[0])
    index.remove_reader(K[0])
    assert index.is_evictable(K[0])
    assert index.remove(K[0]) == 7
    assert K[0] not in index and len(index) == 0


def test_lookup_is_the_leading_ready_run() -> None:
    index = PrefixIndex()
    for i, key in enumerate(K[:5]):
        index.add_pending(key, 10 + i)
    for key in (K[0], K[1], K[3], K[4]):  # K[2] stays PENDING
        index.mark_ready(key)
    assert index.lookup(K[:5]) == 2  # stops at the PENDING K[2]
    assert index.lookup([K[3], K[4]]) == 2
    assert index.lookup([K[3], K[5], K[4]]) == 1  # stops at the unknown K[5]
    assert index.lookup([K[5], K[0]]) == 0
    assert index.lookup([]) == 0
    # a reader does not change readability
    index.add_reader(K[0])
    assert index.lookup(K[:2]) == 2
    # repeated keys count each time (lookup is positional)
    assert index.lookup([K[0], K[0], K[1]]) == 3


def test_pending_key_cannot_be_read_and_ready_key_cannot_be_marked_again() -> None:
    index = PrefixIndex()
    index.add_pending(K[1], 3)
    before = _dump(index)
    with pytest.raises(BlockStateError):
        index.add_reader(K[1])
    index.mark_ready(K[1])
    with pytest.raises(BlockStateError):
        index.mark_ready(K[1])
    with pytest.raises(BlockStateError):
        index.add_pending(K[1], 4)  # a key maps to at most one block
    assert _dump(index) == {K[1]: (3, BlockState.READY, 0)}
    assert before[K[1]][1] is BlockState.PENDING


def test_failed_store_removes_the_pending_entry() -> None:
    index = PrefixIndex()
    index.add_pending(K[2], 5)
    assert index.remove(K[2]) == 5
    assert index.get(K[2]) is None


@pytest.mark.parametrize("method", ["entry", "mark_ready", "add_reader", "remove_reader", "remove"])
def test_unknown_key_raises_and_changes_nothing(method: str) -> None:
    index = PrefixIndex()
    index.add_pending(K[0], 1)
    before = _dump(index)
    with pytest.raises(UnknownKeyError, match=K[3].hex()[:16]):
        getattr(index, method)(K[3])
    assert _dump(index) == before


def test_unknown_key_predicates_are_false_and_get_is_none() -> None:
    index = PrefixIndex()
    assert not index.is_ready(K[4]) and not index.is_evictable(K[4])
    assert index.get(K[4]) is None
    assert K[4] not in index


def test_unknown_key_error_is_a_readable_key_error() -> None:
    index = PrefixIndex()
    with pytest.raises(KeyError) as info:
        index.entry(b"\xab\xcd")
    assert str(info.value).startswith("key abcd")
