"""``SizePool``: free buffers by size class, taken on one thread and given back from another.

A bottom module (imports nothing of kvmgr): the DMA issuer's descriptor tables
(``kvmgr.transfer.dma.DescriptorBuffers``) and the copy kernel's table slots
(``kvmgr.kernels.copy.staging.TableSlots``) are both pools of it. A buffer is reused only after
its batch's end event (the completion thread gives it back), so memory a copy may still read
is never handed out again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["SizePool"]


class _Sized(Protocol):
    capacity: int


B = TypeVar("B", bound=_Sized)


class SizePool(Generic[B]):
    """Free buffers by size class: powers of two from ``smallest`` entries.

    Args:
        make: builds a buffer of a given capacity (called outside the lock).
        smallest: the smallest capacity handed out.

    Attributes:
        num_allocated: buffers ``make`` built so far.
    """

    def __init__(self, make: Callable[[int], B], smallest: int) -> None:
        self._make = make
        self._smallest = smallest
        self._free: dict[int, list[B]] = {}
        self._lock = threading.Lock()
        self.num_allocated = 0

    def take(self, count: int) -> B:
        """A free buffer of at least ``count`` entries (``count >= 1``), built if none is free;
        on the submitting thread."""
        capacity = max(self._smallest, 1 << (count - 1).bit_length())
        free = self._free.get(capacity)
        if free:  # no lock: dict.get and list.pop are atomic, and give only appends
            try:
                return free.pop()
            except IndexError:  # another thread took the last one in between
                pass
        self.num_allocated += 1
        return self._make(capacity)

    def give(self, buffer: B) -> None:
        """Return a buffer whose batch has ended (any thread)."""
        with self._lock:
            self._free.setdefault(buffer.capacity, []).append(buffer)
