"""Transfer plans: flat numpy arrays of (src address, dst address, bytes) for one batch.

Offers:
    Direction       ``D2H`` (GPU -> CPU, a store) or ``H2D`` (CPU -> GPU, a load)
    TransferPlan    one batch's descriptors plus the counts the step report needs
    BlockPairs      optional record on a plan of the block pairs and layouts it was built from
    build_plan      block id pairs + layouts -> merged descriptors, without a loop per page
    check_hazards   reject a batch that writes one destination twice

Copies inside one batch run in no order (docs/transfer.md, rule 5), so a plan may reorder its
pages freely: ``build_plan`` sorts pairs by source block and merges runs of consecutive source and
destination blocks into one descriptor per tensor (rule 6). Engines split plans above their
descriptor cap with ``TransferPlan.split``.

``build_plan`` records the block pairs, their runs and the layouts (``TransferPlan.blocks``) and
computes nothing per page: the descriptor arrays of its plans are built on first access (one numpy
broadcast per tensor group, then cached), while ``num_descriptors`` and ``num_bytes`` come from the
run count and the dense mask. An engine that copies from the blocks (the host engine's tensor
indexing, the paged copy kernel) never builds them. A plan given any descriptor array (made by
hand, edited with ``attrs.evolve``, a ``split`` chunk) is copied from its descriptors by every
engine (``matching_blocks()`` is then ``None``).
"""

from __future__ import annotations

import attrs
import numpy as np

from kvmgr.errors import GeometryError, HazardError, InvalidBlockError
from kvmgr.pool.layout import KVLayout
from kvmgr.scheduler.jobs import Direction  # the scheduler's (torch-free) name for it

__all__ = ["BlockPairs", "Direction", "TransferPlan", "build_plan", "check_hazards"]


_EMPTY = np.zeros(0, dtype=np.int64)


@attrs.frozen(eq=False)
class BlockPairs:
    """The block pairs and layouts a plan was built from (``build_plan`` fills it in).

    Attributes:
        src, dst: layouts of the source and destination tier.
        src_block_ids, dst_block_ids: int64 ``[num_blocks]``: block ``src_block_ids[i]`` of every
            tensor is copied to block ``dst_block_ids[i]`` (sorted by source block when merged).
        num_bytes, num_descriptors: what the plan's descriptors add up to; an engine uses the
            pairs only while the plan still says the same.
        run_src_ids, run_dst_ids, run_lengths: int64 ``[num_runs]``: the same pairs as runs,
            blocks ``run_src_ids[r] + k -> run_dst_ids[r] + k`` for ``k < run_lengths[r]`` (one
            run per pair when not merged); a dense tensor's run is one descriptor.
    """

    src: KVLayout
    dst: KVLayout
    src_block_ids: np.ndarray
    dst_block_ids: np.ndarray
    num_bytes: int
    num_descriptors: int
    run_src_ids: np.ndarray
    run_dst_ids: np.ndarray
    run_lengths: np.ndarray

    @property
    def num_runs(self) -> int:
        """Runs of consecutive blocks (on both sides)."""
        return len(self.run_lengths)

    def descriptors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """int64 ``[num_descriptors]`` source addresses, destination addresses and bytes,
        tensor-major: one descriptor per run in tensors dense on both sides, listed first (unless
        every tensor is), then one per page elsewhere."""
        src, dst = self.src, self.dst
        merged = self.run_lengths if self.num_runs < len(self.src_block_ids) else None
        dense = src.is_dense & dst.is_dense
        run_s, run_d = self.run_src_ids, self.run_dst_ids
        if dense.all():  # the common case: every tensor dense, one descriptor per run
            return _descriptors(src, dst, None, run_s, run_d, merged)
        parts = []
        if dense.any():  # one descriptor per run in dense tensors
            parts.append(_descriptors(src, dst, dense, run_s, run_d, merged))
        # one descriptor per page elsewhere
        parts.append(_descriptors(src, dst, ~dense, self.src_block_ids, self.dst_block_ids, None))
        if len(parts) == 1:
            return parts[0]
        srcs, dsts, sizes = (np.concatenate(p) for p in zip(*parts))
        return srcs, dsts, sizes


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
    _built: tuple[np.ndarray, np.ndarray, np.ndarray] | None = attrs.field(
        default=None, init=False, repr=False
    )

    @property
    def src_addrs(self) -> np.ndarray:
        """int64 ``[num_descriptors]``: source addresses."""
        return self._src_addrs if self._src_addrs is not None else self._from_blocks()[0]

    @property
    def dst_addrs(self) -> np.ndarray:
        """int64 ``[num_descriptors]``: destination addresses."""
        return self._dst_addrs if self._dst_addrs is not None else self._from_blocks()[1]

    @property
    def sizes(self) -> np.ndarray:
        """int64 ``[num_descriptors]``: bytes of each copy."""
        return self._sizes if self._sizes is not None else self._from_blocks()[2]

    @property
    def is_from_blocks(self) -> bool:
        """Whether every descriptor array is (to be) computed from ``blocks``: a plan from
        ``build_plan``, not edited; it never needs its descriptors checked."""
        given = (self._src_addrs, self._dst_addrs, self._sizes)
        return self.blocks is not None and all(a is None for a in given)

    def _from_blocks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        built = self._built
        if built is None:
            built = (_EMPTY, _EMPTY, _EMPTY) if self.blocks is None else self.blocks.descriptors()
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


