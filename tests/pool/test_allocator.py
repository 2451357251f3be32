"""BlockAllocator: allocation order, frees, and the errors that must leave it unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.errors import DoubleFreeError, InvalidBlockError, PoolExhaustedError
from kvmgr.pool.allocator import BlockAllocator
from kvmgr.pool.block_ids import as_id_array


def _state(alloc: BlockAllocator) -> tuple[int, tuple[bool, ...]]:
    """Free count and which ids are allocated: what a failed call must not change."""
    return alloc.num_free, tuple(alloc.is_allocated(b) for b in range(alloc.num_blocks))


def test_fresh_ids_first_in_order_then_freed_last_freed_first() -> None:
    alloc = BlockAllocator(6, name="cpu")
    # 1. fresh ids come out in increasing order
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(1) == [2]
    # 2. free 1 and 0 in one batch: 0, the smallest, is the next id reused, after fresh ones
    alloc.free([1, 0])
    assert alloc.num_free == 5
    assert alloc.allocate(3) == [3, 4, 5]
    # 3. fresh ids exhausted: the freed batch in increasing order
    assert alloc.allocate(1) == [0]
    assert alloc.allocate(1) == [1]
    assert alloc.num_free == 0
    assert alloc.num_allocated == 6


def test_one_call_mixes_fresh_and_freed_ids() -> None:
    alloc = BlockAllocator(4)
    ids = alloc.allocate(3)  # [0, 1, 2]
    alloc.free([ids[2], ids[0]])  # stack: 2, 0 (0 on top)
    # 1 fresh id (3) first, then the stack top (0), then 2
    assert alloc.allocate(3) == [3, 0, 2]


def test_zero_allocation_is_empty_and_changes_nothing() -> None:
    alloc = BlockAllocator(3)
    before = _state(alloc)
    assert alloc.allocate(0) == []
    assert alloc.try_allocate(0) == []
    assert _state(alloc) == before


def _three_taken_one_given_back(num_blocks: int) -> BlockAllocator:
    """An allocator of ``num_blocks`` that handed out 0, 1, 2 and got 1 back."""
    alloc = BlockAllocator(num_blocks)
    alloc.allocate(3)
    alloc.free([1])
    return alloc


def test_try_allocate_returns_none_and_changes_nothing() -> None:
    alloc = _three_taken_one_given_back(5)
    before = _state(alloc)
    assert alloc.try_allocate(4) is None  # 3 free
    assert _state(alloc) == before
    # the allocation order is intact too: fresh 3, 4, then freed 1
    assert alloc.allocate(3) == [3, 4, 1]


def test_allocate_raises_pool_exhausted_with_counts_and_changes_nothing() -> None:
    alloc = BlockAllocator(4, name="gpu")
    alloc.allocate(3)
    before = _state(alloc)
    with pytest.raises(PoolExhaustedError) as info:
        alloc.allocate(2)
    assert (info.value.needed, info.value.available, info.value.reason) == (2, 1, "gpu_full")
    assert _state(alloc) == before


def test_double_free_raises_and_frees_nothing() -> None:
    alloc = _three_taken_one_given_back(4)
    before = _state(alloc)
    with pytest.raises(DoubleFreeError, match="1"):
        alloc.free([1])
    # a batch with one double free frees none of its valid ids either
    with pytest.raises(DoubleFreeError):
        alloc.free([0, 1])
    assert _state(alloc) == before


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        ([4], InvalidBlockError),  # out of range (== num_blocks)
        ([-1], InvalidBlockError),  # negative
        ([10**12], InvalidBlockError),  # far out of range
        ([3], InvalidBlockError),  # in range but never allocated here
        ([0, 0], InvalidBlockError),  # duplicate in one call
        ([0, "1"], InvalidBlockError),  # not an int
        ([0, 1.0], InvalidBlockError),  # float, even integral
        ([True], InvalidBlockError),  # bool is not a block id
        (b"\x00", InvalidBlockError),  # bytes is not a sequence of ids
        ("0", InvalidBlockError),  # neither is str
        (7, InvalidBlockError),  # not iterable
    ],
)
def test_free_rejects_bad_ids_and_changes_nothing(ids: object, error: type[Exception]) -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(3)  # 0, 1, 2 allocated, 3 fresh
    before = _state(alloc)
    with pytest.raises(error):
        alloc.free(ids)  # type: ignore[arg-type]
    assert _state(alloc) == before


def test_numpy_integer_ids_are_accepted() -> None:
    alloc = BlockAllocator(4)
    ids = alloc.allocate(2)
    alloc.free(np.asarray(ids, dtype=np.int64))
    assert alloc.num_free == 4
    assert alloc.allocate(4) == [2, 3, 0, 1]  # a freed batch comes back smallest first


def test_negative_count_and_bad_pool_size() -> None:
    alloc = BlockAllocator(2)
    with pytest.raises(InvalidBlockError):
        alloc.try_allocate(-1)
    with pytest.raises(InvalidBlockError):
        alloc.allocate(-1)
    assert alloc.num_free == 2
    with pytest.raises(InvalidBlockError):
        BlockAllocator(0)


def test_check_allocated_validates_without_freeing() -> None:
    alloc = BlockAllocator(3)
    alloc.allocate(2)
    assert alloc.check_allocated([1, 0]) == [1, 0]
    assert alloc.num_free == 1
    with pytest.raises(InvalidBlockError):
        alloc.check_allocated([2])


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_allocator_matches_a_reference_model(ops: list[tuple[bool, int]]) -> None:
    """Random allocate/free sequences against a list model of the documented order."""
    num_blocks = 8
    alloc = BlockAllocator(num_blocks)
    next_fresh, freed, held = 0, [], []  # the model
    for is_alloc, n in ops:
        if is_alloc:
            n = min(n, num_blocks)
            expected = None
            if n <= num_blocks - next_fresh + len(freed):
                k = min(n, num_blocks - next_fresh)
                expected = list(range(next_fresh, next_fresh + k))
                next_fresh += k
                expected += [freed.pop() for _ in range(n - k)]
                held += expected
            assert alloc.try_allocate(n) == expected
        elif held:
            chunk = held[: n + 1]
            held = held[n + 1 :]
            alloc.free(chunk)
            freed += sorted(chunk, reverse=True)  # one freed batch: smallest id on top
        assert alloc.num_free == num_blocks - next_fresh + len(freed)
        assert sorted(b for b in range(num_blocks) if alloc.is_allocated(b)) == sorted(held)


def test_array_twins_take_and_give_follow_the_same_order() -> None:
    """``take``/``give`` (int64 arrays, the manager's hot path) and ``take_one``/``give_one``
    hand out ids in the documented order and agree with ``allocated_mask``."""
    alloc = BlockAllocator(6)
    ids = alloc.take(3)
    assert ids is not None and ids.dtype == np.int64 and ids.tolist() == [0, 1, 2]
    alloc.give(np.array([2, 0], dtype=np.int64))  # one batch: 0, the smallest, reused first
    assert alloc.allocated_mask().tolist() == [False, True, False, False, False, False]
    before = _state(alloc)
    assert alloc.take(6) is None  # 5 free: nothing changed
    assert _state(alloc) == before
    assert alloc.take_one() == 3
    mixed = alloc.take(4)
    assert mixed is not None and mixed.tolist() == [4, 5, 0, 2]
    assert alloc.take_one() is None
    alloc.give_one(4)
    assert alloc.take_one() == 4 and alloc.num_free == 0
    with pytest.raises(InvalidBlockError):  # duplicate in one call: nothing freed
        alloc.give(np.array([3, 3], dtype=np.int64))
    assert alloc.num_allocated == 6


@pytest.mark.parametrize(
    "ids",
    [
        np.array([[0]]),  # 2-D
        np.array([0.0]),  # float dtype
        np.array([True]),  # bool dtype
        "01",
        b"\x00",
        5,
        [1, None],
        [2**70],  # outside int64
    ],
)
def test_as_id_array_rejects_what_is_not_a_list_of_ids(ids: object) -> None:
    with pytest.raises(InvalidBlockError):
        as_id_array(ids, "gpu")


def test_as_id_array_accepts_lists_and_integer_arrays() -> None:
    assert as_id_array([3, np.int32(1)], "gpu").tolist() == [3, 1]
    out = as_id_array(np.array([2, 0], dtype=np.uint8), "gpu")
    assert out.dtype == np.int64 and out.tolist() == [2, 0]
    assert as_id_array([], "gpu").tolist() == []


def test_freed_batches_are_reused_last_batch_first_each_in_increasing_order() -> None:
    # Blocks evicted together come back as ascending runs (they merge into one descriptor per
    # tensor), taken at once or one by one; the batch freed last is reused first.
    alloc = BlockAllocator(8)
    assert alloc.take(8) is not None
    alloc.give(np.array([5, 3], dtype=np.int64))
    alloc.give(np.array([7, 1], dtype=np.int64))
    assert alloc.take(2).tolist() == [1, 7]  # type: ignore[union-attr]
    assert [alloc.take_one(), alloc.take_one()] == [3, 5]
    alloc.give(np.array([6, 4, 2, 0], dtype=np.int64))
    assert alloc.take(4).tolist() == [0, 2, 4, 6]  # type: ignore[union-attr]


def test_take_and_give_refuse_bad_input_before_any_change() -> None:
    # found by a fresh-user pass: take(-1) corrupted the free count and handed out id -1;
    # give() of a bool or float array raised an untyped IndexError (or acted as a mask)
    alloc = BlockAllocator(4)
    ids = alloc.take(2)
    assert ids is not None
    before = _state(alloc)
    for bad_n in (-1, True, 1.0):
        with pytest.raises(InvalidBlockError):
            alloc.take(bad_n)  # type: ignore[arg-type]
    for bad_ids in (np.ones(4, dtype=bool), np.array([0.0, 1.0]), np.array([[0, 1]]), [0, 1]):
        with pytest.raises(InvalidBlockError):
            alloc.give(bad_ids)  # type: ignore[arg-type]
    assert _state(alloc) == before
    assert alloc.take_one() == 2


def test_only_ready_ids_are_handed_out_and_the_bound_only_grows() -> None:
    # the CPU tier's memory is pinned piece by piece: ids past num_ready are never handed out,
    # by any path (take, take_one, allocate), until make_ready raises the bound
    alloc = BlockAllocator(10, num_ready=3)
    assert (alloc.num_free, alloc.num_ready) == (3, 3)
    assert alloc.take(4) is None and alloc.try_allocate(4) is None
    with pytest.raises(PoolExhaustedError):
        alloc.allocate(4)
    assert alloc.take(2).tolist() == [0, 1]  # type: ignore[union-attr]
    assert alloc.take_one() == 2 and alloc.take_one() is None
    alloc.give(np.array([1], dtype=np.int64))  # a freed ready id comes back as usual
    alloc.make_ready(6)
    alloc.make_ready(4)  # a smaller bound changes nothing
    assert (alloc.num_free, alloc.num_ready) == (4, 6)
    assert alloc.take(4).tolist() == [3, 4, 5, 1]  # type: ignore[union-attr]
    assert alloc.take_one() is None
    alloc.make_ready(10)
    assert alloc.allocate(4) == [6, 7, 8, 9]
    for bad in (-1, 11, True, 2.0):
        with pytest.raises(InvalidBlockError):
            alloc.make_ready(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidBlockError):
        BlockAllocator(4, num_ready=5)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.lists(st.integers(0, 40), max_size=12), st.data())
def test_no_id_beyond_the_ready_bound_ever_leaves(
    num_blocks: int, bounds: list[int], data: st.DataObject
) -> None:
    alloc = BlockAllocator(num_blocks, num_ready=0)
    held: list[int] = []
    for bound in bounds:
        alloc.make_ready(min(bound, num_blocks))
        n = data.draw(st.integers(0, num_blocks))
        ids = alloc.take(n)
        if ids is not None:
            assert (ids < alloc.num_ready).all()
            held += ids.tolist()
        if held and data.draw(st.booleans()):
            alloc.give(np.array(held[: len(held) // 2 + 1], dtype=np.int64))
            del held[: len(held) // 2 + 1]
        assert alloc.num_free + alloc.num_allocated == alloc.num_ready


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), max_size=60))
def test_num_free_counts_the_ready_ids_not_handed_out(ops: list[tuple[int, int]]) -> None:
    """``num_free`` is kept as an attribute: it must follow every take, give and make_ready."""
    pool = BlockAllocator(16, num_ready=4)
    held: list[int] = []
    for op, n in ops:
        if op == 0:
            ids = pool.take(n)
            held += [] if ids is None else ids.tolist()
        elif op == 1:
            one = pool.take_one()
            held += [] if one is None else [one]
        elif op == 2 and held:
            pool.give(np.array(held[:n], dtype=np.int64))
            del held[:n]
        elif op == 3 and held:
            pool.give_one(held.pop())
        elif op == 4:
            pool.make_ready(min(16, pool.num_ready + n - 2))
        allocated = int(pool.allocated_mask().sum())
        assert allocated == len(held)
        assert pool.num_free == pool.num_ready - allocated
        assert (pool.take(pool.num_free + 1) is None) and pool.num_free >= 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9)), max_size=40), st.integers(3, 12))
def test_few_twins_hand_out_and_take_back_in_the_order_of_one_id_calls(
    ops: list[tuple[bool, int]], num_ready: int
) -> None:
    """take_few / give_few are take_one / give_one repeated: the same ids, the same stack."""
    few, one = (BlockAllocator(12, num_ready=num_ready) for _ in range(2))
    held: list[int] = []
    for take, n in ops:
        if take:
            if n > one.num_free:
                before = _state(few)
                with pytest.raises(PoolExhaustedError):
                    few.take_few(n)
                assert _state(few) == before
                continue
            got = few.take_few(n)
            assert got == [one.take_one() for _ in range(n)]
            held += got
        else:
            keep = max(0, len(held) - n)
            back, held = held[keep:][::-1], held[:keep]  # the newest first, in a mixed order
            few.give_few(back)
            for block in back:
                one.give_one(block)
        assert _state(few) == _state(one)
    assert few.take_few(few.num_free) == [one.take_one() for _ in range(one.num_free)]
