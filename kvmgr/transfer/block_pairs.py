"""The block pairs and layouts a transfer plan was built from (``kvmgr.transfer.plan``).

Offers:
    BlockPairs      what ``build_plan`` records on a plan: the pairs as runs, the layout pair,
                    the byte and descriptor counts, and the descriptor table built from them

``kvmgr.transfer.plan`` re-exports ``BlockPairs``; engines that copy from the blocks (the host
engine, the paged copy kernel) read the runs, the DMA issuer builds the descriptor table into its
own buffer (``descriptor_table(out=...)``).
"""

from __future__ import annotations

import attrs
import numpy as np

from kvmgr.pool.layout import KVLayout
from kvmgr.transfer._pairs import LayoutPair
from kvmgr.transfer._runs import Runs

__all__ = ["BlockPairs"]


@attrs.define(eq=False)
class BlockPairs:
    """The block pairs and layouts a plan was built from (``build_plan`` fills it in).

    Not frozen (a frozen attrs ``__init__`` costs ~3x on the step's path): read-only by use.

    Attributes:
        src, dst: layouts of the source and destination tier.
        src_block_ids, dst_block_ids: int64 ``[num_blocks]``: block ``src_block_ids[i]`` of every
            tensor is copied to block ``dst_block_ids[i]`` (sorted by source block when merged).
        num_bytes, num_descriptors: what the plan's descriptors add up to; an engine uses the
            pairs only while the plan still says the same.
        run_src_ids, run_dst_ids, run_lengths: int64 ``[num_runs]``: the same pairs as runs,
            blocks ``run_src_ids[r] + k -> run_dst_ids[r] + k`` for ``k < run_lengths[r]`` (one
            run per pair when not merged); a dense tensor's run is one descriptor.
        max_run: the longest run, in blocks (1 when no pairs merged).
    """

    src: KVLayout
    dst: KVLayout
    num_bytes: int
    num_descriptors: int
    _runs: Runs = attrs.field(alias="runs", repr=False)
    _pair: LayoutPair = attrs.field(alias="pair", repr=False)

    @property
    def runs(self) -> Runs:
        """The pairs as runs (``kvmgr.transfer._runs.Runs``), to slice a plan by tensors."""
        return self._runs

    @property
    def src_block_ids(self) -> np.ndarray:
        """int64 ``[num_blocks]``: source block of each pair, in copy order."""
        return self._runs.src_ids

    @property
    def dst_block_ids(self) -> np.ndarray:
        """int64 ``[num_blocks]``: destination block of each pair, in copy order."""
        return self._runs.dst_ids

    @property
    def run_src_ids(self) -> np.ndarray:
        """int64 ``[num_runs]``: first source block of each run."""
        return self._runs.run_src

    @property
    def run_dst_ids(self) -> np.ndarray:
        """int64 ``[num_runs]``: first destination block of each run."""
        return self._runs.run_dst

    @property
    def run_lengths(self) -> np.ndarray:
        """int64 ``[num_runs]``: blocks of each run (a new array of ones when none merged)."""
        lengths = self._runs.lengths
        return np.ones(self.num_runs, dtype=np.int64) if lengths is None else lengths

    @property
    def run_lengths_or_none(self) -> np.ndarray | None:
        """``run_lengths``, or ``None`` when every run is one block (nothing is built)."""
        return self._runs.lengths

    @property
    def max_run(self) -> int:
        """The longest run, in blocks."""
        return self._runs.max_run

    @property
    def num_runs(self) -> int:
        """Runs of consecutive blocks (on both sides)."""
        return len(self._runs.run_src)

    def descriptor_table(self, out: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[3, num_descriptors]``: source addresses, destination addresses and bytes,
        tensor-major: one descriptor per run in tensors dense on both sides, listed first (unless
        every tensor is), then one per page elsewhere. Written into ``out`` (C-contiguous, that
        shape) if given, else into a new C-contiguous array."""
        return self._pair.descriptors(self._runs, out)

    def descriptors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows of ``descriptor_table()``: int64 ``[num_descriptors]`` each."""
        table = self.descriptor_table()
        return table[0], table[1], table[2]
