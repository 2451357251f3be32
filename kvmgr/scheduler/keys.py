"""Validation of keys and parents at the scheduler's boundary.

Private to ``kvmgr.scheduler``. Offers ``check_keys`` (``kvmgr._keys``: a list of non-empty bytes keys), ``check_parents``
(one parent per key) and ``SMALL`` (calls with at most this many blocks take the list path, no
numpy per call).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmgr._keys import check_keys  # the one key rule (non-empty bytes), shared with the tiers
from kvmgr.errors import InvalidKeyError

__all__ = ["SMALL", "check_keys", "check_parents"]

#: Calls with at most this many blocks take the list path (no numpy per call).
SMALL = 8


def check_parents(keys: list[bytes], parents: object) -> list[bytes | None]:
    """One parent per key: ``parents`` as given, or one chain (``keys[i]`` extends
    ``keys[i-1]``, ``keys[0]`` is a root).

    Raises:
        InvalidKeyError: not a sequence of ``len(keys)`` non-empty bytes or ``None``, or a key
            its own parent.
    """
    if parents is None:
        return [None, *keys[:-1]]
    if isinstance(parents, (bytes, str)) or not isinstance(parents, Sequence):
        raise InvalidKeyError(f"expected a sequence of parent keys, got {type(parents).__name__}")
    out = list(parents)
    if len(out) != len(keys):
        raise InvalidKeyError(f"expected one parent per key, got {len(out)} for {len(keys)} keys")
    for i, (key, parent) in enumerate(zip(keys, out)):
        if parent is not None and (type(parent) is not bytes or not parent):
            # the key rule (``kvmgr._keys``): a parent is a key, so never b""
            raise InvalidKeyError(
                f"parent {i}: expected non-empty bytes or None, got "
                f"{type(parent).__name__}: {parent!r:.40}"
            )
        if parent == key:
            raise InvalidKeyError(f"key {key.hex()[:16]}... is given as its own parent")
    return out
