"""What the groups' copies give back: one ``queue_all`` future, folded into per-group results.

Private to ``kvmgr.groups`` (``GroupedStore`` is public through ``kvmgr.groups``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs

from kvmgr.reports import SwapResult

__all__ = ["GroupedStore", "by_group", "grouped_store"]


@attrs.frozen
class GroupedStore:
    """A completed grouped store.

    Attributes:
        results: per group, in layout order: the group's ``SwapResult`` (``None`` when the
            store named no block of that group).
    """

    results: tuple[SwapResult | None, ...]

    @property
    def num_bytes(self) -> int:
        """Bytes copied across the groups."""
        return sum(r.num_bytes for r in self.results if r is not None)


async def by_group(
    every: asyncio.Future[list[Any]], groups: list[int], num_groups: int
) -> list[SwapResult | None]:
    """The results of ``every`` (a ``queue_all`` future of the swaps of ``groups``, in that
    order) in layout order, ``None`` where a group had none; raises as ``every``."""
    results: list[SwapResult | None] = [None] * num_groups
    for g, result in zip(groups, await every, strict=True):
        results[g] = result
    return results


async def grouped_store(
    every: asyncio.Future[list[Any]], groups: list[int], num_groups: int
) -> GroupedStore:
    """``by_group`` as a ``GroupedStore``."""
    return GroupedStore(tuple(await by_group(every, groups, num_groups)))
