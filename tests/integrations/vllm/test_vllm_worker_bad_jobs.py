"""A job ``KvmgrOffloadingWorker`` cannot copy is refused when vLLM submits it (newuser13).

Before: ``submit_store`` / ``submit_load`` buffered any job and returned True; a GPU block or
chunk id out of range (a scheduler and a worker built with different ``num_chunks``), GPU and
CPU lists of different lengths, or one destination twice in a job was found only when the
buffer was flushed, by the plan builder. That flush raised before the buffer was cleared, so
the bad job stayed: every later ``get_finished``, ``submit_load``, ``wait`` and ``shutdown``
raised the same error, the good jobs buffered beside it were never submitted (vLLM waits for
them for ever) and the engine was never closed. Now the call raises ``InvalidBlockError``
before anything is buffered or flushed, and the worker goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import vllm_support  # noqa: F401  (skips without vLLM, fails in CI; silences import warnings)
from test_vllm_backend_worker import NUM_BLOCKS, gpu, make_worker

import kvmgr.integrations.vllm._worker_jobs as worker_jobs
from kvmgr.errors import InvalidBlockError
from kvmgr.integrations.vllm._worker_jobs import Job, check_job
from kvmgr.integrations.vllm.backend import KvmgrChunkSpec

CHUNKS = 8

BAD: dict[str, Callable[[Any], Any]] = {
    "store-gpu-past": lambda w: w.submit_store(7, gpu([NUM_BLOCKS + 3]), KvmgrChunkSpec([1], 2)),
    "store-gpu-negative": lambda w: w.submit_store(7, gpu([-1]), KvmgrChunkSpec([1], 2)),
    "store-chunk-past": lambda w: w.submit_store(7, gpu([1]), KvmgrChunkSpec([CHUNKS], 2)),
    "store-chunk-negative": lambda w: w.submit_store(7, gpu([1]), KvmgrChunkSpec([-2], 2)),
    "store-lengths": lambda w: w.submit_store(7, gpu([1, 2]), KvmgrChunkSpec([1], 2)),
    "store-chunk-twice": lambda w: w.submit_store(7, gpu([1, 2]), KvmgrChunkSpec([3, 3], 2)),
    "load-chunk-past": lambda w: w.submit_load(7, KvmgrChunkSpec([CHUNKS + 5]), gpu([4])),
    "load-gpu-past": lambda w: w.submit_load(7, KvmgrChunkSpec([0]), gpu([NUM_BLOCKS])),
    "load-gpu-twice": lambda w: w.submit_load(7, KvmgrChunkSpec([0, 0]), gpu([4, 4])),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_job_that_cannot_be_copied_is_refused_at_submit_and_the_worker_goes_on(bad: str) -> None:
    worker, tensors = make_worker(num_chunks=CHUNKS)
    assert worker.submit_store(0, gpu([0]), KvmgrChunkSpec([0], 1))  # a good job, buffered
    with pytest.raises(InvalidBlockError):
        BAD[bad](worker)
    worker.wait({0})  # the good store is submitted and ends
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(0, True)]
    assert worker.submit_load(1, KvmgrChunkSpec([0]), gpu([9]))
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    for t in tensors:  # the good jobs' bytes, and nothing of the refused one
        assert torch.equal(t[9], t[0])
    assert worker.statistics().num_store_jobs == 1 and worker.statistics().num_load_jobs == 1
    worker.shutdown()


def test_chunk_ids_are_checked_against_the_sub_blocks_with_several_blocks_per_chunk() -> None:
    worker, _ = make_worker(num_chunks=CHUNKS, bpc=2)
    with pytest.raises(InvalidBlockError, match="chunk"):
        worker.submit_store(0, gpu([0, 1]), KvmgrChunkSpec([CHUNKS], 1))
    assert worker.submit_store(1, gpu([0, 1]), KvmgrChunkSpec([CHUNKS - 1], 1))
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    worker.shutdown()


@pytest.mark.parametrize("seed", range(3))
def test_check_job_decides_alike_on_its_list_and_array_paths(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(400):
        n = int(rng.integers(0, 64))
        gpu_ids, chunks = rng.permutation(64)[:n], rng.permutation(64)[:n]
        for ids in (gpu_ids, chunks):  # now and then one id out of range, or repeated
            if n > 1 and rng.random() < 0.2:
                ids[int(rng.integers(0, n))] = rng.choice([-1, -7, 64, 99, int(ids[0])])
        cpu = chunks if rng.random() < 0.95 else rng.integers(0, 64, n + 1)
        jobs.append((Job(i, gpu_ids, cpu, chunks, 0), bool(rng.random() < 0.5)))

    def verdicts() -> list[str]:
        out = []
        for job, store in jobs:
            try:
                check_job(job, 64, 64, store=store)
                out.append("ok")
            except InvalidBlockError as exc:
                out.append(str(exc))
        return out

    monkeypatch.setattr(worker_jobs, "_FEW", 10**9)
    lists = verdicts()
    monkeypatch.setattr(worker_jobs, "_FEW", 0)
    assert verdicts() == lists
    assert 100 < lists.count("ok") < 380
