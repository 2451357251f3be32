"""The CPU tier's memory: one host region laid out like the GPU KV tensors.

Offers:
    HostKVPool   one region (allocated by the engine: pinned where it copies with DMA), viewed
                 as one ``[num_blocks, page_bytes]`` uint8 tensor per GPU KV tensor

One region registered once, not ``pin_memory=True`` per tensor, which rounds every allocation up
to a power of two (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvmgr.errors import GeometryError
from kvmgr.pool.layout import KVLayout

__all__ = ["HostKVPool"]

#: Start of every tensor's pages in the region is aligned to this many bytes.
REGION_ALIGN_BYTES = 256


class HostKVPool:
    """CPU copies of the KV pages, one ``uint8 [num_blocks, page_bytes[t]]`` view per tensor.

    Args:
        page_bytes: bytes of one page of each GPU KV tensor.
        num_blocks: CPU blocks.
        allocate: returns a CPU ``uint8`` tensor of the given number of bytes (the engine's
            ``allocate_host``); called once.

    Raises:
        GeometryError: no tensors or a non-positive size.
    """

    def __init__(
        self, page_bytes: Sequence[int], num_blocks: int, allocate: Callable[[int], torch.Tensor]
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
        self.region = allocate(total)
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
