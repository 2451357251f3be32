"""Transfer plans: merging, non-dense tensors, hazards, splitting, and a memmove property test."""

from __future__ import annotations

import ctypes

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.errors import GeometryError, HazardError, InvalidBlockError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan, check_hazards


def _layout(bases: list[int], pages: list[int], strides: list[int], num_blocks: int) -> KVLayout:
    """A synthetic layout with readable addresses (nothing is copied through it)."""
    return KVLayout(
        base_addrs=np.array(bases, dtype=np.int64),
        block_strides=np.array(strides, dtype=np.int64),
        page_bytes=np.array(pages, dtype=np.int64),
        num_blocks=num_blocks,
        device=torch.device("cpu"),
    )


SRC = _layout([1000], [10], [10], 8)
DST = _layout([5000], [10], [10], 8)


def _arrays(plan: TransferPlan) -> tuple[list[int], list[int], list[int]]:
    return plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.sizes.tolist()


def test_adjacent_runs_merge_into_one_descriptor() -> None:
    # pairs given out of order: 7->5, 3->1, 2->0, 4->2; sorted by source: 2-4 -> 0-2 is one run
    plan = build_plan(Direction.D2H, SRC, DST, np.array([7, 3, 2, 4]), np.array([5, 1, 0, 2]))
    assert _arrays(plan) == ([1020, 1070], [5000, 5050], [30, 10])
    assert (plan.num_blocks, plan.num_pages, plan.num_descriptors, plan.num_bytes) == (4, 4, 2, 40)
    assert plan.direction is Direction.D2H


def test_consecutive_sources_with_non_consecutive_destinations_do_not_merge() -> None:
    plan = build_plan(Direction.H2D, SRC, DST, np.array([0, 1, 2]), np.array([3, 2, 4]))
    # 0->3 and 1->2 break the run (dst goes down); 1->2, 2->4 break it too
    assert _arrays(plan) == ([1000, 1010, 1020], [5030, 5020, 5040], [10, 10, 10])


def test_repeated_source_is_copied_to_each_destination() -> None:
    # a load of one key into two GPU blocks reads one CPU block twice: legal in one batch
    plan = build_plan(Direction.H2D, SRC, DST, np.array([3, 3, 4]), np.array([0, 1, 2]))
    # sorted stable: 3->0, 3->1, 4->2; 3->1 and 4->2 are consecutive on both sides: merged
    assert _arrays(plan) == ([1030, 1030], [5000, 5010], [10, 20])


def test_merge_off_keeps_one_descriptor_per_page_in_call_order() -> None:
    plan = build_plan(
        Direction.D2H, SRC, DST, np.array([3, 1, 2]), np.array([4, 2, 3]), merge=False
    )
    assert _arrays(plan) == ([1030, 1010, 1020], [5040, 5020, 5030], [10, 10, 10])


def test_non_dense_tensor_is_not_merged_while_dense_one_is() -> None:
    # tensor 0 dense on both sides (page 10); tensor 1 is a K/V half: page 6, stride 12 on the GPU
    gpu = _layout([1000, 2000], [10, 6], [10, 12], 8)
    cpu = _layout([5000, 6000], [10, 6], [10, 6], 8)
    plan = build_plan(Direction.D2H, gpu, cpu, np.array([1, 2, 3]), np.array([0, 1, 2]))
    assert _arrays(plan) == (
        [1010, 2012, 2024, 2036],
        [5000, 6000, 6006, 6012],
        [30, 6, 6, 6],
    )
    assert (plan.num_pages, plan.num_descriptors, plan.num_bytes) == (6, 4, 48)


def test_empty_plan() -> None:
    plan = build_plan(Direction.H2D, SRC, DST, np.array([], np.int64), np.array([], np.int64))
    assert (plan.num_descriptors, plan.num_bytes, plan.num_blocks, plan.num_pages) == (0, 0, 0, 0)


def test_duplicate_destination_is_a_hazard() -> None:
    with pytest.raises(HazardError, match="destination block 2"):
        build_plan(Direction.H2D, SRC, DST, np.array([0, 1]), np.array([2, 2]))
    with pytest.raises(HazardError):
        check_hazards(np.array([5, 1, 5]))
    check_hazards(np.array([5, 1, 4]))  # distinct: fine


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "error"),
    [
        ([0, 1], [2], InvalidBlockError),  # lengths differ
        ([8], [0], InvalidBlockError),  # source out of range
        ([0], [-1], InvalidBlockError),  # destination negative
        ([0], [8], InvalidBlockError),  # destination out of range
    ],
)
def test_bad_ids(src_ids: list[int], dst_ids: list[int], error: type[Exception]) -> None:
    with pytest.raises(error):
        build_plan(Direction.D2H, SRC, DST, np.array(src_ids), np.array(dst_ids))


