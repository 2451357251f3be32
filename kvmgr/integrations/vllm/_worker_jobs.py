"""What the vLLM worker moves: a vLLM job as kvmgr block ids, a kvmgr batch of jobs, the
results vLLM gets back for a batch that succeeded, and the worker's totals.

Private to ``kvmgr.integrations.vllm`` (``_backend_worker`` documents the CPU tier's layout:
sub-block ``chunk * blocks_per_chunk + i`` holds GPU block ``i`` of that chunk).
"""

from __future__ import annotations

import attrs
import numpy as np
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    TransferResult,
)

from kvmgr.errors import InvalidBlockError
from kvmgr.transfer import BatchHandle, Direction

__all__ = ["Batch", "Job", "WorkerStatistics", "check_job", "job_of", "succeeded"]

_EMPTY = np.zeros(0, dtype=np.int64)
_FEW = 32  #: ``check_job`` checks up to this many ids in plain lists


@attrs.define(eq=False)
class Job:
    """One vLLM job as kvmgr block ids."""

    job_id: int
    gpu_ids: np.ndarray  # int64 GPU block ids
    cpu_ids: np.ndarray  # int64 CPU sub-block ids, same length
    chunk_ids: np.ndarray  # int64 CPU chunk ids (stores: for the fault table)
    seq: int  # store sequence number (0 for loads)


@attrs.define(eq=False)
class Batch:
    """One kvmgr engine batch of jobs (one direction)."""

    batch_id: int
    direction: Direction
    handle: BatchHandle
    jobs: list[Job]
    gpu_ids: np.ndarray
    reported: bool = False  # a failed load already counted / raised


def job_of(
    job_id: int, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec, blocks_per_chunk: int
) -> Job:
    """A vLLM job as kvmgr block ids: its GPU blocks and, for each, the CPU sub-block
    ``chunk * blocks_per_chunk + i`` that holds it."""
    assert isinstance(cpu_spec, BlockIDsLoadStoreSpec)
    chunks = cpu_spec.block_ids.astype(np.int64)
    gpu = gpu_spec.block_ids.astype(np.int64)
    bpc = blocks_per_chunk
    if bpc == 1:
        cpu = chunks
    else:  # GPU block k of group g sits at sub-block (first + k) % bpc of its chunk
        parts, c0 = [], 0
        for size, first in zip(gpu_spec.group_sizes, gpu_spec.block_indices):
            pos = first % bpc + np.arange(size, dtype=np.int64)
            if size and c0 + int(pos[-1]) // bpc >= len(chunks):
                raise InvalidBlockError(f"job {job_id}: {len(chunks)} chunks for {len(gpu)} blocks")
            parts.append(chunks[c0 + pos // bpc] * bpc + pos % bpc)
            c0 += -(-(first % bpc + size) // bpc) if size else 0
        cpu = np.concatenate(parts) if parts else _EMPTY
    return Job(job_id, gpu, cpu, chunks, int(getattr(cpu_spec, "store_seq", 0)))


def check_job(job: Job, num_gpu_blocks: int, num_chunks: int, *, store: bool) -> Job:
    """``job`` if its batch can be planned: as many CPU as GPU ids, GPU blocks in
    ``[0, num_gpu_blocks)``, chunks in ``[0, num_chunks)``, no destination twice (a store's
    sub-blocks, a load's GPU blocks). Checked at submit: found at the flush, the plan's error
    left the job buffered, every later call raised it and the jobs beside it never ran.

    Raises:
        InvalidBlockError: the first of those that does not hold.
    """
    gpu, cpu, chunks = job.gpu_ids, job.cpu_ids, job.chunk_ids  # int64 (``job_of``)
    if len(gpu) != len(cpu):
        raise InvalidBlockError(f"job {job.job_id}: {len(gpu)} GPU blocks, {len(cpu)} CPU blocks")
    dst = cpu if store else gpu
    if len(gpu) <= _FEW:  # plain lists beat numpy's calls on a few ids
        g, c, d = gpu.tolist(), chunks.tolist(), dst.tolist()
        in_range = (not g or (min(g) >= 0 and max(g) < num_gpu_blocks)) and (
            not c or (min(c) >= 0 and max(c) < num_chunks)
        )
        distinct = len(set(d)) == len(d)
    else:  # as uint64 a negative id is beyond any bound
        in_range = int(gpu.view(np.uint64).max()) < num_gpu_blocks and (
            not len(chunks) or int(chunks.view(np.uint64).max()) < num_chunks
        )
        ordered = np.sort(dst)  # (np.unique is 5-10x slower here)
        distinct = bool((ordered[1:] != ordered[:-1]).all())
    if not in_range:
        for what, ids, n in (("GPU block", gpu, num_gpu_blocks), ("chunk", chunks, num_chunks)):
            bad = [b for b in ids.tolist() if not 0 <= b < n]
            if bad:
                raise InvalidBlockError(f"job {job.job_id}: {what} id {bad[0]} out of range [0, {n})")  # fmt: skip
    if not distinct:
        raise InvalidBlockError(f"job {job.job_id}: a destination block twice in one job")
    return job


def succeeded(batch: Batch) -> list[TransferResult]:
    """The ``TransferResult`` of each job of a batch that succeeded: its share of the bytes and
    of the device time, by its number of blocks."""
    result = batch.handle.future.result()
    total = max(1, len(batch.gpu_ids))
    seconds = result.device_s or 0.0
    block_bytes = result.num_bytes / total
    return [
        TransferResult(
            j.job_id,
            True,
            int(block_bytes * len(j.gpu_ids)),
            seconds * len(j.gpu_ids) / total,
        )
        for j in batch.jobs
    ]


@attrs.frozen
class WorkerStatistics:
    """Totals since the worker was built.

    Attributes:
        num_store_jobs / num_load_jobs: jobs vLLM submitted.
        num_store_batches / num_load_batches: engine batches they became.
        num_failed_store_jobs / num_failed_load_jobs: jobs in batches the engine failed.
    """

    num_store_jobs: int = 0
    num_load_jobs: int = 0
    num_store_batches: int = 0
    num_load_batches: int = 0
    num_failed_store_jobs: int = 0
    num_failed_load_jobs: int = 0
