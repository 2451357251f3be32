"""``KvmgrOffloadingWorker`` driven directly, as vLLM's connector worker drives it.

The coalescing rule (stores buffered until the first ``submit_load``, ``wait`` or
``get_finished``; loads until ``wait`` or ``get_finished``, expedited ones first), ordered
batches for a repeated destination, chunk sub-block mapping, the failure paths, and the fault
table shared with another process (a real one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import vllm_support  # noqa: F401  (skips without vLLM, fails in CI; silences import warnings)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

from kvmgr.errors import TransferError
from kvmgr.integrations.vllm._fault_table import FaultTable
from kvmgr.integrations.vllm.backend import KvmgrChunkSpec, KvmgrOffloadingWorker
from kvmgr.testing import FaultyEngine, ScriptedEngine
from kvmgr.transfer import HostEngine

PAGES = (96, 160)  # two canonical tensors with different page sizes
NUM_BLOCKS = 16


def recording_engine() -> ScriptedEngine:
    """The host engine under the testing kit's scripted engine, recording every batch."""
    return ScriptedEngine(HostEngine(), record=True)


def plans(engine: ScriptedEngine) -> list[tuple[str, int]]:
    """``(direction, number of blocks)`` of every plan ``engine`` was given, in order."""
    return [(plan.direction.value, plan.num_blocks) for plan, _, _ in engine.submitted]


def make_worker(engine=None, *, bpc: int = 1, faults=None, num_chunks: int = 8):
    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.randint(1, 127, (NUM_BLOCKS, page), dtype=torch.int8, generator=gen) for page in PAGES
    ]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        [[CanonicalKVCacheRef(i, p) for i, p in enumerate(PAGES)]],
    )
    worker = KvmgrOffloadingWorker(
        caches,
        num_chunks=num_chunks,
        blocks_per_chunk=bpc,
        faults=faults,
        engine=engine or recording_engine(),
    )
    return worker, tensors


def gpu(ids: list[int], first: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[first])


def test_stores_wait_for_the_first_load_loads_for_get_finished() -> None:
    worker, tensors = make_worker()
    engine = worker.engine
    # three store jobs (as handle_preemptions submits them): nothing submitted yet
    for job, (blocks, chunks) in enumerate([([0, 1], [0, 1]), ([2], [2]), ([3, 4], [3, 4])]):
        assert worker.submit_store(job, gpu(blocks), KvmgrChunkSpec(chunks, 1 + job))
    assert plans(engine) == []
    # the first load flushes the stores as ONE D2H batch; the loads stay buffered
    assert worker.submit_load(10, KvmgrChunkSpec([0, 1]), gpu([8, 9]))
    assert worker.submit_load(11, KvmgrChunkSpec([2]), gpu([10]))
    assert plans(engine) == [("d2h", 5)]
    # get_finished submits the loads as ONE H2D batch
    results = worker.get_finished()
    assert plans(engine) == [("d2h", 5), ("h2d", 3)]
    worker.wait({10, 11})
    results += worker.get_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2, 10, 11]
    assert all(r.success for r in results)
    assert sum(r.transfer_size for r in results if r.job_id < 10) == 5 * sum(PAGES)
    # the loaded blocks are the stored ones, byte for byte, in every tensor
    for t in tensors:
        assert torch.equal(t[[8, 9, 10]], t[[0, 1, 2]])
    worker.shutdown()


def test_expedited_loads_are_their_own_batch_first() -> None:
    worker, _ = make_worker()
    worker.submit_store(0, gpu([0, 1, 2]), KvmgrChunkSpec([0, 1, 2], 7))
    results = worker.get_finished()  # submits the store (job 0 may already be reported)
    worker.submit_load(1, KvmgrChunkSpec([0]), gpu([8]))
    worker.submit_load(2, KvmgrChunkSpec([1, 2]), gpu([9, 10]), expedited=True)
    worker.wait({2})  # vLLM waits on the expedited load within the step
    assert plans(worker.engine) == [("d2h", 3), ("h2d", 2), ("h2d", 1)]
    # job 0 too: the loads start after the store on the device, but the store's future is
    # resolved by the other direction's completion thread, possibly after the loads' futures
    worker.wait({0, 1})
    results += worker.get_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2]
    worker.shutdown()


