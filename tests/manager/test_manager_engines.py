"""The manager's end-to-end scenarios, run on every engine.

On a machine without a GPU only the host engine runs; on a GPU the same scenarios run with CUDA
KV tensors through the batched-DMA engine (``cuda``), the copy-kernel engine (``kernel``) and
the per-batch choice (``auto``). Page data is random; every load is checked byte for byte.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager, StepContext, TransferError
from kvmgr.hooks import HookReport
from kvmgr.testing import FaultyEngine, check_invariants
from kvmgr.transfer import make_engine

ENGINES = [
    pytest.param("host", id="host"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
    pytest.param("kernel", id="kernel", marks=pytest.mark.gpu),
    pytest.param("auto", id="auto", marks=pytest.mark.gpu),
]
NUM_GPU, NUM_CPU = 24, 16
#: page bytes differ per tensor and are not multiples of 16: 4096, 1152 and 584 bytes
SHAPES = [(16, 128), (8, 72), (1, 292)]


def _device(engine: str) -> str:
    return "cpu" if engine == "host" else "cuda"


def _kv(engine: str, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(NUM_GPU, *shape, generator=gen, dtype=torch.float32 if i else torch.bfloat16)
        .to(torch.bfloat16 if i == 0 else torch.float16)
        .to(_device(engine))
        for i, shape in enumerate(SHAPES)
    ]


def _page(kv: list[torch.Tensor], block: int) -> list[bytes]:
    return [t[block].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in kv]


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


def _config(engine: str, **overrides: object) -> ManagerConfig:
    return ManagerConfig(num_cpu_blocks=NUM_CPU, engine=engine, **overrides)  # type: ignore[arg-type]


def _hold_all(mgr: OffloadManager) -> None:
    """The serving loop holds every GPU block: with the owned pool (the default) a keyed swap
    may name only held blocks (issue 11)."""
    assert mgr.allocate("serving", NUM_GPU) == list(range(NUM_GPU))


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ENGINES)
async def test_round_trip_scattered_and_merged(engine: str) -> None:
    kv = _kv(engine)
    keys = _keys(8)
    src = [0, 1, 2, 3, 9, 5, 17, 11]  # a merged run and scattered blocks
    original = [_page(kv, b) for b in src]
    async with OffloadManager(kv, _config(engine)) as mgr:
        _hold_all(mgr)
        stored = mgr.swap_out(src, keys)
        report = await mgr.step()
        await stored
        assert report.d2h.pages == 8 * len(SHAPES)
        assert report.d2h.descriptors < report.d2h.pages  # the run 0-3 was merged
        assert mgr.lookup(keys) == 8
        dst = [23, 22, 21, 20, 12, 13, 14, 15]
        for t in kv:  # poison the destinations
            t[dst] = -7
        loaded = mgr.swap_in(keys, dst)
        await mgr.step()
        await loaded
        assert [_page(kv, b) for b in dst] == original
        check_invariants(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ENGINES)
async def test_store_sees_what_a_hook_wrote_in_the_same_step(engine: str) -> None:
    kv = _kv(engine)

    class Writer:
        name = "writer"

        def __call__(self, ctx: StepContext) -> HookReport:
            for t in kv:  # a kernel on the compute stream writes block 4
                t[4].fill_(3)
            return HookReport(name=self.name, launches=len(kv))

    async with OffloadManager(kv, _config(engine), hooks=[Writer()]) as mgr:
        _hold_all(mgr)
        key = _keys(1)
        stored = mgr.swap_out([4], key)
        await mgr.step()
        await stored
        loaded = mgr.swap_in(key, [7])
        await mgr.step()
        await loaded
        mgr.stream_wait_loads()
        assert all(bool((t[7] == 3).all()) for t in kv)


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ENGINES)
async def test_store_and_load_of_one_gpu_block_in_one_step_are_ordered(engine: str) -> None:
    kv = _kv(engine)
    old_key, new_key = _keys(2)
    async with OffloadManager(kv, _config(engine)) as mgr:
        _hold_all(mgr)
        first = mgr.swap_out([1], [old_key])
        await mgr.step()
        await first
        before = _page(kv, 6)
        # same step: store block 6 under new_key, then load old_key into block 6
        store = mgr.swap_out([6], [new_key])
        load = mgr.swap_in([old_key], [6])
        report = await mgr.step()
        await store
        await load
        assert report.d2h.batches == 1 and report.h2d.batches == 1
        assert _page(kv, 6) == _page(kv, 1)  # the load landed
        back = mgr.swap_in([new_key], [8])
        await mgr.step()
        await back
        assert _page(kv, 8) == before  # the store saw the bytes from before the load


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ENGINES)
async def test_preempt_and_resume_move_the_bytes(engine: str) -> None:
    kv = _kv(engine)
    async with OffloadManager(kv, _config(engine)) as mgr:
        gpu = mgr.allocate("req", 5)
        data = [_page(kv, b) for b in gpu]
        out = mgr.preempt("req")
        await mgr.step()
        freed = await out
        assert sorted(freed.gpu_block_ids) == sorted(gpu)  # the GPU blocks given back
        assert mgr.statistics().gpu_blocks_free == NUM_GPU
        for t in kv:
            t[:] = 0.5  # the GPU blocks are reused by others meanwhile
        back = mgr.resume("req")
        await mgr.step()
        resumed = await back
        assert [_page(kv, b) for b in resumed.gpu_block_ids] == data
        mgr.free("req")
        check_invariants(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_failed_store_is_never_ready(engine: str) -> None:
    kv = _kv(engine)
    inner = make_engine(engine, kv[0].device, _config(engine))
    faulty = FaultyEngine(inner, fail_batches={0})
    async with OffloadManager(kv, _config(engine), engine=faulty) as mgr:
        keys = _keys(3)
        assert mgr.allocate("req", 3) == [0, 1, 2]
        store = mgr.swap_out([0, 1, 2], keys)
        await mgr.step()
        with pytest.raises(TransferError):
            await store
        assert mgr.lookup(keys) == 0
        assert mgr.statistics().cpu_blocks_used == 0
        check_invariants(mgr)
