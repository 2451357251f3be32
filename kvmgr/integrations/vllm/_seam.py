"""Where the vLLM backend meets the rest of kvmgr: the CPU tier's bookkeeping, a rank's copies.

Private to ``kvmgr.integrations.vllm``. The backend's manager and worker reach kvmgr's
bookkeeping (``kvmgr.scheduler``) and data path (``kvmgr.worker``) only through this module, so
re-pointing the backend at another scheduler-side package or worker changes this file and
nothing else.

Offers:
    scheduler_tier      the CPU tier's torch-free bookkeeping (block states PENDING / READY,
                        the key index, readers, eviction through a kvmgr policy)
    stores_landed       PENDING -> READY for a few blocks without numpy
    loads_ended         one reader less for a few blocks without numpy
    forget_all          drop every key at once (a cache reset); returns the blocks still busy
    release_forgotten   free those blocks once no copy touches them any more
    transfer_engine     a kvmgr ``TransferEngine`` for KV tensors on a device
    rank_copies         one rank's copies (`RankCopies`): a ``kvmgr.worker.TransferWorker`` over
                        its KV tensors and its CPU tier's memory, jobs in block ids
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvmgr.errors import BlockStateError
from kvmgr.policy import make_policy
from kvmgr.pool.host_pool import HostKVPool
from kvmgr.pool.layout import KVLayout
from kvmgr.scheduler.cpu_tier import CpuState, CpuTier
from kvmgr.scheduler.jobs import TransferJob
from kvmgr.transfer import BatchHandle, Direction, TransferEngine, make_engine
from kvmgr.worker import TransferWorker

__all__ = [
    "CpuState",
    "CpuTier",
    "RankCopies",
    "forget_all",
    "loads_ended",
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
    tier = CpuTier(num_chunks, policy, on_removed, by_block=False)
    if hasattr(tier.policy, "_tree"):
        tier.chains = _TreeChains(tier)  # type: ignore[assignment]
    return tier


class _TreeChains:
    """``CpuTier.chains`` of the backend's tier: no second record of parents. ``KeyChains``
    refuses key cycles in stores that name their parents; the backend's parents are keys at
    strictly lower token positions of one request (never a cycle), its tier is never asked to
    check one, and every indexed key is tracked by the policy, whose prefix tree already
    counts each key's tracked children. ``orphans`` (read by ``CpuTier.add_pending``: does a
    new key have tracked children?) is therefore that tree's count map."""

    __slots__ = ("_tier",)

    def __init__(self, tier: CpuTier) -> None:
        self._tier = tier

    @property
    def orphans(self) -> dict[bytes, int]:
        """Keys with tracked children (a new key among them has some)."""
        return self._tier.policy._tree.num_children  # type: ignore[attr-defined, no-any-return]

    def add(self, *args: object) -> None:
        """Nothing to record (the policy's tree counts the children)."""

    def remove(self, *args: object) -> None:
        """Nothing to forget."""


def stores_landed(tier: CpuTier, ids: list[int]) -> None:
    """PENDING blocks ``ids`` became READY (their stores landed); a few without numpy."""
    if len(ids) > 8:
        tier.stores_landed(np.array(ids, dtype=np.int64), all_pending=True)
        return
    state, ready = tier.state, CpuState.READY
    for block in ids:
        state[block] = ready
    tier.num_pending -= len(ids)


def loads_ended(tier: CpuTier, ids: list[int]) -> None:
    """Loads of blocks ``ids`` ended (one reader each, repeats allowed); a few without numpy.

    Raises:
        BlockStateError: a block has fewer loads in flight than ``ids`` ends (a load ended
            twice, or never begun); nothing changed (a reader count below its loads would let
            the block be evicted, and handed out, while a later load still copies from it).
    """
    if len(ids) > 32:
        blocks, counts = np.unique(np.array(ids, dtype=np.int64), return_counts=True)
        if (tier.readers_np[blocks] < counts).any():
            raise BlockStateError(_NO_LOAD)
        tier.remove_readers(np.array(ids, dtype=np.int64))
        return
    readers, idle = tier.readers, 0
    for i, block in enumerate(ids):
        left = readers[block] - 1
        if left < 0:
            for done in ids[:i]:  # undone: nothing changed
                readers[done] += 1
            raise BlockStateError(_NO_LOAD)
        readers[block] = left
        idle += left == 0
    tier.num_loading -= idle


_NO_LOAD = "complete_load: a key has no load in flight (ended twice, or never prepared)"


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
    """One rank's copies between its KV tensors and its CPU tier, jobs named in block ids: a
    ``kvmgr.worker.TransferWorker`` (the same data path as ``OffloadManager``'s ranks) over a
    CPU tier allocated at once through the engine (no background pinning: vLLM's worker has no
    step that could wait for blocks still being pinned).

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
        pages = KVLayout.from_tensors(gpu_kv_caches).page_bytes.tolist()
        pool = HostKVPool(pages, num_cpu_blocks, engine.allocate_host)
        self.worker = TransferWorker(gpu_kv_caches, num_cpu_blocks, engine, cpu_pool=pool)
        self.cpu_tensors: list[torch.Tensor] = pool.tensors  #: uint8 ``[num_cpu_blocks, page]``

    @property
    def engine(self) -> TransferEngine:
        """The worker's engine (tests may wrap it before the first job)."""
        return self.worker.engine

    @engine.setter
    def engine(self, engine: TransferEngine) -> None:
        self.worker.engine = engine

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
            StaleKVTensorError: a KV tensor moved since construction.
            TransferError: the engine refused the batch.
            KVMgrError: the plan could not be built (bad ids, a repeated destination).
        """
        job = TransferJob(job_id, direction, gpu_ids, cpu_ids, tuple(wait_for))
        return self.worker.submit(job).handle

    def forget(self, job_id: int) -> None:
        """The job's outcome was taken: stop tracking its handle."""
        self.worker.forget(job_id)

    def close(self) -> None:
        """Close the engine (after the copies in flight) and let go of the CPU tier."""
        self.worker.close(None)
        self.cpu_tensors = []


def rank_copies(
    gpu_kv_caches: list[torch.Tensor], num_cpu_blocks: int, engine: TransferEngine
) -> RankCopies:
    """This rank's `RankCopies` over ``gpu_kv_caches`` with a CPU tier of ``num_cpu_blocks``."""
    return RankCopies(gpu_kv_caches, num_cpu_blocks, engine)
