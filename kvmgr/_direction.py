"""``Direction``, the copy direction: the one name the scheduler side (torch-free) and the
transfer layer both use. A bottom module (imports nothing of kvmgr), so neither imports the
other for it. Public as ``kvmgr.scheduler.Direction`` and
``kvmgr.transfer.Direction``.
"""

from __future__ import annotations

import enum

__all__ = ["Direction"]


class Direction(enum.Enum):
    """Copy direction."""

    D2H = "d2h"  #: GPU -> CPU: a store (swap-out)
    H2D = "h2d"  #: CPU -> GPU: a load (swap-in)
