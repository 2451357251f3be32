"""The staged path on the GPU (H200): the real copy kernel's device-to-device part and the real
DMA batch, random data, poisoned destinations, chunks that reuse the buffer, and engine
``"auto"`` taking the staged path for a step whose CPU ids run."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kvmgr import ManagerConfig, OffloadManager
from kvmgr.kernels.copy.row import KERNEL_AVAILABLE
from kvmgr.pool.layout import KVLayout
from kvmgr.testing import check_invariants
from kvmgr.transfer.dma import DmaCopy
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.kernel import KernelCopy
from kvmgr.transfer.pinned import PinnedHostBuffer
from kvmgr.transfer.plan import Direction, build_plan
from kvmgr.transfer.staged import StagedCopy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not KERNEL_AVAILABLE, reason="needs Triton"),
]
PAGES = (4096, 1152, 584)  # unequal, one not a multiple of 16
POISON = 0xA5


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("staging_blocks", [1000, 7])
def test_staged_bytes_on_the_gpu(direction: Direction, staging_blocks: int) -> None:
    rng = np.random.default_rng(staging_blocks)
    driver = CopyDriver()
    cuda = torch.device("cuda", torch.cuda.current_device())  # the paged kernel's own device
    move = KernelCopy(cuda, driver, d2h_programs=32, h2d_programs=32)
    staged = StagedCopy(cuda, move, DmaCopy(driver, "batch", 8192),
                        staging_bytes=staging_blocks * (sum(PAGES) + 256 * len(PAGES)))  # fmt: skip
    num_blocks = 256
    gpu = [torch.randint(0, 256, (num_blocks, p), dtype=torch.uint8, device=cuda) for p in PAGES]
    buffer = PinnedHostBuffer(num_blocks * sum(PAGES))
    host, offset = [], 0
    for p in PAGES:
        host.append(buffer.tensor[offset : offset + num_blocks * p].view(num_blocks, p))
        offset += num_blocks * p
    for h in host:
        h.copy_(torch.randint(0, 256, h.shape, dtype=torch.uint8))
    gpu_ids = 2 * rng.choice(num_blocks // 2, 60, replace=False)  # scattered
    starts = 16 * rng.choice(num_blocks // 16, 6, replace=False)
    host_ids = rng.permutation((starts[:, None] + np.arange(10)).reshape(-1))  # runs of 10
    d2h = direction is Direction.D2H
    src, dst = (gpu, host) if d2h else (host, gpu)
    src_ids, dst_ids = (gpu_ids, host_ids) if d2h else (host_ids, gpu_ids)
    for t in dst:
        t.fill_(POISON)
    torch.cuda.synchronize()
    plan = build_plan(direction, KVLayout.from_tensors(src), KVLayout.from_tensors(dst),
                      src_ids, dst_ids)  # fmt: skip
    stream = torch.cuda.Stream()
    issues = []  # each kept (with its keep-alives) until the stream finished, as CopyStreams does
    for _ in range(2):  # twice: the second use waits for the first on the device
        issued = staged.issue(plan, stream)
        assert issued.error is None and issued.path == "staged"
        issues.append(issued)
    stream.synchronize()
    assert move.stager._layouts  # the paged kernel's path (layout tables), not descriptors
    for issued in issues:
        if issued.release is not None:
            issued.release()
    s, d = torch.from_numpy(src_ids), torch.from_numpy(dst_ids)
    for a, b in zip(src, dst):
        assert torch.equal(a[s.to(a.device)].cpu(), b[d.to(b.device)].cpu())
        rest = torch.ones(b.shape[0], dtype=torch.bool)
        rest[d] = False
        assert bool((b.cpu()[rest] == POISON).all())
    buffer.close()  # unregister: a freed registered range would be reused still registered


@pytest.mark.asyncio
async def test_auto_stages_a_step_of_consecutive_cpu_blocks() -> None:
    # 48 x 32 KiB pages: scattered GPU blocks, fresh (consecutive) CPU blocks (with 4 KiB pages
    # the gather's cost per page makes the kernel the choice: test_duplex)
    caches = [torch.randint(0, 256, (1024, 32768), dtype=torch.uint8, device="cuda")
              for _ in range(48)]  # fmt: skip
    keys = [hashlib.blake2b(i.to_bytes(4, "little")).digest() for i in range(512)]
    config = ManagerConfig(num_cpu_blocks=1024, engine="auto", manage_gpu_blocks=False)
    async with OffloadManager(caches, config) as mgr:
        first = mgr.store_many(np.arange(0, 512, 2), keys[:256])
        await mgr.step()
        await first
        # one step both ways: 256 stores into fresh CPU ids, 256 loads of consecutive CPU ids
        store = mgr.store_many(np.arange(513, 1024, 2), keys[256:])
        dst = np.arange(1, 512, 2)
        load = mgr.load_many(keys[:256], dst)
        await mgr.step()
        await store
        await load
        stats = mgr.engine.statistics()  # type: ignore[attr-defined]
        for t in caches:
            assert torch.equal(t[torch.arange(0, 512, 2, device="cuda")],
                               t[torch.from_numpy(dst).cuda()])  # fmt: skip
        check_invariants(mgr)
        issuer = mgr.engine.issuer  # type: ignore[attr-defined]
        assert issuer.staged is not None and issuer.staged.num_buffers >= 1, stats