def test_a_repeated_destination_becomes_ordered_batches() -> None:
    worker, tensors = make_worker()
    worker.submit_store(0, gpu([0]), KvmgrChunkSpec([0], 1))
    worker.submit_store(1, gpu([1]), KvmgrChunkSpec([0], 2))  # the same chunk again (rule 5)
    worker.wait({0, 1})
    assert plans(worker.engine) == [("d2h", 1), ("d2h", 1)]
    worker.submit_load(2, KvmgrChunkSpec([0]), gpu([5]))
    worker.wait({2})
    for t in tensors:  # the later store won
        assert torch.equal(t[5], t[1])
    worker.shutdown()


def test_sub_blocks_of_a_chunk() -> None:
    """Chunks of 4 blocks; a store of blocks 2..5 of a request (block_indices 2) fills the
    second half of chunk 3 and the first half of chunk 6."""
    worker, tensors = make_worker(bpc=4)
    worker.submit_store(0, gpu([11, 12, 13, 14], first=2), KvmgrChunkSpec([3, 6], 1))
    worker.wait({0})
    for view, t in zip(worker.cpu_views, tensors):
        got = view[[14, 15, 24, 25]].view(torch.int8)
        assert torch.equal(got, t[[11, 12, 13, 14]])
    worker.submit_load(1, KvmgrChunkSpec([3, 6]), gpu([0, 1, 2], first=3))  # blocks 3..5
    worker.wait({1})
    for t in tensors:
        assert torch.equal(t[[0, 1, 2]], t[[12, 13, 14]])
    worker.shutdown()


def test_a_failed_store_goes_into_the_fault_table(tmp_path: Path) -> None:
    faults = FaultTable(tmp_path / "f", world_size=1, num_chunks=8)
    worker, _ = make_worker(FaultyEngine(HostEngine(), fail_batches={0}), faults=faults)
    worker.submit_store(0, gpu([0, 1]), KvmgrChunkSpec([4, 5], 99))
    worker.wait({0})
    (result,) = worker.get_finished()
    assert result.success  # what vLLM's assert needs...
    assert faults.table[0, [4, 5]].tolist() == [99, 99]  # ...and the truth, for the manager
    assert faults.num_faults() == 2
    assert worker.statistics().num_failed_store_jobs == 1
    worker.shutdown()


def test_a_failed_load_raises_or_is_reported() -> None:
    worker, _ = make_worker(FaultyEngine(HostEngine(), fail_batches={0, 1}, poison=False))
    worker.submit_load(0, KvmgrChunkSpec([0]), gpu([3]))
    with pytest.raises(TransferError, match="cannot recompute"):
        worker.wait({0})
    worker.report_load_errors = True  # as KvmgrOffloadingConnector sets it
    worker.submit_load(1, KvmgrChunkSpec([1, 2]), gpu([6, 7]), expedited=True)
    worker.wait({1})
    assert worker.take_load_errors() == {6, 7}
    assert worker.take_load_errors() == set()
    worker.shutdown()


def test_without_a_fault_table_a_failed_store_raises_and_loses_nothing() -> None:
    # a worker built directly (the spec always gives one a table): an ended good store and a
    # refused one end together; get_finished raises before taking either out of flight, and
    # keeps raising (the failed store is never reported as landed)
    worker, _ = make_worker(FaultyEngine(HostEngine(), refuse_batches={1}))
    worker.submit_store(0, gpu([0]), KvmgrChunkSpec([0], 1))
    worker.wait({0})
    worker.submit_store(1, gpu([1]), KvmgrChunkSpec([1], 2))
    for _ in range(2):
        with pytest.raises(TransferError, match="no fault table"):
            worker.get_finished()
    assert worker.statistics().num_failed_store_jobs == 0  # nothing recorded
    worker.shutdown()


def test_a_failed_load_raises_once_and_its_batch_still_ends() -> None:
    # the good store's result is not lost to the raise: the next call reports both batches
    worker, _ = make_worker(FaultyEngine(HostEngine(), refuse_batches={1}))
    worker.submit_store(0, gpu([0]), KvmgrChunkSpec([0], 1))
    worker.wait({0})
    worker.submit_load(1, KvmgrChunkSpec([2]), gpu([5]))
    with pytest.raises(TransferError, match="cannot recompute"):
        worker.get_finished()
    assert sorted(r.job_id for r in worker.get_finished()) == [0, 1]
    assert worker.statistics().num_failed_load_jobs == 1
    worker.shutdown()


CHILD = """
import sys
from pathlib import Path
import numpy as np
from kvmgr.integrations.vllm._fault_table import FaultTable
FaultTable(Path(sys.argv[1]), world_size=2, num_chunks=8).record(1, np.array([3]), np.array([42]))
"""


