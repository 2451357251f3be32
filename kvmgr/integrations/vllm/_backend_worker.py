"""``KvmgrOffloadingWorker``: one rank's copies for vLLM 0.33, one kvmgr batch per direction a step.

Private to ``kvmgr.integrations.vllm``; ``KvmgrOffloadingSpec.get_worker()`` builds it.

The rank's copies go through ``_seam.rank_copies``: its canonical KV tensors, and a CPU tier
allocated by its kvmgr engine (pinned on a GPU host) with, for every tensor ``t``, ``uint8
[num_chunks * blocks_per_chunk, page_bytes[t]]``, so sub-block ``chunk * blocks_per_chunk + i``
holds GPU block ``i`` of that chunk. A vLLM job becomes (GPU block ids, CPU sub-block ids)
arrays once, at submit; a batch is one kvmgr job of those ids.

Coalescing: vLLM calls ``submit_store`` / ``submit_load`` job by job and has no per-step flush,
so the worker buffers them. Buffered stores become ONE D2H batch at the first ``submit_load``
(so a load never overtakes the stores vLLM handed over before it), at ``wait()`` or at
``get_finished()``; buffered loads become at most two H2D batches at ``wait()`` or
``get_finished()``: the expedited ones first (vLLM waits on them within the step), then the
others. A batch that would write one destination twice is split into ordered batches (one per
job). A batch waits for an earlier batch of the other direction that touches one of its GPU
blocks. A batch the engine refuses at submit (``TransferError``) is a failed batch.

Failures (vLLM asserts that every ``TransferResult`` succeeded):

- a failed **store** batch: once the engine resolved it (it no longer touches the blocks), its
  chunks and store sequence numbers go into the fault table, then each job is reported finished;
  the manager's ``complete_store`` then frees those chunks instead of marking them READY;
- a failed **load** batch: the GPU blocks it wrote are wrong. With ``report_load_errors`` (set
  by ``KvmgrOffloadingConnector``) their ids are handed to vLLM by ``take_load_errors`` (vLLM
  recomputes them); without it (vLLM's stock ``OffloadingConnector`` has no such path)
  ``wait`` / ``get_finished`` raise ``TransferError`` rather than let the model read them.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvmgr.errors import TransferError
from kvmgr.integrations.vllm import _seam
from kvmgr.integrations.vllm._fault_table import FaultTable
from kvmgr.integrations.vllm._worker_jobs import (
    Batch,
    Job,
    WorkerStatistics,
    check_job,
    job_of,
    succeeded,
)
from kvmgr.transfer import BatchHandle, Direction, TransferEngine

__all__ = ["KvmgrOffloadingWorker", "WorkerStatistics"]


class KvmgrOffloadingWorker(OffloadingWorker):
    """vLLM's per-rank ``OffloadingWorker`` on a kvmgr ``TransferEngine`` (module docstring).

    Args:
        kv_caches: vLLM's canonical KV caches (``int8 [num_blocks, page_bytes]`` views).
        num_chunks: CPU chunks of the tier (as the manager's).
        blocks_per_chunk: GPU blocks per chunk.
        rank: this worker's rank (its row of the fault table).
        faults: the engine's fault table, or ``None``: a failed store then makes every later
            ``get_finished`` raise ``TransferError`` (it cannot be reported as landed).
        engine: a kvmgr engine instance, or the name of one (``"auto"``: the host engine for
            CPU tensors, DMA / copy kernel per batch on CUDA).

    Raises:
        GeometryError: the KV tensors are not one device's, or the engine does not suit it.
        TransferError: the CPU tier cannot be allocated.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_chunks: int,
        blocks_per_chunk: int,
        rank: int = 0,
        faults: FaultTable | None = None,
        engine: TransferEngine | str = "auto",
    ) -> None:
        gpu = [t.tensor for t in kv_caches.tensors]
        if isinstance(engine, str):
            engine = _seam.transfer_engine(engine, gpu[0].device)
        self.blocks_per_chunk = blocks_per_chunk
        self.rank = rank
        self.report_load_errors = False
        #: this rank's copies: its KV tensors, its CPU tier of ``num_chunks * bpc`` blocks
        self.copies = _seam.rank_copies(gpu, max(1, num_chunks) * blocks_per_chunk, engine)
        self._num_gpu_blocks, self._num_chunks = gpu[0].shape[0], max(1, num_chunks)
        self._faults = faults
        self._stores: list[Job] = []
        self._loads: list[Job] = []
        self._expedited: list[Job] = []
        self._in_flight: list[Batch] = []
        self._load_errors: set[int] = set()
        self._next_batch_id = 0
        self._stats = WorkerStatistics()

    # -- vLLM OffloadingWorker ----------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Buffer a GPU -> CPU job (never blocks). Raises InvalidBlockError (``check_job``)."""
        self._stores.append(self._job(job_id, src_spec, dst_spec, store=True))
        self._bump(num_store_jobs=1)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Submit the buffered stores as one batch, buffer this CPU -> GPU job. Raises
        InvalidBlockError (``check_job``) before either."""
        job = self._job(job_id, dst_spec, src_spec, store=False)
        self._flush_stores()
        (self._expedited if expedited else self._loads).append(job)
        self._bump(num_load_jobs=1)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Submit what is buffered; the jobs of every batch that ended since the last call.

        Raises (before any ended batch is taken out of flight, so no job's result is lost):
            TransferError: a load failed and no load-error channel is set (module docstring;
                raised once, as ``wait`` does: the next call reports the ended batches, that
                load's jobs among them); a store failed and the worker has no fault table
                (raised again by every later call: the store is never reported as landed).
        """
        self._flush()
        done: list[Batch] = []
        pending: list[Batch] = []
        for batch in self._in_flight:  # one look at each: a batch ending meanwhile waits
            (done if batch.handle.done() else pending).append(batch)
        if not done:
            return []
        for batch in done:
            self._check_reportable(batch)
        self._in_flight = pending
        results: list[TransferResult] = []
        for batch in done:
            self.copies.forget(batch.batch_id)
            results.extend(self._finish(batch))
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Submit what is buffered and block until the batches holding ``job_ids`` ended (their
        results still come from `get_finished`).

        Raises:
            TransferError: a waited load failed and no load-error channel is set.
        """
        self._flush()
        batches = [b for b in self._in_flight if any(j.job_id in job_ids for j in b.jobs)]
        concurrent.futures.wait([b.handle.future for b in batches])
        for batch in batches:
            if batch.direction is Direction.H2D and batch.handle.future.exception() is not None:
                self._load_failed(batch)

    def shutdown(self) -> None:
        """Wait for the copies in flight, close the engine, let go of the CPU tier."""
        self._flush()
        concurrent.futures.wait([b.handle.future for b in self._in_flight])
        self._in_flight.clear()
        self.copies.close()
        if self._faults is not None:
            self._faults.close()

    # -- kvmgr extras -------------------------------------------------------------------------

    @property
    def engine(self) -> TransferEngine:
        """This rank's kvmgr engine (tests may wrap it, e.g. in ``FaultyEngine``, before use)."""
        return self.copies.engine

    @engine.setter
    def engine(self, engine: TransferEngine) -> None:
        self.copies.engine = engine

    @property
    def cpu_views(self) -> list[torch.Tensor]:
        """uint8 ``[num_chunks * blocks_per_chunk, page_bytes[t]]`` per KV tensor: this rank's
        CPU tier (sub-block ``chunk * blocks_per_chunk + i`` holds GPU block ``i`` of a chunk)."""
        return self.copies.cpu_tensors

    def take_load_errors(self) -> set[int]:
        """GPU block ids that failed loads wrote since the last call (``report_load_errors``)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def statistics(self) -> WorkerStatistics:
        """Totals since the worker was built."""
        return self._stats

    # -- private ------------------------------------------------------------------------------

    def _job(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, *, store: bool) -> Job:
        job = job_of(job_id, gpu, cpu, self.blocks_per_chunk)
        return check_job(job, self._num_gpu_blocks, self._num_chunks, store=store)

    def _flush(self) -> None:
        self._flush_stores()
        for jobs in (self._expedited, self._loads):
            if jobs:
                self._submit(Direction.H2D, jobs)
                jobs.clear()

    def _flush_stores(self) -> None:
        if self._stores:
            self._submit(Direction.D2H, self._stores)
            self._stores.clear()

    def _submit(self, direction: Direction, jobs: Sequence[Job]) -> None:
        gpu = np.concatenate([j.gpu_ids for j in jobs])
        cpu = np.concatenate([j.cpu_ids for j in jobs])
        dst = cpu if direction is Direction.D2H else gpu
        if len(jobs) > 1 and len(np.unique(dst)) < len(dst):  # rule 5: ordered batches
            for job in jobs:
                self._submit(direction, [job])
            return
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        wait_for = tuple(
            b.batch_id
            for b in self._in_flight
            if b.direction is not direction
            and not b.handle.done()
            and np.intersect1d(b.gpu_ids, gpu).size
        )
        try:
            handle = self.copies.submit(batch_id, direction, gpu, cpu, wait_for)
        except TransferError as exc:  # refused: nothing copied; reported as a failed batch
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            future.set_exception(exc)
            handle = BatchHandle(-1, direction, future)
        self._in_flight.append(Batch(batch_id, direction, handle, list(jobs), gpu))
        if direction is Direction.D2H:
            self._bump(num_store_batches=1)
        else:
            self._bump(num_load_batches=1)

    def _finish(self, batch: Batch) -> list[TransferResult]:
        """TransferResults of an ended batch (its failure recorded first)."""
        error = batch.handle.future.exception()
        if error is None:
            return succeeded(batch)
        if batch.direction is Direction.D2H:
            self._store_failed(batch)
        else:
            self._load_failed(batch)
        return [TransferResult(j.job_id, True) for j in batch.jobs]

    def _check_reportable(self, batch: Batch) -> None:
        """Raise now what finishing the ended ``batch`` would raise (``get_finished``)."""
        error = batch.handle.future.exception()
        if error is None:
            return
        if batch.direction is Direction.H2D:
            self._load_failed(batch)  # raises once without a load-error channel
        elif self._faults is None:
            raise TransferError(f"store copy failed and no fault table is set: {error}") from error

    def _store_failed(self, batch: Batch) -> None:
        assert self._faults is not None  # else _check_reportable raised
        for job in batch.jobs:
            seqs = np.full(len(job.chunk_ids), job.seq, dtype=np.int64)
            self._faults.record(self.rank, job.chunk_ids, seqs)
        self._bump(num_failed_store_jobs=len(batch.jobs))

    def _load_failed(self, batch: Batch) -> None:
        if batch.reported:
            return
        batch.reported = True
        self._bump(num_failed_load_jobs=len(batch.jobs))
        if not self.report_load_errors:
            raise TransferError(
                f"a CPU -> GPU copy of jobs {[j.job_id for j in batch.jobs]} failed; vLLM's "
                "OffloadingConnector cannot recompute its blocks (use KvmgrOffloadingConnector)"
            ) from batch.handle.future.exception()
        self._load_errors.update(batch.gpu_ids.tolist())

    def _bump(self, **deltas: int) -> None:
        self._stats = attrs.evolve(
            self._stats, **{k: getattr(self._stats, k) + v for k, v in deltas.items()}
        )
