"""The errors of cache groups: a bad group spec, a bad grouped key or block table.

Offers:
    GroupSpecError      a group spec or a grouped layout is invalid (a ``ConfigError``)
    GroupKeyError       a grouped key, block hash list or block table is malformed (an
                        ``InvalidKeyError``)

Both are raised before any state changes, like every ``KVMgrError``; they subclass the
manager's errors so that ``except ConfigError`` / ``except InvalidKeyError`` catch them too.
"""

from __future__ import annotations

from kvmgr.errors import ConfigError, InvalidKeyError

__all__ = ["GroupKeyError", "GroupSpecError"]


class GroupSpecError(ConfigError):
    """A cache group spec (kind, block size, window, ratio, page bytes) or layout is invalid."""


class GroupKeyError(InvalidKeyError):
    """A grouped key, a block hash list or a per-group block table is malformed."""
