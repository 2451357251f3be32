"""IndexTracker: keeps a ``GroupIndex`` in line with the groups' managers and drops orphans.

Package-private (``GroupedManager`` holds one). It drains every group's KV events, applies
them to the index (``stored`` -> READY, ``removed`` -> a sweep for orphans), invalidates the
orphans in their managers, retries those with loads in flight at the next sync, and rebuilds a
group's part of the index from its tier when that group's bounded event stream dropped events.
It keeps the events for ``GroupedManager.take_events`` (bounded like the managers' streams).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from kvmgr.errors import BlockStateError
from kvmgr.groups.index import GroupIndex
from kvmgr.groups.spec import GroupedLayout


class IndexTracker:
    """The index of a grouped manager, fed by its managers' events.

    Args:
        layout: the groups.
        managers: one ``OffloadManager`` per group (their public calls only: ``take_events``,
            ``invalidate``, ``statistics``, ``snapshot``).
    """

    def __init__(self, layout: GroupedLayout, managers: Sequence[Any]) -> None:
        self.index = GroupIndex(layout)
        self.managers = list(managers)
        self._events: collections.deque[Any] = collections.deque(
            maxlen=sum(m.config.max_events for m in managers)
        )
        self._events_lost = [0] * len(managers)  # each manager's events_dropped, last seen
        self._deferred: set[bytes] = set()  # orphans with loads in flight: retried each sync
        self.num_orphans_dropped = 0

    def check_lost(self) -> None:
        """Rebuild the part of the index of any group whose event stream dropped events."""
        for g, mgr in enumerate(self.managers):
            lost = mgr.statistics().events_dropped
            if lost != self._events_lost[g]:
                self._events_lost[g] = lost
                self._resync(g)

    def defer(self, keys: list[bytes]) -> None:
        """Drop these orphans at the next sync (READY ones; PENDING ones when they land)."""
        for key in keys:
            if self.index.is_ready(key):
                self._deferred.add(key)
            else:
                self.index.recheck([key])

    def take_events(self) -> list[Any]:
        """The events applied since the last call (oldest first)."""
        self.sync()
        out = list(self._events)
        self._events.clear()
        return out

    def _resync(self, g: int) -> None:
        """Bring group ``g``'s part of the index in line with its manager's tier (after its
        bounded event stream dropped events), then drop the orphans."""
        in_tier = self.managers[g].snapshot().keys
        mine = [k for k in self.index.held_keys() if self.index.split(k)[1] == g]
        landed = [
            k
            for k in mine
            if k in in_tier and in_tier[k].state.name == "READY" and not self.index.is_ready(k)
        ]
        orphans = self.index.landed(landed)
        orphans += self.index.removed([k for k in mine if k not in in_tier])
        by_group: dict[int, list[bytes]] = {}
        for key in orphans:
            by_group.setdefault(self.index.split(key)[1], []).append(key)
        for h, keys in by_group.items():
            self._drop(h, keys)
        self.sync()

    def sync(self) -> None:
        """Apply the managers' KV events to the index and drop the orphans they leave."""
        retry, self._deferred = self._deferred, set()
        drop: dict[int, list[bytes]] = {}
        for key in retry:
            if self.index.is_ready(key):
                drop.setdefault(self.index.split(key)[1], []).append(key)
        while True:
            events = [e for mgr in self.managers for e in mgr.take_events()]
            for key in self._apply(events):
                drop.setdefault(self.index.split(key)[1], []).append(key)
            if not drop:
                return
            for g, keys in drop.items():
                self._drop(g, keys)
            drop = {}

    def _apply(self, events: list[Any]) -> list[bytes]:
        orphans: list[bytes] = []
        for event in events:
            self._events.append(event)
            if event.kind == "stored" and event.tier == "cpu":
                orphans.extend(self.index.landed(event.keys))
            elif event.kind == "removed" and event.tier == "cpu":
                orphans.extend(self.index.removed(event.keys))  # dropped orphans: not held
        return orphans

    def _drop(self, g: int, keys: list[bytes]) -> None:
        """Invalidate orphans of group ``g``; those with loads in flight wait for a later
        sync. Dropped keys leave the index now, so their removal events sweep nothing."""
        mgr = self.managers[g]
        if mgr.closed:  # a closed tier serves nothing: no orphan to drop (events after close)
            return
        keys = list(dict.fromkeys(keys))
        try:
            mgr.invalidate(keys)
        except BlockStateError:  # some have loads in flight: one by one, retry the rest later
            dropped = []
            for key in keys:
                try:
                    mgr.invalidate([key])
                except BlockStateError:
                    self._deferred.add(key)
                else:
                    dropped.append(key)
            keys = dropped
        self.index.forget(keys)
        self.num_orphans_dropped += len(keys)
