"""The parent of every key in the CPU tier, to refuse stores that would close a key cycle.

Private to ``kvmgr.scheduler``. A store names the key each new key extends (its parent). The
keys of the CPU tier must form a forest: a cycle (``a`` extends ``b`` and ``b`` extends
``a``, in one call or across calls) has no leaf, so no policy would ever evict it and the tier
would fill up for good (issue 20). ``KeyChains.check`` finds such a cycle before the store
changes anything.

Cost: a store whose new keys have no indexed children (every store that writes a prefix
parent-first) walks only its own keys, O(len(keys)); only a new key that already has indexed
children (its parent was invalidated or failed, or children were stored before it) walks up
the indexed ancestors too.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmgr.errors import InvalidKeyError

__all__ = ["KeyChains"]


class KeyChains:
    """Parent and indexed-children count of every key in the CPU tier's index.

    Attributes:
        parent: ``key -> parent`` (``None``: a root) of every indexed key.
        children: ``key -> number of indexed keys naming it as parent`` (counts > 0 only; the
            key itself may be absent from the index).
    """

    __slots__ = ("children", "parent")

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes | None] = {}
        self.children: dict[bytes, int] = {}

    def check(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Refuse new keys (none indexed yet) whose parent chain would reach the key itself.

        Raises:
            InvalidKeyError: a cycle; nothing changed.
        """
        children = self.children
        # the old graph is a forest: a new cycle passes through a new key with an indexed
        # child; without one, walks stay inside this call's keys
        deep = not children.keys().isdisjoint(keys)
        if not deep and (len(keys) == 1 or (parents[1:] == keys[:-1] and parents[0] not in keys)):
            return  # one key, or one chain hanging below a key outside the call
        batch = dict(zip(keys, parents))
        tracked = self.parent
        done: set[bytes] = set()
        for start in batch:
            if start in done:
                continue
            path: dict[bytes, None] = {}
            key: bytes | None = start
            while key is not None and key not in done:
                if key in path:
                    raise InvalidKeyError(
                        f"key {key.hex()[:16]}... would extend itself through its parents "
                        f"(a key cycle of {len(path) - list(path).index(key)} keys); a key's "
                        "parent chain must end at a root"
                    )
                path[key] = None
                if key in batch:
                    key = batch[key]
                elif deep and key in tracked:
                    key = tracked[key]
                else:
                    break
            done.update(path)

    def add(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        """Record newly indexed keys (checked by ``check``)."""
        self.parent.update(zip(keys, parents))
        children = self.children
        for up in parents:
            if up is not None:
                children[up] = children.get(up, 0) + 1

    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget keys that left the index (evicted, invalidated, failed)."""
        pop, children = self.parent.pop, self.children
        for key in keys:
            up = pop(key, None)
            if up is not None:
                count = children[up]
                if count == 1:
                    del children[up]
                else:
                    children[up] = count - 1
