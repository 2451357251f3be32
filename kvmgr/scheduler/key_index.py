"""The CPU tier's key index, written in passes over many keys (issue 27).

Private to ``kvmgr.scheduler``; used by ``fresh_store.add_new`` (a batched store of keys all
new) and by the tier's evictions (``set_items``).

``add_absent`` indexes keys that must all be absent and distinct with one ``dict.setdefault``
per key (a C-level ``map``: each key hashed and probed once), where a store otherwise makes
three passes (absent? distinct? insert). ``setdefault`` never overwrites a value, and a dict
keeps insertion order, so the keys it added are the index's last entries: when fewer were
added than given (a key was indexed already, or came twice), ``dict.popitem`` (last in, first
out) takes exactly those back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvmgr._index_c import index_c
from kvmgr.errors import InvalidArgumentError

__all__ = ["add_absent", "drop_last", "int_list", "set_items"]


#: ``_INTS[i] == i`` (an object array): the index's values, made once per process (doubled as
#: runs of fresh ids beyond it are stored; to the pool's size at the first store of other ids;
#: up to the largest pool's size: 36 bytes per CPU block at most),
#: instead of 512 new ints per store (``tolist`` of an int64 array)
_INTS = np.arange(0).astype(object)


def int_list(ids: np.ndarray | slice, num_blocks: int) -> list[int]:
    """``ids.tolist()`` (int ``[n]``, or a ``slice``; in ``[0, num_blocks)``) of int objects
    made once."""
    global _INTS
    ints = _INTS  # one array throughout: another thread may replace the module's meanwhile
    need = ids.stop if type(ids) is slice else num_blocks  # (a fresh run: what it uses)
    if need > (have := len(ints)):
        more = np.arange(have, min(num_blocks, max(need, 2 * have))).astype(object)
        _INTS = ints = np.concatenate([ints, more])
    return ints[ids].tolist()  # type: ignore[no-any-return]


def add_absent(index: dict[bytes, int], keys: Sequence[bytes], values: list[int] | int) -> bool:
    """Index ``keys[i] -> values[i]`` when every key is absent from ``index`` and the keys are
    distinct (``True``); otherwise leave ``index`` as it was, the same entries in the same
    order, and return ``False``. ``values``: a ``list`` of one per key, or one int for every key.

    One C loop where kvmgr's C modules build (:mod:`kvmgr._index_c`: it stops at the first key
    not new, and prefetches the index's table ahead), else ``setdefault`` through ``map``.

    Raises:
        InvalidArgumentError: ``values`` neither an int nor a list of ``len(keys)`` (the C loop
            took a tuple or an array as one value for every key, the Python path zipped it;
            a short list gave ``ValueError`` in C, ``False`` in Python); nothing indexed.
    """
    if type(values) is not list:
        if not isinstance(values, int):
            raise InvalidArgumentError(f"add_absent: expected a list or an int of values, got {type(values).__name__}")  # fmt: skip
    elif len(values) != len(keys):
        raise InvalidArgumentError(f"add_absent: {len(values)} values for {len(keys)} keys")
    module = index_c()
    if module is not None and type(index) is dict and type(keys) is list:
        added = module.add_absent(index, keys, values)
        if added == len(keys):
            return True
        drop_last(index, added)
        return False
    before = len(index)
    each = repeat(values, len(keys)) if isinstance(values, int) else values
    deque(map(index.setdefault, keys, each), 0)
    added = len(index) - before
    if added == len(keys):
        return True
    drop_last(index, added)
    return False


def set_items(index: dict[bytes, int], keys: list[bytes], values: list[int] | None) -> None:
    """``index.update(zip(keys, values))``, or (``values`` None) ``del index[key]`` for each key
    (a missing key: ``KeyError``, those before it deleted); one C loop where it builds."""
    module = index_c()
    if module is not None and type(index) is dict and type(keys) is list:
        module.set_items(index, keys, values)
    elif values is None:
        deque(map(index.__delitem__, keys), 0)
    else:
        index.update(zip(keys, values))


def drop_last(index: dict[bytes, int], n: int) -> None:
    """Remove the ``n`` entries inserted last (by ``add_absent``, nothing inserted since)."""
    popitem = index.popitem
    for _ in range(n):
        popitem()
