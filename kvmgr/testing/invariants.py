"""The manager's invariants, checked over its public ``snapshot()``.

Offers:
    check_invariants  raises ``InvariantError`` naming every broken invariant
    InvariantError    the ``AssertionError`` it raises
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmgr.manager.snapshot import ManagerSnapshot
from kvmgr.pool.block_table import Tier
from kvmgr.scheduler.cpu_tier import CpuState
from kvmgr.scheduler.gpu_blocks import GpuState
from kvmgr.testing._engine_invariants import check_scripted_engine

if TYPE_CHECKING:
    from kvmgr.manager import OffloadManager

__all__ = ["InvariantError", "check_invariants"]

_KEYED = (CpuState.PENDING, CpuState.READY)
#: swaps that sit in the manager's queue until a flush (promotes and waiting stores do not)
_QUEUED_KINDS = frozenset({"store", "load", "preempt", "resume"})


class InvariantError(AssertionError):
    """A manager invariant does not hold; the message lists every violation found."""


def check_invariants(manager: OffloadManager, *, scan_poison: bool = True) -> None:
    """Check the manager's bookkeeping against itself; call it between steps of a test.

    Checked (each violation is named in the error, with the offending keys or block ids):

    - CPU tier: a block is allocated exactly when its state is not FREE; every keyed block
      (PENDING/READY) has one key, every SWAPPED/RESUMING block is in one swapped-out table,
      every PREEMPTING block belongs to one preempt not settled yet (no leak, no double use);
    - index and policy track the same keys; the parents the manager records cover exactly the
      indexed keys and no parent chain comes back to its key (a key cycle is never evicted);
    - a key is PENDING exactly while one queued or in-flight store writes its block, and its
      reader count equals the loads of it queued or in flight (nothing pinned for ever);
    - every moving block table has exactly one preempt or resume queued or in flight;
    - GPU blocks: each busy count equals the unsettled copies naming the block; with the owned
      pool, a block is allocated exactly when HELD or DRAINING, every HELD block is in one
      resident table or one resume in flight, every DRAINING block is busy, and no block a
      copy uses is FREE (it could be handed out while the DMA still uses it);
    - no swap future resolved before its copy settled (cancelled and abandoned ones excepted);
    - ``statistics()`` agrees with the snapshot; with a ``FaultyEngine``: every unresolved
      batch belongs to the manager, and two unresolved batches of opposite directions that share
      a GPU block are ordered: the later one waits (``wait_for``, directly or through other
      batches) for the earlier one or for a later batch of the earlier one's direction (the
      batches of one direction run in submission order);
    - with a poisoning ``FaultyEngine`` and ``scan_poison``: no READY key's pages are all
      ``POISON_BYTE`` (a failed store treated as complete). Costs one read of every READY page.

    Args:
        manager: an ``OffloadManager`` (open or closed).
        scan_poison: scan READY pages for the poison of failed stores.

    Raises:
        InvariantError: one or more invariants are broken.
    """
    snap = manager.snapshot()
    problems = _check_keys(snap) + _check_cpu(snap) + _check_gpu(snap)
    problems += _check_statistics(snap, manager.statistics())
    problems += check_scripted_engine(manager, snap, scan_poison)
    if problems:
        raise InvariantError("kvmgr invariants broken:\n- " + "\n- ".join(problems))


def _check_statistics(snap: ManagerSnapshot, stats: Any) -> list[str]:
    """Futures resolved early, and ``statistics()`` against the snapshot."""
    problems: list[str] = []
    for swap in snap.swaps:
        if swap.future_done and not (swap.future_cancelled or swap.abandoned):
            problems.append(f"a {swap.kind}'s future resolved before its copy settled")
    queued = sum(1 for s in snap.swaps if s.batch_seq is None and s.kind in _QUEUED_KINDS)
    if stats.batches_in_flight != len(snap.batches):
        problems.append(
            f"statistics: {stats.batches_in_flight} batches in flight, snapshot has "
            f"{len(snap.batches)}"
        )
    if stats.queued_swaps != queued:
        problems.append(f"statistics: {stats.queued_swaps} queued swaps, snapshot has {queued}")
    if stats.cpu_blocks_used != len(snap.cpu_allocated):
        problems.append("statistics: cpu_blocks_used differs from the allocator")
    pending = sum(1 for k in snap.keys.values() if k.state is CpuState.PENDING)
    if stats.cpu_keys_pending != pending:
        problems.append(f"statistics: {stats.cpu_keys_pending} PENDING keys, snapshot {pending}")
    loading = sum(1 for k in snap.keys.values() if k.readers)
    if stats.cpu_keys_loading != loading:
        problems.append(f"statistics: {stats.cpu_keys_loading} keys loading, snapshot {loading}")
    return problems


def _short(key: bytes) -> str:
    return key.hex()[:16]


def _check_keys(snap: ManagerSnapshot) -> list[str]:
    problems: list[str] = []
    keys = snap.keys
    missing = [_short(k) for k in keys if k not in snap.policy_keys]
    if missing or snap.num_policy_keys != len(keys):
        problems.append(
            f"index has {len(keys)} keys, policy {snap.num_policy_keys}; not in the policy: "
            f"{missing[:8]}"
        )
    problems += _check_chains(snap)
    writes: Counter[int] = Counter()
    reads: Counter[int] = Counter()
    for swap in snap.swaps:
        if swap.kind in ("store", "promote"):
            writes.update(swap.cpu_block_ids)
        elif swap.kind == "load":
            reads.update(swap.cpu_block_ids)
    for key, entry in keys.items():
        block = entry.cpu_block_id
        if snap.cpu_states[block] is not entry.state:
            problems.append(f"key {_short(key)}: block {block} state differs from the key's")
        if entry.state not in _KEYED:
            problems.append(f"key {_short(key)} is on a {entry.state.name} block {block}")
        pending = entry.state is CpuState.PENDING
        if pending and writes[block] != 1:
            problems.append(f"key {_short(key)} is PENDING with {writes[block]} stores in flight")
        if not pending and writes[block]:
            problems.append(f"key {_short(key)} is READY while a store still writes its block")
        if entry.readers != reads[block]:
            problems.append(f"key {_short(key)} has {entry.readers} readers, {reads[block]} loads")
        if pending and entry.readers:
            problems.append(f"key {_short(key)} is PENDING with readers")
    return problems


def _check_chains(snap: ManagerSnapshot) -> list[str]:
    parents = snap.key_parents
    if parents.keys() != snap.keys.keys():
        odd = sorted(_short(k) for k in parents.keys() ^ snap.keys.keys())
        return [f"recorded parents and index differ on keys {odd[:8]}"]
    done: set[bytes] = set()
    for start in parents:
        path: list[bytes] = []
        key: bytes | None = start
        while key is not None and key in parents and key not in done:
            if key in path:
                cycle = path[path.index(key) :]
                return [f"key cycle (never evictable): {[_short(k) for k in cycle][:8]}"]
            path.append(key)
            key = parents[key]
        done.update(path)
    return []


def _check_cpu(snap: ManagerSnapshot) -> list[str]:
    problems: list[str] = []
    owners: dict[int, list[str]] = {}
    for key, entry in snap.keys.items():
        owners.setdefault(entry.cpu_block_id, []).append(f"key {_short(key)}")
    moving: Counter[object] = Counter()
    for swap in snap.swaps:
        if swap.kind in ("preempt", "resume"):
            moving[swap.req_id] += 1
        if swap.kind == "preempt":
            for b in swap.cpu_block_ids:
                owners.setdefault(b, []).append(f"preempt of {swap.req_id!r}")
    for req_id, table in snap.tables.items():
        if table.tier is Tier.CPU:
            for b in table.block_ids:
                owners.setdefault(b, []).append(f"request {req_id!r}")
        if table.moving != (moving[req_id] == 1):
            problems.append(
                f"request {req_id!r}: moving={table.moving} with {moving[req_id]} "
                "preempts/resumes queued or in flight"
            )
    problems += _check_holders("CPU", owners, "with several owners", snap.cpu_states,
                               snap.cpu_allocated, CpuState.FREE)  # fmt: skip
    for b, state in enumerate(snap.cpu_states):
        if state is not CpuState.FREE and b in snap.cpu_allocated and b not in owners:
            problems.append(f"CPU block {b} ({state.name}) is allocated with no owner (leaked)")
    for b in owners:
        if b not in snap.cpu_allocated:
            problems.append(f"CPU block {b} is in use but free in the allocator")
    return problems


def _check_gpu(snap: ManagerSnapshot) -> list[str]:
    problems: list[str] = []
    uses: Counter[int] = Counter()
    for swap in snap.swaps:
        uses.update(swap.gpu_block_ids)
    if dict(uses) != dict(snap.gpu_busy):
        diff = sorted(set(uses.items()) ^ set(snap.gpu_busy.items()))[:8]
        problems.append(f"GPU busy counts differ from the unsettled copies: {diff}")
    if snap.gpu_states is None or snap.gpu_allocated is None:
        return problems
    holders: dict[int, list[str]] = {}
    for req_id, table in snap.tables.items():
        if table.tier is Tier.GPU and table.gpu_owned:
            for b in table.block_ids:
                holders.setdefault(b, []).append(f"request {req_id!r}")
    for swap in snap.swaps:
        if swap.kind == "resume":
            for b in swap.gpu_block_ids:
                holders.setdefault(b, []).append(f"resume of {swap.req_id!r}")
    problems += _check_holders("GPU", holders, "held twice", snap.gpu_states,
                               snap.gpu_allocated, GpuState.FREE)  # fmt: skip
    for b, state in enumerate(snap.gpu_states):
        if state is GpuState.HELD and b not in holders:
            problems.append(f"GPU block {b} is HELD by no request and no resume (leaked)")
        if state is not GpuState.HELD and b in holders:
            problems.append(f"GPU block {b} is {state.name} but in {holders[b]}")
        if state is GpuState.DRAINING and not uses[b]:
            problems.append(f"GPU block {b} is DRAINING with no copy using it")
        if state is GpuState.FREE and uses[b]:
            problems.append(
                f"GPU block {b} is FREE while a queued or in-flight copy uses it (could be "
                "handed out mid-copy)"
            )
    return problems


def _check_holders(
    tier: str,
    holders: dict[int, list[str]],
    several: str,
    states: Sequence[Any],
    allocated: frozenset[int],
    free: Any,
) -> list[str]:
    """Blocks of ``tier`` with several holders, and blocks whose state (``free`` or not)
    disagrees with the allocator."""
    problems = []
    twice = {b: who for b, who in holders.items() if len(who) > 1}
    if twice:
        problems.append(f"{tier} blocks {several}: {dict(list(twice.items())[:8])}")
    for b, state in enumerate(states):
        is_allocated = b in allocated
        if is_allocated != (state is not free):
            problems.append(f"{tier} block {b} is {state.name} but allocated={is_allocated}")
    return problems
