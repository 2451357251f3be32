"""PinnedRegion and a manager on a tier pinned in pieces (issue 28 part 4), on the CPU.

A fake registrar stands in for cudaHostRegister: it records the ranges, can hold a piece on a
gate (to see the tier grow) or fail the n-th registration. What is checked:

1. Before returning: every page registered once, in pieces; the first touch (on the populate
   threads) happened before each registration; statistics per phase.
2. In the background: only the first piece before returning, the rest on a thread;
   ``num_blocks_ready`` follows the pieces; close stops after the current piece and unregisters
   everything.
3. A failing piece: before returning a typed ``TransferError`` with nothing left registered; in
   the background a smaller tier (the error in the statistics); with ``allow_pageable`` the
   engine is told (``on_pageable``) before any unpinned block is usable.
4. The manager: stores made while the tier is pinning get only blocks of pinned pieces (an
   engine checks every host byte of every copy against the registered ranges at submission),
   are refused with reason ``cpu_pinning`` (or wait, with ``backpressure="wait"``) when those
   are full, and succeed once ``step()`` sees the next piece.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager, PoolExhaustedError, TransferError
from kvmgr.errors import ConfigError, HostMemoryError
from kvmgr.pool.host_pool import HostRegionLayout
from kvmgr.testing import check_invariants
from kvmgr.transfer import HostEngine, host_pages
from kvmgr.transfer.engine import BatchHandle
from kvmgr.transfer.pin_plan import PAGE_BYTES, plan_pieces
from kvmgr.transfer.pinned import HostRegistrar
from kvmgr.transfer.pinning import PinnedRegion, PinOptions
from kvmgr.transfer.plan import TransferPlan

MIB = 1 << 20


class FakeRegistrar:
    """Records registrations; ``gates[i]`` holds the i-th call; ``fail_at`` fails that call."""

    def __init__(self, *, fail_at: int | None = None, check_touched: bool = False) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.gates: dict[int, threading.Event] = {}
        self.fail_at = fail_at
        self.check_touched = check_touched
        self.untouched_pages = 0
        self._lock = threading.Lock()

    def registrar(self) -> HostRegistrar:
        return HostRegistrar(self._register, self._unregister)

    def _register(self, address: int, num_bytes: int) -> None:
        call = len(self.ranges)
        gate = self.gates.get(call)
        if gate is not None:
            assert gate.wait(30), "test gate never opened"
        if call == self.fail_at:
            raise RuntimeError("cudaHostRegister failed: out of memory (error 2)")
        if self.check_touched:
            self.untouched_pages += _non_resident_pages(address, num_bytes)
        with self._lock:
            self.ranges.append((address, num_bytes))

    def _unregister(self, address: int) -> None:
        self.unregistered.append(address)

    def is_registered(self, address: int, num_bytes: int) -> bool:
        """Whether [address, address + num_bytes) lies in registered, not unregistered, ranges."""
        live = sorted((a, n) for a, n in self.ranges if a not in self.unregistered)
        at, end = address, address + num_bytes
        for start, size in live:
            if start <= at < start + size:
                at = start + size
                if at >= end:
                    return True
        return at >= end


def _non_resident_pages(address: int, num_bytes: int) -> int:
    """Pages of the range not in memory (``mincore``): untouched pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-num_bytes // PAGE_BYTES)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(num_bytes), vec) == 0
    return int(pages - sum(v & 1 for v in vec))


