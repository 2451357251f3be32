"""Layers of a KV cache, and the groups a layerwise load or store copies them in.

Offers:
    LayerGroups     which KV tensors make up each layer, and layers merged into groups by size
    sub_layout      a ``KVLayout`` of some of a layout's tensors
    group_plan      a checked whole-load plan's block pairs over one group's sub-layouts

Pure numpy; used by ``kvmgr.transfer.layerwise`` and the manager's layerwise operations.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import numpy as np

from kvmgr.errors import LayerOrderError
from kvmgr.pool.layout import KVLayout
from kvmgr.transfer._pairs import layout_pair
from kvmgr.transfer.plan import BlockPairs, Direction, TransferPlan

__all__ = ["LayerGroups", "dense_tensors", "group_plan", "sub_layout"]


@attrs.frozen(eq=False)
class LayerGroups:
    """Layers of a KV cache and the groups they are copied in.

    Attributes:
        layer_of: int64 ``[num_tensors]``: the layer of each KV tensor (non-decreasing from 0,
            no gaps: ``[0, 0, 1, 1, ...]`` for one K and one V tensor per layer).
        group_of: int64 ``[num_layers]``: the group of each layer.
        tensors: per group, the int64 indices of its tensors.
        group_bytes: per group, its bytes per block.
        layer_group: ``group_of`` as a tuple of ints (read per ``wait_layer`` / ``save_layer``).
        group_last: per group, its highest layer.
    """

    layer_of: np.ndarray
    group_of: np.ndarray
    tensors: tuple[np.ndarray, ...]
    group_bytes: tuple[int, ...]
    layer_group: tuple[int, ...] = attrs.field(init=False)
    group_last: tuple[int, ...] = attrs.field(init=False)

    @layer_group.default
    def _layer_group(self) -> tuple[int, ...]:
        return tuple(self.group_of.tolist())

    @group_last.default
    def _group_last(self) -> tuple[int, ...]:
        last = [0] * len(self.tensors)
        for layer, group in enumerate(self.layer_group):
            last[group] = layer
        return tuple(last)

    @property
    def num_layers(self) -> int:
        """Layers covered."""
        return len(self.group_of)

    @property
    def num_groups(self) -> int:
        """Batches a load or store is split into."""
        return len(self.tensors)

    def last_layer(self, group: int) -> int:
        """The highest layer of ``group``."""
        return self.group_last[group]

    @classmethod
    def build(
        cls,
        page_bytes: Sequence[int],
        layers: Sequence[int] | int | None,
        min_group_bytes: int = 0,
        max_groups: int | None = None,
    ) -> LayerGroups:
        """Map tensors to layers and merge adjacent layers until a group holds at least
        ``min_group_bytes`` per block (the last group may hold less).

        Args:
            page_bytes: bytes per block of each KV tensor.
            layers: one layer index per tensor; an int ``k``: ``k`` consecutive tensors per layer;
                ``None``: one tensor per layer.
            min_group_bytes: bytes per block below which a layer joins the next one (``0``: one
                group per layer). A small layer's batch costs about as much host and launch time
                as a large one's, so tiny layers are better copied together.
            max_groups: at most this many groups: ``min_group_bytes`` is raised to
                ``ceil(block bytes / max_groups)`` (each submitted batch costs ~100-200 us of
                host time on the H200 host: 32 layers in 8 groups save ~3-5 ms per load).

        Raises:
            LayerOrderError: ``layers`` is not ``None``, an int ``k >= 1`` dividing the tensors
                or a sequence of ints (one per tensor, non-decreasing from 0 with no gaps);
                ``min_group_bytes`` is not an int ``>= 0`` or ``max_groups`` an int ``>= 1``.
        """
        layer_of = _layer_of(layers, len(page_bytes))
        _check_int("max_groups", max_groups, 1, allow_none=True)
        _check_int("min_group_bytes", min_group_bytes, 0)
        if max_groups is not None:
            total = int(sum(page_bytes))
            min_group_bytes = max(min_group_bytes, -(-total // max_groups))
        layer_bytes = np.bincount(layer_of, weights=np.asarray(page_bytes, dtype=np.float64))
        group_of = _merge_layers(layer_bytes, min_group_bytes)
        tensor_group = group_of[layer_of]
        tensors = tuple(np.flatnonzero(tensor_group == g) for g in range(int(group_of[-1]) + 1))
        sizes = np.asarray(page_bytes, dtype=np.int64)
        return cls(layer_of, group_of, tensors, tuple(int(sizes[t].sum()) for t in tensors))


def _merge_layers(layer_bytes: np.ndarray, min_group_bytes: int) -> np.ndarray:
    """int64 ``[num_layers]``: the group of each layer, adjacent layers merged until a group
    holds at least ``min_group_bytes`` (``layer_bytes``: bytes per block of each layer)."""
    group_of = np.zeros(len(layer_bytes), dtype=np.int64)
    group, filled = 0, 0.0
    for layer in range(len(layer_bytes)):
        if filled >= min_group_bytes and layer > 0 and filled > 0:
            group, filled = group + 1, 0.0
        group_of[layer] = group
        filled += layer_bytes[layer]
    return group_of


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _check_int(name: str, value: object, low: int, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < low:  # type: ignore[operator]
        raise LayerOrderError(f"expected an int {name} >= {low}, got {value!r:.40}")


def _layer_of(layers: object, num_tensors: int) -> np.ndarray:
    """The layer of each of ``num_tensors`` tensors, from ``LayerGroups.build``'s ``layers``.

    Raises:
        LayerOrderError: as ``LayerGroups.build``.
    """
    if layers is None:
        return np.arange(num_tensors, dtype=np.int64)
    if _is_int(layers):
        if layers < 1 or num_tensors % layers:  # type: ignore[operator]
            raise LayerOrderError(
                f"expected {num_tensors} tensors to split into layers of {layers}, they do not"
            )
        return np.arange(num_tensors, dtype=np.int64) // int(layers)  # type: ignore[call-overload]
    if isinstance(layers, np.ndarray) and layers.ndim == 1:
        layers = layers.tolist()  # float layers stay floats and are refused below
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise LayerOrderError(
            "expected layers None, an int or a sequence of int layers (one per KV tensor), "
            f"got {type(layers).__name__}"
        )
    for layer in layers:
        if not _is_int(layer):
            raise LayerOrderError(f"expected int layers, got {type(layer).__name__}: {layer!r:.40}")
    if len(layers) != num_tensors:
        raise LayerOrderError(
            f"expected one layer per KV tensor ({num_tensors}), got {len(layers)}"
        )
    values = [int(x) for x in layers]
    if values[0] != 0 or any(b - a not in (0, 1) for a, b in itertools.pairwise(values)):
        raise LayerOrderError(f"expected layers non-decreasing from 0 without gaps, got {values}")
    return np.array(values, dtype=np.int64)


def sub_layout(layout: KVLayout, tensors: np.ndarray) -> KVLayout:
    """The layout of ``layout``'s tensors ``tensors`` (int indices), in that order."""
    return KVLayout(
        base_addrs=layout.base_addrs[tensors],
        block_strides=layout.block_strides[tensors],
        page_bytes=layout.page_bytes[tensors],
        num_blocks=layout.num_blocks,
        device=layout.device,
    )


