"""The parent of every key in the CPU tier, to refuse stores that would close a key cycle.

Private to ``kvmgr.scheduler``. A store names the key each new key extends (its parent). The
keys of the CPU tier must form a forest: a cycle (``a`` extends ``b`` and ``b`` extends
``a``, in one call or across calls) has no leaf, so no policy would ever evict it and the tier
would fill up for good (issue 20). ``KeyChains.check`` finds such a cycle before the store
changes anything (its walks: ``_key_cycles``).

Kept per CPU block, not per key (issue 27): the block of each key's parent when that parent is
in the tier, and the number of indexed children of each block's key, so a store of one chain
(or of roots) and an eviction are array operations over block ids, no dict operation per key.
A parent key is held only where no block names it: for a key whose parent is not in the tier
(``loose``: stored before its parent, or left by an invalidated, failed or evicted parent); the
policy holds every key's parent anyway. Those indexed children of keys not in the tier are also
listed by parent key (``orphans``).

Cost: a store whose new keys have no indexed children (every store that writes a prefix
parent-first) walks only its own keys, O(len(keys)); only a new key that already has indexed
children (its parent was invalidated or failed, or children were stored before it) walks up
the indexed ancestors too.
"""

from __future__ import annotations

import array
from collections import deque
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np

from kvmgr.scheduler._key_cycles import chain_with_gaps, walk_chains

__all__ = ["KeyChains"]