def check_hazards(dst_block_ids: np.ndarray) -> None:
    """Reject a batch that writes one destination block twice (docs/transfer.md, rule 5).

    A batch always reads one tier and writes the other, so a read and a write of one block cannot
    share a batch; the manager orders batches that touch a block both ways.

    Raises:
        HazardError: a destination block id occurs more than once (the first one is named).
    """
    ids = np.asarray(dst_block_ids, dtype=np.int64)
    if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):  # strictly increasing: no repeat
        return
    ordered = np.sort(ids)
    repeats = ordered[1:] == ordered[:-1]
    if repeats.any():
        raise HazardError(
            f"destination block {int(ordered[1:][repeats][0])} is written twice in one batch"
        )


def _int_ids(name: str, ids: object) -> np.ndarray:
    array = np.asarray(ids).reshape(-1)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidBlockError(f"{name} block ids: expected integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _check_ids(name: str, ids: np.ndarray, num_blocks: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
        raise InvalidBlockError(f"{name} block id {bad} out of range [0, {num_blocks})")


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
    if src.num_tensors != dst.num_tensors or not np.array_equal(src.page_bytes, dst.page_bytes):
        raise GeometryError(
            f"expected equal page bytes per tensor, got {src.page_bytes.tolist()} and "
            f"{dst.page_bytes.tolist()}"
        )
    s, d = _int_ids("source", src_block_ids), _int_ids("destination", dst_block_ids)
    if len(s) != len(d):
        raise InvalidBlockError(
            f"expected as many destination as source blocks, got {len(d)} and {len(s)}"
        )
    _check_ids("source", s, src.num_blocks)
    _check_ids("destination", d, dst.num_blocks)
    check_hazards(d)
    n = len(s)
    if n == 0:
        return TransferPlan(direction)
    run_s, run_d, lengths = s, d, np.ones(n, dtype=np.int64)  # one run per pair unless merged
    if merge and n > 1:
        step_s = s[1:] - s[:-1]
        if not bool((step_s >= 0).all()):  # sort by source block unless already sorted
            order = np.argsort(s, kind="stable")
            s, d = s[order], d[order]
            step_s = s[1:] - s[:-1]
        breaks = (step_s != 1) | (d[1:] - d[:-1] != 1)
        if not breaks.any():  # one run: the common case of consecutive ids
            lengths = np.array([n], dtype=np.int64)
            run_s, run_d = s[:1], d[:1]
        elif breaks.all():  # no run: the common case of scattered ids
            run_s, run_d = s, d
        else:
            starts = np.flatnonzero(breaks)
            starts += 1
            bounds = np.concatenate(((0,), starts, (n,)))
            lengths = bounds[1:] - bounds[:-1]
            run_s, run_d = s[bounds[:-1]], d[bounds[:-1]]
    num_dense = int(np.count_nonzero(src.is_dense & dst.is_dense))
    num_descriptors = len(lengths) * num_dense + n * (src.num_tensors - num_dense)
    pairs = BlockPairs(src, dst, s, d, n * src.block_bytes, num_descriptors, run_s, run_d, lengths)
    return TransferPlan(direction, num_blocks=n, num_pages=n * src.num_tensors, blocks=pairs)


def _descriptors(
    src: KVLayout,
    dst: KVLayout,
    tensors: np.ndarray | None,
    s: np.ndarray,
    d: np.ndarray,
    runs: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tensor-major descriptors of the given tensors (``None``: all) for blocks ``s -> d``, each
    ``runs[i]`` pages long (``None``: one page each)."""
    pick = slice(None) if tensors is None else tensors
    src_addrs = np.multiply.outer(src.block_strides[pick], s)
    src_addrs += src.base_addrs[pick, None]
    dst_addrs = np.multiply.outer(dst.block_strides[pick], d)
    dst_addrs += dst.base_addrs[pick, None]
    if runs is None:
        sizes = np.repeat(src.page_bytes[pick], len(s))
    else:
        sizes = np.multiply.outer(src.page_bytes[pick], runs).reshape(-1)
    return src_addrs.reshape(-1), dst_addrs.reshape(-1), sizes