@pytest.mark.parametrize("ids", [np.array([0.7]), np.array([1.0]), np.array([True])])
def test_non_integer_ids_are_rejected(ids: np.ndarray) -> None:
    with pytest.raises(InvalidBlockError):
        build_plan(Direction.D2H, SRC, DST, ids, np.array([1]))


@pytest.mark.parametrize(
    "dst",
    [
        _layout([5000], [12], [12], 8),  # page bytes differ
        _layout([5000, 6000], [10, 10], [10, 10], 8),  # tensor count differs
    ],
)
def test_mismatched_layouts_raise_geometry_error(dst: KVLayout) -> None:
    with pytest.raises(GeometryError):
        build_plan(Direction.D2H, SRC, dst, np.array([0]), np.array([0]))


def test_split_above_the_cap_preserves_descriptors_and_totals() -> None:
    plan = build_plan(
        Direction.D2H, SRC, DST, np.array([0, 2, 4, 6, 1, 3, 5]), np.arange(7), merge=False
    )
    chunks = plan.split(3)
    assert [c.num_descriptors for c in chunks] == [3, 3, 1]
    for name in ("src_addrs", "dst_addrs", "sizes"):
        joined = np.concatenate([getattr(c, name) for c in chunks])
        assert joined.tolist() == getattr(plan, name).tolist()
    assert sum(c.num_bytes for c in chunks) == plan.num_bytes == 70
    assert sum(c.num_blocks for c in chunks) == plan.num_blocks == 7
    assert sum(c.num_pages for c in chunks) == plan.num_pages == 7
    assert all(c.direction is Direction.D2H for c in chunks)
    assert plan.split(7) == [plan] and plan.split(100) == [plan]
    with pytest.raises(ValueError):
        plan.split(0)


# ------------------------------------------------------------------ property: plan == page copies


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def _execute(plan: TransferPlan, srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    """memmove every descriptor, after checking each lies inside one source/destination tensor."""
    src_ranges = [_storage_range(t) for t in srcs]
    dst_ranges = [_storage_range(t) for t in dsts]
    for s, d, n in zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.sizes.tolist()):
        assert n > 0
        assert any(lo <= s and s + n <= hi for lo, hi in src_ranges), "source out of bounds"
        assert any(lo <= d and d + n <= hi for lo, hi in dst_ranges), "destination out of bounds"
        ctypes.memmove(d, s, n)


@st.composite
def _copy_case(
    draw: st.DrawFn,
) -> tuple[list[int], list[list[bool]], int, int, list[int], list[int]]:
    num_tensors = draw(st.integers(1, 3))
    pages = draw(st.lists(st.integers(1, 70), min_size=num_tensors, max_size=num_tensors))
    flags = st.lists(st.booleans(), min_size=num_tensors, max_size=num_tensors)
    split_kv = [draw(flags), draw(flags)]  # per side: which tensors are non-dense K halves
    nb_src, nb_dst = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    n = draw(st.integers(0, min(nb_src * 2, nb_dst)))
    dst_ids = draw(st.permutations(range(nb_dst)))[:n]
    src_ids = draw(st.lists(st.integers(0, nb_src - 1), min_size=n, max_size=n))
    return pages, split_kv, nb_src, nb_dst, src_ids, list(dst_ids)


def _tensors(pages: list[int], split_kv: list[bool], nb: int, gen: torch.Generator) -> list:
    """One uint8 tensor per page size; ``split_kv`` ones are the K half of a [nb, 2, page] cache."""
    out = []
    for page, split in zip(pages, split_kv):
        full = torch.randint(
            1, 256, (nb, 2 if split else 1, page), dtype=torch.uint8, generator=gen
        )
        out.append(full[:, 0])
    return out


