"""The DMA issuer's pooled descriptor tables (``kvmgr.transfer.dma``): a buffer's ``[3, n]``
view is kept for the last ``n`` and rebuilt for another, and plans of changing sizes through
one reused buffer copy exactly their pages (poisoned destinations elsewhere)."""

from __future__ import annotations

import types

import numpy as np
import torch
from cuda_fakes import FakeDriverLib

from kvmgr.pool.layout import KVLayout
from kvmgr.transfer.dma import DmaCopy, _Buffer
from kvmgr.transfer.driver import CopyDriver
from kvmgr.transfer.plan import Direction, TransferPlan, build_plan


def test_a_buffer_keeps_the_view_of_the_last_count() -> None:
    buffer = _Buffer(256)
    first = buffer.table(48)
    assert first.shape == (3, 48) and first.flags.c_contiguous
    assert np.shares_memory(first, buffer.rows) and int(first.ctypes.data) == buffer.address
    assert buffer.table(48) is first  # the same count: the same view
    other = buffer.table(5)
    assert other.shape == (3, 5) and other is not first
    assert buffer.table(48) is not other and buffer.table(48).shape == (3, 48)


def test_plans_of_changing_sizes_through_one_reused_buffer_copy_their_pages() -> None:
    rng = np.random.default_rng(11)
    page, blocks = 512, 40
    src = [torch.from_numpy(rng.integers(0, 256, (blocks, page), dtype=np.uint8)) for _ in range(3)]
    dst = [torch.full((blocks, page), 0xA5, dtype=torch.uint8) for _ in range(3)]
    lib = FakeDriverLib()  # its callbacks stay alive while the driver calls them
    dma = DmaCopy(CopyDriver(lib.resolver(), driver_version=13000), "batch", 8192)
    stream = types.SimpleNamespace(cuda_stream=0x7F00)
    written: set[int] = set()
    for src_ids, dst_ids in (([3, 9, 27], [0, 1, 2]), ([5], [10]), ([8, 1, 30], [20, 31, 12])):
        plan = build_plan(Direction.D2H, KVLayout.from_tensors(src), KVLayout.from_tensors(dst),
                          src_ids, dst_ids)  # fmt: skip
        issued = dma.issue(plan, stream)
        assert issued.error is None and issued.num_chunks == 1
        issued.release()  # the batch "ended": the same buffer serves the next plan
        written |= set(dst_ids)
        for t_src, t_dst in zip(src, dst):
            assert torch.equal(t_dst[dst_ids], t_src[src_ids])
    assert dma.buffers.num_allocated == 1
    untouched = sorted(set(range(blocks)) - written)
    assert all(bool((t[untouched] == 0xA5).all()) for t in dst)


def test_the_one_call_path_matches_the_general_path_in_every_field() -> None:
    # A plan from build_plan under the cap takes the one-call path (pooled table, no loop); the
    # same descriptors as a hand-made plan take the general one (_copy). Same driver calls,
    # same bytes, same Issued, the same refusal (12.8 ABI failIdx) when the driver refuses.
    rng = np.random.default_rng(12)
    page, blocks = 256, 24
    src = [torch.from_numpy(rng.integers(0, 256, (blocks, page), dtype=np.uint8)) for _ in range(3)]
    src_ids, dst_ids = [3, 9, 4, 5, 6], [0, 7, 1, 2, 3]
    for fail_at in (None, 4):
        results = []
        for fast in (True, False):
            dst = [torch.full((blocks, page), 0xA5, dtype=torch.uint8) for _ in range(3)]
            lib = FakeDriverLib(fail_at=fail_at)
            dma = DmaCopy(CopyDriver(lib.resolver(), driver_version=12080), "batch", 8192)
            plan = build_plan(Direction.D2H, KVLayout.from_tensors(src),
                              KVLayout.from_tensors(dst), src_ids, dst_ids)  # fmt: skip
            if not fast:
                table = plan.descriptor_table()
                plan = TransferPlan(Direction.D2H, table[0].copy(), table[1].copy(), table[2].copy())  # fmt: skip
                assert plan.matching_blocks() is None
            issued = dma.issue(plan, types.SimpleNamespace(cuda_stream=0x7F00))
            error = issued.error
            results.append((
                [{k: v for k, v in c.items()} for c in lib.calls if "batch" in c],
                (issued.path, issued.num_chunks, issued.num_fallbacks),
                None if error is None else (type(error), str(error), error.fail_index),
                [t.clone() for t in dst],
            ))  # fmt: skip
            assert (
                issued.release is not None
            ) is fast  # the pooled table goes back after the end event
            assert (len(issued.keep_alive) == 1) is not fast  # the hand-made table is kept instead
        fast_result, general_result = results
        assert fast_result[:3] == general_result[:3]
        assert all(torch.equal(a, b) for a, b in zip(fast_result[3], general_result[3]))
        if fail_at is None:
            assert torch.equal(fast_result[3][0][dst_ids], src[0][src_ids])
        else:
            assert fast_result[2][2] == fail_at and bool((fast_result[3][0] == 0xA5).all())
