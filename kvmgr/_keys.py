"""The one rule for block keys, shared by the manager and the lower tiers.

Offers:
    check_keys   ``keys`` as a fresh list of non-empty ``bytes``, optionally distinct

A key is a block hash: exactly ``bytes`` (not a subclass, not ``str``), never empty (an empty
key cannot be told from a missing one once a tier namespace prefixes it). Calls of up to
``SMALL`` keys take a plain loop; larger ones count the keys of type ``bytes`` in a list of
their types, C passes instead of a Python call per key; one C pass (:mod:`kvmgr._index_c`'s
``bytes_list``) copies and checks a list or tuple of them where kvmgr's C modules build.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmgr._index_c import index_c
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
    out: list[bytes]
    if type(keys) is list and len(keys) <= SMALL:  # (a per-call store: a plain loop)
        out = keys[:]
        for key in out:
            if type(key) is not bytes or not key:
                raise _bad_key(out)
    else:
        many = type(keys) in (list, tuple) and (module := index_c()) is not None
        fast = module.bytes_list(keys) if many else None  # (None: a key to word)
        out = _checked(keys) if fast is None else fast
    if distinct and len(out) > 1 and len(set(out)) != len(out):
        raise InvalidKeyError(f"expected distinct keys, got {len(out) - len(set(out))} repeats")
    return out


def _checked(keys: object) -> list[bytes]:
    """``check_keys`` without ``distinct``, in Python."""
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
        raise _bad_key(out)
    return out


def _bad_key(keys: Sequence[object]) -> InvalidKeyError:
    """The error for the first key of ``keys`` that is not non-empty ``bytes``."""
    i = next(i for i, k in enumerate(keys) if type(k) is not bytes or not k)
    return InvalidKeyError(
        f"key {i}: expected non-empty bytes, got {type(keys[i]).__name__}: {keys[i]!r:.40}"
    )