def group_plan(
    direction: Direction,
    pairs: BlockPairs | None,
    src: KVLayout,
    dst: KVLayout,
    num_dense: int | None = None,
) -> TransferPlan:
    """The plan copying ``pairs``' blocks (a whole-load plan from ``build_plan``, whose ids were
    checked there) over the sub-layouts ``src`` / ``dst`` of one group's tensors: what
    ``build_plan`` would return for them, without checking, sorting or merging again. ``None``
    pairs (no block): an empty plan. ``num_dense`` is accepted for callers that counted it
    (``dense_tensors(src, dst)``); the layout pair's own count is used."""
    if pairs is None:
        return TransferPlan(direction)
    n = len(pairs.src_block_ids)
    pair = layout_pair(src, dst)  # cached per layout objects (the group's sub-layouts are)
    num_descriptors = pair.num_descriptors(n, pairs.num_runs)
    sub = BlockPairs(src, dst, n * pair.block_bytes, num_descriptors, pairs.runs, pair)
    return TransferPlan(direction, num_blocks=n, num_pages=n * pair.num_tensors, blocks=sub)


def dense_tensors(a: KVLayout, b: KVLayout) -> int:
    """How many tensors are dense (block stride == page bytes) in both layouts."""
    return int(np.count_nonzero(a.is_dense & b.is_dense))
