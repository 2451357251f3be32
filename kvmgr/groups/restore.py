"""The restorable-prefix lookup: the longest boundary every group of a request can restore.

Offers:
    RestorePlan     a boundary and, per group, the logical blocks (and keys) to load for it
    plan_at         the plan of one boundary (what a restore point at ``N`` tokens needs)
    find_restorable the longest boundary whose every needed block is ready, and its plan

No torch, no asyncio: ``is_ready`` is any predicate on grouped keys (a set's ``__contains__``,
a manager's index). A boundary ``N`` is restorable when, for every group ``g``, every block in
``g.live_blocks(N)`` is ready: the whole prefix for full/MLA/compressed groups, the window's
blocks for a sliding-window group, the one state at ``N`` for a recurrent group. Unlike a
single key space, the restorable boundaries of a hybrid model need not form a prefix run: a
sliding-window group that lost a block in the middle of the prompt blocks only the boundaries
whose window covers it, so a later boundary may still be restorable (vLLM's offloading
scheduler scans sliding-window groups from the end for the same reason,
``OffloadingConnectorScheduler._sliding_window_lookup``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from kvmgr.groups.errors import GroupKeyError
from kvmgr.groups.spec import GroupedLayout

__all__ = ["RestorePlan", "find_restorable", "plan_at"]


@attrs.frozen
class RestorePlan:
    """What to load to restore a request at ``num_tokens``.

    Attributes:
        num_tokens: the boundary (a multiple of ``layout.boundary_tokens``; 0 = a miss).
        blocks: per group, in layout order: the logical block indices to load.
        keys: per group: the grouped keys of those blocks (``keys[g][i]`` names
            ``blocks[g][i]``).
        num_bytes: bytes the load moves, ``sum(len(blocks[g]) * block_bytes(g))``.
    """

    num_tokens: int
    blocks: tuple[range, ...]
    keys: tuple[tuple[bytes, ...], ...]
    num_bytes: int

    @property
    def is_hit(self) -> bool:
        """True when the plan restores at least one boundary."""
        return self.num_tokens > 0


def plan_at(layout: GroupedLayout, hashes: Sequence[bytes], num_tokens: int) -> RestorePlan:
    """The blocks and keys a restore point at ``num_tokens`` needs, whether ready or not.

    Args:
        hashes: the request's block hashes (checked by ``layout.check_hashes``), at least
            ``num_tokens / layout.hash_block_size`` of them.
        num_tokens: a multiple of ``layout.boundary_tokens``.

    Raises:
        GroupKeyError: ``num_tokens`` is not a boundary, or ``hashes`` is too short.
    """
    if num_tokens % layout.boundary_tokens:
        raise GroupKeyError(
            f"{num_tokens} tokens is not a multiple of the boundary {layout.boundary_tokens}"
        )
    if num_tokens > len(hashes) * layout.hash_block_size:
        raise GroupKeyError(
            f"{num_tokens} tokens needs {num_tokens // layout.hash_block_size} block hashes, "
            f"got {len(hashes)}"
        )
    blocks = tuple(g.live_blocks(num_tokens) for g in layout.groups)
    keys = tuple(tuple(layout.keys(i, hashes, b)) for i, b in enumerate(blocks))
    num_bytes = sum(len(b) * g.block_bytes for b, g in zip(blocks, layout.groups, strict=True))
    return RestorePlan(num_tokens, blocks, keys, num_bytes)


def find_restorable(
    layout: GroupedLayout,
    hashes: Sequence[bytes],
    is_ready: Callable[[bytes], bool],
    max_tokens: int | None = None,
) -> RestorePlan:
    """The longest boundary ``N <= max_tokens`` every group can restore, and its plan.

    Cost: one ``is_ready`` call per block of each prefix group up to its first miss, plus, per
    candidate boundary tried (longest first), the live blocks of the window and recurrent
    groups: ``O(num_blocks * num_groups)`` in the worst case.

    Args:
        hashes: the request's block hashes (checked here).
        is_ready: whether a grouped key can be loaded now (READY, not PENDING).
        max_tokens: cap on the boundary (for example the prompt length minus one token, which
            must be computed to sample); ``None`` = every hash.

    Returns:
        The plan of the longest restorable boundary; ``num_tokens == 0`` when none is.

    Raises:
        GroupKeyError: bad hashes, or ``max_tokens`` negative.
    """
    hashes = layout.check_hashes(hashes)
    limit = len(hashes) * layout.hash_block_size
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise GroupKeyError(f"max_tokens: expected an int >= 0, got {max_tokens!r}")
        limit = min(limit, max_tokens)
    limit = _prefix_limit(layout, hashes, is_ready, limit)
    return plan_at(layout, hashes, _longest_boundary(layout, hashes, is_ready, limit))


def _prefix_limit(
    layout: GroupedLayout, hashes: list[bytes], is_ready: Callable[[bytes], bool], limit: int
) -> int:
    """``limit`` bounded by each prefix group's leading run of ready blocks (in tokens)."""
    for i, g in enumerate(layout.groups):
        if g.kind.needs_prefix:
            run = 0
            for key in layout.keys(i, hashes, range(limit // g.block_size)):
                if not is_ready(key):
                    break
                run += 1
            limit = min(limit, run * g.block_size)
    return limit


def _longest_boundary(
    layout: GroupedLayout, hashes: list[bytes], is_ready: Callable[[bytes], bool], limit: int
) -> int:
    """The longest boundary ``<= limit`` whose live blocks every window and recurrent group
    holds ready (0: none); ``is_ready`` is asked once per key."""
    others = [i for i, g in enumerate(layout.groups) if not g.kind.needs_prefix]
    step = layout.boundary_tokens
    cache: dict[bytes, bool] = {}

    def ready(key: bytes) -> bool:
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = bool(is_ready(key))
        return hit

    for n in range(limit - limit % step, 0, -step):
        if all(
            all(ready(k) for k in layout.keys(i, hashes, layout.groups[i].live_blocks(n)))
            for i in others
        ):
            return n
    return 0