@settings(max_examples=80, deadline=None)
@given(case=_copy_case(), merge=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_plan_executed_with_memmove_equals_page_by_page_copy(
    case: tuple[list[int], list[list[bool]], int, int, list[int], list[int]],
    merge: bool,
    seed: int,
) -> None:
    pages, split_kv, nb_src, nb_dst, src_ids, dst_ids = case
    gen = torch.Generator().manual_seed(seed)
    srcs = _tensors(pages, split_kv[0], nb_src, gen)
    dsts = _tensors(pages, split_kv[1], nb_dst, gen)  # poisoned below, never zeros
    for t in dsts:
        t.fill_(0xA5)
    expected = [t.clone() for t in dsts]
    for s, d in zip(src_ids, dst_ids):
        for e, src in zip(expected, srcs):
            e[d] = src[s]
    plan = build_plan(
        Direction.D2H,
        KVLayout.from_tensors(srcs),
        KVLayout.from_tensors(dsts),
        np.array(src_ids, dtype=np.int64),
        np.array(dst_ids, dtype=np.int64),
        merge=merge,
    )
    _execute(plan, srcs, dsts)
    for got, want in zip(dsts, expected):
        assert torch.equal(got, want)
    n = len(src_ids)
    assert plan.num_pages == n * len(pages) and plan.num_blocks == n
    assert plan.num_bytes == n * sum(pages)
    assert plan.num_descriptors <= plan.num_pages
    if not merge:
        assert plan.num_descriptors == plan.num_pages
    dense = [not (a or b) for a, b in zip(*split_kv)]
    if merge and n and not any(dense):
        assert plan.num_descriptors == plan.num_pages  # nothing merges without dense tensors


def test_property_cases_do_merge() -> None:
    """Guard for the property test: a dense consecutive case really merges (descriptors < pages)."""
    gen = torch.Generator().manual_seed(3)
    srcs, dsts = _tensors([7, 9], [False, True], 6, gen), _tensors([7, 9], [False, False], 6, gen)
    plan = build_plan(
        Direction.H2D,
        KVLayout.from_tensors(srcs),
        KVLayout.from_tensors(dsts),
        np.arange(4),
        np.arange(2, 6),
    )
    assert (plan.num_pages, plan.num_descriptors) == (8, 1 + 4)


def test_a_plan_records_its_block_pairs_until_it_is_edited_or_split() -> None:
    plan = build_plan(Direction.D2H, SRC, DST, np.array([7, 3, 2, 4]), np.array([5, 1, 0, 2]))
    pairs = plan.matching_blocks()
    assert pairs is not None and (pairs.src, pairs.dst) == (SRC, DST)
    # the pairs sorted by source block, as the descriptors were built
    assert (pairs.src_block_ids.tolist(), pairs.dst_block_ids.tolist()) == (
        [2, 3, 4, 7],
        [0, 1, 2, 5],
    )
    assert (pairs.num_bytes, pairs.num_descriptors) == (plan.num_bytes, plan.num_descriptors)
    # an edit of the descriptors, or a split, leaves nothing an engine could misread
    assert attrs.evolve(plan, sizes=plan.sizes - 1).matching_blocks() is None
    assert all(chunk.blocks is None for chunk in plan.split(1))
    assert TransferPlan(Direction.H2D).matching_blocks() is None


# ------------------------------------------------------------------ lazy descriptors


def _reference_descriptors(
    src: KVLayout, dst: KVLayout, src_ids: list[int], dst_ids: list[int], merge: bool
) -> tuple[list[int], list[int], list[int]]:
    """The descriptors ``build_plan`` built eagerly before they became lazy, one Python loop per
    page: pairs sorted by source (stable) and cut into runs when merging; per tensor (dense ones
    first unless all are), one descriptor per run where dense on both sides, else per page."""
    pairs = list(zip(src_ids, dst_ids))
    if merge:
        pairs.sort(key=lambda pair: pair[0])
    runs: list[list[int]] = []  # [src, dst, length]
    for s, d in pairs:
        last = runs[-1] if runs else None
        if merge and last and s == last[0] + last[2] and d == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([s, d, 1])
    dense = (src.is_dense & dst.is_dense).tolist()
    order = list(range(src.num_tensors))
    if not all(dense):
        order = [t for t in order if dense[t]] + [t for t in order if not dense[t]]
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    for t in order:
        page = int(src.page_bytes[t])
        items = runs if dense[t] else [[s, d, 1] for s, d in pairs]
        for s, d, length in items:
            out[0].append(int(src.base_addrs[t] + s * src.block_strides[t]))
            out[1].append(int(dst.base_addrs[t] + d * dst.block_strides[t]))
            out[2].append(page * length)
    return out


@st.composite
def _layout_case(draw: st.DrawFn) -> tuple[KVLayout, KVLayout, list[int], list[int]]:
    num_tensors = draw(st.integers(1, 4))
    pages = draw(st.lists(st.integers(1, 5000), min_size=num_tensors, max_size=num_tensors))

    def layout(num_blocks: int) -> KVLayout:
        pads = draw(st.lists(st.sampled_from([0, 0, 8, 100]), min_size=num_tensors,
                             max_size=num_tensors))  # fmt: skip
        bases = [(1 << 30) * (t + 1) + draw(st.integers(0, 15)) for t in range(num_tensors)]
        return _layout(bases, pages, [p + pad for p, pad in zip(pages, pads)], num_blocks)

    nb_src, nb_dst = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    n = draw(st.integers(1, nb_dst))
    consecutive = draw(st.booleans())  # long runs, or random ids
    if consecutive and n <= nb_src:
        first_s, first_d = draw(st.integers(0, nb_src - n)), draw(st.integers(0, nb_dst - n))
        src_ids, dst_ids = list(range(first_s, first_s + n)), list(range(first_d, first_d + n))
    else:
        dst_ids = list(draw(st.permutations(range(nb_dst)))[:n])
        src_ids = draw(st.lists(st.integers(0, nb_src - 1), min_size=n, max_size=n))
    return layout(nb_src), layout(nb_dst), src_ids, dst_ids


@settings(max_examples=150, deadline=None)
@given(case=_layout_case(), merge=st.booleans())
def test_lazy_descriptors_equal_the_eager_ones(
    case: tuple[KVLayout, KVLayout, list[int], list[int]], merge: bool
) -> None:
    src, dst, src_ids, dst_ids = case
    plan = build_plan(Direction.D2H, src, dst, np.array(src_ids), np.array(dst_ids), merge=merge)
    expected = _reference_descriptors(src, dst, src_ids, dst_ids, merge)
    # the counts come from the runs, before any descriptor is built
    assert plan.is_from_blocks and plan._built is None
    assert (plan.num_descriptors, plan.num_bytes) == (len(expected[2]), sum(expected[2]))
    assert plan.matching_blocks() is plan.blocks and plan._built is None
    assert _arrays(plan) == expected
    assert all(a.dtype == np.int64 for a in (plan.src_addrs, plan.dst_addrs, plan.sizes))
    assert plan.matching_blocks() is plan.blocks  # still matching once built (and cached)
    pairs = plan.blocks
    assert pairs is not None
    # the runs cover the pairs exactly
    k = [np.arange(n) for n in pairs.run_lengths]
    run_pairs = sorted(
        (int(s + i), int(d + i))
        for s, d, ks in zip(pairs.run_src_ids, pairs.run_dst_ids, k)
        for i in ks
    )
    assert run_pairs == sorted(zip(src_ids, dst_ids))
    if not merge:
        assert pairs.num_runs == len(src_ids)


def test_descriptors_are_built_once_and_edits_keep_the_descriptor_path() -> None:
    plan = build_plan(Direction.D2H, SRC, DST, np.array([7, 3, 2, 4]), np.array([5, 1, 0, 2]))
    assert plan.src_addrs is plan.src_addrs  # cached
    edited = attrs.evolve(plan, sizes=plan.sizes * 2)
    assert not edited.is_from_blocks and edited.matching_blocks() is None
    assert edited.src_addrs.tolist() == plan.src_addrs.tolist()  # built from the blocks
    assert edited.num_bytes == 2 * plan.num_bytes
    same = attrs.evolve(plan, num_blocks=4)  # no descriptor given: still from the blocks
    assert same.is_from_blocks and same.matching_blocks() is plan.blocks
    hand = TransferPlan(Direction.H2D, plan.src_addrs, plan.dst_addrs, plan.sizes)
    assert not hand.is_from_blocks and hand.matching_blocks() is None
    assert (hand.num_descriptors, hand.num_bytes) == (plan.num_descriptors, plan.num_bytes)
    empty = TransferPlan(Direction.H2D)
    assert (empty.num_descriptors, empty.num_bytes, len(empty.src_addrs)) == (0, 0, 0)


# ------------------------------------------------------------------ the fast paths of build_plan


@pytest.mark.parametrize("first", [0, 3, 8 - 4])
def test_consecutive_ids_are_one_run_and_checked_at_both_ends(first: int) -> None:
    plan = build_plan(Direction.D2H, SRC, DST, np.arange(first, first + 4), np.arange(4))
    pairs = plan.matching_blocks()
    assert pairs is not None and (pairs.num_runs, pairs.max_run) == (1, 4)
    assert _arrays(plan) == ([1000 + 10 * first], [5000], [40])
    with pytest.raises(InvalidBlockError, match="source block id 8"):
        build_plan(Direction.D2H, SRC, DST, np.arange(5, 9), np.arange(4))  # runs past the end
    with pytest.raises(InvalidBlockError, match="destination block id -1"):
        build_plan(Direction.D2H, SRC, DST, np.arange(4), np.arange(-1, 3))


def test_ids_far_above_the_cached_range_still_compare_right() -> None:
    big_src = _layout([1000], [10], [10], 50_000)
    big_dst = _layout([9_000_000], [10], [10], 50_000)
    ids = np.arange(40_000, 40_512)
    plan = build_plan(Direction.H2D, big_src, big_dst, ids, ids - 39_000)
    assert plan.num_descriptors == 1 and plan.sizes.tolist() == [5120]
    broken = ids.copy()
    broken[100] += 1  # a repeat and a gap: two breaks, and a hazard on the destinations
    with pytest.raises(HazardError):
        build_plan(Direction.H2D, big_src, big_dst, ids, broken)
    plan = build_plan(Direction.H2D, big_src, big_dst, broken, ids)
    assert plan.num_descriptors == 3  # 40000-40099, 40101 -> 100 (repeat breaks), rest


@pytest.mark.parametrize("seed", range(6))
def test_random_ids_with_and_without_merge_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = _layout([1 << 30, 3 << 30], [64, 32], [64, 48], 300)
    dst = _layout([5 << 30, 7 << 30], [64, 32], [64, 32], 400)
    n = int(rng.integers(1, 200))
    first = int(rng.integers(0, 100))
    src_ids = [first + i for i in range(n)] if seed % 2 else rng.integers(0, 300, n).tolist()
    dst_ids = rng.permutation(400)[:n].tolist() if seed % 3 else list(range(n))
    for merge in (True, False):
        plan = build_plan(Direction.D2H, src, dst, np.array(src_ids), np.array(dst_ids),
                          merge=merge)  # fmt: skip
        assert _arrays(plan) == _reference_descriptors(src, dst, src_ids, dst_ids, merge)
        table = plan.descriptor_table()
        assert table.flags.c_contiguous and table.shape == (3, plan.num_descriptors)
        assert all(np.shares_memory(row, table) for row in (plan.src_addrs, plan.sizes))


@pytest.mark.parametrize(("first", "n"), [(100, 40), (100, 80), (0, 80), (10, 20)])
def test_consecutive_ids_past_the_cached_range_are_found_all_the_same(
    monkeypatch: pytest.MonkeyPatch, first: int, n: int
) -> None:
    from kvmgr.transfer import _runs

    monkeypatch.setattr(_runs, "_MAX_IOTA", 64)  # the ids above 64: subtraction or diffs
    monkeypatch.setattr(_runs, "_IOTA", np.arange(16, dtype=np.int64))
    src, dst = _layout([1000], [10], [10], 300), _layout([90_000], [10], [10], 300)
    ids = np.arange(first, first + n)
    plan = build_plan(Direction.D2H, src, dst, ids, ids[::-1].copy() - first)  # no run
    assert plan.num_descriptors == n
    plan = build_plan(Direction.D2H, src, dst, ids, ids + 7)
    assert _arrays(plan) == ([1000 + 10 * first], [90_000 + 10 * (first + 7)], [10 * n])
    assert len(_runs._IOTA) <= 64


@pytest.mark.parametrize("n", [2, 7, 512])
def test_one_run_lengths_are_shared_read_only_and_exact(n: int) -> None:
    # consecutive ids on both sides: one run of n blocks, its lengths array shared by the
    # plans of that n (read-only, so no plan can change another's) and equal to the numpy path's
    from kvmgr.transfer import _runs

    src = KVLayout.from_tensors([torch.zeros(600, 64, dtype=torch.uint8) for _ in range(2)])
    dst = KVLayout.from_tensors([torch.zeros(700, 64, dtype=torch.uint8) for _ in range(2)])
    plans = [
        build_plan(Direction.D2H, src, dst, np.arange(n) + k, np.arange(n) + 3) for k in (0, 5)
    ]
    lengths = [p.blocks.run_lengths_or_none for p in plans]
    assert lengths[0] is lengths[1] and lengths[0].tolist() == [n] and lengths[0].dtype == np.int64
    with pytest.raises(ValueError):
        lengths[0][0] = 1
    numpy_runs = _runs.find_runs_numpy(np.arange(n), np.arange(n) + 3, 600, 700, True)
    assert numpy_runs.lengths is lengths[0]
    table = plans[1].descriptor_table()  # one descriptor a tensor: the whole run
    assert table.tolist() == [
        [int(src.base_addrs[t] + 5 * src.block_strides[t]) for t in range(2)],
        [int(dst.base_addrs[t] + 3 * dst.block_strides[t]) for t in range(2)],
        [n * 64] * 2,
    ]
