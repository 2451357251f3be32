"""The per-rank transfer worker: this rank's KV tensors, CPU-tier memory and engine.

``TransferWorker`` turns a ``kvmgr.scheduler.TransferJob`` (block ids) into this rank's pointer
plan (``build_plan`` over its own layouts), submits it to its engine (CopyStreams and a copy
issuer on CUDA, a worker thread on the host engine), fenced on the earlier jobs the job names,
and keeps each job's ``BatchHandle`` until the caller forgets it. One worker per rank; in one
process ``OffloadManager`` holds one, behind ``kvmgr.transport.LocalTransport``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvmgr.errors import KVMgrError, StaleKVTensorError, TransferError
from kvmgr.pool.host_pool import HostKVPool
from kvmgr.pool.layout import KVLayout
from kvmgr.scheduler.jobs import Direction, KVGeometry, TransferJob
from kvmgr.transfer.engine import BatchHandle, TransferEngine, check_orderable
from kvmgr.transfer.plan import TransferPlan, build_plan, prepare
from kvmgr.worker.tensors import TensorGuard

__all__ = ["Submitted", "TransferWorker"]


@attrs.define
class Submitted:
    """What one rank submitted for a job (for the step report).

    Not frozen (a frozen attrs ``__init__`` costs ~3x on the step's path): read-only by use.

    Attributes:
        handle: the engine's handle (resolves when the copy ended).
        num_blocks, num_pages, num_descriptors, num_bytes: the plan's counts.
    """

    handle: BatchHandle
    num_blocks: int
    num_pages: int
    num_descriptors: int
    num_bytes: int


class TransferWorker:
    """One rank's data path: KV tensors, CPU-tier memory for its slice, an engine.

    Args:
        gpu_kv_caches: this rank's KV tensors (``[num_gpu_blocks, ...]`` each, contiguous
            blocks; CUDA tensors for the CUDA engines, CPU tensors for the host engine). Not
            copied; they must not move afterwards (a job then fails with
            ``StaleKVTensorError``).
        num_cpu_blocks: CPU blocks of the CPU tier (this rank's slice of each page).
        engine: the engine (the worker closes it in ``close``).
        merge: merge runs of consecutive blocks into one descriptor (``ManagerConfig.merge``).
        layout: ``"heads"`` or ``"replicated"`` (see ``KVGeometry``); ``rank``, ``num_ranks``:
            this rank in its group.
        cpu_pool: the CPU tier's memory when given (a ``HostKVPool`` over memory shared by the
            ranks, for the replicated layout); else allocated here through the engine.

    Raises:
        GeometryError: the tensors cannot be managed.
        TransferError, MemoryError: the CPU-tier memory could not be allocated.
    """

    def __init__(
        self,
        gpu_kv_caches: Sequence[torch.Tensor],
        num_cpu_blocks: int,
        engine: TransferEngine,
        *,
        merge: bool = True,
        layout: str = "heads",
        rank: int = 0,
        num_ranks: int = 1,
        cpu_pool: HostKVPool | None = None,
    ) -> None:
        tensors = list(gpu_kv_caches)
        self.gpu_layout = KVLayout.from_tensors(tensors)
        self.engine = engine
        self.rank = rank
        self.merge = merge
        pages = tuple(int(p) for p in self.gpu_layout.page_bytes.tolist())
        self.geometry = KVGeometry(self.gpu_layout.num_blocks, pages, layout, num_ranks)
        self.cpu_pool = cpu_pool or HostKVPool(
            self.gpu_layout.page_bytes.tolist(),
            num_cpu_blocks,
            engine.allocate_host,
            allocate_region=getattr(engine, "allocate_host_region", None),
        )
        self.tensors = tensors
        self._guard = TensorGuard(tensors)  # (builds kvmgr's C module, as ``prepare`` the plan's)
        prepare()
        cpu_layout = self.cpu_pool.layout
        self._layouts = {Direction.D2H: (self.gpu_layout, cpu_layout),
                         Direction.H2D: (cpu_layout, self.gpu_layout)}  # fmt: skip
        # a store is split between the ranks (``KVGeometry.writer``): else every block is ours
        self._split_stores = layout == "replicated" and num_ranks > 1
        self._handles: dict[int, BatchHandle] = {}
        self._last: dict[Direction, BatchHandle] = {}  # the last job submitted, per direction
        self._prebuilt: dict[int, TransferPlan] = {}  # job id -> its plan (``order``)
        self._duplex = getattr(engine, "plan_duplex", None)  # engine "auto": paths per step
        self._duplex_plans = getattr(engine, "plan_duplex_plans", None)  # ... given the plans

    def blocks_ready(self) -> int:
        """Leading CPU blocks pinned so far (all of them unless still pinning)."""
        return self.cpu_pool.num_blocks_ready

    @property
    def is_pinning(self) -> bool:
        """Whether the CPU-tier memory is still being registered in the background."""
        return self.cpu_pool.memory is not None and self.blocks_ready() < self.cpu_pool.num_blocks

    def moved(self) -> str | None:
        """Why a KV tensor moved since construction, or ``None``."""
        return self._guard.moved()

    def _share(self, job: TransferJob) -> tuple[np.ndarray, np.ndarray]:
        """(GPU ids, CPU ids) this rank copies: every block, except under the replicated layout
        where a store is written by one rank per block (``KVGeometry.writer``)."""
        if job.direction is Direction.D2H and self._split_stores:
            mine = self.geometry.writer(job.cpu_ids) == self.rank
            return job.gpu_ids[mine], job.cpu_ids[mine]
        return job.gpu_ids, job.cpu_ids

    def _plan(self, job: TransferJob) -> TransferPlan:
        direction = job.direction
        src_layout, dst_layout = self._layouts[direction]
        if direction is Direction.D2H:
            if self._split_stores:
                gpu_ids, cpu_ids = self._share(job)
                return build_plan(direction, src_layout, dst_layout, gpu_ids, cpu_ids, merge=self.merge)  # fmt: skip
            return build_plan(direction, src_layout, dst_layout, job.gpu_ids, job.cpu_ids, merge=self.merge)  # fmt: skip
        return build_plan(direction, src_layout, dst_layout, job.cpu_ids, job.gpu_ids, merge=self.merge)  # fmt: skip

    def order(self, d2h: TransferJob, h2d: TransferJob) -> tuple[TransferJob, TransferJob]:
        """The order to submit one step's store and load jobs in: the engine's choice where it
        plans both directions together (``plan_duplex``: engine ``"auto"``), else stores
        first. The plans built to decide are kept for ``submit``."""
        if self._duplex is None:
            return d2h, h2d
        counts, plans = [], []
        for job in (d2h, h2d):
            try:
                plan = self._plan(job)
            except KVMgrError:  # one descriptor per page; ``submit`` raises the error again
                n = job.num_blocks
                counts.append((n * self.gpu_layout.num_tensors, n * self.gpu_layout.block_bytes))
                continue
            self._prebuilt[job.job_id] = plan
            plans.append(plan)
            counts.append((plan.num_descriptors, plan.num_bytes))
        if self._duplex_plans is not None and len(plans) == 2:  # the staged path's counts too
            first, _ = self._duplex_plans(*plans)
        else:
            first, _ = self._duplex(*counts)
        return (d2h, h2d) if first is Direction.D2H else (h2d, d2h)

    def submit(self, job: TransferJob, *, checked: bool = False) -> Submitted:
        """Plan and submit this rank's share of ``job``, fenced on the jobs it names that this
        worker still tracks. ``checked``: the caller ran `moved` in this same step, with no
        user code since (the KV tensors cannot have moved), so it is not run again (48
        tensors: 37-136 us of host time each run).

        Raises:
            StaleKVTensorError: a KV tensor moved.
            TransferError: the engine refused the batch, or it cannot be fenced on a job it
                must follow (an open layerwise store).
            KVMgrError: the plan could not be built (bad ids).
        """
        if not checked and (moved := self._guard.moved()) is not None:
            raise StaleKVTensorError(moved)
        handles, job_id, prebuilt = self._handles, job.job_id, self._prebuilt
        wait_for: Sequence[BatchHandle] = ()  # the engines' default: nothing to follow
        try:  # one frame from here to the engine (each one a cold step pays for)
            plan = (prebuilt and prebuilt.pop(job_id, None)) or self._plan(job)
            if job.wait_for:
                wait_for = [handles[j] for j in job.wait_for if j in handles]
                check_orderable(wait_for, job.direction)  # the host engine would run it at once
            handle = self.engine.submit(plan, wait_for=wait_for)
        except ValueError as exc:  # a CUDA engine cannot fence on a batch without an event
            self._stand_in(job)
            if any(h.end_event is None and not h.done() for h in wait_for):
                raise TransferError(
                    f"the {job.direction.value} job cannot be fenced on a batch in flight "
                    f"without an end event: {exc}"
                ) from exc
            raise
        except BaseException:
            self._stand_in(job)
            raise
        handles[job_id] = self._last[job.direction] = handle
        pairs = plan.blocks  # build_plan's own record: its byte count, no second sum
        num_bytes = plan.num_bytes if pairs is None else pairs.num_bytes
        return Submitted(handle, plan.num_blocks, plan.num_pages, plan.num_descriptors, num_bytes)

    def _stand_in(self, job: TransferJob) -> None:
        """``job`` was refused here but may run on other ranks, so later jobs of the other
        direction can be fenced on it: here the last job of its direction (still running)
        stands in for it, as this job would have run after that one. Dropped when it ends."""
        last = self._last.get(job.direction)
        if last is None or last.done():
            return
        handles, job_id = self._handles, job.job_id
        handles[job_id] = last
        last.future.add_done_callback(lambda _: handles.pop(job_id, None))

    def handle(self, job_id: int) -> BatchHandle | None:
        """The engine handle of a job this worker still tracks."""
        return self._handles.get(job_id)

    def adopt(self, job_id: int, handle: BatchHandle) -> None:
        """Track a handle submitted for ``job_id`` outside ``submit`` (layerwise groups)."""
        self._handles[job_id] = self._last[handle.direction] = handle

    def forget(self, job_id: int) -> None:
        """The job's outcome was applied (or it was never submitted): stop tracking it."""
        self._handles.pop(job_id, None)
        self._prebuilt.pop(job_id, None)

    def stream_wait(self, job_id: int, stream: Any = None) -> None:
        """Make ``stream`` wait on the device for a job's copy (no-op on the host engine)."""
        handle = self._handles.get(job_id)
        if handle is not None:
            self.engine.stream_wait(handle, stream)

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Close the engine (bounded wait for copies in flight).

        Raises:
            TransferTimeoutError: copies still running after ``timeout_s``.
        """
        self.engine.close(timeout_s)
