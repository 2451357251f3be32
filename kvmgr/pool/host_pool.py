"""The CPU tier's memory: one host region laid out like the GPU KV tensors.

Offers:
    HostKVPool   one region (allocated by the engine: pinned where it copies with DMA), viewed
                 as one ``[num_blocks, page_bytes]`` uint8 tensor per GPU KV tensor
    HostRegionLayout  where each tensor's pages lie in the region (what an engine needs to pin
                 the region block range by block range)
    HostRegion   the protocol of an engine's region: its tensor and how many blocks are usable

One region registered once, not ``pin_memory=True`` per tensor, which rounds every allocation up
to a power of two (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch

from kvmgr.errors import GeometryError
from kvmgr.pool.layout import KVLayout

__all__ = ["HostKVPool", "HostRegion", "HostRegionLayout"]

#: Start of every tensor's pages in the region is aligned to this many bytes.
REGION_ALIGN_BYTES = 256


@attrs.frozen
class HostRegionLayout:
    """Where the pages of each KV tensor lie in the CPU tier's region.

    Block ``b`` of tensor ``t`` is the bytes ``[offsets[t] + b * page_bytes[t], ... +
    page_bytes[t])`` of the region.

    Attributes:
        offsets: byte offset of each tensor's first page (``REGION_ALIGN_BYTES``-aligned).
        page_bytes: bytes of one page of each tensor.
        num_blocks: blocks of the tier.
        num_bytes: bytes of the whole region.
    """

    offsets: tuple[int, ...]
    page_bytes: tuple[int, ...]
    num_blocks: int
    num_bytes: int


class HostRegion(Protocol):
    """An engine's CPU-tier region that may become usable block range by block range.

    ``tensor`` is ``uint8 [layout.num_bytes]``; ``num_blocks_ready`` (read from any thread)
    counts the leading blocks whose memory an engine may copy to and from now; it only grows.
    ``statistics()`` reports the pinning (``kvmgr.transfer.pinning.PinStatistics``).
    """

    tensor: torch.Tensor

    @property
    def num_blocks_ready(self) -> int: ...

    def statistics(self) -> Any: ...


class HostKVPool:
    """CPU copies of the KV pages, one ``uint8 [num_blocks, page_bytes[t]]`` view per tensor.

    Args:
        page_bytes: bytes of one page of each GPU KV tensor.
        num_blocks: CPU blocks.
        allocate: returns a CPU ``uint8`` tensor of the given number of bytes (the engine's
            ``allocate_host``); called once, unless ``allocate_region`` is given.
        allocate_region: the engine's ``allocate_host_region``: the region for a
            ``HostRegionLayout``, possibly still being pinned (``num_blocks_ready``).

    Attributes:
        region: the ``uint8`` region; tensors: its views; layout: their ``KVLayout``;
        region_layout: the ``HostRegionLayout``; memory: the engine's ``HostRegion`` or ``None``.

    Raises:
        GeometryError: no tensors or a non-positive size.
    """

    def __init__(
        self,
        page_bytes: Sequence[int],
        num_blocks: int,
        allocate: Callable[[int], torch.Tensor],
        *,
        allocate_region: Callable[[HostRegionLayout], HostRegion] | None = None,
    ) -> None:
        if not page_bytes or num_blocks < 1 or min(page_bytes) < 1:
            raise GeometryError(
                f"expected >= 1 tensor, pages >= 1 B and num_blocks >= 1, got pages "
                f"{list(page_bytes)} and num_blocks {num_blocks}"
            )
        offsets, total = [], 0
        for page in page_bytes:
            total = -(-total // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES
            offsets.append(total)
            total += page * num_blocks
        self.region_layout = HostRegionLayout(tuple(offsets), tuple(page_bytes), num_blocks, total)
        self.memory: HostRegion | None = None
        if allocate_region is None:
            self.region = allocate(total)
        else:
            self.memory = allocate_region(self.region_layout)
            self.region = self.memory.tensor
        self.tensors = [
            self.region[off : off + page * num_blocks].view(num_blocks, page)
            for off, page in zip(offsets, page_bytes)
        ]
        self.layout = KVLayout.from_tensors(self.tensors)
        self.num_blocks = num_blocks

    @property
    def num_bytes(self) -> int:
        """Bytes of the whole region."""
        return self.region.numel()

    @property
    def num_blocks_ready(self) -> int:
        """Leading blocks an engine may copy to and from now (all of them unless the engine
        is still pinning the region)."""
        return self.num_blocks if self.memory is None else self.memory.num_blocks_ready
