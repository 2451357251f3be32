"""The CPU tier's reader counts: loads in flight per CPU block (issue 27: split from
``cpu_tier``).

Private to ``kvmgr.scheduler``; ``CpuTier`` inherits ``ReaderCounts``. A READY block with
readers is not evictable; ``num_loading`` counts such blocks.
"""

from __future__ import annotations

import array

import numpy as np

from kvmgr.pool.block_ids import sorted_distinct

__all__ = ["ReaderCounts"]


class ReaderCounts:
    """``add_readers`` / ``remove_readers`` over the tier's ``readers`` buffer (``readers_np``
    its int64 view) and ``num_loading`` (blocks with readers), which the tier sets up."""

    readers: array.array[int]
    readers_np: np.ndarray
    num_loading: int

    def add_readers(self, ids: list[int] | np.ndarray) -> None:
        """Loads of these READY blocks were queued (one reader per occurrence)."""
        readers = self.readers
        if isinstance(ids, list):
            for b in ids:
                if readers[b] == 0:
                    self.num_loading += 1
                readers[b] += 1
        else:
            distinct = sorted_distinct(ids)
            self.num_loading += int(np.count_nonzero(self.readers_np[distinct] == 0))
            if len(distinct) == len(ids):
                self.readers_np[ids] += 1
            else:
                np.add.at(self.readers_np, ids, 1)

    def remove_readers(self, ids: np.ndarray) -> None:
        """Loads of these blocks ended (successfully or not)."""
        if len(ids) == 1:
            b = int(ids[0])
            self.readers[b] -= 1
            self.num_loading -= self.readers[b] == 0
            return
        distinct = sorted_distinct(ids)
        if len(distinct) == len(ids):
            self.readers_np[ids] -= 1
        else:
            np.subtract.at(self.readers_np, ids, 1)
        self.num_loading -= int(np.count_nonzero(self.readers_np[distinct] == 0))