def test_the_fault_table_crosses_processes(tmp_path: Path) -> None:
    """A worker process records a fault; the scheduler's mapping of the same file sees it."""
    table = FaultTable(tmp_path / "f", world_size=2, num_chunks=8)
    seqs = np.zeros(8, dtype=np.int64)
    seqs[3], seqs[4] = 42, 43
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "f")], check=True, env=env)
    assert table.num_faults() == 1
    assert table.failed_chunks(seqs).tolist() == [3]
    table.close(unlink=True)
    assert not (tmp_path / "f").exists()


def test_a_refused_batch_is_a_failed_one(tmp_path: Path) -> None:
    faults = FaultTable(tmp_path / "f", world_size=1, num_chunks=8)
    worker, _ = make_worker(FaultyEngine(HostEngine(), refuse_batches={0}), faults=faults)
    worker.submit_store(0, gpu([0]), KvmgrChunkSpec([2], 5))
    (result,) = worker.get_finished()  # reported at once, never lost
    assert result.job_id == 0 and faults.table[0, 2] == 5
    worker.shutdown()


def test_two_ranks_one_failing_drops_the_chunk(tmp_path: Path) -> None:
    """Two ranks' workers and the manager share one fault table: rank 1's copy fails, rank 0's
    lands; the chunk is dropped (a store is good only if every rank's copy was)."""
    from test_vllm_policies import context, key

    from kvmgr.integrations.vllm.backend import KvmgrOffloadingManager

    path = tmp_path / "f"
    mgr = KvmgrOffloadingManager(1, "lru", faults=FaultTable(path, 2, 1))  # one chunk
    ranks = [
        make_worker(engine, faults=FaultTable(path, 2, 1), num_chunks=1)[0]
        for engine in (HostEngine(), FaultyEngine(HostEngine(), fail_batches={0}))
    ]
    ranks[1].rank = 1
    ctx = context("r", [key("a"), key("b")])
    out = mgr.prepare_store([key("a")], ctx)
    assert out is not None
    for worker in ranks:  # vLLM sends every rank the same job
        worker.submit_store(7, gpu([3]), out.store_spec)
        worker.wait({7})
        assert [r.job_id for r in worker.get_finished()] == [7]
    mgr.complete_store(out.keys_to_store, ctx)  # vLLM: all ranks reported, success=True
    assert mgr.lookup(key("a"), ctx).name == "MISS"
    out = mgr.prepare_store([key("b")], ctx)  # the next store into the same chunk lands
    assert out is not None
    for worker in ranks:
        assert list(out.store_spec.block_ids) == [0]
        worker.submit_store(8, gpu([4]), out.store_spec)
        worker.wait({8})
        worker.get_finished()
    mgr.complete_store(out.keys_to_store, ctx)
    assert mgr.lookup(key("b"), ctx).name == "HIT"
    for worker in ranks:
        worker.shutdown()
    mgr.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["auto", "cuda", "kernel"])
def test_on_a_gpu_stores_and_loads_move_the_bytes(engine: str) -> None:
    """CUDA KV tensors and a kvmgr CUDA engine (pinned CPU tier): three store jobs become one
    D2H batch, two loads one H2D batch, and the loaded blocks equal the stored ones."""
    gen = torch.Generator().manual_seed(9)
    tensors = [
        torch.randint(1, 127, (NUM_BLOCKS, page), dtype=torch.int8, generator=gen).cuda()
        for page in PAGES
    ]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
        [[CanonicalKVCacheRef(i, p) for i, p in enumerate(PAGES)]],
    )
    worker = KvmgrOffloadingWorker(caches, num_chunks=8, blocks_per_chunk=1, engine=engine)
    for job, (blocks, chunks) in enumerate([([0, 1], [0, 1]), ([2], [2]), ([3, 4], [3, 4])]):
        worker.submit_store(job, gpu(blocks), KvmgrChunkSpec(chunks, 1 + job))
    worker.submit_load(10, KvmgrChunkSpec([0, 1, 2]), gpu([8, 9, 10]))
    worker.submit_load(11, KvmgrChunkSpec([3, 4]), gpu([11, 12]), expedited=True)
    worker.wait({0, 1, 2, 10, 11})
    torch.cuda.synchronize()
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2, 10, 11]
    stats = worker.statistics()
    assert (stats.num_store_batches, stats.num_load_batches) == (1, 2)
    for t in tensors:
        assert torch.equal(t[8:13].cpu(), t[0:5].cpu())
    worker.shutdown()
