"""The scheduler/worker split: a scheduler that imports no torch, driven by hand over a worker.

``kvmgr.scheduler`` holds no tensors; ``kvmgr.worker.TransferWorker`` turns its jobs (block ids)
into copies. These tests drive the two directly, the way a TP scheduler process and a rank do,
without ``OffloadManager`` in between.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kvmgr.config import ManagerConfig
from kvmgr.errors import GeometryError, PoolExhaustedError
from kvmgr.scheduler import CpuState, Direction, JobOutcome, KVGeometry, Scheduler
from kvmgr.transfer.host import HostEngine
from kvmgr.worker import TransferWorker


def test_the_scheduler_package_imports_without_torch() -> None:
    # a fresh interpreter where importing torch fails: the scheduler side must not need it
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith(("torch.", "triton", "cuda")):
                    raise ImportError(f"{name} is blocked in this test")
        sys.meta_path.insert(0, Block())
        import kvmgr.scheduler
        from kvmgr.scheduler import Scheduler, KVGeometry
        from kvmgr.config import ManagerConfig
        s = Scheduler(ManagerConfig(num_cpu_blocks=4), KVGeometry(8, (64,)))
        assert "torch" not in sys.modules, "torch was imported"
        print("ok", sorted(m for m in sys.modules if m.startswith("kvmgr.scheduler")))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def _kv(num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 256, (num_blocks, 64), dtype=torch.uint8, generator=gen),
        torch.randint(1, 256, (num_blocks, 3, 8), dtype=torch.uint8, generator=gen),
    ]


def _run(worker: TransferWorker, scheduler: Scheduler) -> list[JobOutcome]:
    """Launch every queued lane on the worker, wait for each copy, complete it."""
    outcomes = []
    for lane in (lane for lanes in scheduler.take() for lane in lanes):
        job = scheduler.launch(lane)
        handle = worker.submit(job).handle
        result = handle.future.result(timeout=10)
        worker.forget(job.job_id)
        outcome = JobOutcome(job.job_id, None, result.num_bytes, result.device_s, (result,))
        settled = scheduler.complete(outcome)
        assert settled is not None and settled.error is None
        outcomes.append(outcome)
    return outcomes


def test_a_scheduler_drives_a_worker_by_hand_store_then_load() -> None:
    kv = _kv(8, seed=1)
    engine = HostEngine()
    worker = TransferWorker(kv, 6, engine)
    config = ManagerConfig(num_cpu_blocks=6, engine="host", manage_gpu_blocks=False)
    scheduler = Scheduler(config, worker.geometry)
    books = scheduler.books
    keys = [b"k0", b"k1", b"k2"]
    # 1. store GPU blocks 5, 1, 3 under three keys: PENDING until the job completes
    part = books.prepare_store([5, 1, 3], keys, None, None, batched=False)
    assert scheduler.enqueue(part)
    assert books.cpu.num_pending == 3
    (stored,) = _run(worker, scheduler)
    assert stored.num_bytes == 3 * worker.geometry.block_bytes
    cpu_ids = list(part.cpu_ids)
    assert all(books.cpu.state[b] == CpuState.READY for b in cpu_ids)
    for t, host in zip(kv, worker.cpu_pool.tensors):  # the bytes landed in the CPU tier
        flat = t.view(8, -1)
        for g, c in zip([5, 1, 3], cpu_ids):
            assert torch.equal(host[c], flat[g])
    # 2. load them back into other GPU blocks
    part = books.prepare_load(keys, [0, 2, 4], None, batched=False)
    scheduler.enqueue(part)
    _run(worker, scheduler)
    for t in kv:
        assert torch.equal(t[[0, 2, 4]], t[[5, 1, 3]])
    worker.close()


def test_evictions_come_back_as_data() -> None:
    config = ManagerConfig(num_cpu_blocks=2, manage_gpu_blocks=False)
    scheduler = Scheduler(config, KVGeometry(4, (16,)), keep_evicted=True)
    books = scheduler.books
    part = books.prepare_store([0, 1], [b"a", b"b"], None, None, batched=False)
    scheduler.enqueue(part)
    ((lane,),) = scheduler.take()  # one generation, one direction
    job = scheduler.launch(lane)
    assert job.direction is Direction.D2H and job.gpu_ids.tolist() == [0, 1]
    settled = scheduler.complete(JobOutcome(job.job_id, None, 32))
    assert settled is not None and settled.landed is not None
    assert settled.landed.keys == [b"a", b"b"]
    assert books.take_evicted() == []
    books.prepare_store([2], [b"c"], [None], None, batched=False)  # evicts one of a, b
    (evicted,) = books.take_evicted()
    keys, ids = evicted
    assert len(keys) == 1 and keys[0] in (b"a", b"b")
    assert ids.tolist() == [part.cpu_ids[[b"a", b"b"].index(keys[0])]]
    assert books.take_evicted() == []


def test_a_failed_job_never_makes_its_keys_ready() -> None:
    config = ManagerConfig(num_cpu_blocks=4, manage_gpu_blocks=False)
    scheduler = Scheduler(config, KVGeometry(4, (16,)))
    books = scheduler.books
    scheduler.enqueue(books.prepare_store([0, 1], [b"a", b"b"], None, None, batched=False))
    ((lane,),) = scheduler.take()  # one generation, one direction
    job = scheduler.launch(lane)
    error = RuntimeError("rank 1 failed")
    settled = scheduler.complete(JobOutcome(job.job_id, error))
    assert settled is not None and settled.error is error and settled.landed is None
    assert books.lookup([b"a"], touch=False) == 0 and len(books.cpu.index) == 0
    assert scheduler.complete(JobOutcome(job.job_id)) is None  # settled once only
    books.prepare_store(np.arange(4), [b"%d" % i for i in range(4)], None, None, batched=True)
    with pytest.raises(PoolExhaustedError):  # 4 PENDING keys fill the tier: refused, unchanged
        books.prepare_store(np.arange(4), [b"x%d" % i for i in range(4)], None, None, batched=True)
    assert len(books.cpu.index) == 4


def test_the_engine_names_match_the_engine_registry() -> None:
    from kvmgr.config import ENGINE_NAMES
    from kvmgr.transfer import ENGINES

    assert set(ENGINE_NAMES) == set(ENGINES)


def test_geometry_rejects_bad_shapes() -> None:
    with pytest.raises(GeometryError):
        KVGeometry(0, (16,))
    with pytest.raises(GeometryError):
        KVGeometry(4, ())
    with pytest.raises(GeometryError):
        KVGeometry(4, (16,), layout="striped")


def test_a_replicated_rank_stores_only_the_blocks_it_writes() -> None:
    kv = _kv(8, seed=2)
    worker = TransferWorker(kv, 8, HostEngine(), layout="replicated", rank=1, num_ranks=2)
    config = ManagerConfig(num_cpu_blocks=8, manage_gpu_blocks=False)
    scheduler = Scheduler(config, worker.geometry)
    keys = [b"%d" % i for i in range(4)]
    part = scheduler.books.prepare_store([0, 1, 2, 3], keys, None, None, batched=False)
    scheduler.enqueue(part)
    (outcome,) = _run(worker, scheduler)
    mine = [c for c in part.cpu_ids if c % 2 == 1]  # rank 1 writes the odd CPU blocks
    assert outcome.num_bytes == len(mine) * worker.geometry.block_bytes
    worker.close()


def test_simulate_tp_ranks_move_their_share_of_the_loaded_bytes_in_parallel() -> None:
    from kvmgr.errors import ConfigError
    from kvmgr.sim.loop import SimConfig, simulate
    from kvmgr.sim.trace import TraceRequest

    with pytest.raises(ConfigError):
        SimConfig(tp=0)
    # ten requests with long outputs on a tight GPU: preempted, then resumed over a slow link
    trace = [
        TraceRequest(0.01 * i, 1100 + 37 * i, 300 + 50 * (i % 3), (0, 100 + i, 200 + i))
        for i in range(10)
    ]
    tight = dict(
        block_size=16, gpu_tokens=3 * 1024, watermark=0.0, max_batched_tokens=512,
        h2d_gbps=0.05, engine="host",
    )  # fmt: skip
    one, four = (simulate(SimConfig(tp=tp, **tight), trace) for tp in (1, 4))  # type: ignore[arg-type]
    loaded = [r.counters["load_blocks"] + r.counters["resume_blocks"] for r in (one, four)]
    assert loaded[0] > 0 and loaded[0] == loaded[1]  # the same decisions, the same bytes
    assert four.counters["virtual_s"] < one.counters["virtual_s"]  # loads 4x faster


def test_a_job_refused_on_this_rank_is_stood_in_for_by_the_job_before_it() -> None:
    # Another rank may run job 1, so the scheduler fences job 2 on it; here, where job 1 was
    # refused, job 2 must still wait for job 0, which reads the GPU block job 2 writes.
    from kvmgr.errors import TransferError
    from kvmgr.scheduler.jobs import TransferJob
    from kvmgr.testing import FaultyEngine

    engine = FaultyEngine(HostEngine(), refuse_batches={1})
    worker = TransferWorker(_kv(8, seed=2), 6, engine)
    engine.hold()

    def job(job_id: int, direction: Direction, cpu: int, wait_for: tuple[int, ...] = ()):
        ids = np.array([4], dtype=np.int64)
        return TransferJob(job_id, direction, ids, np.array([cpu], np.int64), wait_for)

    first = worker.submit(job(0, Direction.D2H, 0)).handle
    with pytest.raises(TransferError, match="refused"):
        worker.submit(job(1, Direction.D2H, 1))
    load = worker.submit(job(2, Direction.H2D, 2, wait_for=(1,))).handle
    assert engine.unresolved_wait_for(load.batch_id) == (first.batch_id,)
    engine.release()
    first.future.result(timeout=10)
    load.future.result(timeout=10)
    assert worker.handle(1) is None  # the stand-in went with job 0
    worker.close()
