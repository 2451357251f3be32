"""The disk tier's saved index: ``PATH.index``, written on a clean close, validated on open.

Offers (to ``kvmgr.tiers.disk`` only):
    save_index   write the index atomically (temporary file, fsync, rename; nothing left on
                 failure)
    load_index   read, validate, then remove it; a damaged one is kept as ``PATH.index.invalid``
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

__all__ = ["load_index", "save_index"]

_log = logging.getLogger(__name__)
_INDEX_VERSION = 1


def save_index(path: Path, geometry: list[int], index: OrderedDict[bytes, tuple[int, int]]) -> None:
    """Write ``index`` (LRU order kept) and the tier geometry to ``path`` atomically (a
    temporary file, fsync'ed, then renamed; removed again if anything fails).

    Raises:
        OSError: the file could not be written (``ENOSPC`` on a full disk); nothing is left.
    """
    entries = [[k.hex(), s, n] for k, (s, n) in index.items()]
    text = json.dumps({"geometry": [_INDEX_VERSION, *geometry], "entries": entries})
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_index(
    path: Path, geometry: list[int], num_slots: int, slot_bytes: int
) -> OrderedDict[bytes, tuple[int, int]] | None:
    """The index saved at ``path`` for the same geometry, else ``None``.

    The file is validated first: a valid one is removed once loaded (a crash after this start
    must not reuse it); one that is damaged (even if still valid JSON: a list, ``null``, no
    ``entries``, a key that is not hex, a slot that is not an int, slots out of range or used
    twice) is renamed ``PATH.invalid`` for inspection and the tier starts empty. Another
    geometry: the file is left alone and the tier starts empty.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _log.warning("disk tier index %s unreadable (%s): starting empty", path, exc.strerror)
        return None
    try:
        index = _parse_index(json.loads(text), geometry, num_slots, slot_bytes)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        _log.warning("disk tier index %s is damaged (%s): starting empty; kept as %s.invalid",
                     path, exc, path.name)  # fmt: skip
        path.replace(path.with_name(path.name + ".invalid"))
        return None
    if index is not None:
        path.unlink(missing_ok=True)
    return index


def _parse_index(
    saved: Any, geometry: list[int], num_slots: int, slot_bytes: int
) -> OrderedDict[bytes, tuple[int, int]] | None:
    """The entries of a parsed index file; ``None`` for another geometry.

    Raises:
        ValueError, TypeError: anything that is not a well-formed index.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("entries"), list):
        raise ValueError("not an index object with a list of entries")
    if saved.get("geometry") != [_INDEX_VERSION, *geometry]:
        return None
    index: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
    used = set()
    for entry in saved["entries"]:
        if not isinstance(entry, list) or len(entry) != 3:
            raise ValueError(f"entry {entry!r:.40}: expected [key hex, slot, length]")
        key_hex, slot, length = entry
        if not isinstance(key_hex, str) or type(slot) is not int or type(length) is not int:
            raise TypeError(f"entry {entry!r:.40}: expected [str, int, int]")
        if not (0 <= slot < num_slots and 0 < length <= slot_bytes) or slot in used:
            raise ValueError(f"entry {entry!r:.40}: slot or length out of range, or repeated")
        index[bytes.fromhex(key_hex)] = (slot, length)
        used.add(slot)
    return index
