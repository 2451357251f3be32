"""Which bytes of the CPU tier to page-lock in which order, so that blocks become usable early.

Offers:
    PinPiece            one step of the pinning: the page-aligned byte ranges to register, and
                        the blocks that are wholly pinned once it (and every earlier piece) is
    plan_pieces         the pieces of a ``HostRegionLayout``
    PinOptions          how to pin: in the background or not, piece sizes, first-touch threads,
                        transparent huge pages (re-exported by ``kvmgr.transfer.pinning``)
    PAGE_BYTES, MAX_REGISTER_BYTES

Why pieces. A single ``cudaHostRegister`` of 512 GiB or more fails whatever the free memory
(vllm #51080), so no range registered here exceeds ``MAX_REGISTER_BYTES`` (64 GiB). And pinning
a large tier takes seconds to minutes; in pieces, the blocks of the pieces already pinned can
be handed out while the rest is pinned in the background.

A block is one page in *every* KV tensor, and the region lays the tensors out one after the
other (``HostKVPool``), so a piece is a range of blocks, ``[b0, b1)``, and its bytes are one
range per tensor. Every OS page is registered exactly once (a second registration of a page
fails), by the first piece that needs it: where a piece boundary or a tensor boundary falls
inside an OS page, that page goes to the earlier piece. Piece sizes grow geometrically from
``first_piece_bytes`` (the first blocks are usable after a short pin) to ``max_piece_bytes``
(few registrations for a large tier).
"""

from __future__ import annotations

import bisect

import attrs

from kvmgr.errors import ConfigError
from kvmgr.pool.host_pool import HostRegionLayout

__all__ = ["MAX_REGISTER_BYTES", "PAGE_BYTES", "PinOptions", "PinPiece", "plan_pieces"]

#: The OS page: the unit of registration.
PAGE_BYTES = 4096
#: The most one registration covers (a single cudaHostRegister of >= 512 GiB fails; vllm #51080).
MAX_REGISTER_BYTES = 64 << 30


def _non_negative_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError(f"{attribute.name}: expected an int >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class PinOptions:
    """How the CPU tier is page-locked.

    Attributes:
        background: pin the first piece before returning and the rest on a background thread
            (blocks become usable piece by piece); ``False`` pins everything before returning.
        first_piece_bytes: size of the first piece (the blocks usable at once), bytes.
        max_piece_bytes: largest piece (at most 64 GiB: one registration never exceeds it).
        populate_threads: threads that first-touch the pages before registration; 0 lets the
            registration fault them in (one thread, in the driver).
        hugepages: advise transparent huge pages (``MADV_HUGEPAGE``) on the region (see the
            ``kvmgr.transfer.pinning`` docstring for why it is off by default).
    """

    background: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    first_piece_bytes: int = attrs.field(default=1 << 30, validator=_non_negative_int)
    max_piece_bytes: int = attrs.field(default=MAX_REGISTER_BYTES, validator=_non_negative_int)
    populate_threads: int = attrs.field(default=8, validator=_non_negative_int)
    hugepages: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if not PAGE_BYTES <= self.first_piece_bytes <= self.max_piece_bytes <= MAX_REGISTER_BYTES:
            raise ConfigError(
                f"expected {PAGE_BYTES} <= first_piece_bytes <= max_piece_bytes <= "
                f"{MAX_REGISTER_BYTES}, got {self.first_piece_bytes} and {self.max_piece_bytes}"
            )


@attrs.frozen
class PinPiece:
    """One piece of the pinning.

    Attributes:
        end_block: once this piece and every earlier one are registered, blocks
            ``[0, end_block)`` are wholly page-locked in every tensor.
        ranges: ``(offset, num_bytes)`` in the region, page-aligned, disjoint from every other
            piece's, each ``<= MAX_REGISTER_BYTES``, increasing.
    """

    end_block: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def num_bytes(self) -> int:
        """Bytes this piece registers."""
        return sum(size for _, size in self.ranges)


class _PageSet:
    """Disjoint, sorted page intervals ``[start, end)``; ``claim`` returns what was not yet in."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def claim(self, start: int, end: int) -> list[tuple[int, int]]:
        """Add ``[start, end)``; return its parts that were not in the set before, in order."""
        fresh: list[tuple[int, int]] = []
        i = bisect.bisect_right(self._ends, start)  # first interval ending after `start`
        cursor = start
        while i < len(self._starts) and self._starts[i] < end:
            if self._starts[i] > cursor:
                fresh.append((cursor, self._starts[i]))
            cursor = max(cursor, self._ends[i])
            i += 1
        if cursor < end:
            fresh.append((cursor, end))
        if fresh:
            self._insert(start, end)
        return fresh

    def _insert(self, start: int, end: int) -> None:
        lo = bisect.bisect_left(self._ends, start)  # intervals touching or after `start`
        hi = bisect.bisect_right(self._starts, end)  # ... and starting at or before `end`
        if lo < hi:
            start, end = min(start, self._starts[lo]), max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]


def plan_pieces(
    layout: HostRegionLayout,
    *,
    first_piece_bytes: int = 1 << 30,
    max_piece_bytes: int = MAX_REGISTER_BYTES,
) -> tuple[PinPiece, ...]:
    """Cut the region of ``layout`` into pieces of whole blocks, in block order.

    Piece ``k`` holds ``max(1, size_k // block_bytes)`` blocks, where ``size_0 =
    first_piece_bytes`` and ``size_{k+1} = min(2 * size_k, max_piece_bytes)``. The last piece
    ends at ``layout.num_blocks``. Cost: O(pieces x tensors x log) on the host; no memory is
    touched.

    Raises:
        ConfigError: ``first_piece_bytes`` below a page, or ``max_piece_bytes`` below it or
            above ``MAX_REGISTER_BYTES``.
    """
    if not PAGE_BYTES <= first_piece_bytes <= max_piece_bytes <= MAX_REGISTER_BYTES:
        raise ConfigError(
            f"expected {PAGE_BYTES} <= first_piece_bytes <= max_piece_bytes <= "
            f"{MAX_REGISTER_BYTES}, got {first_piece_bytes} and {max_piece_bytes}"
        )
    block_bytes = sum(layout.page_bytes)
    claimed = _PageSet()
    pieces: list[PinPiece] = []
    start_block, size = 0, first_piece_bytes
    while start_block < layout.num_blocks:
        end_block = min(layout.num_blocks, start_block + max(1, size // block_bytes))
        pages: list[tuple[int, int]] = []
        for offset, page in zip(layout.offsets, layout.page_bytes):
            first = (offset + start_block * page) // PAGE_BYTES
            last = -(-(offset + end_block * page) // PAGE_BYTES)
            pages += claimed.claim(first, last)
        pieces.append(PinPiece(end_block, _ranges(sorted(pages))))
        start_block, size = end_block, min(2 * size, max_piece_bytes)
    return tuple(pieces)


def _ranges(pages: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted page intervals -> merged byte ranges, each at most ``MAX_REGISTER_BYTES``."""
    merged: list[list[int]] = []
    for start, end in pages:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    cap = MAX_REGISTER_BYTES // PAGE_BYTES
    out = []
    for start, end in merged:
        for at in range(start, end, cap):
            out.append((at * PAGE_BYTES, (min(end, at + cap) - at) * PAGE_BYTES))
    return tuple(out)
