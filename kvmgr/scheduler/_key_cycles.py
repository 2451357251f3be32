"""The walks of ``KeyChains.check`` (``kvmgr.scheduler.chains``): a store's new keys must not close
a key cycle through their parents.

Private to ``kvmgr.scheduler``. Offers:
    chain_with_gaps     the cheap test: every parent is ``None``, the previous key or no key
                        of the call (then no walk can come back)
    walk_chains         the general test: each new key's parent chain walked, up the indexed
                        ancestors by block when a new key already has indexed children
"""

from __future__ import annotations

import array
from collections.abc import Sequence

from kvmgr.errors import InvalidKeyError

__all__ = ["chain_with_gaps", "walk_chains"]


def walk_chains(
    keys: Sequence[bytes],
    parents: Sequence[bytes | None],
    index: dict[bytes, int],
    up: array.array,
    loose: dict[int, bytes],
    deep: bool,
) -> None:
    """``KeyChains.check``'s general test: each new key's parent chain walked (``deep``: also up
    the indexed ancestors, by block: ``index`` key -> block, ``up`` parent block or -1, ``loose``
    block -> a parent key not indexed); raises ``InvalidKeyError`` on a key cycle."""
    batch = dict(zip(keys, parents))
    done: set[bytes] = set()
    for start in batch:
        if start in done:
            continue
        path: dict[bytes, int] = {}  # key -> keys walked before it
        key: bytes | None = start
        walked = 0
        while key is not None and key not in done:
            if key in path:
                raise InvalidKeyError(
                    f"key {key.hex()[:16]}... would extend itself through its parents (a key"
                    f" cycle of {walked - path[key]} keys); a key's parent chain must end at a root"
                )
            path[key] = walked
            walked += 1
            if key in batch:
                key = batch[key]
            elif deep and key in index:  # up its indexed ancestors (a forest) by block
                block = index[key]
                while up[block] >= 0:
                    block = up[block]
                    walked += 1
                key = loose.get(block)
            else:
                break
        done.update(path)


def chain_with_gaps(keys: Sequence[bytes], parents: Sequence[bytes | None]) -> bool:
    """Whether every ``parents[i]`` is ``None``, ``keys[i - 1]`` or no key of the call (``keys``
    distinct, as a store's new keys are, which ``check``'s one-chain test assumes too): then a
    walk within the call only goes to earlier keys (no cycle). A store whose present keys were
    skipped (the default chain with gaps) is such a call; ``False`` decides nothing."""
    inside: dict[bytes, None] | None = None
    previous: bytes | None = None
    for key, parent in zip(keys, parents):
        if parent is not None and parent is not previous and parent != previous:
            if inside is None:
                inside = dict.fromkeys(keys)
            if parent in inside:
                return False
        previous = key
    return True
