"""Round 4, session 5: what a fresh user hit with bad input, one regression test per finding.

1. Block ids that are not a sequence (a generator, a dict, a set, a memoryview) raise
   ``InvalidBlockError`` on every call that takes ids (more cases in tests/test_bad_input.py).
2. A block id beyond the int64 range (a uint64 id >= 2**63, a Python int) is named in the
   message with the pool's valid range, instead of the negative id it wrapped to.
3. An empty parent key ``b""`` is refused like an empty key (one key rule, ``kvmgr._keys``).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmgr.errors import InvalidBlockError
from kvmgr.pool.allocator import BlockAllocator
from kvmgr.pool.block_ids import as_id_array


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param(lambda: (i for i in [0]), id="generator"),
        pytest.param(lambda: iter([0]), id="iterator"),
        pytest.param(lambda: {0: 1}, id="dict"),
        pytest.param(lambda: {0}, id="set"),
        pytest.param(lambda: frozenset([0]), id="frozenset"),
        pytest.param(lambda: memoryview(b"\x00"), id="memoryview"),
        pytest.param(lambda: None, id="none"),
        pytest.param(lambda: 0, id="int"),
    ],
)
def test_block_ids_that_are_not_a_sequence_are_refused(ids: object) -> None:
    pool = BlockAllocator(4, name="cpu")
    held = pool.allocate(2)
    with pytest.raises(InvalidBlockError, match="expected a sequence of int block ids"):
        pool.free(ids())  # type: ignore[operator]
    with pytest.raises(InvalidBlockError, match="expected a sequence of int block ids"):
        pool.check_allocated(ids())  # type: ignore[operator]
    assert pool.num_allocated == 2 and pool.check_allocated(held) == held  # nothing freed


def test_sequences_and_integer_arrays_are_still_accepted() -> None:
    for ids in ([2, 0], (2, 0), range(2, -1, -2), np.array([2, 0], dtype=np.uint8)):
        assert as_id_array(ids, "gpu").tolist() == [2, 0]


@pytest.mark.parametrize(
    ("ids", "bad"),
    [
        pytest.param(np.array([1, 2**63], dtype=np.uint64), 2**63, id="uint64-2**63"),
        pytest.param(np.array([2**64 - 1], dtype=np.uint64), 2**64 - 1, id="uint64-max"),
        pytest.param([1, 2**63], 2**63, id="int-2**63"),
        pytest.param([-(2**63) - 1], -(2**63) - 1, id="int-below-int64"),
        pytest.param([np.uint64(2**63)], 2**63, id="np-uint64-scalar"),
    ],
)
def test_an_id_beyond_int64_is_named_with_the_valid_range(ids: object, bad: int) -> None:
    pool = BlockAllocator(8, name="gpu")
    pool.allocate(2)
    message = rf"^gpu block id {bad} out of range \[0, 8\)$"
    with pytest.raises(InvalidBlockError, match=message):
        pool.free(ids)  # type: ignore[arg-type]
    with pytest.raises(InvalidBlockError, match=message):
        as_id_array(ids, "gpu", 8)
    assert pool.num_allocated == 2


@pytest.mark.asyncio
async def test_a_huge_uint64_id_through_the_manager_names_the_id() -> None:
    import torch

    from kvmgr import ManagerConfig, OffloadManager

    kv = [torch.randn(8, 16) for _ in range(2)]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=8, engine="host")) as mgr:
        mgr.allocate("r", 2)
        huge = np.array([0, 2**63 + 5], dtype=np.uint64)
        for call in (
            lambda: mgr.store_many(huge, [b"a" * 8, b"b" * 8]),
            lambda: mgr.load_many([b"a" * 8, b"b" * 8], huge),
        ):
            with pytest.raises(InvalidBlockError, match=rf"id {2**63 + 5} out of range \[0, 8\)"):
                call()
        assert mgr.statistics().queued_swaps == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("batched", [False, True], ids=["swap_out", "store_many"])
async def test_an_empty_parent_key_is_refused_like_an_empty_key(batched: bool) -> None:
    import torch

    from kvmgr import InvalidKeyError, ManagerConfig, OffloadManager

    kv = [torch.randn(8, 16) for _ in range(2)]
    async with OffloadManager(kv, ManagerConfig(num_cpu_blocks=8, engine="host")) as mgr:
        ids = mgr.allocate("r", 2)
        keys = [b"a" * 8, b"b" * 8]
        store = mgr.store_many if batched else mgr.swap_out
        for parents in ([b"", keys[0]], [None, b""]):
            with pytest.raises(InvalidKeyError, match="non-empty bytes or None"):
                store(ids, keys, parents=parents)  # type: ignore[operator]
        with pytest.raises(InvalidKeyError, match="non-empty bytes"):
            store(ids, [b"", keys[1]])  # type: ignore[operator]
        assert mgr.statistics().queued_swaps == 0 and mgr.peek(keys) == 0
        future = store(ids, keys, parents=[None, keys[0]])  # type: ignore[operator]
        await mgr.step()
        await future
        assert mgr.peek(keys) == 2
