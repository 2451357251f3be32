"""The one rule for block keys, shared by the manager and the lower tiers.

Offers:
    check_keys   ``keys`` as a fresh list of non-empty ``bytes``, optionally distinct

A key is a block hash: exactly ``bytes`` (not a subclass, not ``str``), never empty (an empty
key cannot be told from a missing one once a tier namespace prefixes it). Calls of up to
``SMALL`` keys take a plain loop; larger ones count the keys of type ``bytes`` in a list of
their types, C passes instead of a Python call per key.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmgr.errors import InvalidKeyError

__all__ = ["check_keys"]

#: Up to this many keys the types are tested one by one (cheaper than building a set).
SMALL = 8


def check_keys(keys: object, *, distinct: bool = False) -> list[bytes]:
    """``keys`` as a new list (the caller may reuse its own) of non-empty ``bytes``.

    Args:
        keys: a sequence of ``bytes`` (a list, tuple, ...; not ``bytes`` or ``str`` itself).
        distinct: whether repeated keys are an error (the keys of one store).

    Raises:
        InvalidKeyError: not a sequence, a key that is not ``bytes`` or is empty, or repeated
            keys where ``distinct``.
    """
    if type(keys) is list:
        out = keys[:]
    elif isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise InvalidKeyError(f"expected a sequence of bytes keys, got {type(keys).__name__}")
    else:
        out = list(keys)
    if len(out) > SMALL:
        is_bytes = list(map(type, out)).count(bytes) == len(out)  # (faster than a set)
    else:
        is_bytes = all(type(key) is bytes for key in out)
    if not is_bytes or not all(out):  # all bytes by then: an empty one is the false one
        i = next(i for i, k in enumerate(out) if type(k) is not bytes or not k)
        raise InvalidKeyError(
            f"key {i}: expected non-empty bytes, got {type(out[i]).__name__}: {out[i]!r:.40}"
        )
    if distinct and len(out) > 1 and len(set(out)) != len(out):
        raise InvalidKeyError(f"expected distinct keys, got {len(out) - len(set(out))} repeats")
    return out
