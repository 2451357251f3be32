"""The paged copy kernel (interpreter on CPU tensors, or the GPU) against its torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmgr.errors import GeometryError, InvalidBlockError
from kvmgr.kernels.copy.blocks import copy_blocks, copy_blocks_reference, launch_copy_blocks
from kvmgr.kernels.copy.tables import build_layout_table, build_run_table, max_run_blocks
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.plan import Direction, build_plan

POISON = 0xA5
MARGIN = 64  # poisoned bytes before and after every tensor
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _carve(buffer: torch.Tensor, pages: list[int], strides: list[int], skews: list[int], nb: int):
    """``uint8 [nb, page]`` views of ``buffer``, one per tensor, ``stride`` bytes between blocks,
    each starting ``skew`` bytes past a 16-byte boundary, ``MARGIN`` bytes apart."""
    views, offset = [], MARGIN
    for page, stride, skew in zip(pages, strides, skews, strict=True):
        offset += (skew - offset) % 16
        views.append(buffer[offset : offset + nb * stride].view(nb, stride)[:, :page])
        offset += nb * stride + MARGIN
    return views


def _span(pages: list[int], strides: list[int], nb: int) -> int:
    return sum(nb * s + MARGIN + 16 for s in strides) + MARGIN


class _Case:
    """Random non-zero source caches and a poisoned destination buffer with its tensors."""

    def __init__(
        self, seed: int, pages: list[int], pads: tuple[list[int], list[int]], nb: tuple[int, int]
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.pages, self.nb = pages, nb
        self.src_strides = [p + pad for p, pad in zip(pages, pads[0], strict=True)]
        self.dst_strides = [p + pad for p, pad in zip(pages, pads[1], strict=True)]
        self.skews = [[int(s) for s in rng.choice([0, 8, 4, 1], len(pages))] for _ in range(2)]
        src_buffer = torch.randint(1, 256, (_span(pages, self.src_strides, nb[0]),),
                                   dtype=torch.uint8, generator=gen)  # fmt: skip
        self.src_buffer = src_buffer.to(DEVICE)
        self.src = _carve(self.src_buffer, pages, self.src_strides, self.skews[0], nb[0])
        span = _span(pages, self.dst_strides, nb[1])
        self.dst_buffer = torch.full((span,), POISON, dtype=torch.uint8, device=DEVICE)
        self.dst = self.dst_views(self.dst_buffer)

    def dst_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return _carve(buffer, self.pages, self.dst_strides, self.skews[1], self.nb[1])

    def check(self, runs: tuple[np.ndarray, np.ndarray, np.ndarray], **kwargs) -> None:
        """Copy with the kernel and with the reference (into a copy of the poisoned buffer);
        every byte of the destination buffer must agree: copied pages, pages not written, gaps
        between pages of strided tensors and the margins around the tensors."""
        expected = self.dst_buffer.clone()
        copy_blocks_reference(self.src, self.dst_views(expected), *runs)
        copy_blocks(self.src, self.dst, *runs, device=DEVICE, **kwargs)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(self.dst_buffer, expected)
        # and the reference wrote no more than the runs' pages: the rest is still poison
        num_written = int(runs[2].sum()) * sum(self.pages)
        assert int((expected != POISON).sum()) <= num_written
        assert bool((expected[:MARGIN] == POISON).all())
        assert bool((expected[-MARGIN:] == POISON).all())


MIXED = [576, 584, 4096]


def _runs(*rows: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s, d, n = (np.array(c, dtype=np.int64) for c in zip(*rows))
    return s, d, n


@pytest.mark.parametrize(
    "pads",
    [([0, 0, 0], [0, 0, 0]), ([0, 8, 0], [16, 0, 100]), ([576, 584, 4096], [0, 0, 0])],
    ids=["dense", "strided", "kv-halves"],
)
def test_runs_of_mixed_pages_match_the_reference(pads: tuple[list[int], list[int]]) -> None:
    case = _Case(1, MIXED, pads, (24, 30))
    # one block, a run of 7, a run of 5 (split at 2 blocks per item), scattered blocks
    runs = _runs((3, 29, 1), (10, 0, 7), (17, 12, 5), (0, 8, 1), (22, 19, 2), (2, 25, 1))
    case.check(runs, max_programs=3, chunk_bytes=8192)


@pytest.mark.parametrize(
    "pads", [([0] * 3, [0] * 3), ([0, 8, 0], [16, 0, 100])], ids=["dense", "strided"]
)
def test_a_run_longer_than_the_cap_spreads_over_programs(pads) -> None:
    case = _Case(2, MIXED, pads, (40, 40))
    runs = _runs((1, 3, 37))
    assert build_run_table(*runs, max_run_blocks(np.array(MIXED), 8192)).shape == (3, 19)
    case.check(runs, max_programs=4, chunk_bytes=8192)


def test_a_single_block_and_a_single_program() -> None:
    # one run of one tensor: on a GPU both counts reach Triton as the constexpr 1
    case = _Case(3, [584], ([0], [8]), (4, 4))
    case.check(_runs((2, 1, 1)), max_programs=1)


def test_many_scattered_blocks_from_a_plan() -> None:
    # the runs build_plan records for 60 scattered pairs (some consecutive by chance)
    case = _Case(4, [576, 4096], ([0, 0], [0, 64]), (130, 100))
    rng = np.random.default_rng(4)
    src_ids, dst_ids = rng.choice(130, 60, replace=False), rng.permutation(100)[:60]
    plan = build_plan(
        Direction.D2H, KVLayout.from_tensors(case.src), KVLayout.from_tensors(case.dst),
        src_ids, dst_ids,
    )  # fmt: skip
    pairs = plan.blocks
    assert pairs is not None
    case.check((pairs.run_src_ids, pairs.run_dst_ids, pairs.run_lengths), max_programs=5)
    for src, dst in zip(case.src, case.dst, strict=True):  # the pairs, as given
        assert torch.equal(dst[torch.as_tensor(dst_ids)], src[torch.as_tensor(src_ids)])


def test_run_table_splits_long_runs_in_order() -> None:
    s, d, n = _runs((0, 100, 5), (50, 7, 1), (10, 20, 16))
    table = build_run_table(s, d, n, 4)
    assert table.flags.c_contiguous and table.dtype == np.int64
    assert table.tolist() == [
        [0, 4, 50, 10, 14, 18, 22],
        [100, 104, 7, 20, 24, 28, 32],
        [4, 1, 1, 4, 4, 4, 4],
    ]
    assert build_run_table(s, d, n, 16).tolist() == [s.tolist(), d.tolist(), n.tolist()]
    assert build_run_table(*(np.zeros(0, np.int64) for _ in range(3)), 4).shape == (3, 0)
    # about chunk_bytes per item: 64 KiB of 4 KiB pages is 16 blocks; a large page is 1 block
    assert max_run_blocks(np.array([576, 4096])) == 16
    assert max_run_blocks(np.array([1 << 20]), 65536) == 1


def test_layout_table_and_argument_checks() -> None:
    src = [torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, 8, dtype=torch.uint8)[:, 0]]
    dst = [torch.zeros(6, 16, dtype=torch.uint8), torch.zeros(6, 8, dtype=torch.uint8)]
    table = build_layout_table(KVLayout.from_tensors(src), KVLayout.from_tensors(dst))
    assert table.shape == (5, 2) and table.dtype == np.int64
    assert table[:, 1].tolist() == [src[1].data_ptr(), dst[1].data_ptr(), 16, 8, 8]
    with pytest.raises(GeometryError, match="equal page bytes"):
        copy_blocks(src, dst[:1], [0], [0], [1], device=DEVICE)
    for runs, match in [
        (([0], [0], [0]), ">= 1 block"),
        (([3], [0], [2]), "source run"),
        (([0], [5], [2]), "destination run"),
        (([0, 1], [0], [1]), "equal run counts"),
        (([0.5], [0], [1]), "integers"),
    ]:
        with pytest.raises(InvalidBlockError, match=match):
            copy_blocks(src, dst, *runs, device=DEVICE)
        with pytest.raises(InvalidBlockError, match=match):
            copy_blocks_reference(src, dst, *runs)
    with pytest.raises(GeometryError, match="max_programs"):
        copy_blocks(src, dst, [0], [0], [1], device=DEVICE, max_programs=0)
    good = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(GeometryError, match=r"layout: expected int64 \[5, n\]"):
        launch_copy_blocks(good, good)
    with pytest.raises(GeometryError, match="runs: expected contiguous"):
        launch_copy_blocks(
            torch.zeros(5, 2, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64).t()
        )
    # nothing to copy: nothing is launched
    empty = torch.zeros(3, 0, dtype=torch.int64)
    assert launch_copy_blocks(torch.zeros(5, 2, dtype=torch.int64), empty) == 0


_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvmgr.kernels.copy.row import NUM_WARPS as _NUM_WARPS
from kvmgr.kernels.copy.blocks import _copy_blocks_kernel
target, options = GPUTarget("cuda", 90, 32), {"num_warps": _NUM_WARPS}
names = ("num_tensors", "num_runs")
# counts equal to 1 reach the kernel as constexprs (Triton specializes the integer 1)
ones = {"layout_ptr": "*i64", "runs_ptr": "*i64", **{n: "constexpr" for n in names}}
triton.compile(ASTSource(_copy_blocks_kernel, ones, {n: 1 for n in names}), target=target,
               options=options)
signature = {"layout_ptr": "*i64", "runs_ptr": "*i64", "num_tensors": "i32", "num_runs": "i32"}
kernel = triton.compile(ASTSource(_copy_blocks_kernel, signature, {}), target=target,
                        options=options)
"""


