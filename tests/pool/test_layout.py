"""KVLayout (and the HostKVPool laid out from it): page bytes, strides, addresses, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmgr.errors import GeometryError
from kvmgr.pool.host_pool import REGION_ALIGN_BYTES, HostKVPool
from kvmgr.pool.layout import KVLayout, kv_page_bytes


def _cpu_alloc(num_bytes: int) -> torch.Tensor:
    return torch.empty(num_bytes, dtype=torch.uint8)


def test_page_bytes_differ_per_tensor_and_need_not_be_multiples_of_16() -> None:
    nb = 5
    tensors = [
        torch.empty(nb, 584, dtype=torch.uint8),  # DeepSeek-V4 c128: 584 B per token
        torch.empty(nb, 576, dtype=torch.bfloat16),  # MLA row: 1152 B
        torch.empty(nb, 3, 7, dtype=torch.float16),  # 42 B: odd and tiny
    ]
    layout = KVLayout.from_tensors(tensors)
    assert layout.page_bytes.tolist() == [584, 1152, 42]
    assert layout.block_strides.tolist() == [584, 1152, 42]
    assert layout.is_dense.tolist() == [True, True, True]
    assert layout.block_bytes == 584 + 1152 + 42
    assert (layout.num_tensors, layout.num_blocks) == (3, nb)
    assert layout.base_addrs.tolist() == [t.data_ptr() for t in tensors]
    assert layout.base_addrs.dtype == layout.page_bytes.dtype == np.int64
    assert kv_page_bytes(tensors) == [584, 1152, 42]


def test_non_dense_block_stride_of_a_k_or_v_view() -> None:
    # [num_blocks, 2 (K/V), block_size, head_dim] fp16; kv[:, 1] is V: blocks 2 pages apart
    nb, bs, hd = 6, 4, 9
    kv = torch.empty(nb, 2, bs, hd, dtype=torch.float16)
    v = kv[:, 1]
    page = bs * hd * 2
    layout = KVLayout.from_tensors([kv[:, 0], v])
    assert layout.page_bytes.tolist() == [page, page]
    assert layout.block_strides.tolist() == [2 * page, 2 * page]
    assert layout.is_dense.tolist() == [False, False]
    assert layout.base_addrs.tolist() == [kv.data_ptr(), kv.data_ptr() + page]
    # every page address equals the address torch gives for that block
    ids = np.array([0, 5, 2], dtype=np.int64)
    addrs = layout.page_addrs(ids)
    assert addrs.shape == (2, 3)
    assert addrs[1].tolist() == [v[b].data_ptr() for b in ids.tolist()]
    assert addrs[0].tolist() == [kv[b, 0].data_ptr() for b in ids.tolist()]


def test_page_addrs_of_a_dense_tensor() -> None:
    t = torch.empty(4, 10, dtype=torch.int32)
    layout = KVLayout.from_tensors((t,))  # a tuple works as well as a list
    assert layout.page_addrs(np.array([3, 1])).tolist() == [[t[3].data_ptr(), t[1].data_ptr()]]


def test_single_block_tensor_with_any_stride_is_accepted() -> None:
    base = torch.empty(1, 8, dtype=torch.uint8)
    layout = KVLayout.from_tensors([base.expand(1, 8)])
    assert layout.num_blocks == 1 and layout.page_bytes.tolist() == [8]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: [], "non-empty"),
        (lambda: torch.empty(4, 8), "non-empty"),  # a bare tensor, not a list
        (lambda: [np.zeros((4, 8))], "torch.Tensor"),
        (lambda: [torch.empty(4, 8), "x"], "kv tensor 1"),
        (lambda: [torch.tensor(3.0)], "dim 0"),  # 0-d
        (lambda: [torch.empty(0, 8)], "dim 0"),  # no blocks
        (lambda: [torch.empty(4, 8), torch.empty(5, 8)], "4 blocks"),  # unequal block counts
        (lambda: [torch.empty(8, 4).t()], "contiguous"),  # blocks not contiguous
        (lambda: [torch.empty(4, 2, 8)[:, :, ::2]], "contiguous"),  # strided inside a block
        (lambda: [torch.empty(1, 8).expand(4, 8)], "stride"),  # blocks overlap (stride 0)
        (lambda: [torch.empty(4, 8, device="meta"), torch.empty(4, 8)], "device"),
    ],
)
def test_bad_tensors_raise_geometry_error(make: object, match: str) -> None:
    with pytest.raises(GeometryError, match=match):
        KVLayout.from_tensors(make())  # type: ignore[operator]


def test_host_pool_mirrors_page_sizes_and_aligns_each_tensor() -> None:
    pages = [584, 1152, 42]
    pool = HostKVPool(pages, 3, _cpu_alloc)
    assert [tuple(t.shape) for t in pool.tensors] == [(3, 584), (3, 1152), (3, 42)]
    assert all(t.dtype == torch.uint8 for t in pool.tensors)
    offsets = [t.data_ptr() - pool.region.data_ptr() for t in pool.tensors]
    assert all(off % REGION_ALIGN_BYTES == 0 for off in offsets)
    # the regions do not overlap and fit in the region
    ends = [off + p * 3 for off, p in zip(offsets, pages)]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:]))
    assert ends[-1] <= pool.num_bytes
    assert pool.layout.page_bytes.tolist() == pages
    assert pool.layout.is_dense.all()
    # writes through the views land in the region
    pool.tensors[1][2].fill_(0x5A)
    start = offsets[1] + 2 * 1152
    assert bool((pool.region[start : start + 1152] == 0x5A).all())


@pytest.mark.parametrize(("pages", "num_blocks"), [([], 4), ([8, 0], 4), ([8], 0)])
def test_host_pool_rejects_empty_geometry(pages: list[int], num_blocks: int) -> None:
    calls: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        calls.append(n)
        return _cpu_alloc(n)

    with pytest.raises(GeometryError):
        HostKVPool(pages, num_blocks, alloc)
    assert calls == []  # nothing allocated before validation
