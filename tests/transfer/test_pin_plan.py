"""plan_pieces (issue 28 part 4): which pages each piece registers, on random layouts.

For any layout HostKVPool builds (any page sizes, tensor counts, block counts, piece sizes):
every OS page a block touches is registered exactly once, by the first piece that needs it;
ranges are page-aligned, disjoint and at most 64 GiB; once pieces 0..k are registered every
byte of blocks [0, end_block_k) is registered; the pieces end at num_blocks. No memory is
allocated: the planner is arithmetic, so a 600 GiB tier is planned here too.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmgr.errors import ConfigError
from kvmgr.pool.host_pool import HostKVPool, HostRegionLayout
from kvmgr.transfer.pin_plan import MAX_REGISTER_BYTES, PAGE_BYTES, PinPiece, plan_pieces

GIB = 1 << 30


def _layout(page_bytes: list[int], num_blocks: int) -> HostRegionLayout:
    """The layout HostKVPool gives (built without memory: the allocator is never called)."""
    captured: list[HostRegionLayout] = []

    class _Stop(Exception):
        pass

    def allocate_region(layout: HostRegionLayout) -> object:
        captured.append(layout)
        raise _Stop

    with pytest.raises(_Stop):
        HostKVPool(page_bytes, num_blocks, lambda n: None, allocate_region=allocate_region)  # type: ignore[arg-type,return-value]
    return captured[0]


def _check(layout: HostRegionLayout, pieces: tuple[PinPiece, ...]) -> None:
    ranges = [r for piece in pieces for r in piece.ranges]
    # 1. aligned, capped, disjoint
    for offset, size in ranges:
        assert offset % PAGE_BYTES == 0 and size % PAGE_BYTES == 0 and size > 0
        assert size <= MAX_REGISTER_BYTES
    ordered = sorted(ranges)
    for (a, n), (b, _) in itertools.pairwise(ordered):
        assert a + n <= b, "a page registered twice"
    # 2. end blocks grow to num_blocks; each piece's blocks are covered by pieces <= it
    ends = [piece.end_block for piece in pieces]
    assert ends == sorted(set(ends)) and ends[-1] == layout.num_blocks and ends[0] >= 1
    covered: list[tuple[int, int]] = []
    start = 0
    for piece in pieces:
        covered = sorted(covered + list(piece.ranges))
        for offset, page in zip(layout.offsets, layout.page_bytes):
            lo, hi = offset + start * page, offset + piece.end_block * page
            assert _covers(covered, lo, hi), (lo, hi)
        start = piece.end_block
    # 3. nothing beyond the region's last page
    assert ordered[-1][0] + ordered[-1][1] <= -(-layout.num_bytes // PAGE_BYTES) * PAGE_BYTES


def _covers(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether the sorted disjoint ranges cover [lo, hi) (page-rounded)."""
    lo = lo // PAGE_BYTES * PAGE_BYTES
    for offset, size in ranges:
        if offset > lo:
            return lo >= hi
        lo = max(lo, offset + size)
        if lo >= hi:
            return True
    return lo >= hi


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 3 * PAGE_BYTES), min_size=1, max_size=6),
    st.integers(1, 300),
    st.integers(PAGE_BYTES, 64 * PAGE_BYTES),
    st.integers(1, 8),
)
def test_every_page_once_by_the_first_piece_that_needs_it(
    page_bytes: list[int], num_blocks: int, first: int, growth: int
) -> None:
    layout = _layout(page_bytes, num_blocks)
    pieces = plan_pieces(layout, first_piece_bytes=first, max_piece_bytes=first * growth)
    _check(layout, pieces)


def test_pieces_grow_from_the_first_size_to_the_cap() -> None:
    layout = _layout([4096, 4096], 1 << 12)  # 32 MiB, 8 KiB blocks
    pieces = plan_pieces(layout, first_piece_bytes=1 << 20, max_piece_bytes=4 << 20)
    sizes = [p.num_bytes for p in pieces]
    assert sizes[:4] == [1 << 20, 2 << 20, 4 << 20, 4 << 20]
    _check(layout, pieces)


def test_a_600_gib_tier_is_registered_in_ranges_of_at_most_64_gib() -> None:
    # vllm #51080: one cudaHostRegister of >= 512 GiB fails. One flat tensor, 2 MiB blocks.
    layout = _layout([2 << 20], 300 * 1024)
    assert layout.num_bytes == 600 * GIB
    pieces = plan_pieces(layout)
    assert max(size for p in pieces for _, size in p.ranges) == MAX_REGISTER_BYTES
    assert sum(p.num_bytes for p in pieces) == 600 * GIB
    assert pieces[0].num_bytes == GIB  # the first GiB is usable first
    _check(layout, pieces)
    # the cap holds even for a piece larger than 64 GiB (one huge block)
    (piece,) = plan_pieces(_layout([100 * GIB], 1), first_piece_bytes=PAGE_BYTES)
    assert [size for _, size in piece.ranges] == [64 * GIB, 36 * GIB]


@pytest.mark.parametrize(
    ("first", "cap"), [(100, PAGE_BYTES), (8192, 4096), (PAGE_BYTES, MAX_REGISTER_BYTES + 1)]
)
def test_bad_piece_sizes_raise(first: int, cap: int) -> None:
    with pytest.raises(ConfigError, match="first_piece_bytes"):
        plan_pieces(_layout([4096], 4), first_piece_bytes=first, max_piece_bytes=cap)
