"""The disk tier's slot table: which slot holds which blob, in LRU order, and which are free.

Private to ``kvmgr.tiers.disk``. Offers:
    SlotTable   ``index`` (OrderedDict stored key -> (slot, blob bytes), least recently used
                first), free slot ids (fresh ids ascending first, so a batch lands in
                consecutive slots, then freed ids last-freed-first), pins (slot -> reads in
                flight: a pinned slot is never evicted or reused; one dropped while pinned is
                freed by its last unpin) and the keys whose write is in flight (not readable;
                one dropped while in flight is never indexed: its write frees its slot)

Every method runs on the event loop's thread; none does I/O.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["SlotTable"]


class SlotTable:
    """The slots of one disk tier.

    Args:
        num_slots: slots in all files together.
        saved: an index loaded from the saved file (its slots are in use), or ``None``.
    """

    def __init__(self, num_slots: int, saved: OrderedDict[bytes, tuple[int, int]] | None) -> None:
        self.index: OrderedDict[bytes, tuple[int, int]] = saved or OrderedDict()
        used = {slot for slot, _length in self.index.values()}
        self._free = [s for s in range(num_slots - 1, -1, -1) if s not in used]
        self._pins: dict[int, int] = {}
        self._doomed: set[int] = set()
        self.pending: set[bytes] = set()
        self._cancelled: set[bytes] = set()  # pending keys dropped: their write frees the slot

    def is_stored(self, key: bytes) -> bool:
        """Whether ``key`` is readable or being written (a write of it would be redundant);
        a readable key becomes the most recently used."""
        if key in self.index:
            self.index.move_to_end(key)
            return True
        return key in self.pending

    def reserve(self, n: int) -> tuple[list[int], int]:
        """Up to ``n`` slots: free ones first, then LRU victims that no read pins. Returns the
        slots and how many blobs were evicted for them."""
        need = n - len(self._free)
        victims = []
        if need > 0:  # walk from the LRU end; stop at ``need`` victims (pinned slots are skipped)
            for key, (slot, _length) in self.index.items():
                if slot not in self._pins:
                    victims.append(key)
                    if len(victims) == need:
                        break
            for key in victims:
                slot, _length = self.index.pop(key)
                self._free.append(slot)
        take = min(n, len(self._free))
        return [self._free.pop() for _ in range(take)], len(victims)

    def commit(self, writes: list[tuple[int, bytes, int]], ok: bool) -> None:
        """Writes ``(slot, key, blob bytes)`` ended: index them (``ok``) or free their slots."""
        for slot, key, length in writes:
            self.pending.discard(key)
            if ok and key not in self._cancelled:
                self.index[key] = (slot, length)
            else:
                self._free.append(slot)
            self._cancelled.discard(key)

    def pin(self, key: bytes) -> tuple[int, int] | None:
        """``(slot, blob bytes)`` of a readable key, pinned until ``unpin``; ``None`` if absent."""
        entry = self.index.get(key)
        if entry is not None:
            self.index.move_to_end(key)
            self._pins[entry[0]] = self._pins.get(entry[0], 0) + 1
        return entry

    def pin_reads(self, keys: list[bytes]) -> list[tuple[int, int, int, bytes]]:
        """``(slot, blob bytes, position, key)`` of each readable key, pinned (``pin``)."""
        reads = []
        for pos, key in enumerate(keys):
            entry = self.pin(key)
            if entry is not None:
                reads.append((entry[0], entry[1], pos, key))
        return reads

    def unpin(self, slot: int) -> None:
        """A read of ``slot`` ended."""
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
            return
        del self._pins[slot]
        if slot in self._doomed:
            self._doomed.discard(slot)
            self._free.append(slot)

    def drop(self, key: bytes) -> bool:
        """Forget ``key``; its slot is free once no read pins it. Whether it was indexed.

        A key whose write is in flight is not indexed when that write ends (its slot is freed
        then): a delete is never undone by a write that started before it. A put of the key
        until then counts it as stored (it is pending) but it reads as a miss."""
        entry = self.index.pop(key, None)
        if entry is None:
            if key in self.pending:
                self._cancelled.add(key)
            return False
        slot = entry[0]
        if slot in self._pins:
            self._doomed.add(slot)
        else:
            self._free.append(slot)
        return True
