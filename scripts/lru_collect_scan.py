"""How far ``VictimSearch._collect`` walks the LRU log per call during ``kvmgr simulate
--limit 3000`` (issue 27, helper tidy): a copy of it with counters (positions visited, stale
entries, blocks not READY or read, blocks with live children, victims), averaged per call.

    PYTHONPATH=$PWD python3 scripts/lru_collect_scan.py

Keep the copy in step with ``kvmgr/scheduler/lru_victims.py`` when that changes.
"""

from __future__ import annotations

import collections
import sys

import kvmgr.scheduler.lru_victims as lv
from kvmgr.cli import main

seen: collections.Counter[str] = collections.Counter()


def _collect(self, n, can_evict, guarded):  # VictimSearch._collect, counted
    log, stamp, up_of, kids = self._log, self._stamp, self._chains._up_block, self._chains._kids
    state, readers, ready, key_of = self._state, self._readers, self._ready, self.key_of
    head = self._head
    while head < self._tail and stamp[log[head]] != head:
        head += 1
    self._head = head
    left, waiting, victims = {}, set(), []
    seen["calls"] += 1
    for pos in range(head, self._tail):
        seen["visited"] += 1
        block = log[pos]
        if stamp[block] != pos or block in guarded:
            seen["stale or guarded"] += 1
            continue
        if can_evict is None:
            if state[block] != ready or readers[block]:
                seen["not READY or read"] += 1
                continue
        elif not can_evict(key_of[block]):
            seen["can_evict refused"] += 1
            continue
        if left.get(block, kids[block]) > 0:
            seen["live children"] += 1
            waiting.add(block)
            continue
        while True:
            victims.append(block)
            up = up_of[block]
            if up < 0:
                break
            count = left[up] = left.get(up, kids[up]) - 1
            if count > 0 or up not in waiting or len(victims) >= n:
                break
            waiting.discard(up)
            block = up
        if len(victims) >= n:
            seen["victims"] += len(victims)
            return victims
    return None


if __name__ == "__main__":
    lv.VictimSearch._collect = _collect  # type: ignore[method-assign]
    try:
        main(["simulate", "--limit", "3000"])
    finally:
        calls = max(1, seen["calls"])
        per_call = {k: round(v / calls) for k, v in seen.items() if k != "calls"}
        print(f"per call over {seen['calls']} calls: {per_call}", file=sys.stderr)