class KeyChains:
    """Parent block and indexed-children count of every key in the CPU tier's index, by block.

    Args:
        num_blocks: CPU blocks.
        index: the tier's key -> block dict (never rebound; read, not changed here).

    Attributes:
        orphans: ``key -> blocks of its indexed children`` for keys not in the index.
        loose: ``block -> parent key`` of the indexed keys whose parent is not in the index
            (the same links as ``orphans``, by child).
        num_parents: keys (indexed or not) with at least one indexed child.
    """

    __slots__ = ("_index", "_kids", "_kids_np", "_scratch", "_up_block", "_up_np", "loose",
                 "num_parents", "orphans")  # fmt: skip

    def __init__(self, num_blocks: int, index: dict[bytes, int]) -> None:
        self._index = index
        self._up_block = array.array("q", [-1]) * num_blocks  # parent's block when indexed, else -1
        self._up_np = np.frombuffer(self._up_block, dtype=np.int64)
        self._kids = array.array("q", [0]) * num_blocks  # indexed children of each block's key
        self._kids_np = np.frombuffer(self._kids, dtype=np.int64)
        self._scratch = np.zeros(num_blocks, dtype=np.int64)  # for _num_distinct
        self.orphans: dict[bytes, list[int]] = {}
        self.loose: dict[int, bytes] = {}
        self.num_parents = 0

    @property
    def up_block(self) -> array.array[int]:
        """The parent's block of every block's key, ``-1`` where the parent is not indexed
        (read it; do not change it)."""
        return self._up_block

    @property
    def parent(self) -> dict[bytes, bytes | None]:
        """``key -> parent`` of every indexed key (a new dict; for snapshots)."""
        key_of = {block: key for key, block in self._index.items()}
        up, loose = self._up_block, self.loose
        return {
            key: key_of[up[block]] if up[block] >= 0 else loose.get(block)
            for key, block in self._index.items()
        }

    def check(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Refuse new keys (none indexed yet) whose parent chain would reach the key itself.

        Raises:
            InvalidKeyError: a cycle; nothing changed.
        """
        # the old graph is a forest: a new cycle passes through a new key with an indexed
        # child (an orphan parent: new keys are not indexed); else walks stay in the call
        orphans = self.orphans
        deep = bool(orphans) and not orphans.keys().isdisjoint(keys)
        if not deep and (len(keys) == 1 or (parents[1:] == keys[:-1] and parents[0] not in keys)):
            return  # one key, or one chain hanging below a key outside the call
        if not deep and chain_with_gaps(keys, parents):
            return
        walk_chains(keys, parents, self._index, self._up_block, self.loose, deep)

    def add(
        self,
        keys: Sequence[bytes],
        ids: list[int],
        parents: Sequence[bytes | None] | None,
        at: np.ndarray | None = None,
        run: slice | None = None,
    ) -> None:
        """Record keys just indexed on blocks ``ids`` (a list; checked by ``check``);
        ``parents`` ``None``: the default chain (``keys[i]`` extends ``keys[i - 1]``,
        ``keys[0]`` a root); ``at``: the same ids as an int64 array, when the caller has one
        (``run``: they are ``arange(run.start, run.stop)``: slices, not gathers)."""
        adopted = self._adopt(keys, ids)
        n = len(keys)
        if parents is None or (n > 1 and parents[1:] == keys[:-1]):  # one chain
            if n > 1:  # keys[i] extends keys[i - 1]
                if at is None:
                    at = np.array(ids, dtype=np.int64)
                inner: Any = at[:-1]
                if run is None:
                    self._up_np[at[1:]] = inner
                else:
                    self._up_np[run.start + 1 : run.stop] = inner
                    inner = slice(run.start, run.stop - 1)
                if adopted or parents is not None:
                    self.num_parents += int(np.count_nonzero(self._kids_np[inner] == 0))
                    self._kids_np[inner] += 1
                else:  # a block enters the index without children (``remove`` leaves every
                    self.num_parents += n - 1  # block it frees at 0), adopted none here
                    self._kids_np[inner] = 1
            if parents is not None and n:
                self._link(ids[0], parents[0])
        elif parents.count(None) < n:
            for block, up in zip(ids, parents):
                self._link(block, up)

    def _adopt(self, keys: Sequence[bytes], ids: list[int]) -> bool:
        """Give the orphans waiting for any of ``keys`` (children stored before them) their
        parent's block; whether any were."""
        orphans = self.orphans
        if not orphans or orphans.keys().isdisjoint(keys):
            return False
        loose = self.loose
        for key, block in zip(keys, ids):
            children = orphans.pop(key, None)
            if children is not None:  # still a parent: num_parents unchanged
                self._up_np[children] = block
                self._kids[block] = len(children)
                deque(map(loose.__delitem__, children), 0)
        return True

    def _link(self, block: int, up: bytes | None) -> None:
        """The key on ``block`` extends ``up`` (``None``: a root)."""
        if up is None:
            return
        parent = self._index.get(up)
        if parent is None:
            self.loose[block] = up
            children = self.orphans.get(up)
            if children is None:
                self.orphans[up] = [block]
                self.num_parents += 1
            else:
                children.append(block)
            return
        self._up_block[block] = parent
        if self._kids[parent] == 0:
            self.num_parents += 1
        self._kids[parent] += 1

    def remove(self, keys: Sequence[bytes], ids: list[int] | np.ndarray) -> None:
        """Forget keys that left the index (evicted, invalidated, failed), on blocks ``ids``."""
        at = np.asarray(ids, dtype=np.int64)
        up_np, kids_np = self._up_np, self._kids_np
        parents = up_np[at]
        if len(at) > 2 and (parents[:-1] == at[1:]).all():
            self._remove_chain(at, int(parents[-1]))
        else:
            self._remove_links(at, parents)
        up_np[at] = -1
        staying = np.flatnonzero(kids_np[at])
        for i in staying.tolist():  # children stay: they become orphans of the key
            block, key = int(at[i]), keys[i]
            children = np.flatnonzero(up_np == block).tolist()
            up_np[children] = -1
            self.orphans[key] = children
            self.loose.update(zip(children, repeat(key)))
            kids_np[block] = 0

    def remove_run(self, at: np.ndarray) -> None:
        """``remove`` of keys on blocks ``at`` (int64, more than one) that form one chain, its
        leaf first, each block's only indexed child the one before it (``BlockLru``'s
        ``victim_chain``): the same counts, none read but the last block's parent."""
        n, last = len(at), int(self._up_block[int(at[-1])])
        self._kids_np[at[1:]] = 0  # each had one child, the block before it: gone too
        self._up_np[at] = -1
        gone = n - 1
        if last >= 0:  # (a forest: not in the run)
            self._kids[last] -= 1
            gone += self._kids[last] == 0
        self.num_parents -= gone
        if last < 0 and self.loose:  # the parent is not in the tier (roots have none)
            self._orphan_links([int(at[-1])])

    def remove_isolated(self, at: np.ndarray) -> None:
        """``remove`` of keys on blocks ``at`` (int64) without an indexed parent or child
        (``BlockLru``'s ``victim_isolated``: per-call roots): no count changes, only the
        links of keys whose parent is not indexed go."""
        if self.loose:
            self._orphan_links(at.tolist())

    def _remove_links(self, at: np.ndarray, parents: np.ndarray) -> None:
        """``remove``'s child counts for any blocks ``at`` whose parent blocks are ``parents``
        (``-1``: a root or a loose key)."""
        kids_np = self._kids_np
        linked = parents >= 0
        if linked.any():  # parents in the tier lose a child each
            parents = parents[linked]
            np.subtract.at(kids_np, parents, 1)
            self.num_parents -= self._num_distinct(parents[kids_np[parents] == 0])
        if self.loose and not linked.all():  # parents not in the tier (roots have none)
            self._orphan_links(at[~linked].tolist())

    def _remove_chain(self, at: np.ndarray, last: int) -> None:
        """``remove``'s child counts when the key on ``at[i]`` extends the one on ``at[i + 1]``
        (an evicted run of one chain, its leaf first), the last one's parent block ``last``
        (``-1``: a root or a loose key): the same counts without ``ufunc.at`` (``at[1:]`` are
        distinct) or a distinct count."""
        kids_np, inner = self._kids_np, at[1:]
        kids_np[inner] -= 1
        if last >= 0:
            kids_np[last] -= 1
        gone = int(np.count_nonzero(kids_np[inner] == 0))
        if last >= 0 and kids_np[last] == 0 and not (inner == last).any():  # (in: a cycle)
            gone += 1
        self.num_parents -= gone
        if last < 0 and self.loose:  # the parent is not in the tier (roots have none)
            self._orphan_links([int(at[-1])])

    def _num_distinct(self, blocks: np.ndarray) -> int:
        """How many distinct ids ``blocks`` holds, without a sort: each id's position is
        written into a scratch array, and one position per distinct id survives."""
        if len(blocks) < 2:
            return len(blocks)
        positions = np.arange(len(blocks), dtype=np.int64)
        scratch = self._scratch
        scratch[blocks] = positions
        return int(np.count_nonzero(scratch[blocks] == positions))

    def _orphan_links(self, blocks: Any) -> None:
        """Keys on ``blocks`` whose parent is not indexed leave: unlist them."""
        loose, orphans = self.loose, self.orphans
        for block in blocks:
            parent = loose.pop(block, None)
            if parent is not None:
                children = orphans[parent]
                children.remove(block)
                if not children:
                    del orphans[parent]
                    self.num_parents -= 1
