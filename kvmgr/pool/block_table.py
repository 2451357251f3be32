"""Block tables: per request, logical block index -> (tier, block id).

Offers:
    Tier        GPU or CPU
    BlockTable  one request's blocks in order, and whether a swap of it is in flight
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["BlockTable", "Tier"]


class Tier(enum.Enum):
    """Where a block lives."""

    GPU = "gpu"
    CPU = "cpu"


@attrs.define(eq=False)
class BlockTable:
    """The blocks of one request, logical index -> (tier, block id).

    A request is either resident (all blocks on the GPU), swapped out (all on the CPU), or moving
    (a preempt or resume in flight, ``moving`` set); blocks are appended only while resident.

    Attributes:
        req_id: the caller's request id.
        tier: tier of every block.
        block_ids: block ids in logical order, in ``tier``.
        gpu_owned: whether the GPU ids came from the manager's pool (``allocate``) and go back to
            it, or were supplied by the caller (``append_blocks``) and are handed back to it.
        moving: a preempt or resume of this request is in flight.
    """

    req_id: object
    tier: Tier = Tier.GPU
    block_ids: list[int] = attrs.field(factory=list)
    gpu_owned: bool | None = None
    moving: bool = False

    def entries(self) -> list[tuple[Tier, int]]:
        """``[(tier, block_id), ...]`` in logical order."""
        return [(self.tier, b) for b in self.block_ids]