def _layout(num_blocks: int, pages: Sequence[int] = (64 << 10, 32 << 10)) -> HostRegionLayout:
    offsets, total = [], 0
    for page in pages:
        total = -(-total // 256) * 256
        offsets.append(total)
        total += page * num_blocks
    return HostRegionLayout(tuple(offsets), tuple(pages), num_blocks, total)


def _options(**kw: object) -> PinOptions:
    kw.setdefault("first_piece_bytes", 1 * MIB)
    kw.setdefault("max_piece_bytes", 4 * MIB)
    kw.setdefault("populate_threads", 2)
    return PinOptions(**kw)  # type: ignore[arg-type]


# ====================================================================== 1. before returning


def test_a_sync_region_registers_every_page_once_after_first_touch() -> None:
    fake = FakeRegistrar(check_touched=True)
    layout = _layout(200)  # 19.2 MiB in pieces of 1, 2, 4, 4, ... MiB
    region = PinnedRegion(layout, fake.registrar, _options(background=False))
    stats = region.statistics()
    assert region.num_blocks_ready == 200 and stats.done and stats.error is None
    assert stats.pieces_pinned == stats.num_pieces > 3
    assert stats.pinned_bytes == sum(n for _, n in fake.ranges) >= layout.num_bytes
    assert stats.register_s >= 0 and stats.pin_s >= stats.alloc_s
    assert fake.untouched_pages == 0  # first touch ran before every registration
    base = region.tensor.data_ptr()
    assert base % (2 * MIB) == 0 and region.tensor.numel() == layout.num_bytes
    assert fake.is_registered(base, layout.num_bytes)
    region.close()
    region.close()  # idempotent
    assert sorted(fake.unregistered) == sorted(a for a, _ in fake.ranges)
    region.tensor[:16] = 7  # still valid memory after close


def test_first_touch_falls_back_to_writes_where_madvise_cannot_populate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Linux < 5.14 has no MADV_POPULATE_WRITE (EINVAL): an unknown advice gives the same answer
    monkeypatch.setattr(host_pages, "_MADV_POPULATE_WRITE", 12345)
    fake = FakeRegistrar(check_touched=True)
    region = PinnedRegion(_layout(40), fake.registrar, _options(background=False))
    assert region.num_blocks_ready == 40 and fake.untouched_pages == 0
    region.close()


def test_without_populate_threads_the_registration_touches_the_pages() -> None:
    fake = FakeRegistrar(check_touched=True)
    region = PinnedRegion(_layout(40), fake.registrar, _options(background=False,
                                                                populate_threads=0))  # fmt: skip
    assert region.num_blocks_ready == 40 and fake.untouched_pages > 0
    region.close()


# ====================================================================== 2. in the background


def _until(predicate: object, what: str) -> None:
    """Wait (bounded) for a condition another thread makes true."""
    done = threading.Event()
    for _ in range(3000):
        if predicate():  # type: ignore[operator]
            return
        done.wait(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_background_region_grows_piece_by_piece_and_close_unregisters() -> None:
    fake = FakeRegistrar()
    layout = _layout(200)
    options = _options()
    pieces = plan_pieces(layout, first_piece_bytes=options.first_piece_bytes,
                         max_piece_bytes=options.max_piece_bytes)  # fmt: skip
    starts = np.cumsum([0] + [len(p.ranges) for p in pieces]).tolist()
    fake.gates = {starts[k]: threading.Event() for k in range(1, len(pieces))}  # hold each piece
    region = PinnedRegion(layout, fake.registrar, options)
    # 1. only the first piece before returning
    assert region.num_blocks_ready == pieces[0].end_block
    assert region.statistics().pieces_pinned == 1 and not region.statistics().done
    # 2. each piece, once registered, makes its blocks ready in every tensor, and no more
    for k in (1, 2):
        assert region.num_blocks_ready == pieces[k - 1].end_block
        fake.gates[starts[k]].set()
        _until(lambda k=k: region.num_blocks_ready == pieces[k].end_block, f"piece {k}")
        for offset, page in zip(layout.offsets, layout.page_bytes):
            address = region.tensor.data_ptr() + offset
            assert fake.is_registered(address, page * region.num_blocks_ready)
    # 3. close while piece 3 waits: it stops after that piece and unregisters everything
    closer = threading.Thread(target=region.close)
    closer.start()
    for gate in fake.gates.values():
        gate.set()
    closer.join(30)
    assert not closer.is_alive()
    stats = region.statistics()
    assert stats.done and 3 <= stats.pieces_pinned < stats.num_pieces == len(pieces)
    assert sorted(fake.unregistered) == sorted(a for a, _ in fake.ranges)


# ====================================================================== 3. failures


def test_a_failing_first_piece_raises_and_leaves_nothing_registered() -> None:
    fake = FakeRegistrar(fail_at=1)  # the second range of piece 0
    with pytest.raises(TransferError, match=r"0 of \d+ pieces pinned.*out of memory"):
        PinnedRegion(_layout(200), fake.registrar, _options(background=False))
    assert fake.unregistered == [a for a, _ in fake.ranges] and len(fake.ranges) == 1


def test_a_failing_later_piece_in_the_background_leaves_a_smaller_tier() -> None:
    fake = FakeRegistrar(fail_at=4)  # piece 2
    region = PinnedRegion(_layout(200), fake.registrar, _options())
    assert region.wait(30)
    stats = region.statistics()
    assert stats.pieces_pinned == 2 and stats.error is not None and "out of memory" in stats.error
    assert 0 < region.num_blocks_ready < 200 and stats.blocks_ready == region.num_blocks_ready
    assert stats.pageable_bytes == 0
    region.close()
    assert sorted(fake.unregistered) == sorted(a for a, _ in fake.ranges)


def test_with_allow_pageable_the_engine_hears_of_it_before_any_unpinned_block() -> None:
    fake = FakeRegistrar(fail_at=4)
    seen_ready: list[int] = []
    holder: list[PinnedRegion] = []

    def on_pageable() -> None:  # what the engine does: DMA only from now on
        seen_ready.append(holder[0].num_blocks_ready)

    fake.gates = {2: threading.Event()}
    region = PinnedRegion(_layout(200), fake.registrar, _options(), allow_pageable=True,
                          on_pageable=on_pageable)  # fmt: skip
    holder.append(region)
    fake.gates[2].set()
    assert region.wait(30)
    assert seen_ready and seen_ready[0] < 200  # told while blocks were still not ready
    assert region.num_blocks_ready == 200 and region.statistics().pageable_bytes > 0
    region.close()


def test_a_registrar_that_cannot_be_had_is_a_failed_first_piece() -> None:
    def no_cuda() -> HostRegistrar:
        raise RuntimeError("CUDA runtime not available to torch")

    with pytest.raises(TransferError, match="not available"):
        PinnedRegion(_layout(8), no_cuda, _options())
    told = []
    region = PinnedRegion(_layout(8), no_cuda, _options(), allow_pageable=True,
                          on_pageable=lambda: told.append(True))  # fmt: skip
    assert told == [True] and region.num_blocks_ready == 8
    region.close()


@pytest.mark.parametrize(
    "kw",
    [
        {"first_piece_bytes": 100},
        {"max_piece_bytes": 128 << 30},
        {"populate_threads": -1},
        {"background": 1},
    ],
)
def test_bad_options_raise(kw: dict[str, object]) -> None:
    with pytest.raises((ConfigError, TypeError)):
        PinOptions(**kw)  # type: ignore[arg-type]


# ====================================================================== 4. the manager


class PiecewiseHostEngine(HostEngine):
    """The host engine on a region pinned in pieces by a fake registrar; every submitted copy
    must touch only registered host bytes (what a DMA engine needs)."""

    def __init__(self, fake: FakeRegistrar, options: PinOptions) -> None:
        super().__init__()
        self.fake = fake
        self.options = options
        self.region: PinnedRegion | None = None
        self.num_checked = 0

    def allocate_host_region(self, layout: HostRegionLayout) -> PinnedRegion:
        self.region = PinnedRegion(layout, self.fake.registrar, self.options)
        return self.region

    def submit(self, plan: TransferPlan, *, wait_for: Sequence[BatchHandle] = ()) -> BatchHandle:
        assert self.region is not None
        host = plan.dst_addrs if plan.direction.name == "D2H" else plan.src_addrs
        lo, hi = self.region.tensor.data_ptr(), self.region.tensor.data_ptr() + 2**40
        for address, size in zip(host.tolist(), plan.sizes.tolist()):
            if lo <= address < hi:
                assert self.fake.is_registered(address, size), "a copy into unpinned memory"
                self.num_checked += 1
        return super().submit(plan, wait_for=wait_for)

    def close(self, timeout_s: float | None = None) -> None:
        super().close(timeout_s)
        if self.region is not None:
            self.region.close()


def _kv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(1, 256, (64, 64 << 10), dtype=torch.uint8, generator=gen),
            torch.randint(1, 256, (64, 32 << 10), dtype=torch.uint8, generator=gen)]  # fmt: skip


def _keys(n: int, salt: str) -> list[bytes]:
    return [f"{salt}{i:04d}".encode().ljust(16, b".") for i in range(n)]


@pytest.mark.asyncio
async def test_stores_get_only_pinned_blocks_while_the_tier_is_being_pinned() -> None:
    fake = FakeRegistrar()
    fake.gates = {2: threading.Event()}  # piece 1 waits until told
    engine = PiecewiseHostEngine(fake, _options())
    cfg = ManagerConfig(num_cpu_blocks=128, engine="host", manage_gpu_blocks=False)
    async with OffloadManager(_kv(), cfg, engine=engine) as mgr:
        assert engine.region is not None
        ready = engine.region.num_blocks_ready  # piece 0: 1 MiB / 96 KiB = 10 blocks
        stats = mgr.statistics()
        assert (stats.cpu_blocks_ready, stats.cpu_blocks_total) == (ready, 128)
        assert stats.cpu_pinning is not None and not stats.cpu_pinning.done
        # 1. the pinned blocks fill up; the next store is refused as "cpu_pinning", nothing changed
        st = mgr.store_many(np.arange(ready), _keys(ready, "a"))
        await mgr.step()
        await st
        mgr.swap_in(_keys(1, "a"), [63])  # a load keeps one block from being evicted ...
        before = mgr.snapshot()
        with pytest.raises(PoolExhaustedError) as info:
            mgr.store_many(np.arange(ready, 64), _keys(64 - ready, "b"))
        assert info.value.reason == "cpu_pinning" and "pinned so far" in str(info.value)
        assert mgr.snapshot() == before
        assert mgr.statistics().rejected == {"cpu_pinning": 1}
        # 2. piece 1 lands; the next step lets the allocator hand out its blocks
        fake.gates[2].set()
        assert await asyncio.to_thread(engine.region.wait, 30)
        await mgr.step()
        st = mgr.store_many(np.arange(ready, 64), _keys(64 - ready, "b"))
        await mgr.step()
        result = await st
        assert result.stored.all() and (result.cpu_block_ids < 128).all()
        assert mgr.statistics().cpu_blocks_ready == 128 and mgr.statistics().cpu_pinning.done
        check_invariants(mgr)
    assert engine.num_checked > 0


@contextlib.asynccontextmanager
async def waiting_for_the_next_piece() -> AsyncIterator[tuple[OffloadManager, Any, int]]:
    """A manager (``backpressure="wait"``) whose CPU tier is pinned piece by piece, the third
    piece held back, and a store of 5 blocks more than are pinned, stepped once: it waits, it
    did not fail. Yields the manager, the store's future and how many blocks were pinned; the
    piece is let go (and pinned) before the store is woken."""
    fake = FakeRegistrar()
    fake.gates = {2: threading.Event()}
    engine = PiecewiseHostEngine(fake, _options())
    cfg = ManagerConfig(num_cpu_blocks=64, engine="host", manage_gpu_blocks=False,
                        backpressure="wait", store_wait_s=30.0)  # fmt: skip
    async with OffloadManager(_kv(), cfg, engine=engine) as mgr:
        assert engine.region is not None
        ready = engine.region.num_blocks_ready
        waiting = asyncio.ensure_future(mgr.store_many(np.arange(ready + 5), _keys(ready + 5, "w")))
        await asyncio.sleep(0)
        await mgr.step()
        assert not waiting.done() and mgr.statistics().stores_waiting == 1
        fake.gates[2].set()
        assert await asyncio.to_thread(engine.region.wait, 30)
        yield mgr, waiting, ready


@pytest.mark.asyncio
async def test_a_waiting_store_is_woken_by_the_step_that_sees_the_next_piece() -> None:
    async with waiting_for_the_next_piece() as (mgr, waiting, _):
        await mgr.step()  # sees the pieces, wakes the store, which queues
        await asyncio.sleep(0)
        await mgr.step()
        result = await asyncio.wait_for(waiting, 30)
        assert result.stored.all()
        check_invariants(mgr)


def test_a_region_that_cannot_be_pinned_is_a_host_memory_error() -> None:
    fake = FakeRegistrar(fail_at=0)
    engine = PiecewiseHostEngine(fake, _options())
    cfg = ManagerConfig(num_cpu_blocks=16, engine="host", manage_gpu_blocks=False)
    with pytest.raises(HostMemoryError, match="page-lock"):
        OffloadManager(_kv(), cfg, engine=engine)


# ====================================================================== 5. on the GPU


@pytest.mark.gpu
def test_gpu_every_piece_is_registered_and_mapped_once_ready() -> None:
    from kvmgr.transfer.pinned import mapped_device_pointer, torch_registrar

    layout = _layout(512)  # 48 MiB in pieces of 1, 2, 4, 4, ... MiB
    region = PinnedRegion(layout, torch_registrar, _options(), thread_init=torch.cuda.init)
    assert region.wait(60) and region.num_blocks_ready == 512
    stats = region.statistics()
    assert stats.error is None and stats.pieces_pinned == stats.num_pieces > 3
    base = region.tensor.data_ptr()
    for offset, page in zip(layout.offsets, layout.page_bytes):
        for block in (0, 9, 10, 300, 511):  # the first piece, its boundary, later pieces
            address = base + offset + block * page
            assert mapped_device_pointer(address) == address
    region.close()
    assert stats.pinned_bytes >= layout.num_bytes


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_gpu_a_manager_stores_at_once_and_round_trips_while_pinning_in_the_background() -> (
    None
):
    page = 1 << 20
    gen = torch.Generator(device="cuda").manual_seed(3)
    kv = [torch.randint(1, 255, (64, page), dtype=torch.uint8, device="cuda", generator=gen)
          for _ in range(2)]  # fmt: skip
    cfg = ManagerConfig(num_cpu_blocks=2048, engine="cuda", manage_gpu_blocks=False)  # 4 GiB
    async with OffloadManager(kv, cfg) as mgr:
        stats = mgr.statistics()
        assert 0 < stats.cpu_blocks_ready <= 2048 and stats.cpu_pinning is not None
        # 1. a store at once lands in pinned blocks; 2. load it back into poisoned blocks
        keys = _keys(8, "g")
        st = mgr.store_many(np.arange(8), keys)
        await mgr.step()
        await st
        for t in kv:
            t[32:40] = 0xEE
        ld = mgr.load_many(keys, np.arange(32, 40))
        await mgr.step()
        await ld
        torch.cuda.synchronize()
        for t in kv:
            assert torch.equal(t[32:40], t[0:8])
        memory = mgr.cpu_pool.memory
        assert await asyncio.to_thread(memory.wait, 120)
        await mgr.step()
        done = mgr.statistics()
        assert done.cpu_blocks_ready == 2048 and done.cpu_pinning.done
        assert done.cpu_pinning.error is None and done.cpu_pinning.pin_s > 0
