"""What the groups' copies give back: one future per group, folded into one result.

Private to ``kvmgr.groups`` (``GroupedStore`` is public through ``kvmgr.groups``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs

from kvmgr._futures import all_ended
from kvmgr.reports import SwapResult

__all__ = ["GroupedStore", "gather_store", "group_results"]


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


async def group_results(futures: list[asyncio.Future[SwapResult] | None]) -> list[Any]:
    """Every group's result, in group order (``None`` where none), once all completed;
    raises the first group's error. Cancelling the caller leaves the copies running."""
    it = iter(await all_ended([f for f in futures if f is not None]))
    return [None if f is None else next(it) for f in futures]


async def gather_store(futures: list[asyncio.Future[SwapResult] | None]) -> GroupedStore:
    """``group_results`` as a ``GroupedStore``."""
    return GroupedStore(tuple(await group_results(futures)))
