"""The invariants of a manager over a ``FaultyEngine`` (``ScriptedEngine``), checked over its
snapshot (private to ``kvmgr.testing``; ``check_invariants`` runs them).

Offers:
    check_scripted_engine   the engine's unresolved batches against the manager's, and the
                            poison scan of READY pages
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmgr.manager.snapshot import ManagerSnapshot
from kvmgr.scheduler.cpu_tier import CpuState
from kvmgr.testing.faults import POISON_BYTE, FaultyEngine

if TYPE_CHECKING:
    from kvmgr.manager import OffloadManager

__all__ = ["check_scripted_engine"]


def check_scripted_engine(
    manager: OffloadManager, snap: ManagerSnapshot, scan_poison: bool
) -> list[str]:
    """With a ``FaultyEngine``: its unresolved batches and, when asked, the poison scan."""
    if not isinstance(manager.engine, FaultyEngine):
        return []
    problems = _check_engine(snap, manager.engine)
    if scan_poison and manager.engine.poisons:
        problems += _check_poison(snap, manager.cpu_pool.tensors)
    return problems


def _check_engine(snap: ManagerSnapshot, engine: FaultyEngine) -> list[str]:
    problems: list[str] = []
    known = {i for b in snap.batches for i in (b.engine_batch_ids or (b.engine_batch_id,))}
    stray = sorted(set(engine.unresolved_batch_ids) - known)
    if stray:
        problems.append(f"engine batches {stray} are unresolved but unknown to the manager")
    batches = snap.batches
    waits = {b.engine_batch_id: engine.unresolved_wait_for(b.engine_batch_id) for b in batches}
    position = {b.engine_batch_id: i for i, b in enumerate(batches)}
    # after[i]: the batches that batch i certainly runs after: those it waits for, every
    # earlier batch of their direction (one direction runs in submission order), transitively
    after: list[set[int]] = []
    for i, batch in enumerate(batches):
        done: set[int] = set()
        for w in waits[batch.engine_batch_id] or ():
            j = position.get(w)
            if j is None or j >= i:
                continue
            done |= after[j] | {
                k for k in range(j + 1) if batches[k].direction is batches[j].direction
            }
        after.append(done)
    for i, later in enumerate(batches):
        if waits[later.engine_batch_id] is None:
            continue  # its copy has ended
        for j, earlier in enumerate(batches[:i]):
            if earlier.direction is later.direction or waits[earlier.engine_batch_id] is None:
                continue
            shared = set(earlier.gpu_block_ids) & set(later.gpu_block_ids)
            if shared and j not in after[i]:
                problems.append(
                    f"batches {earlier.engine_batch_id} and {later.engine_batch_id} share GPU "
                    f"blocks {sorted(shared)[:8]} without a wait_for fence"
                )
    return problems


def _check_poison(snap: ManagerSnapshot, pages: list[torch.Tensor]) -> list[str]:
    ready = [(k, e.cpu_block_id) for k, e in snap.keys.items() if e.state is CpuState.READY]
    if not ready:
        return []
    block_ids = torch.tensor([b for _, b in ready], dtype=torch.long)
    poisoned = torch.ones(len(ready), dtype=torch.bool)
    for tensor in pages:
        poisoned &= (tensor[block_ids] == POISON_BYTE).all(dim=1)
    bad = [_short(ready[i][0]) for i in torch.nonzero(poisoned).flatten().tolist()]
    return [f"READY keys hold the poison of a failed store: {bad[:8]}"] if bad else []


def _short(key: bytes) -> str:
    return key.hex()[:16]