def test_paged_kernel_compiles_to_vector_loads_for_the_h200(compile_for_sm90) -> None:
    # as for the descriptor kernel: compile for sm_90 without the interpreter and read the PTX
    info = compile_for_sm90(_COMPILE_FOR_SM90)
    assert info["missing_widths"] == [], info[
        "ops"
    ]  # _copy_row's 16-, 8-, 4-, 2- and 1-byte branches
    assert (info["shared"], info["converts"]) == (0, 0)


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        (((0,), (2**63 - 2,), (2,)), "destination run leaves"),  # first + n wraps around int64
        (((2**62 - 1,), (0,), (2**62 + 1,)), "source run leaves"),
        (((2**62,), (2**62,), (2**62,)), "run leaves"),
        (((0, 4), (0, 1), (3, 3)), "destination runs overlap"),
        (((0,), (-1,), (1,)), "destination run leaves"),
    ],
)
def test_bad_runs_raise_before_anything_is_written(runs, match) -> None:
    # found by a fresh-user pass: an int64 wrap let a run start before the cache
    case = _Case(7, [64], ([0], [0]), (8, 8))
    before = case.dst_buffer.clone()
    with pytest.raises(InvalidBlockError, match=match):
        copy_blocks(case.src, case.dst, *(np.array(r, dtype=np.int64) for r in runs), device=DEVICE)
    assert torch.equal(case.dst_buffer, before)


def test_one_cache_both_ways_refuses_a_source_overlapping_a_destination() -> None:
    case = _Case(8, [64], ([0], [0]), (8, 8))
    with pytest.raises(InvalidBlockError, match="overlaps a destination"):
        copy_blocks(case.src, case.src, np.array([0]), np.array([2]), np.array([3]), device=DEVICE)
    # reading one block twice is fine
    copy_blocks(
        case.src, case.src, np.array([0, 0]), np.array([4, 6]), np.array([1, 1]), device=DEVICE
    )
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(case.src[0][4], case.src[0][0]) and torch.equal(
        case.src[0][6], case.src[0][0]
    )
