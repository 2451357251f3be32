"""The staged issuer (``kvmgr.transfer.staged``) on CPU: the "device" tensors are CPU tensors,
both the device-to-device part and the DMA part are ``DmaCopy`` over ``test_cuda_engine``'s fake
driver (ctypes callbacks that memmove and log), streams and events are its logging fakes.

Checked: every page lands where the plan says and nothing else is written (poisoned memory
around the outputs, random data); the DMA part issues one descriptor per CPU run and tensor; a
plan larger than the buffer goes in chunks; the buffer's reuse waits for its last use's event;
a refused part stops the chunks after it; an unstageable plan goes to DMA as it is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cuda_fakes import FakeCuda, FakeDriverLib

from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan
from kvmgr.transfer.staged import StagedCopy, host_runs, staged_descriptors

POISON = 0xA5
PAGES = (512, 1152, 100)  # unequal, one not a multiple of 16: the alignment padding is exercised


def _dma(lib: FakeDriverLib) -> DmaCopy:
    driver = CopyDriver(lib.resolver(), driver_version=13000)
    driver.fake_lib = lib  # type: ignore[attr-defined]  # keep the ctypes callbacks alive
    return DmaCopy(driver, "batch", 1 << 16)


def _kv(rng: np.random.Generator, num_blocks: int, fill: int | None = None) -> list[torch.Tensor]:
    if fill is not None:
        return [torch.full((num_blocks, p), fill, dtype=torch.uint8) for p in PAGES]
    return [torch.from_numpy(rng.integers(0, 256, (num_blocks, p), dtype=np.uint8)) for p in PAGES]


def _setup(staging_blocks: int) -> tuple[FakeCuda, FakeDriverLib, FakeDriverLib, StagedCopy]:
    fake = FakeCuda()
    move_lib, dma_lib = FakeDriverLib(), FakeDriverLib()
    move_lib.calls = dma_lib.calls = fake.log  # one log: driver calls between stream operations
    staging_bytes = staging_blocks * (sum(PAGES) + 256 * len(PAGES))
    staged = StagedCopy(torch.device("cpu"), _dma(move_lib), _dma(dma_lib),
                        staging_bytes=staging_bytes, event=fake.Event)  # fmt: skip
    return fake, move_lib, dma_lib, staged


def _ids(rng: np.random.Generator, n: int, num_blocks: int, runs: bool) -> np.ndarray:
    """``n`` distinct ids below ``num_blocks``: scattered, or a few runs of consecutive ids."""
    if not runs:
        return rng.choice(num_blocks // 2, n, replace=False) * 2  # never adjacent
    starts = np.sort(rng.choice(num_blocks // 8, 3, replace=False)) * 8
    ids = np.concatenate([np.arange(s, s + 8) for s in starts])[:n]
    return rng.permutation(ids)


def _check_pages(src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: np.ndarray,
                 dst_ids: np.ndarray) -> None:  # fmt: skip
    """Every destination page equals its source page; every other destination byte is poison."""
    s, d = torch.from_numpy(src_ids), torch.from_numpy(dst_ids)
    for a, b in zip(src, dst):
        assert torch.equal(a[s], b[d])
        rest = torch.ones(b.shape[0], dtype=torch.bool)
        rest[d] = False
        assert bool((b[rest] == POISON).all())


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize(("n", "staging_blocks"), [(20, 64), (20, 7), (1, 1)])
def test_staged_copies_every_page_and_nothing_else(
    direction: Direction, n: int, staging_blocks: int
) -> None:
    rng = np.random.default_rng(n * 31 + staging_blocks)
    fake, _, _, staged = _setup(staging_blocks)
    stream = fake.Stream()
    gpu_ids = _ids(rng, n, 64, runs=False)  # scattered GPU blocks
    host_ids = _ids(rng, n, 64, runs=True)  # CPU blocks in runs
    src, dst = _kv(rng, 64), _kv(rng, 64, POISON)
    d2h = direction is Direction.D2H
    src_ids, dst_ids = (gpu_ids, host_ids) if d2h else (host_ids, gpu_ids)
    plan = build_plan(direction, KVLayout.from_tensors(src), KVLayout.from_tensors(dst),
                      src_ids, dst_ids)  # fmt: skip
    assert staged.can_stage(plan)
    issued = staged.issue(plan, stream)
    assert issued.error is None and issued.path == "staged"
    _check_pages(src, dst, src_ids, dst_ids)
    chunks = -(-n // staging_blocks)
    assert issued.num_chunks == 2 * chunks
    assert staged.num_buffers == 1
    # the DMA part: one descriptor per CPU run and tensor (runs split only at chunk edges)
    dma_counts = [c["count"] for c in fake.log if isinstance(c, dict) and "batch" in c]
    runs = host_runs(plan)
    assert runs is not None
    assert staged_descriptors(plan) == runs * len(PAGES)
    # both libs log into one list, a chunk's two parts in order: gather, DMA or DMA, scatter
    first_dma = 1 if direction is Direction.D2H else 0
    dma_part = dma_counts[first_dma::2]
    assert len(dma_part) == chunks
    assert runs * len(PAGES) <= sum(dma_part) <= (runs + chunks - 1) * len(PAGES)


def test_runs_are_counted_in_cpu_order() -> None:
    rng = np.random.default_rng(3)
    gpu, host = _kv(rng, 32), _kv(rng, 32)
    g, h = KVLayout.from_tensors(gpu), KVLayout.from_tensors(host)
    ids = np.array([9, 3, 4, 10, 5, 11])  # CPU runs 3-5 and 9-11
    gpu_ids = np.array([0, 2, 4, 6, 8, 10])
    d2h = build_plan(Direction.D2H, g, h, gpu_ids, ids)
    h2d = build_plan(Direction.H2D, h, g, ids, gpu_ids)
    assert host_runs(d2h) == host_runs(h2d) == 2
    assert staged_descriptors(d2h) == 2 * len(PAGES)
    handmade = TransferPlan(Direction.D2H, np.zeros(1, np.int64), np.zeros(1, np.int64),
                            np.ones(1, np.int64))  # fmt: skip
    assert host_runs(handmade) is None and staged_descriptors(handmade) is None


def test_reuse_waits_for_the_last_use_on_another_stream() -> None:
    rng = np.random.default_rng(5)
    fake, _, _, staged = _setup(64)
    gpu, host = _kv(rng, 64), _kv(rng, 64, POISON)
    plan = build_plan(Direction.D2H, KVLayout.from_tensors(gpu), KVLayout.from_tensors(host),
                      np.arange(0, 16, 2), np.arange(8))  # fmt: skip
    first, second = fake.Stream(), fake.Stream()
    staged.issue(plan, first)
    records = [e for e in fake.log if isinstance(e, tuple) and e[0] == "record"]
    assert len(records) == 1 and records[0][2] is first  # after the first use, on its stream
    last_use = records[0][1]
    fake.log.clear()
    staged.issue(plan, second)
    # the second use waits for the first on the device before any copy of its own
    assert fake.log[0] == ("wait", second, last_use)
    assert all(not (isinstance(e, tuple) and e[0] == "wait") for e in fake.log[1:])


def test_a_refused_part_stops_the_chunks_after_it() -> None:
    rng = np.random.default_rng(7)
    fake = FakeCuda()
    move_lib, dma_lib = FakeDriverLib(), FakeDriverLib(fail_at=0, fail_call=1)
    staged = StagedCopy(torch.device("cpu"), _dma(move_lib), _dma(dma_lib),
                        staging_bytes=4 * (sum(PAGES) + 256 * 3), event=fake.Event)  # fmt: skip
    gpu, host = _kv(rng, 64), _kv(rng, 64, POISON)
    plan = build_plan(
        Direction.D2H,
        KVLayout.from_tensors(gpu),
        KVLayout.from_tensors(host),
        np.arange(0, 32, 2),
        np.arange(16),
    )  # fmt: skip 4 chunks of 4 blocks
    issued = staged.issue(plan, fake.Stream())
    assert issued.error is not None and issued.error.fail_index is None
    assert move_lib.num_batch_calls == 2 and dma_lib.num_batch_calls == 2  # chunk 2's DMA refused
    s = torch.from_numpy(np.arange(0, 8, 2))
    for a, b in zip(gpu, host):  # chunk 1 landed; chunks 3 and 4 were never issued
        assert torch.equal(a[s], b[:4])
        assert bool((b[8:] == POISON).all())


def test_an_unstageable_plan_goes_to_dma_as_it_is() -> None:
    rng = np.random.default_rng(9)
    fake, move_lib, _, staged = _setup(1)
    src = torch.from_numpy(rng.integers(0, 256, 64, dtype=np.uint8))
    dst = torch.full((64,), POISON, dtype=torch.uint8)
    plan = TransferPlan(Direction.D2H, np.array([src.data_ptr()], np.int64),
                        np.array([dst.data_ptr() + 8], np.int64), np.array([32], np.int64))  # fmt: skip
    assert not staged.can_stage(plan)
    issued = staged.issue(plan, fake.Stream())
    assert issued.error is None and issued.path == "batch"
    assert torch.equal(dst[8:40], src[:32]) and bool((dst[:8] == POISON).all())
    assert move_lib.num_batch_calls == 0 and staged.num_buffers == 0


def test_a_block_larger_than_the_buffer_is_not_staged() -> None:
    rng = np.random.default_rng(11)
    fake, _, _, staged = _setup(1)
    staged.staging_bytes = sum(PAGES)  # less than one padded block
    gpu, host = _kv(rng, 8), _kv(rng, 8, POISON)
    plan = build_plan(Direction.D2H, KVLayout.from_tensors(gpu), KVLayout.from_tensors(host),
                      np.array([1, 5]), np.array([2, 3]))  # fmt: skip
    assert not staged.can_stage(plan)
    assert staged.issue(plan, fake.Stream()).path == "batch"
    _check_pages(gpu, host, np.array([1, 5]), np.array([2, 3]))


def test_bad_staging_size_is_refused() -> None:
    with pytest.raises(ValueError, match="staging_bytes"):
        StagedCopy(torch.device("cpu"), _dma(FakeDriverLib()), _dma(FakeDriverLib()),
                   staging_bytes=0)  # fmt: skip
