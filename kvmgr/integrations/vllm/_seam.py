"""Where the vLLM backend meets the rest of kvmgr: one scheduler-side tier, one copy engine.

Private to ``kvmgr.integrations.vllm``. The backend's manager and worker reach kvmgr's
bookkeeping and engines only through these two functions, so re-pointing the backend at another
scheduler-side package (issue 21's ``kvmgr/scheduler/``) or worker (``kvmgr/worker/``) changes
this file and nothing else.

Offers:
    scheduler_tier      the CPU tier's torch-free bookkeeping (block states PENDING / READY,
                        the key index, readers, eviction through a kvmgr policy)
    stores_landed       PENDING -> READY for a few blocks without numpy
    forget_all          drop every key at once (a cache reset); returns the blocks still busy
    release_forgotten   free those blocks once no copy touches them any more
    transfer_engine     a kvmgr ``TransferEngine`` for KV tensors on a device
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

try:  # issue 21's split moves the CPU tier's bookkeeping to the torch-free scheduler package
    from kvmgr.scheduler.cpu_tier import CpuState, CpuTier
except ImportError:  # pragma: no cover - before the split
    from kvmgr.manager.cpu_tier import CpuState, CpuTier  # type: ignore[no-redef]
from kvmgr.policy import make_policy
from kvmgr.transfer import TransferEngine, make_engine

__all__ = [
    "CpuState",
    "CpuTier",
    "forget_all",
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
