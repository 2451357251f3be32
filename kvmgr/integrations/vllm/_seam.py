"""Where the vLLM backend meets the rest of kvmgr: the CPU tier's bookkeeping, a rank's copies.

Private to ``kvmgr.integrations.vllm``. The backend's manager and worker reach kvmgr's
bookkeeping and engines only through this module, so re-pointing the backend at another
scheduler-side package (issue 21's ``kvmgr/scheduler/``) or worker (``kvmgr/worker/``) changes
this file and nothing else.

Offers:
    scheduler_tier      the CPU tier's torch-free bookkeeping (block states PENDING / READY,
                        the key index, readers, eviction through a kvmgr policy)
    stores_landed       PENDING -> READY for a few blocks without numpy
    forget_all          drop every key at once (a cache reset); returns the blocks still busy
    release_forgotten   free those blocks once no copy touches them any more
    transfer_engine     a kvmgr ``TransferEngine`` for KV tensors on a device
    rank_copies         one rank's copies (`RankCopies`): its KV tensors, its CPU tier's memory,
                        jobs in block ids -> plans -> its engine (the stand-in for issue 21's
                        ``kvmgr.worker.TransferWorker`` until the split is on main)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvmgr.policy import make_policy
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer import BatchHandle, Direction, TransferEngine, build_plan, make_engine

try:  # issue 21's split moves the CPU tier's bookkeeping to the torch-free scheduler package
    from kvmgr.scheduler.cpu_tier import CpuState, CpuTier
except ImportError:  # pragma: no cover - before the split
    from kvmgr.manager.cpu_tier import CpuState, CpuTier

__all__ = [
    "CpuState",
    "CpuTier",
    "RankCopies",
    "forget_all",
    "rank_copies",
    "release_forgotten",
    "scheduler_tier",
    "stores_landed",
    "transfer_engine",
]


def scheduler_tier(
    num_chunks: int, policy: str, on_removed: Callable[[list[bytes]], None]
) -> CpuTier:
    """The CPU tier's bookkeeping over ``num_chunks`` blocks (vLLM chunks), evicting with the
    kvmgr policy ``policy``; ``on_removed`` gets the keys of every eviction, in order.

    Raises:
        ConfigError: ``policy`` is not registered in ``kvmgr.policy``.
        InvalidBlockError: ``num_chunks < 1``.
    """
    return CpuTier(num_chunks, policy, on_removed)


def stores_landed(tier: CpuTier, ids: list[int]) -> None:
    """PENDING blocks ``ids`` became READY (their stores landed); a few without numpy."""
    if len(ids) > 8:
        tier.stores_landed(np.array(ids, dtype=np.int64), all_pending=True)
        return
    state, ready = tier.state, CpuState.READY
    for block in ids:
        state[block] = ready
    tier.num_pending -= len(ids)


def forget_all(tier: CpuTier, policy: str) -> np.ndarray:
    """Drop every key of ``tier`` and start a fresh ``policy``; free the READY blocks without
    readers. Returns int64 ids of the blocks a copy may still touch (PENDING, or READY with
    readers): they keep their state, out of the allocator, until `release_forgotten`."""
    ids = np.fromiter(tier.index.values(), dtype=np.int64, count=len(tier.index))
    tier.index.clear()
    tier.policy = make_policy(policy, tier.num_blocks)
    idle = (tier.state_np[ids] == CpuState.READY) & (tier.readers_np[ids] == 0)
    if idle.any():
        tier.state_np[ids[idle]] = CpuState.FREE
        tier.pool.give(ids[idle])
    busy: np.ndarray = ids[~idle]
    return busy


def release_forgotten(tier: CpuTier, ids: np.ndarray) -> None:
    """Free blocks `forget_all` kept back (no copy touches them any more)."""
    if not len(ids):
        return
    states, readers = tier.state_np[ids], tier.readers_np[ids]
    tier.num_pending -= int(np.count_nonzero(states == CpuState.PENDING))
    tier.num_loading -= int(np.count_nonzero((states == CpuState.READY) & (readers > 0)))
    tier.readers_np[ids] = 0
    tier.state_np[ids] = CpuState.FREE
    tier.pool.give(ids)


def transfer_engine(name: str, device: torch.device) -> TransferEngine:
    """kvmgr's engine ``name`` (``"auto"``, ``"host"``, ``"cuda"``, ``"kernel"``) for KV tensors
    on ``device``.

    Raises:
        ConfigError: unknown name.
        GeometryError: the engine does not suit the device.
    """
    return make_engine(name, device)


class RankCopies:
    """One rank's copies between its KV tensors and its CPU tier, jobs named in block ids.

    Args:
        gpu_kv_caches: this rank's KV tensors (``[num_blocks, page_bytes]`` views, one device).
        num_cpu_blocks: blocks of the rank's CPU tier (allocated here, through ``engine``).
        engine: the kvmgr engine (closed by `close`).

    Raises:
        GeometryError: the tensors cannot be managed.
        TransferError: the CPU tier cannot be allocated.
    """

    def __init__(
        self, gpu_kv_caches: list[torch.Tensor], num_cpu_blocks: int, engine: TransferEngine
    ) -> None:
        self.engine = engine
        self.gpu_layout = KVLayout.from_tensors(gpu_kv_caches)
        pages = self.gpu_layout.page_bytes.tolist()
        self._host: torch.Tensor | None = engine.allocate_host(num_cpu_blocks * sum(pages))
        views, offset = [], 0
        for page in pages:
            views.append(self._host[offset : offset + num_cpu_blocks * page].view(-1, page))
            offset += num_cpu_blocks * page
        self.cpu_tensors: list[torch.Tensor] = views  #: uint8 ``[num_cpu_blocks, page]`` each
        self.cpu_layout = KVLayout.from_tensors(views)
        self._handles: dict[int, BatchHandle] = {}

    def submit(
        self,
        job_id: int,
        direction: Direction,
        gpu_ids: np.ndarray,
        cpu_ids: np.ndarray,
        wait_for: tuple[int, ...] = (),
    ) -> BatchHandle:
        """Plan and submit one job (``gpu_ids[i]`` <-> ``cpu_ids[i]``), after the tracked jobs
        ``wait_for``.

        Raises:
            TransferError: the engine refused the batch.
            KVMgrError: the plan could not be built (bad ids, a repeated destination).
        """
        if direction is Direction.D2H:
            plan = build_plan(direction, self.gpu_layout, self.cpu_layout, gpu_ids, cpu_ids)
        else:
            plan = build_plan(direction, self.cpu_layout, self.gpu_layout, cpu_ids, gpu_ids)
        handles = self._handles
        handle = self.engine.submit(plan, wait_for=[handles[j] for j in wait_for if j in handles])
        handles[job_id] = handle
        return handle

    def forget(self, job_id: int) -> None:
        """The job's outcome was taken: stop tracking its handle."""
        self._handles.pop(job_id, None)

    def close(self) -> None:
        """Close the engine (after the copies in flight) and let go of the CPU tier."""
        self.engine.close()
        self.cpu_tensors = []
        self._host = None


def rank_copies(
    gpu_kv_caches: list[torch.Tensor], num_cpu_blocks: int, engine: TransferEngine
) -> RankCopies:
    """This rank's `RankCopies` over ``gpu_kv_caches`` with a CPU tier of ``num_cpu_blocks``."""
    return RankCopies(gpu_kv_caches, num_cpu_blocks, engine)
