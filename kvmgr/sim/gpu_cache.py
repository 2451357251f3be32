"""The simulated GPU tier: block pool, reference counts and the GPU prefix cache over them.

Offers:
    GPUPrefixCache  free list + refcounted blocks + key index + LRU of unreferenced cached blocks

A block is *free*, *referenced* (held by one or more running requests), *cached* (unreferenced
but still indexed by its key, evictable in LRU order) or *draining* (evicted under the
write-on-evict policy: its store to the CPU tier is in flight, so it is neither indexed nor
reusable until ``finish_drain``). An indexed block is *ready* once its KV is computed or
loaded; a request whose next prefix block is indexed but not ready waits for it instead of
computing it twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["GPUPrefixCache"]


class GPUPrefixCache:
    """Bookkeeping of ``num_blocks`` GPU blocks shared between requests by prefix key.

    Args:
        num_blocks: GPU blocks (>= 1).
        evict_clean: whether cached blocks may be reused at once when evicted (write-through:
            their contents are already in the CPU tier or not worth keeping). When False,
            ``allocate`` only takes free blocks and the caller drains cached ones first.

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int, *, evict_clean: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"expected num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.evict_clean = evict_clean
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives id 0 first
        self._refs = [0] * num_blocks
        self._keys: list[bytes | None] = [None] * num_blocks
        self._is_ready = [False] * num_blocks
        self._key_to_block: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.num_evicted = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free_ids)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks still indexed (evictable)."""
        return len(self._cached)

    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out right now."""
        return len(self._free_ids) + (len(self._cached) if self.evict_clean else 0)

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of the blocks no request references (cached, hence counted available)."""
        refs = self._refs
        return sum(1 for block in block_ids if refs[block] == 0)

    def match(self, keys: Sequence[bytes]) -> tuple[int, bool]:
        """Leading run of ``keys`` indexed and ready.

        Returns:
            ``(hits, is_blocked)``: ``is_blocked`` is True when the key after the run is indexed
            but not ready (computed or loaded by another request right now).
        """
        hits = 0
        for key in keys:
            block = self._key_to_block.get(key)
            if block is None:
                return hits, False
            if not self._is_ready[block]:
                return hits, True
            hits += 1
        return hits, False

    def block_of(self, key: bytes) -> int:
        """The block indexed under ``key`` (the caller matched it first)."""
        return self._key_to_block[key]

    def is_published(self, block: int) -> bool:
        """Whether the block is the indexed holder of its key."""
        key = self._keys[block]
        return key is not None and self._key_to_block.get(key) == block

    # ------------------------------------------------------------------ transitions

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block (taking cached ones off the LRU)."""
        for block in block_ids:
            if self._refs[block] == 0:
                self._cached.pop(block, None)
            self._refs[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` referenced, unindexed blocks: free ones first, then evicted cached ones (only
        when ``evict_clean``). ``None`` means too few were available; nothing changed."""
        if n > self.num_available():
            return None
        num_free = min(n, len(self._free_ids))
        ids = self._free_ids[len(self._free_ids) - num_free :]
        del self._free_ids[len(self._free_ids) - num_free :]
        ids.reverse()
        for _ in range(n - num_free):
            block, _ = self._cached.popitem(last=False)
            self._unindex(block)
            ids.append(block)
        self.num_evicted += n - num_free
        refs = self._refs
        for block in ids:
            refs[block] = 1
        return ids

    def publish(self, block: int, key: bytes, *, is_ready: bool) -> bool:
        """Index a referenced block under ``key``. Returns False (and indexes nothing) when
        another block already holds the key; the block then stays private."""
        if key in self._key_to_block:
            return False
        self._key_to_block[key] = block
        self._keys[block] = key
        self._is_ready[block] = is_ready
        return True

    def mark_ready(self, block_ids: Sequence[int]) -> None:
        """The blocks' KV is now computed or loaded."""
        for block in block_ids:
            self._is_ready[block] = True

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, in the given order. A block left unreferenced
        becomes cached (most recently used last) when it is indexed and ready, else free."""
        refs, keys, index = self._refs, self._keys, self._key_to_block
        for block in block_ids:
            refs[block] -= 1
            assert refs[block] >= 0, f"gpu block {block} released twice"
            if refs[block]:
                continue
            key = keys[block]
            is_published = key is not None and index.get(key) == block
            if is_published and self._is_ready[block]:
                self._cached[block] = None
                continue
            if is_published:
                self._unindex(block)
            keys[block] = None
            self._free_ids.append(block)

    def start_drain(self, n: int) -> tuple[list[int], list[bytes]]:
        """Evict up to ``n`` cached blocks (oldest first) whose contents must be stored before
        reuse: unindex them and return ``(block_ids, keys)``; ``finish_drain`` frees them."""
        ids: list[int] = []
        keys: list[bytes] = []
        while self._cached and len(ids) < n:
            block, _ = self._cached.popitem(last=False)
            key = self._keys[block]
            assert key is not None
            self._unindex(block)
            self.num_evicted += 1
            ids.append(block)
            keys.append(key)
        return ids, keys

    def finish_drain(self, block_ids: Sequence[int]) -> None:
        """The drained blocks' stores ended: put them on the free list."""
        self._free_ids.extend(block_ids)

    def _unindex(self, block: int) -> None:
        key = self._keys[block]
        if key is not None and self._key_to_block.get(key) == block:
            del self._key_to_block[key]
        self._keys[block] = None
        self._is_ready[block] = False
