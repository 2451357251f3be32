"""GroupIndex: which grouped keys the CPU tier holds, on which prefix chains, and which are
orphans (no torch, no asyncio; the scheduler-side half of cache groups).

Offers:
    GroupIndex    held (PENDING or READY) grouped keys, the chains of block hashes they hang
                  on, and the orphans a removal leaves behind

Data structures: one node per block hash (its parent hash, its depth in hash blocks, its
children, and per group whether the block it names is PENDING or READY), a set of READY keys
for lookups, and a set of keys to re-examine (orphans that could not be dropped yet because a
store or a load was in flight).

Orphans. A held block is *needed* when some boundary that needs it (``GroupSpec.live_blocks``)
is restorable, counting PENDING blocks as held (a store in flight will land). When a block
leaves the tier, ``removed`` returns the blocks no restorable boundary needs any more:

- a prefix-group block (full, MLA, compressed) at node ``n``: every boundary at or below ``n``
  is dead, so every block held in ``n``'s subtree, in any group, is an orphan;
- a window or recurrent block: the boundaries within its reach below ``n`` are dead; blocks
  there (and at the ancestors within the longest reach) are orphans when nothing else needs
  them;
- then, up the ancestors, prefix-group blocks whose subtree has no restorable boundary left.

Cost per removal: ``O(subtree)`` for a prefix block, ``O(reach * chain depth)`` otherwise.
The manager drops the orphans (``OffloadManager.invalidate``), so no group keeps CPU memory for
a prefix the others can no longer restore.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from kvmgr.groups.errors import GroupKeyError
from kvmgr.groups.spec import GROUP_ID_BYTES, GroupedLayout

__all__ = ["GroupIndex"]

_PENDING, _READY = 1, 2


@attrs.define(eq=False)
class _Node:
    hash: bytes
    parent: bytes | None
    depth: int
    children: set[bytes] = attrs.field(factory=set, init=False)
    held: dict[int, int] = attrs.field(factory=dict, init=False)  # group index -> _PENDING | _READY


class GroupIndex:
    """Held grouped keys over prefix chains, and the orphans of a removal.

    Args:
        layout: the groups and the hash block size.
    """

    def __init__(self, layout: GroupedLayout) -> None:
        self.layout = layout
        self._nodes: dict[bytes, _Node] = {}
        self._ready: set[bytes] = set()
        self._recheck: set[bytes] = set()
        self._id_to_index = {layout.group_id(i): i for i in range(len(layout.groups))}
        self._prefix = [g.kind.needs_prefix for g in layout.groups]
        self._per = [g.block_size // layout.hash_block_size for g in layout.groups]
        reach = [g.reach_blocks() for g in layout.groups]
        self._reach = [None if r is None else (r + 1) * p for r, p in zip(reach, self._per)]
        self._max_reach = max((r for r in self._reach if r is not None), default=0)

    # ------------------------------------------------------------------ queries

    def is_ready(self, key: bytes) -> bool:
        """Whether a grouped key is READY (loadable now)."""
        return key in self._ready

    def is_held(self, key: bytes) -> bool:
        """Whether a grouped key is PENDING or READY."""
        node = self._nodes.get(key[:-GROUP_ID_BYTES])
        gid = int.from_bytes(key[-GROUP_ID_BYTES:], "big")
        return node is not None and self._id_to_index.get(gid, -1) in node.held

    def num_held(self) -> int:
        """Grouped keys held, PENDING or READY."""
        return sum(len(n.held) for n in self._nodes.values())

    def held_keys(self) -> list[bytes]:
        """Every held grouped key (for tests and invariant checks)."""
        return [h + self._suffix(g) for h, n in self._nodes.items() for g in n.held]

    def _suffix(self, index: int) -> bytes:
        return self.layout.group_id(index).to_bytes(GROUP_ID_BYTES, "big", signed=False)

    def split(self, key: bytes) -> tuple[bytes, int]:
        """``(block_hash, group index)`` of a grouped key of this layout.

        Raises:
            GroupKeyError: not a grouped key of one of this layout's groups.
        """
        if not isinstance(key, bytes) or len(key) <= GROUP_ID_BYTES:
            raise GroupKeyError(f"expected a grouped key, got {key!r:.60}")
        gid = int.from_bytes(key[-GROUP_ID_BYTES:], "big", signed=False)
        if gid not in self._id_to_index:
            raise GroupKeyError(f"group id {gid} is not in this layout")
        return key[:-GROUP_ID_BYTES], self._id_to_index[gid]

    # ------------------------------------------------------------------ updates

    def check_chain(self, hashes: Sequence[bytes]) -> None:
        """Raise ``GroupKeyError`` if ``hashes`` contradicts a known chain (a hash seen with
        another parent or depth: the hashes are not chained prefix hashes). Changes nothing."""
        parent: bytes | None = None
        for depth, h in enumerate(hashes):
            node = self._nodes.get(h)
            if node is not None and (node.parent != parent or node.depth != depth):
                raise GroupKeyError(
                    f"block hash {h.hex()[:16]} at position {depth} was stored at position "
                    f"{node.depth} after another parent: block hashes must chain the prefix"
                )
            parent = h

    def add_pending(self, hashes: Sequence[bytes], index: int, keys: Iterable[bytes]) -> None:
        """Record a queued store of group ``index``'s ``keys`` (named by ``hashes``, checked
        with ``check_chain``); READY keys stay READY."""
        parent: bytes | None = None
        for depth, h in enumerate(hashes):
            if h not in self._nodes:
                self._nodes[h] = _Node(h, parent, depth)
                if parent is not None:
                    self._nodes[parent].children.add(h)
            parent = h
        for key in keys:
            node = self._nodes[key[:-GROUP_ID_BYTES]]
            node.held.setdefault(index, _PENDING)

    def landed(self, keys: Iterable[bytes]) -> list[bytes]:
        """Stores landed: the keys become READY. Returns those of them to drop (orphans
        found while they were in flight)."""
        drop = []
        for key in keys:
            h, g = self.split(key)
            node = self._nodes.get(h)
            if node is None or g not in node.held:
                continue  # a store this index did not queue (an earlier life of the key)
            node.held[g] = _READY
            self._ready.add(key)
            if key in self._recheck:
                self._recheck.discard(key)
                if not self._needed(node, g, {}):
                    drop.append(key)
        return drop

    def forget(self, keys: Iterable[bytes]) -> None:
        """Stores failed, or keys left the tier without a sweep (their prefix was already
        swept): drop them from the index."""
        for key in keys:
            h, g = self.split(key)
            self._unhold(h, g)

    def recheck(self, keys: Iterable[bytes]) -> None:
        """Re-examine these keys when they next land (orphans in flight)."""
        self._recheck.update(keys)

    def removed(self, keys: Iterable[bytes]) -> list[bytes]:
        """Keys left the CPU tier (evicted, invalidated): returns the READY orphans to drop.
        PENDING orphans are remembered and returned by ``landed`` when their store lands."""
        found: dict[bytes, None] = {}
        for key in keys:
            h, g = self.split(key)
            node = self._nodes.get(h)
            if node is None or g not in node.held:
                continue
            self._unhold(h, g, prune=False)
            for orphan in self._sweep(h, g):
                found[orphan] = None
            self._prune(h)
        self._recheck.update(key for key in found if key not in self._ready)
        return [key for key in found if key in self._ready]

    def _unhold(self, h: bytes, g: int, *, prune: bool = True) -> None:
        node = self._nodes.get(h)
        if node is None:
            return
        node.held.pop(g, None)
        key = h + self._suffix(g)
        self._ready.discard(key)
        self._recheck.discard(key)
        if prune:
            self._prune(h)

    def _prune(self, h: bytes | None) -> None:
        while h is not None:
            node = self._nodes.get(h)
            if node is None or node.held or node.children:
                return
            del self._nodes[h]
            if node.parent is not None:
                self._nodes[node.parent].children.discard(h)
            h = node.parent

    # ------------------------------------------------------------------ orphans

    def _sweep(self, h: bytes, g: int) -> list[bytes]:
        """Orphans after ``(h, g)`` left; ``(h, g)`` is already unheld."""
        memo: dict[bytes, bool] = {}
        orphans: list[bytes] = []
        reach = self._reach[g]
        if reach is None:  # a prefix block: everything at and below h is dead
            for m in self._subtree(h, None):
                orphans.extend(m + self._suffix(x) for x in self._nodes[m].held)
        else:
            for m in self._subtree(h, reach):
                node = self._nodes[m]
                orphans.extend(
                    m + self._suffix(x) for x in node.held if not self._needed(node, x, memo)
                )
        node = self._nodes[h]
        climbed, has_prefix = 0, any(self._prefix)
        while node.parent is not None:
            m, node = node.parent, self._nodes[node.parent]
            climbed += 1
            lost = [x for x in node.held if not self._needed(node, x, memo)]
            orphans.extend(m + self._suffix(x) for x in lost)
            if climbed > self._max_reach:
                # beyond every window's reach only prefix blocks can still lose their last
                # boundary; once one is needed, so are all above it (their subtrees hold it)
                holds_prefix = any(self._prefix[x] for x in node.held)
                if not has_prefix or (holds_prefix and not any(self._prefix[x] for x in lost)):
                    break
        return orphans

    def _subtree(self, h: bytes, max_depth: int | None) -> list[bytes]:
        """``h`` and its descendants at most ``max_depth`` levels below (``None``: all)."""
        out, frontier, limit = [h], [h], self._nodes[h].depth + (max_depth or 0)
        while frontier:
            nxt = []
            for m in frontier:
                for c in self._nodes[m].children:
                    if max_depth is None or self._nodes[c].depth <= limit:
                        nxt.append(c)
            out.extend(nxt)
            frontier = nxt
        return out

    def _needed(self, node: _Node, g: int, memo: dict[bytes, bool]) -> bool:
        """Whether some restorable boundary needs group ``g``'s block named by ``node``."""
        reach = self._reach[g]
        limit = None if reach is None else node.depth + reach
        frontier = [node]
        while frontier:
            nxt = []
            for m in frontier:
                if self._needs(m, g, node.depth) and self._restorable(m, memo):
                    return True
                for c in m.children:
                    child = self._nodes[c]
                    if limit is None or child.depth <= limit:
                        nxt.append(child)
            frontier = nxt
        return False

    def _needs(self, boundary: _Node, g: int, depth: int) -> bool:
        """Whether the boundary after ``boundary`` needs group ``g``'s block ending at ``depth``."""
        n_tokens = (boundary.depth + 1) * self.layout.hash_block_size
        if n_tokens % self.layout.boundary_tokens:
            return False
        block = (depth + 1) // self._per[g] - 1
        return block in self.layout.groups[g].live_blocks(n_tokens)

    def _restorable(self, node: _Node, memo: dict[bytes, bool]) -> bool:
        """Whether the boundary after ``node`` is restorable from held blocks (memoized for
        one sweep: nothing changes the holdings meanwhile)."""
        hit = memo.get(node.hash)
        if hit is None:
            hit = memo[node.hash] = self._check_restorable(node)
        return hit

    def _check_restorable(self, node: _Node) -> bool:
        layout = self.layout
        n_tokens = (node.depth + 1) * layout.hash_block_size
        if n_tokens % layout.boundary_tokens:
            return False
        chain = self._chain(node)
        for g, spec in enumerate(layout.groups):
            for j in spec.live_blocks(n_tokens):
                if g not in chain[(j + 1) * self._per[g] - 1].held:
                    return False
        return True

    def _chain(self, node: _Node) -> list[_Node]:
        """The nodes from the root to ``node``, by depth."""
        out = [node]
        while node.parent is not None:
            node = self._nodes[node.parent]
            out.append(node)
        out.reverse()
        return out
