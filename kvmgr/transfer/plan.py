"""Transfer plans: flat numpy arrays of (src address, dst address, bytes) for one batch.

Offers:
    Direction       ``D2H`` (GPU -> CPU, a store) or ``H2D`` (CPU -> GPU, a load)
    TransferPlan    one batch's descriptors plus the counts the step report needs
    BlockPairs      optional record on a plan of the block pairs and layouts it was built from
                    (defined in ``kvmgr.transfer.block_pairs``)
    build_plan      block id pairs + layouts -> merged descriptors, without a loop per page
    check_hazards   reject a batch that writes one destination twice

Copies inside one batch run in no order (docs/transfer.md, rule 5), so a plan may reorder its
pages freely: ``build_plan`` sorts pairs by source block and merges runs of consecutive source and
destination blocks into one descriptor per tensor (rule 6). Engines split plans above their
descriptor cap with ``TransferPlan.split``.

``build_plan`` records the block pairs, their runs and the layouts (``TransferPlan.blocks``) and
computes nothing per page: the descriptors of its plans are one int64 ``[3, n]`` table built on
first access (``scale * (source block, destination block, run length) + base`` for every tensor in
one broadcast, then cached), while ``num_descriptors`` and ``num_bytes`` come from the run count
and the layout pair's dense tensors. An engine that copies from the blocks (the host engine's
tensor indexing, the paged copy kernel) never builds them; the DMA issuer builds them into its own
pooled buffer (``BlockPairs.descriptor_table(out=...)``). A plan given any descriptor array (made
by hand, edited with ``attrs.evolve``, a ``split`` chunk) is copied from its descriptors by every
engine (``matching_blocks()`` is then ``None``).

Host cost: a serving loop builds a plan per step with cold caches, where each numpy call costs
microseconds; the arithmetic (``kvmgr.transfer._runs``, ``_pairs``) uses as few as it can: the layout pair's
checks and stacked arrays are cached per pair of layouts, consecutive ids are one byte comparison.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvmgr._direction import Direction  # the scheduler's (torch-free) name for it too
from kvmgr.errors import InvalidBlockError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer._pairs import layout_pair
from kvmgr.transfer._plan_c import fill_run
from kvmgr.transfer._runs import check_hazards, find_runs, int_ids
from kvmgr.transfer.block_pairs import BlockPairs

__all__ = ["BlockPairs", "Direction", "TransferPlan", "build_plan", "check_hazards", "prepare"]


_NO_DESCRIPTORS = np.zeros((3, 0), dtype=np.int64)


@attrs.frozen(eq=False)
class TransferPlan:
    """The descriptors of one batch in one direction.

    The three descriptor arrays are init arguments (``src_addrs=``, ...) and read-only
    attributes. One left ``None`` (the default) is computed from ``blocks`` on first access and
    cached (empty without ``blocks``): ``build_plan`` gives none, so its plans build descriptors
    only for an engine that reads them.

    Attributes:
        direction: D2H or H2D.
        src_addrs: int64 ``[num_descriptors]``: source addresses.
        dst_addrs: int64 ``[num_descriptors]``: destination addresses.
        sizes: int64 ``[num_descriptors]``: bytes of each copy.
        num_blocks: block pairs in the batch (before multiplying by tensors).
        num_pages: pages (block pairs x tensors), i.e. descriptors before merging.
        blocks: the block pairs and layouts behind the descriptors, or ``None`` (hand-made plans,
            split chunks).
    """

    direction: Direction
    _src_addrs: np.ndarray | None = attrs.field(default=None, alias="src_addrs")
    _dst_addrs: np.ndarray | None = attrs.field(default=None, alias="dst_addrs")
    _sizes: np.ndarray | None = attrs.field(default=None, alias="sizes")
    num_blocks: int = 0
    num_pages: int = 0
    blocks: BlockPairs | None = None
    # (table, its three rows), built once from ``blocks``
    _built: tuple[np.ndarray, ...] | None = attrs.field(default=None, init=False, repr=False)

    @property
    def src_addrs(self) -> np.ndarray:
        """int64 ``[num_descriptors]``: source addresses."""
        return self._src_addrs if self._src_addrs is not None else self._from_blocks()[1]

    @property
    def dst_addrs(self) -> np.ndarray:
        """int64 ``[num_descriptors]``: destination addresses."""
        return self._dst_addrs if self._dst_addrs is not None else self._from_blocks()[2]

    @property
    def sizes(self) -> np.ndarray:
        """int64 ``[num_descriptors]``: bytes of each copy."""
        return self._sizes if self._sizes is not None else self._from_blocks()[3]

    @property
    def is_from_blocks(self) -> bool:
        """Whether every descriptor array is (to be) computed from ``blocks``: a plan from
        ``build_plan``, not edited; it never needs its descriptors checked."""
        return (
            self.blocks is not None
            and self._src_addrs is None
            and self._dst_addrs is None
            and self._sizes is None
        )

    def descriptor_table(self) -> np.ndarray:
        """int64 ``[3, num_descriptors]``, C-contiguous: ``src_addrs``, ``dst_addrs`` and
        ``sizes`` as the rows of one array (what a driver reads through one pointer). A plan from
        ``build_plan`` builds it once and keeps it (the three attributes are its rows); any other
        plan gets a new copy per call."""
        if self._src_addrs is None and self._dst_addrs is None and self._sizes is None:
            return self._from_blocks()[0]
        return np.array((self.src_addrs, self.dst_addrs, self.sizes), dtype=np.int64)

    def _from_blocks(self) -> tuple[np.ndarray, ...]:
        built = self._built
        if built is None:
            table = _NO_DESCRIPTORS if self.blocks is None else self.blocks.descriptor_table()
            built = (table, table[0], table[1], table[2])
            object.__setattr__(self, "_built", built)  # a cache: the plan stays the same value
        return built

    def matching_blocks(self) -> BlockPairs | None:
        """``blocks`` for a plan from ``build_plan`` that was not edited (its descriptors are
        exactly the pairs'), else ``None``: a plan given any descriptor array (by hand,
        ``attrs.evolve``, ``split``) is copied from those arrays, even where its byte and
        descriptor counts still match ``blocks``. O(1)."""
        return self.blocks if self.is_from_blocks else None

    @property
    def num_descriptors(self) -> int:
        """Descriptors after merging (without building them for a plan from ``build_plan``)."""
        if self._sizes is None:
            return 0 if self.blocks is None else self.blocks.num_descriptors
        return len(self._sizes)

    @property
    def num_bytes(self) -> int:
        """Bytes the batch moves (without building descriptors for a plan from ``build_plan``)."""
        if self._sizes is None:
            return 0 if self.blocks is None else self.blocks.num_bytes
        return int(self._sizes.sum())

    def split(self, max_descriptors: int) -> list[TransferPlan]:
        """Cut the plan into consecutive chunks of at most ``max_descriptors`` descriptors.

        Block and page counts are attributed to the first chunk so sums stay exact.

        Raises:
            ValueError: ``max_descriptors < 1``.
        """
        if max_descriptors < 1:
            raise ValueError(f"expected max_descriptors >= 1, got {max_descriptors}")
        if self.num_descriptors <= max_descriptors:
            return [self]
        cuts = range(0, self.num_descriptors, max_descriptors)
        return [
            TransferPlan(
                self.direction,
                self.src_addrs[c : c + max_descriptors],
                self.dst_addrs[c : c + max_descriptors],
                self.sizes[c : c + max_descriptors],
                num_blocks=self.num_blocks if c == 0 else 0,
                num_pages=self.num_pages if c == 0 else 0,
            )
            for c in cuts
        ]


def build_plan(
    direction: Direction,
    src: KVLayout,
    dst: KVLayout,
    src_block_ids: np.ndarray,
    dst_block_ids: np.ndarray,
    *,
    merge: bool = True,
) -> TransferPlan:
    """Build the descriptors that copy block ``src_block_ids[i]`` to ``dst_block_ids[i]``.

    Every tensor's page of each block is copied. With ``merge``, pairs are sorted by source block
    and each run of consecutive source and destination blocks becomes one descriptor per tensor,
    for tensors that are dense on both sides (block stride == page bytes). The work is O(pairs),
    never O(pages): the descriptors are computed when first read (``TransferPlan``).

    Args:
        direction: recorded on the plan; the engine uses it to pick streams and ordering.
        src, dst: layouts of the source and destination tier, with equal page bytes per tensor.
        src_block_ids, dst_block_ids: int ``[n]`` block ids, same length.
        merge: merge adjacent pages (docs/transfer.md, rule 6).

    Returns:
        A plan with ``n * num_tensors`` pages and at most as many descriptors, tensor-major.

    Raises:
        GeometryError: the layouts differ in tensor count or page bytes.
        InvalidBlockError: lengths differ or an id is out of range.
        HazardError: a destination block repeats.
    """
    pair = layout_pair(src, dst)
    s, d = int_ids("source", src_block_ids), int_ids("destination", dst_block_ids)
    n = len(s)
    if len(d) != n:
        raise InvalidBlockError(
            f"expected as many destination as source blocks, got {len(d)} and {n}"
        )
    if n == 0:
        return TransferPlan(direction)
    runs = find_runs(s, d, src.num_blocks, dst.num_blocks, merge)
    num_descriptors = pair.num_descriptors(n, len(runs.run_src))
    pairs = BlockPairs(src, dst, n * pair.block_bytes, num_descriptors, runs, pair)
    return TransferPlan(
        direction, None, None, None, n, n * pair.num_tensors, pairs
    )  # (positional: cheaper)


def prepare() -> None:
    """Build ``build_plan``'s C helpers now, not in a first step (a no-op where they cannot)."""
    fill_run()
