"""Checks of a grouped store's and load's block tables, turned into per-group work (no torch).

Package-private: ``GroupedManager`` validates every group's table with these before it queues
anything, so a bad entry in the last group leaves nothing queued in the first: ``check_blocks``
asks every group's manager about its GPU ids (range, repeats, held blocks), ``check_room``
(``OffloadManager.check_store_room``, exact) refuses a store that some group has no room for,
before any group's store is queued.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from kvmgr.errors import InvalidBlockError, InvalidKeyError, PoolExhaustedError
from kvmgr.groups.errors import GroupKeyError
from kvmgr.groups.restore import RestorePlan
from kvmgr.groups.spec import GroupedLayout

#: per group: (group index, GPU block ids, grouped keys, parent keys)
StoreWork = list[tuple[int, list[int], list[bytes], list[bytes | None]]]
#: per group: (group index, grouped keys, GPU block ids)
LoadWork = list[tuple[int, list[bytes], list[int]]]


def _table(name: str, table: object) -> Sequence[object]:
    """A group's table as a sequence: a list or tuple, or a 1-D array (numpy, torch) as a list
    of its ints, as ``OffloadManager`` takes them."""
    if getattr(table, "ndim", None) == 1 and hasattr(table, "tolist"):
        return table.tolist()  # type: ignore[attr-defined,no-any-return]
    if isinstance(table, (bytes, str)) or not isinstance(table, Sequence):
        raise GroupKeyError(
            f"block_tables[{name!r}]: expected a sequence of block ids, got {type(table).__name__}"
        )
    return table


def _block_id(value: object) -> int | None:
    """``value`` as an int block id (a Python or numpy int), or ``None`` if it is not one."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def store_work(
    layout: GroupedLayout, hashes: list[bytes], tables: Mapping[str, Sequence[int | None]]
) -> StoreWork:
    """Per group that stores something: its GPU ids, keys and parents (the key of the block
    before, ``None`` for block 0).

    Raises:
        GroupKeyError: not a mapping, an unknown group, or an entry not an int or ``None``.
    """
    if not isinstance(tables, Mapping):
        raise GroupKeyError(f"block_tables: expected a mapping, got {type(tables).__name__}")
    work: StoreWork = []
    for name, raw in tables.items():
        g = layout.index(name)
        table = _table(name, raw)
        blocks: list[tuple[int, int]] = []
        for j in range(min(len(table), layout.num_blocks(g, len(hashes)))):
            if table[j] is None:
                continue
            gpu = _block_id(table[j])
            if gpu is None:
                raise GroupKeyError(
                    f"block_tables[{name!r}][{j}]: expected int or None, got {table[j]!r:.40}"
                )
            blocks.append((j, gpu))
        if not blocks:
            continue
        keys = layout.keys(g, hashes, [j for j, _ in blocks])
        parents: list[bytes | None] = [
            None if j == 0 else layout.keys(g, hashes, [j - 1])[0] for j, _ in blocks
        ]
        work.append((g, [gpu for _, gpu in blocks], keys, parents))
    return work


def load_work(
    layout: GroupedLayout, plan: RestorePlan, tables: Mapping[str, Sequence[int]]
) -> LoadWork:
    """Per group with blocks to load: the plan's keys and the GPU ids they go to.

    Raises:
        GroupKeyError: not a plan of this layout, or a group's table missing or too short.
        InvalidBlockError: a GPU id that is not an int.
    """
    if not isinstance(plan, RestorePlan) or len(plan.blocks) != len(layout.groups):
        raise GroupKeyError(f"expected a RestorePlan of this layout, got {plan!r:.80}")
    if not isinstance(tables, Mapping):
        raise GroupKeyError(f"block_tables: expected a mapping, got {type(tables).__name__}")
    work: LoadWork = []
    for g, (spec, blocks, keys) in enumerate(
        zip(layout.groups, plan.blocks, plan.keys, strict=True)
    ):
        if not keys:
            continue
        raw = tables.get(spec.name)
        if raw is None:
            raise GroupKeyError(f"block_tables[{spec.name!r}] must name blocks {blocks}")
        table = _table(spec.name, raw)
        if len(table) < blocks.stop:
            raise GroupKeyError(f"block_tables[{spec.name!r}] must name blocks {blocks}")
        ids = [_block_id(table[j]) for j in blocks]
        if None in ids:
            raise InvalidBlockError(f"block_tables[{spec.name!r}]: expected int block ids")
        work.append((g, list(keys), ids))  # type: ignore[arg-type]
    return work


def check_blocks(
    ids: Sequence[tuple[int, list[int]]], layout: GroupedLayout, managers: Sequence[Any], what: str
) -> None:
    """All or nothing: raise before any group's ``what`` (``"store"``, ``"load"``) is queued
    if a group's GPU ids (``ids``: ``(group index, ids)`` pairs) are bad; the error names the
    group (``OffloadManager.check_gpu_blocks``).

    Raises:
        InvalidBlockError: a group's ids are out of range, repeated, or not held.
        ClosedError: a group's manager is closed.
    """
    for g, group_ids in ids:
        try:
            managers[g].check_gpu_blocks(group_ids, what)
        except InvalidBlockError as exc:
            name = layout.groups[g].name
            raise type(exc)(f"group {name!r}: {exc}; no group's {what} was queued") from exc


def check_room(work: StoreWork, layout: GroupedLayout, managers: Sequence[Any]) -> None:
    """All or nothing: raise before queueing any group's store if a group's ``swap_out``
    would refuse its keys or lack room (``OffloadManager.check_store_room``: free blocks plus
    what the policy could really evict, a READY key above one that cannot go left out), so a
    store that passed is refused by no group for room.

    Raises:
        PoolExhaustedError: a group lacks room (reason ``"cpu_full"``); the error names it.
        GroupKeyError: a group's keys are refused (as ``swap_out``: a block hash repeated).
    """
    for g, _, keys, parents in work:
        try:
            managers[g].check_store_room(keys, parents)
        except InvalidKeyError as exc:  # a hash repeated: one key twice in a group's store
            name = layout.groups[g].name
            raise GroupKeyError(f"group {name!r}: {exc}; no group's store was queued") from exc
        except PoolExhaustedError as exc:
            name = layout.groups[g].name
            raise exc.reworded(f"group {name!r}: {exc}; no group's store was queued") from exc
